"""CheckpointHook: the full training state every N epochs, written atomically, last K kept.

A checkpoint is a plain dict of tensors and Python containers, so it loads with
``torch.load(path, weights_only=True)`` (no arbitrary code runs on load): model,
optimizer and scheduler state dicts, every RNG state (torch CPU and CUDA, numpy,
Python ``random``, the trainer's own generators), the running statistics of the
normalisation wrappers and the counters. Environment internals are not saved: a restored
trainer re-seeds its environments.
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from trainers.callbacks import TrainerHook, TrainerState

if TYPE_CHECKING:
    from trainers.ppo import PPOTrainer

log = logging.getLogger("trainers")

CHECKPOINT_FORMAT = 1


# ---------------------------------------------------------------------- RNG states
def capture_rng_state() -> dict[str, Any]:
    """Global RNG states as tensors / plain containers (``weights_only``-loadable)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, py_state, gauss_next = random.getstate()
    out: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {
            "version": int(version),
            "state": torch.tensor(py_state, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (
            n["name"],
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    p = state["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["state"].tolist()), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------- trainer state
def trainer_checkpoint(trainer: PPOTrainer) -> dict[str, Any]:
    """Everything needed to continue ``trainer`` (see the module docstring)."""
    s = trainer.state
    return {
        "format": CHECKPOINT_FORMAT,
        "epoch": s.epoch,
        "num_epochs": s.num_epochs,
        "agent_step": s.agent_step,
        "optimizer_step": s.optimizer_step,
        "seed": trainer.seed,
        "policy": trainer.policy.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "rng": capture_rng_state(),
        "trainer_rng": {
            "sample": trainer.sample_generator.get_state(),
            "shuffle": trainer.shuffle_generator.get_state(),
        },
        "normalization": trainer.normalization_state(),
        "config": json.dumps(s.config, default=str),
    }


def restore_trainer(trainer: PPOTrainer, ckpt: dict[str, Any]) -> None:
    """Load a checkpoint dict into ``trainer`` (parameters, optimizer, scheduler, RNGs,
    normalisation statistics, counters). The environments are re-seeded on the next
    ``train()``."""
    if ckpt.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"unsupported checkpoint format {ckpt.get('format')!r}")
    trainer.policy.load_state_dict(ckpt["policy"])
    trainer.optimizer.load_state_dict(ckpt["optimizer"])
    trainer.scheduler.load_state_dict(ckpt["scheduler"])
    restore_rng_state(ckpt["rng"])
    trainer.sample_generator.set_state(ckpt["trainer_rng"]["sample"])
    trainer.shuffle_generator.set_state(ckpt["trainer_rng"]["shuffle"])
    trainer.load_normalization_state(ckpt["normalization"])
    s = trainer.state
    s.epoch, s.agent_step, s.optimizer_step = (
        ckpt["epoch"],
        ckpt["agent_step"],
        ckpt["optimizer_step"],
    )


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint safely (``weights_only=True``)."""
    return torch.load(Path(path), map_location=map_location, weights_only=True)


def atomic_save(obj: Any, path: Path) -> None:
    """Write ``obj`` to ``path`` so that ``path`` is either the old or the complete new file:
    a temporary file in the same directory, fsynced, then ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files in ``directory``, oldest first."""
    return sorted(directory.glob("epoch_*.pt"))


class CheckpointHook(TrainerHook):
    """Saves ``run_dir/checkpoints/epoch_<NNNNNN>.pt`` every ``every_epochs`` epochs and at
    the end of training (also after an early stop); keeps the newest ``keep_last``."""

    def __init__(
        self, directory: str | Path, every_epochs: int = 25, keep_last: int = 3, at_end: bool = True
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.directory = Path(directory)
        self.every_epochs = every_epochs
        self.keep_last = keep_last
        self.at_end = at_end
        self.saved_epoch = -1

    def save(self, state: TrainerState) -> Path:
        path = self.directory / f"epoch_{state.epoch:06d}.pt"
        atomic_save(trainer_checkpoint(state.trainer), path)
        self.saved_epoch = state.epoch
        state.last_checkpoint = path
        for old in list_checkpoints(self.directory)[: -self.keep_last]:
            old.unlink(missing_ok=True)
        return path

    def on_epoch_end(self, state: TrainerState) -> None:
        due = self.every_epochs > 0 and state.epoch % self.every_epochs == 0
        last = self.at_end and (state.epoch == state.num_epochs or state.stop_training)
        if due or last:
            self.save(state)

    def on_training_end(self, state: TrainerState) -> None:
        if (
            self.at_end
            and state.error is None
            and state.epoch > 0
            and self.saved_epoch != state.epoch
        ):
            self.save(state)
