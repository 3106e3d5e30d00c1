"""Multi-process PPO on ``torch.distributed`` (``docs/distributed.md``): the process group,
per-rank seeds, and the epoch statistics of all ranks.

Launch with ``torchrun --nproc_per_node=4 -m policy_probes.cli run recipes.cartpole.train``.
:class:`DistributedRun` reads torchrun's variables and owns the process group (without
them it is rank 0 of 1 and touches nothing). Each rank steps its own environments (seeded
by :func:`rank_seed`) and DDP averages the gradients (``PPOTrainer.wrap_ddp``);
:class:`RankStatisticsHook` makes the epoch statistics and ``agent_step`` global.
"""

from __future__ import annotations

import gc
import logging
import math
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainers.callbacks import TrainerHook, TrainerState
from trainers.config import PPOConfig

log = logging.getLogger("trainers")

#: environment variables torchrun sets for every worker
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: seed distance between ranks (larger when one rank has more envs, see rank_seed)
RANK_SEED_STRIDE = 1000


def launched_by_torchrun() -> bool:
    """True when torchrun (or another launcher) set ``RANK`` and ``WORLD_SIZE``."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_seed(seed: int, rank: int, num_envs: int = 1) -> int:
    """The seed of rank ``rank``'s environments, action sampling and minibatch order:
    ``seed + rank * max(1000, num_envs)`` (vector envs seed env ``i`` with ``seed + i``, so
    ranks never share an environment seed; rank 0 keeps ``seed``)."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return seed + rank * max(RANK_SEED_STRIDE, num_envs)


def per_rank_config(cfg: PPOConfig, world_size: int, num_envs: int) -> PPOConfig:
    """The PPO configuration one rank trains with: ``total_timesteps`` is the budget of
    all ranks together (as in CleanRL's multi-GPU PPO); ``ValueError`` when that is less
    than one epoch."""
    if world_size == 1:
        return cfg
    rollout = world_size * num_envs * cfg.num_steps
    if cfg.total_timesteps < rollout:
        raise ValueError(
            f"trainer.total_timesteps={cfg.total_timesteps} counts the steps of all "
            f"{world_size} processes and is smaller than one rollout of all of them "
            f"(world_size * env.num_envs * trainer.num_steps = {rollout}); raise "
            f"total_timesteps or lower num_steps / num_envs"
        )
    return cfg.model_copy(update={"total_timesteps": cfg.total_timesteps // world_size})


class DistributedRun:
    """The process group of one training run, as a context manager: initialises the
    default group (gloo on the CPU, nccl for CUDA) when launched by torchrun and none exists
    yet, and destroys it on exit (also after an error). A group that already existed is
    used and left alone. Outside torchrun it is rank 0 of a world of 1 and does nothing.
    On CUDA ``device`` is ``cuda:<local_rank>``.
    """

    def __init__(self, device: torch.device | str = "cpu", timeout_s: float | None = None) -> None:
        self.requested_device = torch.device(device)
        self.timeout_s = timeout_s
        self.rank, self.world_size, self.local_rank = 0, 1, 0
        self.device = self.requested_device
        self.owns_group = False

    def __enter__(self) -> DistributedRun:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(barrier=exc_type is None)

    def start(self) -> DistributedRun:
        """Join (or create) the process group; a no-op outside a distributed launch."""
        if not dist.is_available():
            if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
                raise RuntimeError(
                    "launched with WORLD_SIZE > 1 but this torch build has no "
                    "torch.distributed; install a torch build with distributed support"
                )
            return self
        if not dist.is_initialized():
            if not launched_by_torchrun():
                return self
            self._init_from_env()
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if not self.owns_group:  # a group the caller created: its LOCAL_RANK or current GPU
            default = torch.cuda.current_device() if torch.cuda.is_available() else 0
            self.local_rank = int(os.environ.get("LOCAL_RANK", default))
        if self.requested_device.type == "cuda":
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        if self.world_size > 1:
            where = f"{dist.get_backend()}, device {self.device}"
            log.info(f"distributed run: rank {self.rank} of {self.world_size} ({where})")
        return self

    def _init_from_env(self) -> None:
        missing = [v for v in TORCHRUN_VARS if v not in os.environ]
        if missing:
            raise RuntimeError(
                f"RANK and WORLD_SIZE are set but {', '.join(missing)} is not; launch with "
                f"torchrun (e.g. torchrun --nproc_per_node=2 -m policy_probes.cli run ...) "
                f"or set every one of {', '.join(TORCHRUN_VARS)}"
            )
        self.local_rank = int(os.environ["LOCAL_RANK"])
        backend = "nccl" if self.requested_device.type == "cuda" else "gloo"
        if backend == "nccl":
            if not torch.cuda.is_available():
                raise RuntimeError(
                    "device=cuda under torchrun but CUDA is not available; use device=cpu "
                    "(gloo backend)"
                )
            if self.local_rank >= torch.cuda.device_count():
                raise RuntimeError(
                    f"LOCAL_RANK={self.local_rank} but only {torch.cuda.device_count()} GPU(s) "
                    f"are visible; lower --nproc_per_node to the number of GPUs"
                )
            torch.cuda.set_device(self.local_rank)
        kwargs: dict[str, Any] = {"backend": backend, "init_method": "env://"}
        if self.timeout_s is not None:
            kwargs["timeout"] = timedelta(seconds=self.timeout_s)
        dist.init_process_group(**kwargs)
        self.owns_group = True

    def close(self, barrier: bool = False) -> None:
        """Destroy the process group if :meth:`start` created it: collect garbage (the
        trainer's DDP sits in reference cycles and its reducer holds the group open), then
        ``barrier`` (a run that ended cleanly), so that no rank tears down its gloo
        connections while another still uses them (it would abort with "terminate called
        without an active exception")."""
        owned, self.owns_group = self.owns_group and dist.is_initialized(), False
        if not owned:
            return
        try:
            gc.collect()
            if barrier and self.distributed:
                dist.barrier()
        finally:
            dist.destroy_process_group()

    @property
    def distributed(self) -> bool:
        """More than one process trains."""
        return self.world_size > 1

    @property
    def backend(self) -> str | None:
        """The process group's backend (``gloo``/``nccl``), None without a group."""
        return dist.get_backend() if dist.is_available() and dist.is_initialized() else None

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes outputs (config, sinks, checkpoints)."""
        return self.rank == 0

    def ddp_device_ids(self) -> list[int] | None:
        """``device_ids`` for DistributedDataParallel: the rank's GPU, None on the CPU."""
        return [self.device.index or 0] if self.device.type == "cuda" else None

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (picklable objects; identity when alone)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        """Wait for every rank (no-op when alone)."""
        if self.distributed:
            dist.barrier()

    def seed(self, seed: int, num_envs: int = 1) -> int:
        """This rank's seed (:func:`rank_seed`)."""
        return rank_seed(seed, self.rank, num_envs)


# Rollout statistics: how each one combines across ranks.
_EPISODE_MEANS = ("episode_return", "episode_length")  # weighted by each rank's episodes
_SUMMED = ("episodes", "rollout_sps")
_AVERAGED = ("sps", "update_seconds", "valid_fraction")
_SUMMED_LOSS = ("batch_size",)


class RankStatisticsHook(TrainerHook):
    """Makes the statistics of a multi-process run describe all ranks together:
    ``agent_step`` counts every rank's steps, and once per epoch the statistics combine
    over ranks as the tables above say (other loss statistics averaged; the return's max
    and min over ranks). It runs on every rank (a collective), before the other hooks.
    """

    run_on_all_ranks = True
    critical = True  # a rank that skipped the collective would hang the others

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size

    def on_rollout_start(self, state: TrainerState) -> None:
        state.agent_step += (self.world_size - 1) * state.trainer.batch_size

    def on_train_phase_end(self, state: TrainerState) -> None:
        if self.world_size == 1:
            return
        rs, ls, n = state.rollout_stats, state.loss_stats, self.world_size
        episodes = float(rs.get("episodes", 0.0))
        rates, loss_keys = (*_SUMMED[1:], *_AVERAGED), sorted(ls)
        sums = [episodes]
        sums += [rs.get(k, 0.0) * episodes if episodes else 0.0 for k in _EPISODE_MEANS]
        sums += [float(rs.get(k, 0.0)) for k in rates]
        sums += [float(ls[k]) for k in loss_keys]
        extremes = [
            rs.get("episode_return_max", -math.inf),
            -rs.get("episode_return_min", math.inf),
        ]
        nccl = dist.get_backend() == "nccl"  # collectives on the current GPU, else the CPU
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        total = torch.tensor(sums, dtype=torch.float64, device=device)
        peak = torch.tensor(extremes, dtype=torch.float64, device=device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        totals, (top, neg_bottom) = iter(total.tolist()), peak.tolist()  # once per epoch
        all_episodes = next(totals)
        out = {"episodes": all_episodes}
        means = {k: next(totals) for k in _EPISODE_MEANS}
        if all_episodes > 0:
            out.update({k: m / all_episodes for k, m in means.items()})
            out["episode_return_max"], out["episode_return_min"] = top, -neg_bottom
        for k, value in zip(rates, totals, strict=False):  # totals goes on
            if k in rs:
                out[k] = value if k in _SUMMED else value / n
        for k in ("episode_return", "episode_length", "episode_return_max", "episode_return_min"):
            rs.pop(k, None)  # a rank without episodes reports the global ones too
        rs.update(out)
        for k, value in zip(loss_keys, totals, strict=True):
            ls[k] = value if k in _SUMMED_LOSS else value / n
