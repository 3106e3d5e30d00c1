"""Saturation probe for bounded activations (tanh, sigmoid).

An element is saturated when |h| > t (tanh) or h < 1-t or h > t (sigmoid), t = 0.95 by
default. Saturated units pass almost no gradient: the derivative 1-h^2 (tanh) or
h(1-h) (sigmoid) is near zero there, which ``mean_derivative`` reports directly.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from policy_probes.plugins import register
from policy_probes.probes.per_layer import ActivationLayer, ActivationProbe
from policy_probes.probes.relu import samples
from policy_probes.probes.rows import COUNT
from policy_probes.probes.state import SUM, Drained, indicator_, unit_rates
from policy_probes.probes.weighted import Weighted
from policy_probes.sampling import standard_error

#: the activation module of each kind (the layers a per-layer saturation probe reads)
SATURATING_MODULES: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "sigmoid": nn.Sigmoid}


class SaturatedActivation(ActivationProbe):
    """Saturated units of a bounded activation (:attr:`activation`, ``tanh`` or
    ``sigmoid``): per-unit counts of saturated elements and sums of the derivative."""

    activation: ClassVar[str] = "tanh"
    docs = "docs/probes/saturation.md"
    maker = "attach_saturated_activation_hooks()"
    metrics = {
        "saturated_fraction": "share of elements beyond the threshold",
        "mean_derivative": "mean activation derivative over the elements",
        "saturation_rate": "per unit: share of its elements that are saturated",
    }
    console = ("saturated_fraction",)

    def __init__(self, *, threshold: float = 0.95, unit_threshold: float = 0.99) -> None:
        low = 0.5 if self.activation == "sigmoid" else 0.0
        if not low < threshold < 1.0:
            raise ValueError(
                f"threshold for {self.activation} saturation must lie in ({low}, 1), got "
                f"{threshold}"
            )
        super().__init__(threshold=threshold, unit_threshold=unit_threshold)

    def selects(self, layer: ActivationLayer) -> bool:
        """Only layers of this probe's activation (tanh or sigmoid)."""
        return isinstance(layer.act, SATURATING_MODULES[self.activation])

    def consume(self, batch: Drained) -> None:
        component, (h,), weight = batch.component, batch.cols, batch.weight
        t = self.settings[component]["threshold"]
        clean, scratch = h.clean, self.scratch(h.clean)  # non-finite entries are 0
        kept = Weighted(h, weight)  # rows the row mask keeps (all without one)
        count = kept.finite_count()
        finite_total = count.sum()
        sq_sum = kept.sums(h.square()).sum().to(SUM)
        if self.activation == "tanh":
            # sum over finite elements of 1 - h^2 (replaced elements add 0 to sq_sum)
            derivative_sum = finite_total - sq_sum
            saturated = kept.counts(indicator_(torch.abs(clean, out=scratch).sub_(t)))
        else:  # sigmoid: h (1 - h); t > 0.5, so the two tails are disjoint
            derivative_sum = kept.sums(clean).sum().to(SUM) - sq_sum
            low = kept.counts(indicator_(torch.mul(clean, -1.0, out=scratch).add_(1 - t)))
            high = kept.counts(indicator_(torch.sub(clean, t, out=scratch)))
            # a replaced 0 is below 1 - t: not saturated
            saturated = low - (kept.num_rows - count) + high
        self._add(component, "count", count, COUNT)
        self._add(component, "saturated", saturated, COUNT)
        self._add(component, "derivative_sum", derivative_sum)
        self._add(component, "nonfinite", kept.nonfinite_total(), COUNT)

    def summarize(self, component: str, s: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict:
        count = s["count"].numpy()  # numpy: see ReLUActivation.summarize_alike
        saturated_units = s["saturated"].numpy()
        rate = unit_rates(saturated_units, count)
        seen = count > 0
        units = int(np.count_nonzero(seen))
        finite_total = int(count.sum())
        elements = finite_total + int(s["nonfinite"])
        saturated = int(saturated_units.sum()) / finite_total if finite_total else 0.0
        return {
            "saturation_rate": rate.tolist(),
            "saturated_fraction": saturated,
            "saturated_fraction_se": standard_error(saturated, finite_total),
            "saturated_units_fraction": (
                int(np.count_nonzero((rate >= cfg["unit_threshold"]) & seen)) / units
                if units
                else 0.0
            ),
            "mean_derivative": float(s["derivative_sum"]) / finite_total if finite_total else 0.0,
            "nonfinite_fraction": (elements - finite_total) / elements if elements else 0.0,
            "samples": samples(count, cfg),
        }


@register
class SaturatedTanh(SaturatedActivation):
    """Saturated tanh units: |h| > threshold."""

    name = "saturation_tanh"
    activation = "tanh"


@register
class SaturatedSigmoid(SaturatedActivation):
    """Saturated sigmoid units: h < 1 - threshold or h > threshold."""

    name = "saturation_sigmoid"
    activation = "sigmoid"


def attach_saturated_activation_hooks(
    activation: str = "tanh", *, threshold: float = 0.95, unit_threshold: float = 0.99
) -> SaturatedActivation:
    """The ``saturation_<activation>`` probe (:class:`SaturatedTanh` or
    :class:`SaturatedSigmoid`), for a component whose output is the activation itself
    (``actor_mlp`` of a tanh policy). Placed with every placement argument."""
    probes = {"tanh": SaturatedTanh, "sigmoid": SaturatedSigmoid}
    if activation not in probes:
        raise ValueError(
            f"unsupported activation {activation!r} for attach_saturated_activation_hooks; "
            f"choose one of {list(probes)}"
        )
    return probes[activation](threshold=threshold, unit_threshold=unit_threshold)
