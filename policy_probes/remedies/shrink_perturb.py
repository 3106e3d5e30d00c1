"""Shrink-and-perturb (Ash & Adams 2020, "On Warm-Starting Neural Network Training").

At a firing each parameter of the component's parametrised layers becomes
``theta <- shrink * theta + noise * theta_init`` (``theta_init``: a fresh initialisation
of the layer, :mod:`~policy_probes.remedies.fresh_init`); the optimiser state is kept."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from typing_extensions import Unpack

from policy_probes.plugins import register
from policy_probes.remedies.base import RemedyOptions, RemedyTarget, checked
from policy_probes.remedies.fresh_init import LayerRefresh, resettable_leaves
from policy_probes.remedies.trigger import Threshold


@register
class ShrinkAndPerturb(LayerRefresh):
    """Shrink-and-perturb (Ash & Adams, 2020): at its trigger, theta <- shrink * theta +
    noise * theta_init for every layer of the component (build with
    :func:`shrink_and_perturb`)."""

    name = "shrink_and_perturb"
    setting_names = ("shrink", "noise")

    def __init__(self, *, shrink: float = 0.8, noise: float = 0.01, **trigger: Any) -> None:
        self.shrink = checked("shrink", shrink, lambda v: 0 <= v <= 1, "in [0, 1]")
        self.noise = checked("noise", noise, lambda v: v >= 0, ">= 0")
        super().__init__(**trigger)

    def prepare(self, target: RemedyTarget) -> list[tuple[str, nn.Module]]:
        return resettable_leaves(self.name, target)

    def update(self, target: RemedyTarget, param: nn.Parameter, fresh: torch.Tensor) -> None:
        param.mul_(self.shrink).add_(fresh, alpha=self.noise)


def shrink_and_perturb(
    shrink: float = 0.8,
    noise: float = 0.01,
    every_epochs: int | None = None,
    when: str | Threshold | None = None,
    **options: Unpack[RemedyOptions],
) -> ShrinkAndPerturb:
    """Shrink-and-perturb on the component it is attached to (module docstring)."""
    return ShrinkAndPerturb(
        shrink=shrink, noise=noise, every_epochs=every_epochs, when=when, **options
    )
