"""Continual backprop (CBP; Dohare, Hernandez-Garcia, Lan, Rahman, Mahmood, Sutton 2024,
"Loss of plasticity in deep continual learning", Nature; reference code
shibhansh/loss-of-plasticity, ``lop/algos/gnt.py``).

After every optimizer step each unit ``i`` of the component's unit layers ages by one and
``u_i <- eta * u_i + (1 - eta) * mean|h_i| * sum_k |w_ik|`` (activations of the step's
training forwards, outgoing weights after it). ``replacement_rate * |E|`` (``E``: units
with ``age > maturity_threshold``) accumulates into a count whose integer part ``n`` is
replaced: the ``n`` lowest ``u_i / (1 - eta^age_i)`` (ranked in the model's precision, at
least float32) get fresh incoming weights, a zero bias (as the paper's GnT), zero outgoing
weights and moments, utility and age 0 (outputs unchanged). Defaults: the paper's
PPO settings. How it differs from the reference code, and why it needs no host sync per
step: ``docs/remedies.md``."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules import conv

from policy_probes.plugins import register
from policy_probes.processes import multi_process
from policy_probes.remedies.base import RemedyTarget, checked, name_list
from policy_probes.remedies.dormant_recycling import recycle
from policy_probes.remedies.fresh_init import draw_seed
from policy_probes.remedies.step_remedy import StepRemedy, StepState
from policy_probes.remedies.structure import RECURRENT, UnitLayer, target_unit_layers
from policy_probes.remedies.trigger import whole_number


@dataclass
class CBPLayer:
    """One unit layer's CBP state."""

    layer: UnitLayer
    util: torch.Tensor
    ages: torch.Tensor
    h_sum: torch.Tensor
    h_count: int = 0
    #: fraction of a unit still to replace
    pending: float = 0.0
    #: (step, units replaced) of the last maturity_threshold steps
    recent: deque = field(default_factory=deque)
    replaced_epoch: int = 0


#: the per-unit tensors of a :class:`CBPLayer`, and its scalars with their types
_TENSORS = ("util", "ages", "h_sum")
_SCALARS = {"h_count": int, "pending": float, "replaced_epoch": int}


@dataclass
class CBPState(StepState):
    layers: list[CBPLayer] = field(default_factory=list)
    #: steps with features since the remedy was attached
    step: int = 0


def output_magnitude(layer: UnitLayer) -> torch.Tensor:
    """``sum_k |w_ik|`` per unit over every consumer's input columns of the unit."""
    total = None
    for c in layer.consumers:
        w = getattr(c.module, c.weight_name).detach().abs()
        per_col = w.sum(dim=[d for d in range(w.dim()) if d != 1])
        per_unit = per_col.view(layer.units, c.block).sum(1)
        total = per_unit if total is None else total + per_unit
    return total


@register
class ContinualBackprop(StepRemedy):
    """Continual backprop (Dohare et al., Nature 2024): after every optimizer step, replace
    the component's lowest-utility mature units (build with :func:`continual_backprop`)."""

    name = "continual_backprop"
    setting_names = ("replacement_rate", "maturity_threshold", "decay", "consumer")

    def __init__(
        self,
        *,
        replacement_rate: float = 1e-4,
        maturity_threshold: int = 10_000,
        decay: float = 0.99,
        consumer: str | Sequence[str] | None = None,
        seed: int | None = None,
    ) -> None:
        self.replacement_rate = checked(
            "replacement_rate", replacement_rate, lambda v: 0 < v <= 1, "in (0, 1]"
        )
        self.maturity_threshold = whole_number("maturity_threshold", maturity_threshold, 0)
        self.decay = checked("decay", decay, lambda v: 0 <= v < 1, "in [0, 1)")
        super().__init__(seed=seed)
        self.consumer = name_list(consumer)

    def prepare(self, target: RemedyTarget) -> CBPState:
        found = target_unit_layers(target, self.consumer, remedy="continual_backprop")
        state = CBPState()
        for layer in found:
            if isinstance(layer.producer, RECURRENT):
                raise ValueError(
                    f"continual_backprop on {target.component!r}: {layer.producer_name!r} is a "
                    f"recurrent layer; CBP replaces units of nn.Linear and nn.Conv1d/2d/3d layers"
                )
            weight = layer.producer.weight
            # utilities in the model's precision, at least float32: a float64 model's units
            # whose utilities differ below float32's resolution still rank apart
            dtype = torch.promote_types(weight.dtype, torch.float32)
            util = torch.zeros(layer.units, device=weight.device, dtype=dtype)
            ages = torch.zeros(layer.units, device=weight.device, dtype=torch.long)
            state.layers.append(CBPLayer(layer, util, ages, h_sum=util.clone()))
        return state

    def start(self, target: RemedyTarget, prepared: CBPState, generator: torch.Generator) -> None:
        if multi_process():
            raise RuntimeError(
                "continual_backprop supports single-process runs only (each rank's utilities "
                "would come from its own samples, and the ranks would replace different units)"
            )
        super().start(target, prepared, generator)
        for entry in prepared.layers:
            conv_layer = isinstance(entry.layer.producer, conv._ConvNd)
            hook = self._features_hook(entry, conv_layer)
            prepared.handles.append(entry.layer.activation.register_forward_hook(hook))

    @staticmethod
    def _features_hook(entry: CBPLayer, conv_layer: bool) -> Any:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            if not torch.is_grad_enabled():  # rollouts, evaluation: not a training forward
                return
            h = output.detach().abs()
            if conv_layer:  # (N, C, *spatial): mean over positions, sum over samples
                entry.h_sum += h.flatten(2).mean(2).sum(0).to(entry.h_sum.dtype)
                entry.h_count += h.shape[0]
            else:  # (..., units)
                rows = h.reshape(-1, entry.layer.units)
                entry.h_sum += rows.sum(0).to(entry.h_sum.dtype)
                entry.h_count += rows.shape[0]

        return hook

    def after_step(
        self, target: RemedyTarget, prepared: CBPState, generator: torch.Generator
    ) -> None:
        if not any(e.h_count for e in prepared.layers):
            return  # no training forward since the last step: nothing to measure
        prepared.step += 1
        t, m, eta = prepared.step, self.maturity_threshold, self.decay
        for entry in prepared.layers:
            if entry.h_count:
                contribution = (entry.h_sum / entry.h_count) * output_magnitude(entry.layer)
                entry.util.mul_(eta).add_(contribution, alpha=1.0 - eta)
            entry.h_sum.zero_()
            entry.h_count = 0
            entry.ages += 1
            while entry.recent and entry.recent[0][0] < t - m:
                entry.recent.popleft()
            eligible = 0 if t <= m else entry.layer.units - sum(n for _, n in entry.recent)
            entry.pending += self.replacement_rate * eligible
            n = int(entry.pending)
            if n == 0:
                continue
            entry.pending -= n
            ages = entry.ages
            corrected = entry.util / (1.0 - torch.pow(torch.full_like(entry.util, eta), ages))
            corrected = torch.where(ages > m, corrected, torch.full_like(corrected, float("inf")))
            units = torch.sort(corrected, stable=True).indices[:n]
            recycle(entry.layer, units, draw_seed(generator), target.optimizer, zero_bias=True)
            entry.util.index_fill_(0, units, 0.0)
            entry.ages.index_fill_(0, units, 0)
            entry.recent.append((t, n))
            entry.replaced_epoch += n

    def epoch_report(self, target: RemedyTarget, prepared: CBPState) -> dict[str, float]:
        out = {f"{e.layer.name}/units_reset": float(e.replaced_epoch) for e in prepared.layers}
        out["units_reset"] = float(sum(e.replaced_epoch for e in prepared.layers))
        out.pop(f"{target.component}/units_reset", None)  # the component total says it
        for entry in prepared.layers:
            entry.replaced_epoch = 0
        return out

    def state_dict(self, prepared: CBPState) -> dict[str, Any]:
        layers = {
            e.layer.name: {
                **{k: getattr(e, k).clone() for k in _TENSORS},
                **{k: getattr(e, k) for k in _SCALARS},
                "recent": list(e.recent),
            }
            for e in prepared.layers
        }
        return {**super().state_dict(prepared), "step": prepared.step, "layers": layers}

    def load_state_dict(self, prepared: CBPState, state: Any) -> None:
        super().load_state_dict(prepared, state)
        prepared.step = int(state["step"])
        for e in prepared.layers:
            saved = state["layers"][e.layer.name]
            for k in _TENSORS:
                getattr(e, k).copy_(saved[k])
            for k, cast in _SCALARS.items():
                setattr(e, k, cast(saved[k]))
            e.recent = deque((int(s), int(n)) for s, n in saved["recent"])


def continual_backprop(
    replacement_rate: float = 1e-4,
    maturity_threshold: int = 10_000,
    decay: float = 0.99,
    *,
    consumer: str | Sequence[str] | None = None,
    seed: int | None = None,
) -> ContinualBackprop:
    """Continual backprop on the component it is attached to; ``consumer`` as for :func:`redo`."""
    return ContinualBackprop(
        replacement_rate=replacement_rate,
        maturity_threshold=maturity_threshold,
        decay=decay,
        consumer=consumer,
        seed=seed,
    )
