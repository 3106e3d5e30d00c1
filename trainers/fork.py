"""Forks: a new run that starts from an end-of-epoch checkpoint of another run.

``policy-probes fork RUN_DIR --epoch N NEW_RUN_DIR [key=value ...]`` (and
``TrainTool.invoke(fork_from=ForkPoint(RUN_DIR, N))``) builds the child with the parent's
recipe and overrides plus the new ones, restores ``RUN_DIR/checkpoints/epoch_N.pt`` into
it exactly as a resume would, then re-applies the child's own optimizer hyperparameters.
The child's records start at epoch N + 1 in NEW_RUN_DIR; its ``config.json`` records
``parent: {run_dir, epoch, checkpoint}``. With no change, the child's epochs are the
parent's, bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from policy_probes.run import held_outputs
from policy_probes.runnable import ForkPoint
from policy_probes.torch_internals import set_last_lr
from trainers.checkpoint import CheckpointError, checkpoint_name, list_checkpoints, load_checkpoint

if TYPE_CHECKING:
    from trainers.config import PPOConfig
    from trainers.ppo import PPOTrainer


class ForkError(ValueError):
    """The fork cannot start (the parent is not a run, the epoch has no checkpoint, ...);
    the message says what to change."""

    usage_error = True  # the CLI prints it without a traceback (exit status 2)


def checkpointed_epochs(run_dir: str | Path) -> list[int]:
    """Epochs of ``run_dir`` with an end-of-epoch checkpoint (mid-epoch ones left out)."""
    out = []
    for path in list_checkpoints(Path(run_dir) / "checkpoints"):
        epoch = int(path.name.removeprefix("epoch_")[:6])
        if path.name == checkpoint_name(epoch):
            out.append(epoch)
    return out


def fork_checkpoint(point: ForkPoint, child_dir: Path) -> tuple[Path, dict[str, Any]]:
    """``(path, checkpoint)`` of the end of epoch ``point.epoch`` of the run in
    ``point.run_dir``; :class:`ForkError` naming the epochs that have one otherwise."""
    parent = Path(point.run_dir)
    if not held_outputs(parent):
        raise ForkError(
            f"{str(parent)!r} is not a run directory (no config.json, metric files or "
            f"checkpoints); give the directory of the run to fork"
        )
    if parent.resolve() == Path(child_dir).resolve():
        raise ForkError(
            f"the fork's run directory is the parent's ({str(parent)!r}); give a new directory"
        )
    if point.epoch < 1:
        raise ForkError(f"--epoch must be >= 1 (an epoch with a checkpoint), got {point.epoch}")
    path = parent / "checkpoints" / checkpoint_name(point.epoch)
    if not path.is_file():
        epochs = checkpointed_epochs(parent)
        have = ", ".join(map(str, epochs)) if epochs else "none"
        raise ForkError(
            f"{str(parent)!r} has no checkpoint of epoch {point.epoch} ({path.name}); epochs "
            f"with one: {have} (a run keeps checkpoint.keep_last of those written every "
            f"checkpoint.every_epochs epochs)"
        )
    try:
        return path, load_checkpoint(path)
    except CheckpointError as exc:
        raise ForkError(f"cannot fork from {path}: {exc}") from None


def check_fork_length(point: ForkPoint, num_epochs: int) -> None:
    """A fork must have epochs left to train: ``point.epoch < num_epochs``."""
    if point.epoch >= num_epochs:
        raise ForkError(
            f"the fork starts after epoch {point.epoch} but trains {num_epochs} epochs in "
            f"all (trainer.total_timesteps); raise trainer.total_timesteps or fork earlier"
        )


def apply_optimizer_config(trainer: PPOTrainer, cfg: PPOConfig) -> None:
    """Give the restored optimizer the child's learning rate, Adam epsilon and betas (the
    parent's state dict carried the parent's); the learning rate is set as the scheduler
    sets it, so an unchanged fork keeps the very same float."""
    scheduler = trainer.scheduler
    groups = trainer.optimizer.param_groups
    scheduler.base_lrs = [cfg.learning_rate for _ in groups]
    for group, factor in zip(groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = cfg.learning_rate
        group["lr"] = cfg.learning_rate * factor(scheduler.last_epoch)
        group["eps"] = cfg.adam_eps
        group["betas"] = tuple(cfg.adam_betas)
    set_last_lr(scheduler, [group["lr"] for group in groups])


def parent_record(point: ForkPoint) -> dict[str, Any]:
    """What ``config.json`` keeps under ``parent``."""
    checkpoint = Path(point.run_dir) / "checkpoints" / checkpoint_name(point.epoch)
    return {"run_dir": str(point.run_dir), "epoch": point.epoch, "checkpoint": str(checkpoint)}
