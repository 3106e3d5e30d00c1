"""The run's reference states: one fixed set of observations, chosen once per run.

Unit scores measured on each epoch's rollout mix two things: units that stopped working
and a state distribution that narrowed as the policy improved (a unit silent on the
states a good policy visits may be alive on others). Scores on a fixed set of states
separate the two, and the trainability probe fits its new targets on the same set.

The set is ``size`` rows evenly spaced through the first rollout handed to
:meth:`ReferenceStates.offer` (``ProbeSession.rollout_end``), or rows the user gives
(:meth:`ReferenceStates.fix`, ``ProbeSession.fix_reference_states``). It is part of the
session's state, so a checkpoint carries it and a resumed or forked run keeps the same
set. The forwards on it run without gradients in the phase ``"reference"``, every global
random generator restored: training is unchanged (docs/reference_states.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from policy_probes.compiled import eager_block
from policy_probes.lifecycle.rng import preserved_rng

#: the phase of the forwards on the reference states (probes record only in theirs)
REFERENCE_PHASE = "reference"
#: rows of the set unless a probe asks for more
DEFAULT_SIZE = 512


def evenly_spaced(observations: torch.Tensor, size: int) -> torch.Tensor:
    """``size`` rows of ``observations`` evenly spaced from the first to the last (a
    detached copy): rows ``(i * (R - 1)) // (size - 1)`` of its ``R``, in exact integer
    arithmetic; all of them when ``R <= size``, the first when ``size == 1``."""
    rows = observations.shape[0]
    if rows <= size:
        return observations.detach().clone()
    idx = torch.arange(size, dtype=torch.long, device=observations.device) * (rows - 1)
    if size > 1:
        idx = idx.div(size - 1, rounding_mode="floor")
    return observations.detach()[idx].clone()


class ReferenceStates:
    """The fixed observations and the forward that runs the policy on them.

    ``wanted`` is set when a probe that reads the set is attached (the session then hands
    it the first rollout); :meth:`capture` runs the policy once on the set and returns what
    the given modules received or produced."""

    def __init__(self, size: int = DEFAULT_SIZE, module: nn.Module | None = None) -> None:
        self.size = size
        #: the policy whose buffers a forward on the set must leave as they were (default:
        #: the forward itself when it is a module)
        self.module = module
        self.wanted = False
        #: the set, on the device the loop gave it on (None: not chosen yet)
        self.observations: torch.Tensor | None = None
        #: ``"first rollout"`` or ``"given"``
        self.source: str | None = None
        #: the epoch of the session when the set was chosen
        self.chosen_at: int | None = None
        self.forward: Callable[[torch.Tensor], Any] | None = None
        #: modules whose outputs the report's shared forward keeps (:meth:`outputs`)
        self.tracked: dict[int, nn.Module] = {}
        self._outputs: dict[int, Any] | None = None
        #: why the policy cannot run on the set (its forward raised; not retried)
        self.unusable: str | None = None

    def want(self, size: int) -> None:
        """A probe reads the set, with at least ``size`` rows (before it is chosen)."""
        if not (isinstance(size, int) and size >= 1):
            raise ValueError(f"reference_rows must be an integer >= 1, got {size!r}")
        self.size = max(self.size, size) if self.wanted else size
        self.wanted = True

    def offer(
        self,
        observations: torch.Tensor | None,
        forward: Callable[[torch.Tensor], Any] | None = None,
        epoch: int | None = None,
    ) -> None:
        """A rollout's observations (flat rows): the first one offered becomes the set;
        ``forward`` (the policy) runs the captures."""
        if forward is not None:
            self.forward = forward
        if self.observations is None and isinstance(observations, torch.Tensor):
            if observations.ndim == 0 or observations.shape[0] == 0:
                return
            self.observations = evenly_spaced(observations, self.size)
            self.source, self.chosen_at = "first rollout", epoch

    def fix(self, observations: torch.Tensor, epoch: int | None = None) -> None:
        """Use ``observations`` (rows of states the policy takes) as the set from now on."""
        if not isinstance(observations, torch.Tensor) or observations.ndim == 0:
            raise TypeError(
                "reference states must be a tensor of rows (batch first), got "
                f"{type(observations).__name__}"
            )
        if observations.shape[0] == 0:
            raise ValueError("reference states need at least one row")
        self.observations = observations.detach().clone()
        self.source, self.chosen_at = "given", epoch

    @property
    def ready(self) -> bool:
        return self.observations is not None and self.forward is not None and not self.unusable

    def missing(self) -> str:
        """Why there is no set to measure on (one line that says what to change)."""
        if self.unusable:
            return (
                f"the policy's forward does not run on the reference states alone "
                f"({self.unusable}), so the _ref keys are not reported; pass "
                f"ProbeSession(forward=...), a function that runs the policy on a batch of "
                f"observation rows, or, for a policy that needs more than the observations "
                f"(a recurrent state), attach the probe with reference=False "
                f"(docs/reference_states.md)"
            )
        if self.observations is None:
            return (
                "no reference states: the loop never handed a rollout's observations to "
                "session.rollout_end(observations=...) nor called "
                "session.fix_reference_states(...), so the _ref keys are not reported "
                "(docs/reference_states.md)"
            )
        return (
            "reference states are set but no forward runs the policy on them; set them with "
            "session.fix_reference_states(...) (docs/reference_states.md)"
        )

    def track(self, module: nn.Module) -> None:
        """Keep ``module``'s output in the report's shared forward (:meth:`outputs`)."""
        self.tracked[id(module)] = module

    def outputs(self, context: Any = None) -> dict[int, Any]:
        """What every :meth:`track`-ed module returned on the set (its first call), by
        ``id(module)``: one forward per report, shared by every probe that reads it, until
        :meth:`release` (the report's end). Empty when not :attr:`ready`, or when the
        forward raises (:attr:`unusable` then says why, and no later report tries again)."""
        if self._outputs is None:
            try:
                self._outputs = self._run(self.tracked, context, inputs=False, raw=True)
            except Exception as exc:  # the policy cannot take the set: said, not retried
                self.unusable = f"{type(exc).__name__}: {exc}"
                self._outputs = {}
        return self._outputs

    def release(self) -> None:
        """End the report: drop the shared forward's outputs."""
        self._outputs = None

    def capture(
        self, modules: Mapping[str, nn.Module], context: Any = None, *, inputs: bool = False
    ) -> dict[str, torch.Tensor]:
        """Run the policy on the set once and return, per name of ``modules``, the tensor
        each module produced (``inputs=True``: its first positional argument), detached.
        Modules whose output is not a tensor are left out. ``context`` (a
        ``ComponentContext``) is switched to the phase ``"reference"`` meanwhile."""
        return self._run(dict(modules), context, inputs=inputs, raw=False)

    def _run(
        self, modules: Mapping[Any, nn.Module], context: Any, *, inputs: bool, raw: bool
    ) -> dict[Any, Any]:
        """One forward on the set, keeping each module's output (``inputs``: its first
        argument) under its key: detached tensors, or (``raw``) whatever it returned."""
        if not self.ready or not modules:
            return {}
        captured: dict[Any, Any] = {}

        def keep(key: Any, _m: nn.Module, args: Any, out: Any = None) -> None:
            value = (args[0] if args else None) if inputs else out
            if key in captured:
                return  # a module called twice: its first call
            if isinstance(value, torch.Tensor):
                captured[key] = value.detach()
            elif raw and value is not None:
                captured[key] = value

        handles = [
            m.register_forward_pre_hook(partial(keep, k))
            if inputs
            else m.register_forward_hook(partial(keep, k))
            for k, m in modules.items()
        ]
        phase = context.phase if context is not None else None
        try:
            if context is not None:
                context.phase = REFERENCE_PHASE
            # eager: a compiled policy runs its Python (the hooks fire; no new graph)
            owner = self.module if self.module is not None else self.forward
            with preserved_rng(), torch.no_grad(), _preserved_buffers(owner), eager_block():
                assert self.forward is not None and self.observations is not None
                self.forward(self.observations)
        finally:
            for h in handles:
                h.remove()
            if context is not None and phase is not None:
                context.phase = phase
        return captured

    def state_dict(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "observations": self.observations,
            "source": self.source,
            "chosen_at": self.chosen_at,
        }

    def load_state_dict(self, state: Mapping[str, Any], device: Any = None) -> None:
        self.size = int(state.get("size", self.size))
        obs = state.get("observations")
        if isinstance(obs, torch.Tensor) and device is not None:
            obs = obs.to(device)
        self.observations = obs
        self.source, self.chosen_at = state.get("source"), state.get("chosen_at")


@contextmanager
def _preserved_buffers(forward: Any) -> Iterator[None]:
    """Restore the buffers of ``forward`` (an ``nn.Module``) afterwards: a forward in
    training mode updates running statistics (batch norm), which training must not see."""
    buffers = list(forward.buffers()) if isinstance(forward, nn.Module) else []
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in zip(buffers, saved, strict=True):
                b.copy_(v)
