"""Layer resets (Nikishin et al. 2022, "The Primacy Bias in Deep Reinforcement Learning"):
at a firing the chosen layers (``layers=[...]`` or the ``last=n``) get fresh values from
their ``reset_parameters()`` and a fresh optimiser state (moments and ``step`` zeroed)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from typing_extensions import Unpack

from policy_probes.plugins import register
from policy_probes.remedies.base import RemedyOptions, RemedyTarget, name_list
from policy_probes.remedies.fresh_init import LayerRefresh, check_resettable, resettable_leaves
from policy_probes.remedies.optim_state import reset_entries
from policy_probes.remedies.structure import parametrised_leaves
from policy_probes.remedies.trigger import Threshold, whole_number


@register
class ResetLayers(LayerRefresh):
    """Layer resets (Nikishin et al., 2022): at its trigger, give the chosen layers fresh
    initial values and reset their optimizer state (build with :func:`reset_layers`)."""

    name = "reset_layers"
    setting_names = ("layers", "last")

    def __init__(
        self, *, layers: Sequence[str] | str | None = None, last: int | None = None, **trigger: Any
    ) -> None:
        if (layers is None) == (last is None):
            raise ValueError(
                "reset_layers needs exactly one of layers=[names inside the component] or "
                "last=<n> (the last n parametrised layers)"
            )
        super().__init__(**trigger)
        self.layers = name_list(layers)
        self.last = None if last is None else whole_number("last", last, 1)

    def prepare(self, target: RemedyTarget) -> list[tuple[str, nn.Module]]:
        if self.last is not None:
            found = parametrised_leaves(target.component, target.module)
            if self.last > len(found):
                raise ValueError(
                    f"reset_layers(last={self.last}) on {target.component!r}: it has only "
                    f"{len(found)} parametrised layers ({[n for n, _ in found]})"
                )
            chosen = found[-self.last :]
            check_resettable(f"reset_layers on {target.component!r}", chosen)
            return chosen
        return resettable_leaves(self.name, target, self.layers or [])

    def update(self, target: RemedyTarget, param: nn.Parameter, fresh: torch.Tensor) -> None:
        param.copy_(fresh)
        reset_entries(target.optimizer, param)


def reset_layers(
    layers: Sequence[str] | str | None = None,
    last: int | None = None,
    every_epochs: int | None = None,
    when: str | Threshold | None = None,
    **options: Unpack[RemedyOptions],
) -> ResetLayers:
    """Reset ``layers`` (names inside the component) or the ``last`` n (module docstring)."""
    return ResetLayers(layers=layers, last=last, every_epochs=every_epochs, when=when, **options)
