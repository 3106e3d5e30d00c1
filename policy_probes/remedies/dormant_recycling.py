"""ReDo: recycle dormant units (Sokar et al. 2023, "The Dormant Neuron Phenomenon in Deep
Reinforcement Learning").

Unit ``u`` is dormant when its ReLU-probe score ``s_u = mean|h_u| / (layer mean + eps)``
over the epoch's observed passes is ``<= tau``. ReDo gives it fresh incoming weights from
the layer's own initialiser (row ``u``, bias entry ``u``; for an LSTM/GRU rows ``g*H + u``
of every gate ``g``), zeroes its outgoing weights (the consumer's input columns of ``u``,
:mod:`~policy_probes.remedies.structure`; for an LSTM/GRU also column ``u`` of its own
``weight_hh``), so the outputs are unchanged at the firing, and zeroes the optimiser's
moment entries of exactly those weights (``step`` kept)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from typing_extensions import Unpack

from policy_probes.plugins import register
from policy_probes.remedies.base import Remedy, RemedyOptions, RemedyTarget, checked, name_list
from policy_probes.remedies.fresh_init import draw_seed, fresh_parameters
from policy_probes.remedies.optim_state import reset_entries
from policy_probes.remedies.structure import RECURRENT, UnitLayer, target_unit_layers
from policy_probes.remedies.trigger import Threshold

log = logging.getLogger("policy_probes")


@register
class ReDo(Remedy):
    """ReDo (Sokar et al., ICML 2023): at its trigger, recycle the component's dormant units:
    fresh incoming weights, zero outgoing ones (build with :func:`redo`)."""

    name = "redo"
    setting_names = ("tau", "consumer")

    def __init__(
        self, *, tau: float = 0.025, consumer: str | Sequence[str] | None = None, **trigger: Any
    ) -> None:
        rule = ">= 0 (a unit is dormant when its score <= tau)"
        self.tau = checked("tau", tau, lambda v: v >= 0, rule)
        super().__init__(**trigger)
        self.consumer = name_list(consumer)
        self._warned: set[str] = set()

    def reads_components(self, component: str) -> list[str]:
        """The ReLU probe's scores of ``component``, besides a threshold's component."""
        return [component, *super().reads_components(component)]

    def prepare(self, target: RemedyTarget) -> list[UnitLayer]:
        tracker = target.context.model_metrics.get("relu")
        if tracker is None or not tracker.has_component(target.component):
            raise ValueError(
                f"ReDo on {target.component!r} reads the dormant scores of the ReLU probe on "
                f"that component, and none is attached: attach "
                f"attach_relu_activation_hooks() to {target.component!r} before the remedy "
                f"(per_layer=True scores every layer inside it)"
            )
        return target_unit_layers(target, self.consumer)

    def apply(
        self, target: RemedyTarget, prepared: list[UnitLayer], generator: torch.Generator
    ) -> dict[str, int]:
        tracker = target.context.model_metrics["relu"]
        scores = [self._scores(tracker, layer) for layer in prepared]  # checked before changes
        out: dict[str, int] = {}
        for layer, layer_scores in zip(prepared, scores, strict=True):
            seed = draw_seed(generator)  # one draw per layer per firing, scored or not
            if layer_scores is None:
                out[layer.name] = 0
                continue
            units = torch.nonzero(layer_scores <= self.tau).reshape(-1)
            out[layer.name] = int(units.numel())
            if units.numel():
                recycle(layer, units, seed, target.optimizer)
        return out

    def _scores(self, tracker: Any, layer: UnitLayer) -> torch.Tensor | None:
        for name in (layer.name, *layer.aliases):
            scores = tracker.scores.get(name)
            if scores is not None:
                break
        else:
            if layer.name not in self._warned:
                self._warned.add(layer.name)
                log.warning(
                    "ReDo: no dormant scores for %s this epoch (the ReLU probe did not read "
                    "it: per_layer=False, or no observed pass); its units are left alone",
                    layer.name,
                )
            return None
        if scores.numel() != layer.units:
            raise ValueError(
                f"ReDo on {layer.name!r}: the ReLU probe reports {scores.numel()} units, the "
                f"layer {layer.producer_name!r} has {layer.units}; attach the probe with the "
                f"layout that puts the units where the layer has them (layout='channels_first' "
                f"for conv channels)"
            )
        return scores


def recycle(
    layer: UnitLayer, units: torch.Tensor, seed: int, optimizer: Any, *, zero_bias: bool = False
) -> None:
    """Fresh incoming and zero outgoing weights and moments for ``units`` of ``layer``;
    ``zero_bias``: the units' biases 0 instead of fresh (continual backprop's GnT)."""
    producer = layer.producer
    fresh = fresh_parameters(producer, seed)
    rows = torch.cat([units + g * layer.units for g in range(layer.gates)])
    with torch.no_grad():
        for name, param in producer.named_parameters(recurse=False):
            idx = rows.to(param.device)
            # the fresh values are drawn on the host; copied without waiting for the device
            # (continual backprop recycles inside the optimizer step)
            fresh_values = fresh[name].to(param, non_blocking=True)
            if zero_bias and name.startswith("bias"):
                param.index_fill_(0, idx, 0)
            else:
                param.index_copy_(0, idx, fresh_values.index_select(0, idx))
            reset_entries(optimizer, param, 0, idx)
        if isinstance(producer, RECURRENT):  # the unit's own recurrent outputs
            zero_columns(producer.weight_hh_l0, units, 1, optimizer)
        for consumer in layer.consumers:
            weight = getattr(consumer.module, consumer.weight_name)
            zero_columns(weight, units, consumer.block, optimizer)


def zero_columns(weight: torch.Tensor, units: torch.Tensor, block: int, optimizer: Any) -> None:
    """Zero the input columns of ``units`` (``block`` columns each) of ``weight``."""
    cols = (units[:, None] * block + torch.arange(block, device=units.device)).reshape(-1)
    cols = cols.to(weight.device)
    weight.index_fill_(1, cols, 0)
    reset_entries(optimizer, weight, 1, cols)


def redo(
    tau: float = 0.025,
    every_epochs: int | None = None,
    when: str | Threshold | None = None,
    *,
    consumer: str | Sequence[str] | None = None,
    **options: Unpack[RemedyOptions],
) -> ReDo:
    """ReDo on the component it is attached to (:mod:`policy_probes.remedies.dormant_recycling`):
    units with score ``<= tau`` are recycled when the trigger
    (:mod:`~policy_probes.remedies.trigger`) is due. ``consumer``: the component(s) reading
    the component's output (default: the policy's ``component_consumers``)."""
    return ReDo(tau=tau, consumer=consumer, every_epochs=every_epochs, when=when, **options)


__all__ = ["ReDo", "recycle", "redo"]
