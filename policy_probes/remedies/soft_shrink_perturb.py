"""Soft shrink-and-perturb (Ash & Adams 2020 for the operation; Juliani & Ash 2024, "A
Study of Plasticity Loss in On-Policy Deep Reinforcement Learning", for applying it every
step in PPO): after every optimizer step each parameter of the chosen layers becomes
``theta <- shrink * theta + noise * theta_init`` (one fresh initialisation per layer and
step, :mod:`~policy_probes.remedies.fresh_init`); the optimizer state is kept."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from policy_probes.plugins import register
from policy_probes.remedies.base import RemedyTarget, checked, name_list
from policy_probes.remedies.fresh_init import refresh_layers, resettable_leaves
from policy_probes.remedies.step_remedy import StepRemedy, StepState


@dataclass
class SoftState(StepState):
    layers: list[tuple[str, nn.Module]] = field(default_factory=list)


@register
class SoftShrinkPerturb(StepRemedy):
    """Soft shrink-and-perturb (Juliani & Ash, 2024): a small shrink-and-perturb after
    every optimizer step (build with :func:`soft_shrink_perturb`)."""

    name = "soft_shrink_perturb"
    setting_names = ("shrink", "noise", "layers")

    def __init__(
        self,
        *,
        shrink: float = 0.9999,
        noise: float = 1e-4,
        layers: Sequence[str] | str | None = None,
        seed: int | None = None,
    ) -> None:
        self.shrink = checked("shrink", shrink, lambda v: 0 < v <= 1, "in (0, 1]")
        self.noise = checked("noise", noise, lambda v: v >= 0, ">= 0")
        super().__init__(seed=seed)
        self.layers = name_list(layers)

    def prepare(self, target: RemedyTarget) -> SoftState:
        return SoftState(layers=resettable_leaves(self.name, target, self.layers))

    def after_step(
        self, target: RemedyTarget, prepared: SoftState, generator: torch.Generator
    ) -> None:
        shrink, noise = self.shrink, self.noise
        refresh_layers(prepared.layers, generator, lambda p, f: p.mul_(shrink).add_(f, alpha=noise))


def soft_shrink_perturb(
    shrink: float = 0.9999,
    noise: float = 1e-4,
    layers: Sequence[str] | str | None = None,
    *,
    seed: int | None = None,
) -> SoftShrinkPerturb:
    """Soft shrink-and-perturb on the component it is attached to (module docstring)."""
    return SoftShrinkPerturb(shrink=shrink, noise=noise, layers=layers, seed=seed)
