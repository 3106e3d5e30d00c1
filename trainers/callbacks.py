"""Trainer lifecycle callbacks: :class:`TrainerHook`, :class:`TrainerState`, :class:`CallbackList`.

Firing order (the full diagram with the session's calls: ``docs/trainer.md``)::

    on_new_training_run
    for epoch in 1..num_epochs:
        on_rollout_start; (rollout, GAE); on_rollout_end
        for update_epoch, for mb_idx: (optimizer step); on_mb_end
        on_train_phase_end          (scheduler already stepped; EvaluationHook evaluates)
        (session.epoch_end: the epoch's records; state.metrics)
        on_epoch_end                (CheckpointHook, ProgressHook, RunControl, ...)
    on_training_end                 (also after an exception; state.error is set then)

Hooks run in registration order. A hook that raises is logged with its traceback,
recorded in ``state.hook_errors`` and training goes on, unless the hook sets
``critical = True`` (or the exception sets ``fatal = True``, as a checkpoint refused for
non-finite parameters does). Only rank 0 runs a hook unless it sets
``run_on_all_ranks = True``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from policy_probes.context import ComponentContext
from policy_probes.lifecycle.manager import current_rank

log = logging.getLogger("trainers")


@dataclass
class TrainerState:
    """Everything a hook can read (and a few things it may set) during training; each
    field is described in ``docs/trainer.md``. ``epoch`` is 1-based (0 before the first);
    the statistics are host floats, filled once per epoch; ``metrics`` (the epoch's record)
    and ``probe_metrics`` (its ``probes/*`` part) are set before ``on_epoch_end``. A hook
    may set ``stop_training = True`` to end the run after the current epoch. ``trainer``
    is the :class:`~trainers.ppo.PPOTrainer` (typed ``Any``: this module does not import it).
    """

    trainer: Any
    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    context: ComponentContext
    config: dict[str, Any]
    run_dir: Path | None = None
    epoch: int = 0
    num_epochs: int = 0
    agent_step: int = 0
    update_epoch: int = 0
    mb_idx: int = 0
    optimizer_step: int = 0
    rollout_stats: dict[str, float] = field(default_factory=dict)
    loss_stats: dict[str, float] = field(default_factory=dict)
    eval_scores: dict[str, float] = field(default_factory=dict)
    probe_metrics: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    last_checkpoint: Path | None = None
    hook_errors: dict[str, str] = field(default_factory=dict)
    stop_training: bool = False
    error: BaseException | None = None


class TrainerHook:
    """Base class of trainer callbacks: override the methods you need."""

    #: an exception in this hook stops training (re-raised)
    critical: bool = False
    #: the hook also runs on ranks other than 0
    run_on_all_ranks: bool = False

    @property
    def name(self) -> str:
        return type(self).__name__

    def on_new_training_run(self, state: TrainerState) -> None:
        """Once, after envs, policy and optimizer exist and before the first rollout."""

    def on_rollout_start(self, state: TrainerState) -> None:
        """Before collecting the rollout of ``state.epoch``."""

    def on_rollout_end(self, state: TrainerState) -> None:
        """After the rollout and GAE; ``state.rollout_stats`` holds its episode statistics."""

    def on_mb_end(self, state: TrainerState) -> None:
        """After each optimizer step; ``state.update_epoch`` and ``state.mb_idx`` say which."""

    def on_train_phase_end(self, state: TrainerState) -> None:
        """After the update phase; ``state.loss_stats`` holds its statistics."""

    def on_epoch_end(self, state: TrainerState) -> None:
        """Last call of each epoch (evaluation, checkpoints, metrics)."""

    def on_training_end(self, state: TrainerState) -> None:
        """Once, at the end, also when training failed (``state.error``) or was stopped."""


#: the event methods, in firing order
HOOK_METHODS = tuple(name for name in vars(TrainerHook) if name.startswith("on_"))


class CallbackList(TrainerHook):
    """The trainer's hooks as one hook (SB3's and Lightning's composite): each event
    method calls that method of every hook in registration order, isolating faults per
    hook (see the module docstring)."""

    def __init__(self, hooks: Iterable[TrainerHook] = ()) -> None:
        self.hooks: list[TrainerHook] = []
        # event -> the hooks that implement it (TrainerHook's own no-op methods skipped):
        # on_mb_end fires every minibatch, and most hooks do not override it
        self._listeners: dict[str, list[TrainerHook]] = {}
        for h in hooks:
            self.append(h)

    def append(self, hook: TrainerHook) -> None:
        if not any(callable(getattr(hook, m, None)) for m in HOOK_METHODS):
            raise TypeError(
                f"{hook!r} is not a trainer hook: subclass trainers.TrainerHook and override "
                f"one of {', '.join(HOOK_METHODS)}"
            )
        self.hooks.append(hook)
        self._listeners.clear()

    def __iter__(self):
        return iter(self.hooks)

    def __len__(self) -> int:
        return len(self.hooks)

    def on_new_training_run(self, state: TrainerState) -> None:
        self._each("on_new_training_run", state)

    def on_rollout_start(self, state: TrainerState) -> None:
        self._each("on_rollout_start", state)

    def on_rollout_end(self, state: TrainerState) -> None:
        self._each("on_rollout_end", state)

    def on_mb_end(self, state: TrainerState) -> None:
        self._each("on_mb_end", state)

    def on_train_phase_end(self, state: TrainerState) -> None:
        self._each("on_train_phase_end", state)

    def on_epoch_end(self, state: TrainerState) -> None:
        self._each("on_epoch_end", state)

    def on_training_end(self, state: TrainerState) -> None:
        self._each("on_training_end", state)

    def _each(self, event: str, state: TrainerState) -> None:
        """Call ``event`` on every hook that implements it and runs on this rank."""
        listeners = self._listeners.get(event)
        if listeners is None:
            noop = getattr(TrainerHook, event)
            listeners = self._listeners[event] = [
                h
                for h in self.hooks
                if callable(getattr(h, event, None)) and getattr(type(h), event, None) is not noop
            ]
        if not listeners:
            return
        rank = current_rank()
        for hook in listeners:
            if rank != 0 and not getattr(hook, "run_on_all_ranks", False):
                continue
            try:
                getattr(hook, event)(state)
            except Exception as exc:
                # critical hooks, and errors that mean the run cannot go on, end it
                if getattr(hook, "critical", False) or getattr(exc, "fatal", False):
                    raise
                name = getattr(hook, "name", type(hook).__name__)
                state.hook_errors[f"{name}.{event}"] = f"{type(exc).__name__}: {exc}"
                where = f"{name} raised in {event} (epoch {state.epoch})"
                log.exception("trainer hook %s; training goes on", where)
