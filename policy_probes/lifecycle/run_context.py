"""RunDataContext: what a lifecycle hook sees when it fires (read-only)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from policy_probes.context import ComponentContext
from policy_probes.lifecycle.points import HookPoint

EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class RunDataContext:
    """The state of the run at one firing of one hook point, read-only (code that changes
    state belongs in an :class:`~policy_probes.lifecycle.hook.InterventionHook`).

    ``epoch``: the records' epoch; ``step``: the global optimizer step (from 0) at step
    points, the steps so far (or ``None``) at epoch points; ``stats``: the loop's
    ``train/``, ``rollout/``, ``eval/``, ``perf/`` statistics; ``observations``: the
    rollout's, ``(samples, *obs_shape)``. ``grads`` (only for ``needs_grads``): at
    PRE_STEP the live pre-clip ``param.grad`` (read only), elsewhere the mean of the
    epoch's PRE_STEP gradients so far; ``prev_step_grads`` (``needs_prev_step_grads``):
    copies of the previous step's. ``last_metrics``: the latest metrics per point, with
    this firing's so far. ``docs/lifecycle.md`` lists what the trainer passes."""

    point: HookPoint
    epoch: int
    loop: str
    step: int | None = None
    agent_step: int | None = None
    update_epoch: int | None = None
    minibatch: int | None = None
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    config: Any = None
    batch: Any = None
    loss: torch.Tensor | None = None
    learning_rate: float | None = None
    stats: Mapping[str, Any] = field(default_factory=lambda: EMPTY)
    observations: torch.Tensor | None = None
    grads: Mapping[str, torch.Tensor] | None = None
    prev_step_grads: Mapping[str, torch.Tensor] | None = None
    component_context: ComponentContext | None = None
    last_metrics: Mapping[HookPoint, Mapping[str, Any]] = field(default_factory=lambda: EMPTY)
    extra: Mapping[str, Any] = field(default_factory=lambda: EMPTY)

    def require(self, name: str, hook: str) -> Any:
        """The field ``name``; a clear error when the loop did not provide it."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(
                f"hook {hook!r} needs RunDataContext.{name} at {self.point.name}, but the loop "
                f"passed none; pass {name}=... to HookManager.fire() or bind() it"
            )
        return value
