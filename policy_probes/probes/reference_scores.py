"""Unit scores on the run's reference states, beside a probe's own (``<metric>_ref`` keys).

A probe that scores units on the epoch's rollout rows (``relu``, ``utility``) also scores
them on the fixed set of :mod:`policy_probes.reference_states`, so a unit silent on the
states the policy visits now but alive on others is told apart from a dead one
(docs/reference_states.md). :class:`ReferenceScores` is the part they share:

* at attach, :meth:`ReferenceScores.read_reference` names each reported key's module and
  how its tensor is read (the extractor and layout of the probe's own hook);
* at each report, before the all-reduce (``StatsReporter``),
  :meth:`ReferenceScores.measure_reference` takes every such module's output from the
  report's one shared forward on the set and reduces it to per-unit sums and counts
  (:meth:`ReferenceScores.reference_sums`), in slots ``("reference", component, key)``
  that :func:`~policy_probes.probes.state.all_reduce_trackers` carries with the rest; with
  several processes the scores are those of the union of the ranks' sets;
* ``to_metrics`` turns them into ``_ref`` keys (:meth:`ReferenceScores.reference_host`).

Nothing runs in the hot path: one forward without gradients per report.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from policy_probes.probes.layout import positions
from policy_probes.probes.observation import Observation
from policy_probes.probes.probe import Probe
from policy_probes.probes.rows import COUNT
from policy_probes.probes.state import BY_SUM, SUM, as_rows, to_host
from policy_probes.reference_states import DEFAULT_SIZE

log = logging.getLogger("policy_probes")

#: the first part of a reference slot (``("reference", component, key)``)
REFERENCE_SLOT = "reference"


@dataclass(frozen=True)
class ReferenceTarget:
    """How one reported key's tensor is read on the set: the observation that owns it,
    the module whose output it is, the layout and the extractor (None: the output)."""

    obs: Any
    module: nn.Module
    channels_first: bool
    extract: Callable[[Any, nn.Module], torch.Tensor] | None = None


class ReferenceScores(Probe):
    """Base of a probe that also scores its units on the reference states: subclasses
    call :meth:`read_reference` at attach and implement :meth:`reference_sums`; their
    settings carry ``reference`` (on or off)."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        #: reported name -> how its tensor is read on the set (filled at attach)
        self.reference_targets: dict[str, ReferenceTarget] = {}
        #: this report's per-unit sums and counts on the set: name -> key -> tensor
        self.reference_state: dict[str, dict[str, torch.Tensor]] = {}
        #: this report's positions per reference state of each name (1 but for conv)
        self.reference_positions: dict[str, int] = {}
        #: whether the policy was found unable to run on the set (warned once)
        self.reference_unusable = False
        #: what this probe put in ``probe_errors`` while there was no set
        self.reference_missing: str | None = None

    def read_reference(
        self,
        name: str,
        obs: Observation,
        module: nn.Module,
        channels_first: bool,
        extract: Callable[[Any, nn.Module], torch.Tensor] | None = None,
    ) -> None:
        """Also score ``name`` (the output of ``module``) on the reference states, when its
        settings say ``reference`` and the context has them (a session's)."""
        states = getattr(obs.context, "reference_states", None)
        if states is None or not self.settings.get(name, {}).get("reference", False):
            return
        target = ReferenceTarget(obs, module, channels_first, extract)
        if self.reference_targets.get(name) == target:
            return  # attached again (hooks re-installed at a phase change)
        states.want(DEFAULT_SIZE)
        states.track(module)
        self.reference_targets[name] = target

    def reference_sums(self, name: str, values: UnitValues) -> dict[str, torch.Tensor]:
        """Per-unit accumulators of ``name``'s output on the set (:class:`UnitValues`)."""
        raise NotImplementedError

    def _live_targets(self) -> dict[str, ReferenceTarget]:
        """The targets still read: registered, ``reference`` on, their observation enabled
        and, for a layer, still this observation's (not taken over or refused)."""
        return {
            name: t
            for name, t in self.reference_targets.items()
            if self.settings.get(name, {}).get("reference", False)
            and t.obs.enabled
            and (name not in self.claimed or self.claimed[name] is t.obs)
        }

    def measure_reference(self) -> None:
        """Score the units on the report's forward on the set (before the all-reduce).
        Without a set, say so in ``context.probe_errors`` (logged once); when the policy
        cannot run on the set (a forward that needs more than the observations: a
        recurrent state, a TorchRL ``ModuleDict``), warn once and report no ``_ref`` key."""
        self.reference_state.clear()
        targets = self._live_targets()
        context = self.context
        states = getattr(context, "reference_states", None)
        if not targets or context is None or states is None:
            return
        key = f"{self.probe}/reference_states"
        if states.observations is None or states.forward is None:
            if key not in context.probe_errors:
                context.probe_errors[key] = self.reference_missing = states.missing()
                log.warning("probe %r: %s", self.probe, states.missing())
            return
        if self.reference_missing is not None:  # a set given since
            if context.probe_errors.get(key) == self.reference_missing:
                del context.probe_errors[key]
            self.reference_missing = None
        outputs = states.outputs(context)
        if states.unusable:  # the policy cannot run on the set: said once, in the log
            if not self.reference_unusable:
                self.reference_unusable = True
                log.warning("probe %r: %s", self.probe, states.missing())
            return
        done: dict[tuple[Any, ...], dict[str, torch.Tensor]] = {}
        for name, target in targets.items():
            out = outputs.get(id(target.module))
            h = out if target.extract is None or out is None else target.extract(out, target.module)
            if not isinstance(h, torch.Tensor):
                continue
            cf = target.channels_first
            self.reference_positions[name] = positions(h, cf)
            same = (h.data_ptr(), h.shape, h.stride(), h.dtype, cf)
            if same not in done:  # a component's output is also its last layer's
                done[same] = self.reference_sums(name, UnitValues.of(h, cf))
            self.reference_state[name] = done[same]

    def reference_host(self) -> dict[str, dict[str, torch.Tensor]]:
        """This report's sums on the host: one transfer per dtype for every name."""
        flat = {(c, k): t for c, st in self.reference_state.items() for k, t in st.items()}
        out: dict[str, dict[str, torch.Tensor]] = {}
        for (c, k), t in to_host(flat).items():  # type: ignore[arg-type]
            out.setdefault(c, {})[k] = t
        return out

    # ------------------------------------------------ with the other accumulators
    def reduced_tensors(self) -> dict[tuple[str, ...], tuple[torch.Tensor, str]]:
        out = super().reduced_tensors()
        shared: set[int] = set()
        for c, st in self.reference_state.items():
            if id(st) in shared:  # shared with another name: each slot reduced once
                self.reference_state[c] = st = {k: v.clone() for k, v in st.items()}
            shared.add(id(st))
            out.update(((REFERENCE_SLOT, c, k), (t, BY_SUM)) for k, t in st.items())
        return out

    def set_reduced(self, slot: tuple[str, ...], value: torch.Tensor) -> None:
        if len(slot) == 3 and slot[0] == REFERENCE_SLOT:
            self.reference_state.setdefault(slot[1], {})[slot[2]] = value
            return
        super().set_reduced(slot, value)

    def reset(self) -> None:
        super().reset()
        self.reference_state.clear()


@dataclass(frozen=True)
class UnitValues:
    """A tensor read on the set as the probe reads it, viewed ``(rows, units, positions)``:
    a channels-first conv output ``(B, C, *spatial)`` as ``(B, C, P)`` (its channels the
    units, every state and position a row), anything else as ``(N, U, 1)``; reduced
    without a copy of the rows, positions first (their few values in the tensor's
    dtype, then float64 across rows), its non-finite values left out."""

    values: torch.Tensor
    #: where the values are finite; None: all of them (the usual case, no mask kept)
    finite: torch.Tensor | None

    @classmethod
    def of(cls, h: torch.Tensor, channels_first: bool) -> UnitValues:
        if channels_first and h.dim() >= 3:
            v = h.reshape(h.shape[0], h.shape[1], -1)
        else:
            v = as_rows(h).unsqueeze(-1)
        if bool(torch.isfinite(v.sum())):  # no NaN or inf anywhere (one host read)
            return cls(v, None)
        finite = v.isfinite()
        return cls(torch.where(finite, v, torch.zeros((), dtype=v.dtype, device=v.device)), finite)

    def _per_unit(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.sum(-1, dtype=torch.int32 if dtype == COUNT else None).sum(0, dtype=dtype)

    def count(self) -> torch.Tensor:
        """Finite values per unit (int64)."""
        if self.finite is not None:
            return self._per_unit(self.finite, COUNT)
        rows, units, positions = self.values.shape
        return torch.full((units,), rows * positions, dtype=COUNT, device=self.values.device)

    def positive(self) -> torch.Tensor:
        """Finite values > 0 per unit (int64)."""
        return self._per_unit(self.values > 0, COUNT)

    def abs_sum(self) -> torch.Tensor:
        """Sum of the finite |h| per unit (float64)."""
        return self._per_unit(self.values.abs(), SUM)
