"""Churn probe: how much an epoch's updates change the outputs on states held out of them.

Churn (CHAIN, NeurIPS 2024; C-CHAIN, Tang, Obando-Ceron, Castro, Courville, Berseth,
ICML 2025) is the change of a network's outputs on data outside the minibatch caused by
an update; plasticity loss comes with rising churn. This probe measures it per epoch: a
fixed batch of held-out states is run through the policy before the epoch's updates and
again after them, and the probed component's outputs are compared row by row:

* ``kind="categorical"`` (a discrete actor head's logits): the policy KL
  KL(π_before ‖ π_after) = Σ_a p_a (log p_a − log q_a) per state (``policy_kl``) and the
  mean |Δ logit| (``output_change``)
* ``kind="value"`` (a value head, one output): |V_after − V_before| (``value_change``)
* ``kind="output"`` (anything else: a Gaussian mean, features): the mean over the output's
  entries of |Δ| per state (``output_change``)

each as its mean and its max over the held-out states. ``"auto"`` is ``"value"`` for a
one-wide output and ``"output"`` otherwise.

The held-out batch: ``batch_size`` states evenly spaced through a rollout. A loop hands
the rollout's observations in after the rollout (``ProbeSession.rollout_end``, which the
trainer and the SB3 ``ProbeCallback`` call too, hands them to :meth:`ChurnState.rollout_end`); they become the held-out
batch of the **next** epoch, whose updates never saw them (in the first epoch the current
rollout's states are used). ``ChurnState.fix_batch(obs)`` sets one batch for the whole run
instead. The forwards run without gradients, in the phase ``"churn"`` (no other probe
records them), with every global random generator restored afterwards, so the training
trajectory is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from policy_probes.context import ComponentContext
from policy_probes.hook_types import ProbeHook
from policy_probes.lifecycle.rng import preserved_rng
from policy_probes.probes.rows import COUNT
from policy_probes.probes.state import SUM, ProbeState, get_state
from policy_probes.processes import multi_process

KINDS = ("auto", "categorical", "value", "output")
CHURN_PHASE = "churn"


class ChurnState(ProbeState):
    """Per component: sums and counts of the per-state changes, and their maxima."""

    probe = "churn"

    def __init__(self) -> None:
        super().__init__()
        self.modules: dict[str, nn.Module] = {}
        #: runs the model on a batch of observations (the policy's forward)
        self.forward: Callable[[torch.Tensor], Any] | None = None
        self.fixed: torch.Tensor | None = None
        #: a subset of the last rollout: the next epoch's held-out batch
        self.pending: torch.Tensor | None = None
        self.batch: torch.Tensor | None = None
        self.before: dict[str, torch.Tensor] = {}
        #: component -> metric -> max over the window (all-reduced with MAX)
        self.maxima: dict[str, dict[str, torch.Tensor]] = {}
        self.batch_size = 256

    def register_component(self, name: str, *, kind: str = "auto", **extra: Any) -> bool:
        return super().register_component(name, kind=kind, **extra)

    def unregister_component(self, name: str) -> None:
        super().unregister_component(name)
        self.modules.pop(name, None)

    # ----------------------------------------------------------- the batch
    def fix_batch(self, observations: torch.Tensor) -> None:
        """Use ``observations`` (rows of states) as the held-out batch of every epoch."""
        self.fixed = observations.detach().clone()

    def held_out(self, observations: torch.Tensor) -> torch.Tensor:
        """``batch_size`` rows evenly spaced through ``observations`` (a copy)."""
        rows = observations.shape[0]
        if rows <= self.batch_size:
            return observations.detach().clone()
        idx = torch.linspace(
            0, rows - 1, self.batch_size, dtype=torch.float64, device=observations.device
        ).long()
        return observations.detach()[idx].clone()

    def rollout_end(
        self,
        observations: torch.Tensor | None = None,
        forward: Callable[[torch.Tensor], Any] | None = None,
    ) -> None:
        """After the rollout, before the updates (the session calls it at its
        ``rollout_end``): record the outputs on the held-out batch; ``observations``
        (this rollout's, flat rows) become the next epoch's; ``forward``: what runs the model
        on them (the session passes its policy)."""
        self.end_epoch()  # a previous epoch not reported yet (a longer reporting window)
        if forward is not None:
            self.forward = forward
        current = self.held_out(observations) if observations is not None else None
        batch = self.fixed if self.fixed is not None else self.pending
        if batch is None:
            batch = current
        if self.fixed is None and current is not None:
            self.pending = current
        if batch is None or self.forward is None or not self.modules:
            return
        self.batch = batch
        self.before = self._outputs(batch)

    def _outputs(self, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        """The probed components' outputs on ``batch``: one forward without gradients in
        the ``churn`` phase, global RNGs restored."""
        captured: dict[str, torch.Tensor] = {}

        def capture(name: str) -> Callable[..., None]:
            def hook(_m: nn.Module, _i: Any, out: Any) -> None:
                if isinstance(out, torch.Tensor):
                    captured[name] = out.detach().to(SUM)

            return hook

        handles = [m.register_forward_hook(capture(n)) for n, m in self.modules.items()]
        context = self.context
        phase = context.phase if context is not None else None
        try:
            if context is not None:
                context.phase = CHURN_PHASE
            with preserved_rng(), torch.no_grad():
                assert self.forward is not None
                self.forward(batch)
        finally:
            for h in handles:
                h.remove()
            if context is not None and phase is not None:
                context.phase = phase
        return captured

    def end_epoch(self) -> None:
        """After the updates: compare the outputs with those before (on the device)."""
        if self.batch is None or not self.before:
            return
        try:
            after = self._outputs(self.batch) if self.forward is not None else {}
        except Exception as exc:  # a probe must never take training down
            if self.context is not None and self.context.strict:
                raise
            self.errors["held-out batch"] = f"{type(exc).__name__}: {exc}"
            after = {}
        for comp, b in self.before.items():
            a = after.get(comp)
            if a is None or a.shape != b.shape:
                continue
            kind = self.settings[comp]["kind"]
            b2, a2 = b.reshape(b.shape[0], -1), a.reshape(a.shape[0], -1)
            if kind == "auto":
                kind = "value" if b2.shape[1] == 1 else "output"
            change = (a2 - b2).abs().mean(1)
            per_state = {"value_change" if kind == "value" else "output_change": change}
            if kind == "categorical":
                logp, logq = b2.log_softmax(1), a2.log_softmax(1)
                per_state["policy_kl"] = (logp.exp() * (logp - logq)).sum(1)
            self._add(comp, "states", torch.tensor(change.shape[0], device=change.device), COUNT)
            maxima = self.maxima.setdefault(comp, {})
            for metric, v in per_state.items():
                self._add(comp, f"{metric}_sum", v.sum())
                m = v.max()
                maxima[metric] = m if metric not in maxima else torch.maximum(maxima[metric], m)
        self.batch, self.before = None, {}

    # ----------------------------------------------------------- window
    def reset(self) -> None:
        super().reset()
        self.maxima = {}

    def all_reduce(self, group: Any = None) -> None:
        self.end_epoch()  # the report: the epoch's updates are done
        super().all_reduce(group)
        if not multi_process(group):
            return
        for maxima in self.maxima.values():
            for metric, m in maxima.items():
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
                maxima[metric] = m

    def to_metrics(self) -> dict[str, float | list[float]]:
        self.end_epoch()
        out = super().to_metrics()
        for comp, maxima in self.maxima.items():
            for metric, m in maxima.items():
                out[self.key(comp, f"{metric}_max")] = float(m)
        return out

    def summarize(self, component: str, s: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict:
        n = int(s["states"])
        if not n:
            return {}
        out: dict[str, float] = {"states": float(n)}
        for key, total in s.items():
            if key.endswith("_sum"):
                out[key.removesuffix("_sum")] = float(total) / n
        return out

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        # a mid-epoch checkpoint carries the outputs before this epoch's updates too
        out["held_out"] = {
            "fixed": self.fixed,
            "pending": self.pending,
            "batch": self.batch,
            "before": dict(self.before),
        }
        out["maxima"] = {c: dict(m) for c, m in self.maxima.items()}
        return out

    def load_state_dict(
        self, state: dict[str, Any], device: torch.device | str | None = None
    ) -> None:
        super().load_state_dict(state, device)
        held = state.get("held_out") or {}

        def placed(t: Any) -> Any:  # the held-out batch and outputs live with the model
            return t.to(device) if isinstance(t, torch.Tensor) and device is not None else t

        self.fixed, self.pending = placed(held.get("fixed")), placed(held.get("pending"))
        self.batch = placed(held.get("batch"))
        self.before = {c: placed(t) for c, t in (held.get("before") or {}).items()}
        self.maxima = {
            c: {k: placed(t) for k, t in m.items()} for c, m in (state.get("maxima") or {}).items()
        }


class ChurnHook(ProbeHook):
    """Records nothing in training passes; :meth:`attach` hands the component to the
    tracker, which runs its own forwards on the held-out batch."""

    probe = "churn"
    builder_name = "attach_churn_hooks()"

    def __init__(self, tracker: ChurnState, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tracker = tracker

    def __call__(self, module: nn.Module, first: Any, second: Any) -> None:
        if not self.attached:
            self.attach(module)

    def attach(self, module: nn.Module) -> list[RemovableHandle]:
        self.attached = True
        self.tracker.modules[self.component] = module
        # the policy the probe is attached to runs the held-out forwards unless the loop
        # hands another forward to rollout_end (also after a mid-epoch resume)
        owner = getattr(self.locate, "__self__", None)
        if self.tracker.forward is None and isinstance(owner, nn.Module):
            self.tracker.forward = owner
        return []


def attach_churn_hooks(*, kind: str = "auto", batch_size: int = 256) -> Any:
    """Builder of the ``churn`` probe (docs/probes/churn.md): the change of the
    component's outputs on ``batch_size`` held-out states caused by an epoch's updates.
    ``kind``: ``"categorical"`` for a discrete actor head (policy KL), ``"value"`` for a
    value head, ``"output"`` for anything else, ``"auto"``: value for one output."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")

    def build(component_name: str, context: ComponentContext) -> ChurnHook | None:
        tracker = get_state(context, "churn", ChurnState)
        tracker.batch_size = batch_size
        if not tracker.register_component(component_name, kind=kind):
            return None
        return ChurnHook(tracker, component_name, context, ("train",))

    build.probe = "churn"  # type: ignore[attr-defined]
    return build
