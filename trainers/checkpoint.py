"""Checkpoints: the full training state, written atomically, read safely, resumed exactly.

A checkpoint is :meth:`PPOTrainer.state_dict` (session, hooks and trackers included) as
tensors and plain containers, so it loads with ``torch.load(path, weights_only=True)`` (no
code runs on load), plus ``format``, ``rng`` (the process RNGs) and ``config`` (JSON).
``mid_epoch`` is None unless it was written at a minibatch boundary; what each part holds
and why: ``docs/run_control.md``. Other formats are refused (:func:`check_format`).

Files: ``epoch_<E>.pt`` after epoch E completed; ``epoch_<E>-step_<S>.pt`` in the middle
of epoch E at optimizer step S (it sorts after ``epoch_<E-1>.pt``, before ``epoch_<E>.pt``).
"""

from __future__ import annotations

import enum
import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from policy_probes.lifecycle.rng import RNGState, capture_rng_state, restore_rng_state
from policy_probes.sinks.jsonl import fsync_dir
from trainers.callbacks import TrainerHook, TrainerState
from trainers.nonfinite_guard import check_finite_parameters

if TYPE_CHECKING:
    from trainers.ppo import PPOTrainer

log = logging.getLogger("trainers")

#: 5: relu, gradient_flow and relu_gradient_flow keep per-unit accumulators
CHECKPOINT_FORMAT = 5
#: test hook: ``SECONDS`` or ``SECONDS@FILENAME``: sleep inside :func:`atomic_save` between
#: writing the temporary file and renaming it (for every file, or that one)
SLOW_SAVE_ENV = "POLICY_PROBES_TEST_CHECKPOINT_SLEEP"
_NAME = re.compile(r"^epoch_(\d+)(?:-step_(\d+))?\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be read or does not fit the run; the message names it."""

    usage_error = True  # the CLI prints it without a traceback (exit status 2)


# ---------------------------------------------------------------------- plain containers
def to_plain_state(obj: Any, where: str = "state") -> Any:
    """``obj`` as tensors and plain containers only (what ``weights_only`` loads): numpy
    arrays become tensors, numpy scalars and enum members plain values; anything else
    raises ``TypeError`` naming ``where``."""
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    if isinstance(obj, enum.Enum):
        return to_plain_state(obj.value, where)
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.array(obj, copy=True))
    if isinstance(obj, np.generic):
        return obj.item()
    for plain in (bool, int, float, str):  # subclasses (np.float64 is a float) made plain
        if isinstance(obj, plain):
            return plain(obj)
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            key = to_plain_state(k, where)
            if not isinstance(key, str | int):
                raise TypeError(f"{where}: dict key {k!r} is not a string or int")
            out[key] = to_plain_state(v, f"{where}.{k}")
        return out
    if isinstance(obj, list | tuple):
        items = [to_plain_state(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return tuple(items) if isinstance(obj, tuple) else items
    raise TypeError(f"{where}: a {type(obj).__name__} cannot be stored in a checkpoint")


# ---------------------------------------------------------------------- RNG states
def rng_state_to_plain(state: RNGState) -> dict[str, Any]:
    """A process RNG state (:func:`policy_probes.lifecycle.capture_rng_state`) as tensors
    and plain containers, which ``torch.load(weights_only=True)`` reads back."""
    name, keys, pos, has_gauss, cached = state.numpy
    version, py_state, gauss_next = state.python
    out: dict[str, Any] = {
        "torch": state.torch_cpu,
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
    if state.torch_cuda is not None:
        out["cuda"] = list(state.torch_cuda)
    return out


def rng_state_from_plain(state: dict[str, Any]) -> RNGState:
    """Inverse of :func:`rng_state_to_plain` (a CUDA state is kept only where CUDA is)."""
    n, p = state["numpy"], state["python"]
    cuda = state.get("cuda") if torch.cuda.is_available() else None
    keys = n["keys"].numpy().astype(np.uint32)
    return RNGState(
        torch_cpu=state["torch"],
        torch_cuda=tuple(cuda) if cuda is not None else None,
        numpy=(n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]),
        python=(p["version"], tuple(int(v) for v in p["state"].tolist()), p["gauss_next"]),
    )


# ---------------------------------------------------------------------- checkpoints
def trainer_checkpoint(trainer: PPOTrainer) -> dict[str, Any]:
    """Everything needed to continue ``trainer`` exactly (see the module docstring); a
    mid-epoch checkpoint while :attr:`PPOTrainer.update_progress` is set."""
    state = dict(trainer.state_dict())
    session = dict(state.pop("session"))
    manager = dict(session.pop("hooks"))
    hooks = {}
    for name, hook_state in manager.pop("hooks").items():
        try:
            hooks[name] = to_plain_state(hook_state, f"lifecycle hook {name!r} state")
        except TypeError as exc:
            log.warning("%s; that hook restarts from an empty state on resume", exc)
    try:
        manager["last_metrics"] = to_plain_state(manager["last_metrics"])
    except TypeError as exc:
        log.warning("%s; hooks see no previous metrics right after a resume", exc)
        manager["last_metrics"] = {}
    manager = {"hooks": hooks, **to_plain_state(manager, "hook manager state")}
    session = {"hooks": manager, **to_plain_state(session, "session state")}
    return {
        "format": CHECKPOINT_FORMAT,
        **to_plain_state(state, "trainer state"),
        "session": session,
        "rng": rng_state_to_plain(capture_rng_state()),
        "config": json.dumps(trainer.state.config, default=str),
    }


def completed_epochs(ckpt: dict[str, Any]) -> int:
    """Epochs whose metrics a run resumed from ``ckpt`` does not repeat."""
    return ckpt["epoch"] - 1 if ckpt.get("mid_epoch") else ckpt["epoch"]


def restore_trainer(
    trainer: PPOTrainer, ckpt: dict[str, Any], *, restore_envs: bool = True
) -> None:
    """Load a checkpoint dict into a freshly built ``trainer`` (same configuration), so that
    ``trainer.train()`` continues exactly where the checkpointed run was
    (``restore_envs``: :meth:`PPOTrainer.load_state_dict`; other formats refused)."""
    ckpt = check_format(ckpt)
    try:
        trainer.load_state_dict(ckpt, restore_envs=restore_envs)
    except ValueError as exc:
        raise CheckpointError(str(exc).replace("the saved state", "the checkpoint")) from None
    restore_rng_state(rng_state_from_plain(ckpt["rng"]))


def check_format(ckpt: dict[str, Any]) -> dict[str, Any]:
    """``ckpt`` if it is in :data:`CHECKPOINT_FORMAT`, else one :class:`CheckpointError`
    that names the format it is in."""
    fmt = ckpt.get("format") if isinstance(ckpt, dict) else None
    if fmt != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"this checkpoint is in format {fmt!r} and this version of policy-probes reads "
            f"format {CHECKPOINT_FORMAT} only; resume it with the version that wrote it, or "
            f"start the run again"
        )
    return ckpt


# ---------------------------------------------------------------------- files
def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint safely (``weights_only=True``); an unreadable (truncated,
    corrupted) file raises :class:`CheckpointError` naming it."""
    path = Path(path)
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:  # truncated zip, bad pickle, unsafe global: all "unreadable"
        raise CheckpointError(
            f"checkpoint {path} is unreadable ({load_failure_reason(exc)}); it is truncated, "
            f"corrupted (a crash while it was written?) or holds objects a checkpoint never "
            f"holds; delete it to use an older one"
        ) from None
    missing = [
        k for k in ("format", "epoch", "policy") if not isinstance(ckpt, dict) or k not in ckpt
    ]
    if missing:
        raise CheckpointError(f"checkpoint {path} is not a training checkpoint (lacks {missing})")
    return ckpt


def load_failure_reason(exc: BaseException) -> str:
    """Why ``torch.load`` failed, in one line and without torch's advice to retry with
    ``weights_only=False`` (which would run whatever code the file carries)."""
    text = str(exc)
    unpickler = re.search(r"WeightsUnpickler error: ([^\n]*?\.)(?: Please use|\n|$)", text)
    if unpickler:
        return f"{type(exc).__name__}: {unpickler.group(1)}"
    first = re.split(r"(?<=\.)\s|\n", text.strip(), maxsplit=1)[0]
    return f"{type(exc).__name__}: {first}"


def atomic_save(obj: Any, path: Path) -> None:
    """Write ``obj`` to ``path`` so that ``path`` is either the old or the complete new file:
    a temporary file in the same directory, fsynced, then ``os.replace`` (and the
    directory fsynced so the rename survives a power cut)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        delay, _, only = os.environ.get(SLOW_SAVE_ENV, "").partition("@")
        if delay and only in ("", path.name):  # a test kills the process in this window
            time.sleep(float(delay))
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def checkpoint_name(epoch: int, optimizer_step: int | None = None) -> str:
    """``epoch_<E>.pt`` (epoch E completed) or ``epoch_<E>-step_<S>.pt`` (mid-epoch)."""
    if optimizer_step is None:
        return f"epoch_{epoch:06d}.pt"
    return f"epoch_{epoch:06d}-step_{optimizer_step:09d}.pt"


def _order(path: Path) -> tuple[int, int, int]:
    m = _NAME.match(path.name)
    assert m is not None
    epoch, step = int(m.group(1)), m.group(2)
    return (epoch, 0, int(step)) if step is not None else (epoch, 1, 0)


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files in ``directory``, oldest first."""
    return sorted(
        (p for p in Path(directory).glob("epoch_*.pt") if _NAME.match(p.name)), key=_order
    )


def remove_stale_temp_files(directory: Path) -> None:
    """Delete temporary files left by a process killed inside :func:`atomic_save`."""
    for tmp in Path(directory).glob(".epoch_*.tmp"):
        tmp.unlink(missing_ok=True)


def newest_valid_checkpoint(directory: Path) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint in ``directory`` that loads, newest first; an unreadable one
    is reported (error log naming the file) and the previous one is tried."""
    candidates = list_checkpoints(directory)
    problems = []
    for path in reversed(candidates):
        try:
            return path, load_checkpoint(path)
        except (CheckpointError, OSError) as exc:
            log.error("%s; falling back to the previous checkpoint", exc)
            problems.append(str(exc))
    if not candidates:
        raise CheckpointError(f"no checkpoint in {directory} (epoch_*.pt); nothing to resume")
    raise CheckpointError(f"no readable checkpoint in {directory}: " + " | ".join(problems))


class CheckpointHook(TrainerHook):
    """Saves ``run_dir/checkpoints/epoch_<NNNNNN>.pt`` every ``every_epochs`` epochs and at
    the end of training (also after an early stop); keeps the newest ``keep_last``. It runs
    at ``on_epoch_end``, after the epoch's records were written: a checkpoint never gets
    ahead of the metric files. Run control calls :meth:`save` mid-epoch."""

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
        #: (epoch, reason) of every checkpoint that could not be written (disk full ...)
        self.failed: list[tuple[int, str]] = []

    def save(self, state: TrainerState) -> Path:
        """Write the trainer's state now (mid-epoch while its update phase is under way);
        non-finite parameters raise :class:`NonFiniteParametersError` instead."""
        trainer = state.trainer
        check_finite_parameters(trainer.policy, state.epoch)
        mid = trainer.update_progress is not None
        path = self.directory / checkpoint_name(state.epoch, state.optimizer_step if mid else None)
        atomic_save(trainer_checkpoint(trainer), path)
        if not mid:
            self.saved_epoch = state.epoch
        state.last_checkpoint = path
        for old in list_checkpoints(self.directory)[: -self.keep_last]:
            old.unlink(missing_ok=True)
        return path

    def on_epoch_end(self, state: TrainerState) -> None:
        due = self.every_epochs > 0 and state.epoch % self.every_epochs == 0
        last = self.at_end and (state.epoch == state.num_epochs or state.stop_training)
        if due or last:
            self._save_or_record(state)

    def on_training_end(self, state: TrainerState) -> None:
        if self.at_end and state.error is None and 0 < state.epoch != self.saved_epoch:
            self._save_or_record(state)

    def _save_or_record(self, state: TrainerState) -> None:
        """:meth:`save`; a failed write (disk full, permissions) is recorded in
        :attr:`failed` and logged (with its traceback the first time), and training goes on."""
        try:
            self.save(state)
        except Exception as exc:
            if getattr(exc, "fatal", False):  # non-finite parameters end the run
                raise
            # torch's zip writer reports a failed write as a RuntimeError over the OSError
            cause = exc.__context__ if isinstance(exc.__context__, OSError) else exc
            reason = f"{type(cause).__name__}: {cause}"
            first = not self.failed
            self.failed.append((state.epoch, reason))
            log.error(
                f"checkpoint of epoch {state.epoch} could not be written ({reason}); training "
                f"goes on, the newest checkpoint is {state.last_checkpoint or 'none'}",
                exc_info=exc if first else None,
            )

    def lost(self) -> str | None:
        """One line on the checkpoints that could not be written, or None."""
        if not self.failed:
            return None
        epochs = sorted({e for e, _ in self.failed})  # the final one may be tried twice
        last = f"epoch {self.saved_epoch}" if self.saved_epoch >= 0 else "none"
        return (
            f"checkpoints: {len(epochs)} could not be written (epochs {epochs[0]}-{epochs[-1]}; "
            f"{self.failed[-1][1]}); the newest checkpoint is {last}"
        )
