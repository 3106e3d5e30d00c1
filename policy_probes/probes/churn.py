"""Churn probe: how much an epoch's updates change the outputs on states held out of them.

Churn (CHAIN, NeurIPS 2024; C-CHAIN, Tang, Obando-Ceron, Castro, Courville, Berseth,
ICML 2025) is the change an update causes in a network's outputs on data outside the
minibatch; plasticity loss comes with rising churn. The component's outputs on held-out
states before and after an epoch's updates are compared row by row:

* ``kind="categorical"`` (a discrete actor head's logits): the policy KL
  KL(π_before ‖ π_after) = Σ_a p_a (log p_a − log q_a) per state (``policy_kl``) and the
  mean |Δ logit| (``output_change``)
* ``kind="value"`` (a value head, one output): |V_after − V_before| (``value_change``)
* ``kind="output"`` (anything else: a Gaussian mean, features): the mean over the output's
  entries of |Δ| per state (``output_change``)

each as its mean and max over the held-out states (``"auto"``: ``"value"`` for one output).

The held-out batch: ``batch_size`` states evenly spaced through the rollout handed to
:meth:`Churn.rollout_end`, used in the **next** epoch (the first uses its own), or one
batch for the run (:meth:`Churn.fix_batch`). The forwards run without gradients in the
phase ``"churn"``, global random generators restored: training is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from policy_probes.lifecycle.rng import preserved_rng
from policy_probes.plugins import Rule, register
from policy_probes.probes.probe import Probe
from policy_probes.probes.rows import COUNT
from policy_probes.probes.state import BY_MAX, SUM, Device
from policy_probes.reference_states import evenly_spaced

if TYPE_CHECKING:
    from policy_probes.probes.observation import Observation

KINDS = ("auto", "categorical", "value", "output")
CHURN_PHASE = "churn"


@register
class Churn(Probe):
    """Per component: sums and counts of the per-state changes, and their maxima, from
    its own forwards on the held-out batch (at ``rollout_end`` and at the report)."""

    name = "churn"
    maker = "attach_churn_hooks()"
    events = ("rollout_end", "epoch_end")
    placements = ()
    component_hook = False
    docs = "docs/probes/churn.md"
    metrics = {
        "policy_kl": "mean KL(pi_before || pi_after) over the held-out states (categorical)",
        "value_change": "mean |V_after - V_before| over the held-out states (value)",
        "output_change": "mean |output_after - output_before| (categorical, output)",
    }
    rules = (
        Rule(
            name="churn_rising",
            title="policy churn grew twentyfold",
            metric="policy_kl",
            direction="rising",
            kind="ratio",
            threshold=20.0,
            floor=1e-4,
            threshold_source="policy-probes default, not from a paper; rising churn comes "
            "with plasticity loss in C-CHAIN (Tang et al., ICML 2025)",
            docs="docs/probes/churn.md",
            remedies=("churn reduction loss (C-CHAIN; not in policy_probes.remedies)",),
            meaning="one epoch of updates changes the policy on held-out states at least 20 "
            "times as much as a few epochs before (C-CHAIN links rising churn with plasticity loss; "
            "probes/trainability tests that directly)",
        ),
        Rule(
            name="value_churn_rising",
            title="value churn grew sixfold",
            metric="value_change",
            direction="rising",
            kind="ratio",
            threshold=6.0,
            floor=1e-4,
            threshold_source="policy-probes default, not from a paper; C-CHAIN (Tang et al., "
            "ICML 2025) measures |dV| on held-out states",
            docs="docs/probes/churn.md",
            remedies=("churn reduction loss (C-CHAIN; not in policy_probes.remedies)",),
            meaning="one epoch of updates moves the value on held-out states at least six "
            "times as much as a few epochs before",
        ),
    )

    def __init__(self, *, kind: str = "auto", batch_size: int = 256) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        super().__init__(kind=kind, batch_size=batch_size)
        self.modules: dict[str, nn.Module] = {}
        #: runs the model on a batch of observations (the policy's forward)
        self.forward: Callable[[torch.Tensor], Any] | None = None
        self.fixed: torch.Tensor | None = None
        #: the next epoch's held-out batch (from the last rollout)
        self.pending: torch.Tensor | None = None
        self.batch: torch.Tensor | None = None
        self.before: dict[str, torch.Tensor] = {}
        #: component -> metric -> max over the window (all-reduced with MAX)
        self.maxima: dict[str, dict[str, torch.Tensor]] = {}
        self.batch_size = batch_size

    def attach(self, obs: Observation, module: nn.Module) -> list[RemovableHandle]:
        self.modules[obs.component] = module
        # the policy runs the held-out forwards unless the loop hands rollout_end another
        owner = getattr(obs.locate, "__self__", None)
        if self.forward is None and isinstance(owner, nn.Module):
            self.forward = owner
        return []

    def register_component(self, name: str, **settings: Any) -> bool:
        """Register ``name``; its ``batch_size`` becomes the held-out batch's size."""
        if not super().register_component(name, **settings):
            return False
        self.batch_size = self.settings[name].get("batch_size", self.batch_size)
        return True

    def unregister_component(self, name: str) -> None:
        super().unregister_component(name)
        self.modules.pop(name, None)

    # ----------------------------------------------------------- the batch
    def fix_batch(self, observations: torch.Tensor) -> None:
        """Use ``observations`` (rows of states) as the held-out batch of every epoch."""
        self.fixed = observations.detach().clone()

    def held_out(self, observations: torch.Tensor) -> torch.Tensor:
        """``batch_size`` rows evenly spaced through ``observations`` (a copy; the rule of
        :func:`~policy_probes.reference_states.evenly_spaced`)."""
        return evenly_spaced(observations, self.batch_size)

    def rollout_end(
        self,
        observations: torch.Tensor | None = None,
        forward: Callable[[torch.Tensor], Any] | None = None,
    ) -> None:
        """After the rollout, before the updates: record the outputs on the held-out batch;
        ``observations`` (flat rows) become the next epoch's; ``forward`` runs the model."""
        self.end_epoch()  # a previous epoch not reported yet (a longer reporting window)
        if forward is not None:
            self.forward = forward
        current = self.held_out(observations) if observations is not None else None
        batch = next((b for b in (self.fixed, self.pending, current) if b is not None), None)
        if self.fixed is None and current is not None:
            self.pending = current
        if batch is None or self.forward is None or not self.modules:
            return
        self.batch = batch
        self.before = self._outputs(batch)

    def _outputs(self, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        """The probed components' outputs on ``batch`` (no gradients, phase ``churn``)."""
        captured: dict[str, torch.Tensor] = {}

        def capture(name: str, _m: nn.Module, _i: Any, out: Any) -> None:
            if isinstance(out, torch.Tensor):
                captured[name] = out.detach().to(SUM)

        handles = [m.register_forward_hook(partial(capture, n)) for n, m in self.modules.items()]
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
            # an entry that did not change (a masked -inf logit both times) changes by 0
            change = torch.where(a2 == b2, 0.0, a2 - b2).abs().mean(1)
            per_state = {"value_change" if kind == "value" else "output_change": change}
            if kind == "categorical":
                per_state["policy_kl"] = policy_kl(b2, a2)
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

    def reduced_tensors(self) -> dict[tuple[str, ...], tuple[torch.Tensor, str]]:
        self.end_epoch()  # the report: the epoch's updates are done
        out = super().reduced_tensors()
        for comp, maxima in self.maxima.items():
            out.update(((comp, metric, BY_MAX), (m, BY_MAX)) for metric, m in maxima.items())
        return out

    def set_reduced(self, slot: tuple[str, ...], value: torch.Tensor) -> None:
        if len(slot) == 3:  # (component, metric, BY_MAX): a maximum
            self.maxima.setdefault(slot[0], {})[slot[1]] = value
        else:
            super().set_reduced(slot, value)

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

    def load_state_dict(self, state: dict[str, Any], device: Device = None) -> None:
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


def policy_kl(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Per row, KL(softmax(before) || softmax(after)) = sum_a p_a (log p_a - log q_a) over
    logits ``(rows, actions)``: actions with p_a = 0 (masked with -inf) add 0, an action
    with p_a > 0 and q_a = 0 makes it +inf."""
    logp, logq = before.log_softmax(1), after.log_softmax(1)
    p = logp.exp()
    return torch.where(p > 0, p * (logp - logq), 0.0).sum(1)


def attach_churn_hooks(*, kind: str = "auto", batch_size: int = 256) -> Churn:
    """The ``churn`` probe (:class:`Churn`, docs/probes/churn.md) on ``batch_size`` held-out
    states; ``kind``: ``"categorical"`` (policy KL), ``"value"``, ``"output"`` or
    ``"auto"`` (value for one output). It takes no placement."""
    return Churn(kind=kind, batch_size=batch_size)
