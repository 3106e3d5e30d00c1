"""ProgressHook: a rich progress bar with environment steps, SPS, epoch and recent return."""

from __future__ import annotations

import torch.distributed as dist
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from trainers.callbacks import TrainerHook, TrainerState


class ProgressHook(TrainerHook):
    """Updated once per epoch (never per step). Pass a shared ``console`` to print beside it."""

    def __init__(self, console: Console | None = None, transient: bool = False) -> None:
        self.console = console
        self.transient = transient
        self.progress: Progress | None = None
        self.task = None

    def on_new_training_run(self, state: TrainerState) -> None:
        self.progress = Progress(
            TextColumn("[bold]epoch {task.fields[epoch]}/{task.fields[epochs]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps"),
            TextColumn("{task.fields[sps]} SPS"),
            TextColumn("return {task.fields[ret]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=self.transient,
        )
        # agent_step counts every rank's steps in a distributed run
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        total = state.num_epochs * state.trainer.batch_size * world
        self.task = self.progress.add_task(
            "train",
            total=total,
            completed=state.agent_step,
            epoch=state.epoch,
            epochs=state.num_epochs,
            sps="-",
            ret="-",
        )
        self.progress.start()

    def on_epoch_end(self, state: TrainerState) -> None:
        if self.progress is None:
            return
        evaluated = state.eval_scores.get("epoch") == state.epoch
        ret = state.eval_scores.get("return_mean") if evaluated else None
        if ret is None:
            ret = state.rollout_stats.get("episode_return")
        self.progress.update(
            self.task,
            completed=state.agent_step,
            epoch=state.epoch,
            sps=f"{state.rollout_stats.get('sps', 0.0):,.0f}",
            ret="-" if ret is None else f"{ret:.1f}",
        )

    def on_training_end(self, state: TrainerState) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
