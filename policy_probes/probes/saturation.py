"""Saturation probe for bounded activations (tanh, sigmoid).

An element is saturated when |h| > t (tanh) or h < 1-t or h > t (sigmoid), t = 0.95 by
default. Saturated units pass almost no gradient: the derivative 1-h^2 (tanh) or
h(1-h) (sigmoid) is near zero there, which ``mean_derivative`` reports directly.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from policy_probes.hook_types import Extractor, HookBuilder
from policy_probes.probes.layout import ActivationState, check_layout
from policy_probes.probes.per_layer import (
    ActivationLayer,
    LayeredProbeHook,
    layered_builder,
)
from policy_probes.probes.relu import samples
from policy_probes.probes.rows import COUNT
from policy_probes.probes.state import (
    SUM,
    Drained,
    indicator_,
    unit_rates,
)
from policy_probes.probes.weighted import Weighted
from policy_probes.sampling import Schedule, standard_error

SATURATING = ("tanh", "sigmoid")
#: the activation module of each kind (the layers a per-layer saturation probe reads)
SATURATING_MODULES: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "sigmoid": nn.Sigmoid}


class SaturatedActivationState(ActivationState):
    """Per-unit counts of saturated elements and sums of the activation derivative."""

    def __init__(self, activation: str = "tanh") -> None:
        if activation not in SATURATING:
            raise ValueError(
                f"unsupported activation {activation!r} for the saturation probe; "
                f"choose one of {list(SATURATING)}"
            )
        super().__init__()
        self.activation = activation
        self.probe = f"saturation_{activation}"

    def register_component(
        self, name: str, *, threshold: float = 0.95, unit_threshold: float = 0.99, **extra: Any
    ) -> bool:
        return super().register_component(
            name, threshold=threshold, unit_threshold=unit_threshold, **extra
        )

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
        count = s["count"].numpy()  # numpy: see ReLUActivationState.summarize
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


class SaturatedActivationHook(LayeredProbeHook):
    builder_name = "attach_saturated_activation_hooks()"

    def __init__(self, tracker: SaturatedActivationState, *args: Any, **kwargs: Any) -> None:
        super().__init__(tracker, *args, **kwargs)
        self.probe = tracker.probe

    def selects(self, layer: ActivationLayer) -> bool:
        """Only layers of this probe's activation (tanh or sigmoid)."""
        return isinstance(layer.act, SATURATING_MODULES[self.tracker.activation])


def attach_saturated_activation_hooks(
    activation: str = "tanh",
    *,
    threshold: float = 0.95,
    unit_threshold: float = 0.99,
    phases: Iterable[str] | str = ("train",),
    extractor: Extractor | None = None,
    layout: str = "auto",
    per_layer: bool = True,
    schedule: Schedule | str | None = None,
) -> HookBuilder:
    """Forward-hook builder for :class:`SaturatedActivationState`.

    Attach to a component whose output is the tanh/sigmoid activation itself (for example
    ``actor_mlp`` of a tanh policy). ``layout``: where the units are (per channel on conv
    outputs, :mod:`~policy_probes.probes.layout`); ``per_layer``: also report every
    ``activation`` layer inside the component (:mod:`~policy_probes.probes.per_layer`).
    """
    check_layout(layout)
    if activation not in SATURATING:
        raise ValueError(
            f"unsupported activation {activation!r} for attach_saturated_activation_hooks; "
            f"choose one of {list(SATURATING)}"
        )
    low = 0.5 if activation == "sigmoid" else 0.0
    if not low < threshold < 1.0:
        raise ValueError(
            f"threshold for {activation} saturation must lie in ({low}, 1), got {threshold}"
        )
    return layered_builder(
        f"saturation_{activation}",
        (SaturatedActivationState, activation),
        SaturatedActivationHook,
        {"threshold": threshold, "unit_threshold": unit_threshold},
        phases=phases,
        extractor=extractor,
        layout=layout,
        per_layer=per_layer,
        schedule=schedule,
    )
