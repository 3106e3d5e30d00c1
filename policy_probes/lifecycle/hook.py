"""Lifecycle hooks: observers (:class:`TrainingHook`) and interventions
(:class:`InterventionHook`); ``docs/lifecycle.md`` ("Writing a hook") has an example.

The manager namespaces a hook's metrics as ``name/metric``. Values may be floats, 0-d
tensors (kept on the device and transferred once per epoch at step points), lists of
floats or nested dicts (flattened with ``/``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from policy_probes.lifecycle.points import (
    ALWAYS,
    STEP_POINTS,
    EpochWindow,
    HookPoint,
    LoopPointsSpec,
    resolve_points,
)
from policy_probes.lifecycle.run_context import RunDataContext
from policy_probes.lifecycle.schedule import StepSchedule

if TYPE_CHECKING:
    from policy_probes.lifecycle.model_context import ModelDataContext

COST_CLASSES: tuple[str, ...] = ("free", "cheap", "moderate", "expensive")
"""free: reads numbers the loop already has. cheap: a pass over the parameters.
moderate: extra forward passes. expensive: extra backward passes or update epochs."""

_NEEDS = ("needs_grads", "needs_prev_step_grads", "needs_pre_epoch_state")


class HookConfig(BaseModel):
    """Parameters every hook accepts (``--hook-config name.param=value``): ``schedule``
    (a :class:`StepSchedule` of the step points, ``"stride:4"``), ``epochs`` (one over the
    epoch points) and the inclusive epoch window ``min_epoch`` / ``max_epoch`` (the
    records' epoch numbers)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    schedule: str | None = None
    epochs: str | None = None
    min_epoch: int | None = Field(None, ge=0)
    max_epoch: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _window_not_empty(self) -> HookConfig:
        lo, hi = self.min_epoch, self.max_epoch
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(
                f"min_epoch={lo} is after max_epoch={hi}: the hook would never fire; swap them"
            )
        return self


class TrainingHook:
    """An observer: reads the run at its hook points and returns metrics.

    Its class attributes declare it (``docs/lifecycle.md``): ``loop_points`` (optional)
    restricts it to the loop types it names, with ``(min_epoch, max_epoch)`` windows per
    point; ``namespaced = False`` keeps keys as returned (``train/...``); ``order`` ranks
    dispatch (observers 100, interventions 200, debug 300); ``run_on_all_ranks`` (else rank
    0 only) is for hooks in collectives; ``runs_model = False`` (hooks that only read
    state) leaves the probes' phase alone while it runs."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    hook_points: ClassVar[tuple[HookPoint, ...]] = (HookPoint.POST_EPOCH,)
    loop_points: ClassVar[LoopPointsSpec | None] = None
    step_schedule: ClassVar[StepSchedule] = StepSchedule()
    epoch_schedule: ClassVar[StepSchedule | None] = None
    needs_grads: ClassVar[bool] = False
    needs_prev_step_grads: ClassVar[bool] = False
    needs_pre_epoch_state: ClassVar[bool] = False
    cost: ClassVar[str] = "cheap"
    metrics: ClassVar[Mapping[str, str]] = {}
    namespaced: ClassVar[bool] = True
    auto_include: ClassVar[bool] = False
    groups: ClassVar[tuple[str, ...]] = ()
    debug: ClassVar[bool] = False
    order: ClassVar[int] = 100
    run_on_all_ranks: ClassVar[bool] = False
    runs_model: ClassVar[bool] = True
    Config: ClassVar[type[HookConfig]] = HookConfig

    def __init__(self, **params: Any) -> None:
        self.config = self.Config(**params)
        self.state: dict[str, Any] = {}
        self.window = EpochWindow(self.config.min_epoch, self.config.max_epoch)
        if self.config.schedule is not None:
            self.step_schedule = StepSchedule.parse(self.config.schedule)
        if self.config.epochs is not None:
            self.epoch_schedule = StepSchedule.parse(self.config.epochs)

    def compute(self, ctx: RunDataContext) -> dict[str, Any]:
        """Return this firing's metrics (un-namespaced)."""
        raise NotImplementedError(f"hook {self.name!r} must implement compute(ctx)")

    def points(self, loop: str) -> dict[HookPoint, EpochWindow]:
        """Points (with epoch windows) where this hook fires in a loop of type ``loop``."""
        resolved = resolve_points(loop, self.hook_points, self.loop_points)
        return {p: w.intersect(self.window) for p, w in resolved.items()}

    def intervenes_at(self, point: HookPoint) -> bool:
        return False

    def is_due(
        self, point: HookPoint, epoch: int, step: int | None, window: EpochWindow = ALWAYS
    ) -> bool:
        if not window.contains(epoch):
            return False
        if point in STEP_POINTS:
            return step is None or self.step_schedule.due(step)
        return self.epoch_schedule is None or self.epoch_schedule.due(epoch)

    def move_state(self, device: torch.device | str) -> None:
        """Move every tensor in :attr:`state` (nested dicts/lists too) to ``device``."""
        self.state = _move(self.state, torch.device(device))

    @classmethod
    def kind(cls) -> str:
        if cls.debug:
            return "debug intervention"
        return "intervention" if issubclass(cls, InterventionHook) else "observer"

    @classmethod
    def describe(cls) -> dict[str, Any]:
        """What ``policy-probes hooks describe NAME`` prints."""
        out: dict[str, Any] = {
            "name": cls.name,
            "kind": cls.kind(),
            "description": cls.description,
            "hook_points": [p.name for p in cls.hook_points],
            "step_schedule": str(cls.step_schedule),
            "epoch_schedule": str(cls.epoch_schedule) if cls.epoch_schedule else "every epoch",
            "cost": cls.cost,
            "needs": [flag for flag in _NEEDS if getattr(cls, flag)],
            "metrics": dict(cls.metrics),
            "namespace": f"{cls.name}/" if cls.namespaced else "(keys kept as returned)",
            "ranks": "all ranks" if cls.run_on_all_ranks else "rank 0 only",
            "parameters": {
                n: {
                    "default": f.default,
                    "type": getattr(f.annotation, "__name__", str(f.annotation)),
                }
                for n, f in cls.Config.model_fields.items()
            },
        }
        if cls.loop_points is not None:
            out["loop_points"] = {k: str(v) for k, v in cls.loop_points.items()}
        if issubclass(cls, InterventionHook):
            ip = cls.intervention_points
            out["intervention_points"] = "all of its points" if ip is None else [p.name for p in ip]
        return out


class InterventionHook(TrainingHook):
    """A hook that may change training state temporarily: at its ``intervention_points``
    (``None``: all of its points) the manager calls :meth:`intervene` inside a guardian
    checkpoint (model, optimizer, scheduler, gradients, every RNG) that is restored
    afterwards whatever happens; at its other points it calls :meth:`compute`."""

    intervention_points: ClassVar[tuple[HookPoint, ...] | None] = None
    cost: ClassVar[str] = "expensive"
    order: ClassVar[int] = 200

    def intervenes_at(self, point: HookPoint) -> bool:
        ip = self.intervention_points
        return ip is None or point in ip

    def compute(self, ctx: RunDataContext) -> dict[str, Any]:
        return {}

    def intervene(self, run_ctx: RunDataContext, model_ctx: ModelDataContext) -> dict[str, Any]:
        """Return this firing's metrics; any state change is undone afterwards."""
        raise NotImplementedError(f"intervention {self.name!r} must implement intervene()")


class DebugInterventionHook(InterventionHook):
    """An intervention that tests the machinery; only ``with_debug`` or its name selects it."""

    debug: ClassVar[bool] = True
    cost: ClassVar[str] = "cheap"
    order: ClassVar[int] = 300


def _move(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_move(v, device) for v in obj)
    return obj
