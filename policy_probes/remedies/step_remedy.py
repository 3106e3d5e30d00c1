"""Remedies that act at every optimizer step instead of at triggered epoch ends: bound,
they hook the loop's optimizer (step pre/post hooks), so they act on every
``optimizer.step()`` whatever loop calls it; every epoch end reports what they did."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from policy_probes.remedies.base import Remedy, RemedyTarget


@dataclass
class StepState:
    """A step remedy's hook handles and the optimizer steps it acted on this epoch."""

    handles: list[Any] = field(default_factory=list)
    steps: int = 0


class StepRemedy(Remedy):
    """Base of per-step remedies: they implement :meth:`before_step` or :meth:`after_step`."""

    trigger = None

    def __init__(self, *, seed: int | None = None) -> None:
        super().__init__(every_epochs=1, seed=seed)  # the seed's checks; no epoch trigger
        self.trigger = None

    def start(self, target: RemedyTarget, prepared: StepState, generator: torch.Generator) -> None:
        opt = target.optimizer
        if type(self).before_step is not StepRemedy.before_step:
            prepared.handles.append(
                opt.register_step_pre_hook(lambda *_: self.before_step(target, prepared, generator))
            )
        prepared.handles.append(  # always: it counts the steps
            opt.register_step_post_hook(lambda *_: self._after(target, prepared, generator))
        )

    def _after(self, target: RemedyTarget, prepared: StepState, generator: torch.Generator) -> None:
        with torch.no_grad():
            self.after_step(target, prepared, generator)
        prepared.steps += 1

    def before_step(
        self, target: RemedyTarget, prepared: StepState, generator: torch.Generator
    ) -> None:
        """Called before every ``optimizer.step()`` (gradients are final)."""

    def after_step(
        self, target: RemedyTarget, prepared: StepState, generator: torch.Generator
    ) -> None:
        """Called after every ``optimizer.step()``, under ``no_grad``."""

    def epoch_metrics(self, target: RemedyTarget, prepared: StepState) -> dict[str, float]:
        steps, prepared.steps = prepared.steps, 0
        return {"steps": float(steps), **self.epoch_report(target, prepared)}

    def epoch_report(self, target: RemedyTarget, prepared: StepState) -> dict[str, float]:
        """Remedy-specific per-epoch metrics (once per epoch: host transfers are fine)."""
        return {}

    def state_dict(self, prepared: StepState) -> dict[str, Any]:
        return {"steps": prepared.steps}

    def load_state_dict(self, prepared: StepState, state: Any) -> None:
        prepared.steps = int(state.get("steps", 0))
