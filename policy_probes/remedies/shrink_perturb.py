"""Shrink-and-perturb (Ash & Adams 2020, "On Warm-Starting Neural Network Training").

At a firing every parameter of every parametrised layer of the component becomes

    theta <- shrink * theta + noise * theta_init

where ``theta_init`` is a fresh initialisation of the same layer (its own
``reset_parameters()``, drawn from the remedy's generator:
:mod:`~policy_probes.remedies.fresh_init`). The optimiser state is kept: the weights move
continuously, and the paper applies the operation between trainings without touching it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from policy_probes.plugins import register
from policy_probes.remedies.base import RemedyOptions, RemedyTarget
from policy_probes.remedies.fresh_init import LayerRefresh, check_resettable
from policy_probes.remedies.structure import parametrised_leaves
from policy_probes.remedies.trigger import Threshold

if TYPE_CHECKING:
    from typing_extensions import Unpack


@register
class ShrinkAndPerturb(LayerRefresh):
    """Shrink-and-perturb (Ash & Adams, 2020): at its trigger, theta <- shrink * theta +
    noise * theta_init for every layer of the component (build with
    :func:`shrink_and_perturb`)."""

    docs = "docs/remedies.md"

    name = "shrink_and_perturb"

    def __init__(self, *, shrink: float = 0.8, noise: float = 0.01, **trigger: Any) -> None:
        if isinstance(shrink, bool) or not 0.0 <= float(shrink) <= 1.0:
            raise ValueError(f"shrink must be in [0, 1], got {shrink!r}")
        if isinstance(noise, bool) or not float(noise) >= 0.0:
            raise ValueError(f"noise must be >= 0, got {noise!r}")
        super().__init__(**trigger)
        self.shrink, self.noise = float(shrink), float(noise)

    def settings(self) -> dict[str, Any]:
        return {"shrink": self.shrink, "noise": self.noise}

    def prepare(self, target: RemedyTarget) -> list[tuple[str, nn.Module]]:
        layers = parametrised_leaves(target.component, target.module)
        check_resettable(f"shrink_and_perturb on {target.component!r}", layers)
        return layers

    def update(self, target: RemedyTarget, param: nn.Parameter, fresh: torch.Tensor) -> None:
        param.mul_(self.shrink).add_(fresh, alpha=self.noise)


def shrink_and_perturb(
    shrink: float = 0.8,
    noise: float = 0.01,
    every_epochs: int | None = None,
    when: str | Threshold | None = None,
    **options: Unpack[RemedyOptions],
) -> ShrinkAndPerturb:
    """Shrink-and-perturb on the component it is attached to (``theta <- shrink * theta +
    noise * theta_init``; :mod:`policy_probes.remedies.shrink_perturb`)."""
    return ShrinkAndPerturb(
        shrink=shrink, noise=noise, every_epochs=every_epochs, when=when, **options
    )
