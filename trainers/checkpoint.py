"""Checkpoints: the full training state, written atomically, read safely, resumed exactly.

A checkpoint is a plain dict of tensors and Python containers, so it loads with
``torch.load(path, weights_only=True)`` (no arbitrary code runs on load). It holds what an
exact continuation needs (``docs/run_control.md``):

* model, optimizer and scheduler state dicts; the counters (epoch, agent and optimizer steps);
* every RNG: torch CPU and CUDA, numpy, Python ``random``, the trainer's sample/shuffle
  generators;
* the vector env's state (:mod:`trainers.env_state`; envs it cannot capture, such as
  ``AsyncVectorEnv``, are re-seeded on resume with a warning), the trainer's pending
  observation and done flags, its episode accumulators, the running statistics of the
  normalisation wrappers;
* the lifecycle hooks' state (e.g. ``norms`` keeps the initial weights) and the hook
  manager's carried gradients, and the evaluation counter (evaluation start states);
* for a *mid-epoch* checkpoint (written at a minibatch boundary by ``ctl checkpoint``,
  ``ctl stop`` or a signal): the rollout storage, the position in the update phase
  (:class:`~trainers.ppo.UpdateProgress`), the epoch's rollout statistics, lifecycle
  metrics so far and the probe trackers' accumulators.

Files: ``epoch_<E>.pt`` after epoch E completed; ``epoch_<E>-step_<S>.pt`` in the middle
of epoch E at optimizer step S (it sorts after ``epoch_<E-1>.pt``, before ``epoch_<E>.pt``).
"""

from __future__ import annotations

import enum
import json
import logging
import os
import random
import re
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from policy_probes.sinks.jsonl import fsync_dir
from trainers.callbacks import TrainerHook, TrainerState
from trainers.env_state import EnvStateError, capture_env_state, restore_env_state
from trainers.nonfinite_guard import check_finite_parameters

if TYPE_CHECKING:
    from trainers.ppo import PPOTrainer

log = logging.getLogger("trainers")

CHECKPOINT_FORMAT = 2
#: formats :func:`restore_trainer` reads (1: no env/lifecycle state, envs re-seeded)
READABLE_FORMATS = (1, 2)
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
    arrays become tensors, numpy scalars and enum members plain values. Raises
    ``TypeError`` naming ``where`` for anything else."""
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


# ---------------------------------------------------------------------- parts of the state
def _env_state(trainer: PPOTrainer) -> dict[str, Any]:
    """The vector env's state, or why it could not be captured."""
    try:
        return {"state": capture_env_state(trainer.envs), "reason": None}
    except EnvStateError as exc:
        return {"state": None, "reason": str(exc)}


def _lifecycle_state(trainer: PPOTrainer) -> dict[str, Any]:
    """Each lifecycle hook's ``state`` plus what the hook manager carries across steps."""
    manager = trainer.manager
    hooks: dict[str, Any] = {}
    for hook in manager.hooks:
        if not hook.state:
            continue
        try:
            hooks[hook.name] = to_plain_state(hook.state, f"lifecycle hook {hook.name!r} state")
        except TypeError as exc:
            log.warning("%s; that hook restarts from an empty state on resume", exc)
    carried: dict[str, Any] = {}
    for attr in ("_prev_grads", "_grad_sum", "_grad_steps", "_grad_epoch"):
        value = getattr(manager, attr, None)
        if value is not None:
            carried[attr] = to_plain_state(value, f"hook manager {attr}")
    try:
        carried["last_metrics"] = to_plain_state(getattr(manager, "last_metrics", {}))
    except TypeError as exc:
        log.warning("%s; hooks see no previous metrics right after a resume", exc)
    return {"hooks": hooks, "manager": carried}


def _mid_epoch_state(trainer: PPOTrainer) -> dict[str, Any]:
    """The state of an epoch interrupted in its update phase."""
    p = trainer.update_progress
    assert p is not None
    st = trainer.storage
    storage = {
        k: to_plain_state(v, f"rollout storage {k}")
        for k, v in vars(st).items()
        if isinstance(v, torch.Tensor | np.ndarray)
    }
    trackers = {}
    for name, tracker in trainer.context.model_metrics.items():
        tracker.flush()  # buffered rows into the accumulators
        trackers[name] = {
            "state": to_plain_state(tracker.state, f"tracker {name}"),
            "errors": dict(getattr(tracker, "errors", {})),
        }
    steps = []
    for r in getattr(trainer.manager, "_records", []):
        steps.append(
            {"point": r.point.value, "epoch": r.epoch, "step": r.step, "metrics": r.metrics}
        )
    hm = trainer.hook_metrics
    return {
        "update": {
            "learning_rate": p.learning_rate,
            "sums": p.sums,
            "update_epoch": p.update_epoch,
            "next_minibatch": p.next_minibatch,
            "order": p.order,
            "steps": p.steps,
            "update_epochs_run": p.update_epochs_run,
            "last_stats": p.last_stats,
        },
        "storage": storage,
        "rollout_stats": to_plain_state(trainer.state.rollout_stats),
        "hook_metrics": to_plain_state({"epoch": hm.epoch, "metrics": hm.metrics}),
        "step_records": to_plain_state(steps, "lifecycle step records"),
        "trackers": trackers,
    }


def trainer_checkpoint(trainer: PPOTrainer) -> dict[str, Any]:
    """Everything needed to continue ``trainer`` exactly (see the module docstring).

    Called at an epoch end or, while :attr:`PPOTrainer.update_progress` is set, at a
    minibatch boundary (then the checkpoint is a mid-epoch one).
    """
    s = trainer.state
    ckpt: dict[str, Any] = {
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
        "env": _env_state(trainer),
        "next_obs": to_plain_state(trainer._next_obs),
        "prev_done": to_plain_state(trainer._prev_done),
        "episodes": {
            "returns": to_plain_state(trainer._episode_returns),
            "lengths": to_plain_state(trainer._episode_lengths),
        },
        "trained_seconds": float(trainer._trained_time),
        "lifecycle": _lifecycle_state(trainer),
        "trainer_hooks": {
            type(h).__name__: {"evaluations": h.evaluations}
            for h in trainer.hooks
            if type(h).__name__ == "EvaluationHook"
        },
        "mid_epoch": None if trainer.update_progress is None else _mid_epoch_state(trainer),
        # pass counters and sampling rates: a resumed run observes the same passes
        "sampler": None
        if trainer.context.sampler is None
        else trainer.context.sampler.state_dict(),
        "config": json.dumps(s.config, default=str),
    }
    return ckpt


def completed_epochs(ckpt: dict[str, Any]) -> int:
    """Epochs whose metrics a run resumed from ``ckpt`` does not repeat."""
    return ckpt["epoch"] - 1 if ckpt.get("mid_epoch") else ckpt["epoch"]


def restore_trainer(
    trainer: PPOTrainer, ckpt: dict[str, Any], *, restore_envs: bool = True
) -> None:
    """Load a checkpoint dict into a freshly built ``trainer`` (same configuration), so that
    ``trainer.train()`` continues exactly where the checkpointed run was.

    ``restore_envs=False`` re-seeds the environments instead of restoring the saved ones
    (ranks other than 0 of a distributed run: the checkpoint holds rank 0's envs).
    """
    if ckpt.get("format") not in READABLE_FORMATS:
        raise CheckpointError(
            f"unsupported checkpoint format {ckpt.get('format')!r} (this version reads "
            f"{READABLE_FORMATS})"
        )
    try:
        trainer.policy.load_state_dict(ckpt["policy"])
        trainer.optimizer.load_state_dict(ckpt["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(
            f"the checkpoint does not fit this run's policy/optimizer ({exc}); resume with the "
            f"configuration it was written with (policy sizes, activations, environment)"
        ) from None
    trainer.scheduler.load_state_dict(ckpt["scheduler"])
    restore_rng_state(ckpt["rng"])
    trainer.sample_generator.set_state(ckpt["trainer_rng"]["sample"])
    trainer.shuffle_generator.set_state(ckpt["trainer_rng"]["shuffle"])
    s = trainer.state
    s.epoch, s.agent_step, s.optimizer_step = (
        ckpt["epoch"],
        ckpt["agent_step"],
        ckpt["optimizer_step"],
    )
    if restore_envs:
        _restore_envs(trainer, ckpt)
    else:
        _reseed_envs(trainer, ckpt, "the checkpoint holds another rank's environments")
    trainer.load_normalization_state(ckpt["normalization"])
    trainer._trained_time = float(ckpt.get("trained_seconds", 0.0))
    _restore_lifecycle(trainer, ckpt.get("lifecycle") or {})
    for hook in trainer.hooks:
        saved = (ckpt.get("trainer_hooks") or {}).get(type(hook).__name__)
        if saved and type(hook).__name__ == "EvaluationHook":
            hook.evaluations = int(saved["evaluations"])
    if ckpt.get("sampler") and trainer.context.sampler is not None:
        trainer.context.sampler.load_state_dict(ckpt["sampler"])
    if ckpt.get("mid_epoch"):
        # another rank's probe sums would be counted twice by the all-reduce
        _restore_mid_epoch(trainer, ckpt["mid_epoch"], trackers=restore_envs)


def _restore_envs(trainer: PPOTrainer, ckpt: dict[str, Any]) -> None:
    env = ckpt.get("env") or {"state": None, "reason": "checkpoint format 1 holds no env state"}
    if env["state"] is not None and ckpt.get("next_obs") is not None:
        trainer.envs.reset(seed=trainer.seed)  # builds every lazily created attribute
        restore_env_state(trainer.envs, env["state"])
        trainer._next_obs = ckpt["next_obs"].numpy()
        trainer._prev_done = ckpt["prev_done"].numpy().copy()
        episodes = ckpt.get("episodes") or {}
        trainer._episode_returns = [t.numpy() for t in episodes.get("returns", [])]
        trainer._episode_lengths = [t.numpy() for t in episodes.get("lengths", [])]
        return
    _reseed_envs(trainer, ckpt, f"the environment state was not saved ({env['reason']})")


def _reseed_envs(trainer: PPOTrainer, ckpt: dict[str, Any], why: str) -> None:
    seed = trainer.seed + ckpt["agent_step"]
    log.warning(
        "%s: the environments are re-seeded with seed %d, so the resumed run is not "
        "bit-identical to an uninterrupted one",
        why,
        seed,
    )
    trainer._next_obs, _ = trainer.envs.reset(seed=seed)
    trainer._prev_done[:] = False


def _restore_lifecycle(trainer: PPOTrainer, saved: dict[str, Any]) -> None:
    manager = trainer.manager
    device = trainer.device
    for hook in manager.hooks:
        if hook.name in saved.get("hooks", {}):
            hook.state = saved["hooks"][hook.name]
            if not getattr(manager, "offload_state", False):
                hook.move_state(device)
    carried = saved.get("manager", {})
    for attr in ("_prev_grads", "_grad_sum"):
        if attr in carried:
            setattr(manager, attr, {k: v.to(device) for k, v in carried[attr].items()})
    for attr in ("_grad_steps", "_grad_epoch"):
        if attr in carried:
            setattr(manager, attr, carried[attr])
    if "last_metrics" in carried:
        from policy_probes.lifecycle import HookPoint

        manager.last_metrics = {HookPoint(k): v for k, v in carried["last_metrics"].items()}


def _restore_mid_epoch(trainer: PPOTrainer, mid: dict[str, Any], *, trackers: bool) -> None:
    from policy_probes.lifecycle import HookPoint
    from policy_probes.lifecycle.manager import StepRecord
    from trainers.ppo import EpochHookMetrics, UpdateProgress

    device = trainer.device
    u = mid["update"]
    trainer.update_progress = UpdateProgress(
        learning_rate=u["learning_rate"],
        sums=u["sums"].to(device),
        update_epoch=u["update_epoch"],
        next_minibatch=u["next_minibatch"],
        order=None if u["order"] is None else u["order"].to(device),
        steps=u["steps"],
        update_epochs_run=u["update_epochs_run"],
        last_stats=None if u["last_stats"] is None else u["last_stats"].to(device),
    )
    st = trainer.storage
    for key, value in mid["storage"].items():
        current = getattr(st, key)
        if isinstance(current, np.ndarray):
            setattr(st, key, value.numpy().astype(current.dtype, copy=True))
        elif current.shape == value.shape:
            current.copy_(value)
        else:
            setattr(st, key, value.to(device))
    trainer.state.rollout_stats = dict(mid["rollout_stats"])
    trainer.hook_metrics = EpochHookMetrics(
        epoch=mid["hook_metrics"]["epoch"], metrics=dict(mid["hook_metrics"]["metrics"])
    )
    trainer.rollout_ready = True
    if hasattr(trainer.manager, "_records"):
        trainer.manager._records = [
            StepRecord(HookPoint(r["point"]), r["epoch"], r["step"], r["metrics"])
            for r in mid["step_records"]
        ]
    for name, saved in mid["trackers"].items() if trackers else ():
        tracker = trainer.context.model_metrics.get(name)
        if tracker is None:
            log.warning("checkpoint holds tracker %r, which this run does not attach", name)
            continue
        tracker.reset()
        for component, accumulators in saved["state"].items():
            tracker.state[component] = {k: v.to(device) for k, v in accumulators.items()}
        getattr(tracker, "errors", {}).update(saved["errors"])


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


def remove_stale_temp_files(directory: Path) -> int:
    """Delete temporary files left by a process killed inside :func:`atomic_save`."""
    removed = 0
    for tmp in Path(directory).glob(".epoch_*.tmp"):
        tmp.unlink(missing_ok=True)
        removed += 1
    return removed


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
    the end of training (also after an early stop); keeps the newest ``keep_last``.

    Register it after :class:`~trainers.metrics_hook.MetricsHook`: a checkpoint then
    never gets ahead of the metric files, which a resume rewinds to the checkpoint's
    epoch. :meth:`save` is also what run control calls mid-epoch.
    """

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
        """Write the trainer's state now (mid-epoch while its update phase is under way).
        Non-finite parameters are never written: :class:`NonFiniteParametersError`
        (the run stops; the directory keeps its last finite checkpoint)."""
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
            self.save(state)

    def on_training_end(self, state: TrainerState) -> None:
        if (
            self.at_end
            and state.error is None
            and state.epoch > 0
            and self.saved_epoch != state.epoch
        ):
            self.save(state)
