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
    """The state of the run at one firing of one hook point.

    Hooks must treat everything here as read-only: an observer that changes the model,
    the optimizer or a tensor it is given alters the training trajectory. Code that must
    change state belongs in an :class:`~policy_probes.lifecycle.hook.InterventionHook`.

    Attributes:
        point: the hook point that fired.
        loop: the loop type (``"ppo"``, ``"external"``).
        epoch: the epoch as the records number it (from 1 in the built-in trainer, from
            the ``Run``'s ``first_epoch``, 0 by default, in a ``ProbeSession``).
        step: the global optimizer step (counted from 0) at PRE_STEP/POST_STEP; at epoch
            points the number of optimizer steps taken so far, or ``None``.
        agent_step: environment steps collected so far.
        update_epoch, minibatch: position inside the update phase at step points.
        model: the policy being trained.
        optimizer, scheduler: the loop's optimizer and learning-rate scheduler.
        config: the loop's configuration object (for the PPO trainer, its TrainTool).
        batch: the current minibatch at step points.
        loss: the current minibatch's loss tensor at step points.
        learning_rate: the learning rate in use.
        stats: loss, rollout, evaluation and performance statistics the loop reports
            (``train/policy_loss``, ``rollout/episode_return``, ``perf/sps``, ...).
        observations: the current rollout's observations, flat ``(samples, *obs_shape)``.
        grads: only when an active hook declares ``needs_grads``: at PRE_STEP the
            minibatch's gradients before clipping (the live ``param.grad`` tensors, read
            them only); at POST_STEP and the epoch points the mean of the PRE_STEP
            gradients of the current epoch so far. Keyed by parameter name.
        prev_step_grads: only when an active hook declares ``needs_prev_step_grads``:
            the gradients of the previous optimizer step (copies).
        component_context: the probes' :class:`ComponentContext` (its trackers).
        last_metrics: the latest metrics per hook point, including those of hooks that
            already ran in this firing (namespaced keys; step-point values may be device
            tensors).
        extra: anything else the loop wants to hand to its hooks.
    """

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
