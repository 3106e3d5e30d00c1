"""TrainTool: one training run described as a pydantic model, and its result.

A recipe builds a ``TrainTool``, adds probes with one line each, selects lifecycle hooks,
and returns it; the CLI (``policy-probes run``) applies ``key=value`` overrides and calls
:meth:`TrainTool.invoke`::

    cfg = TrainTool(env=EnvConfig(id="CartPole-v1"), policy=PolicyConfig(activation="relu"))
    cfg.add_training_hook("actor_mlp", attach_relu_activation_hooks())
    cfg.add_training_backward_hook("actor_mlp", attach_fisher_information_hooks())
    cfg.hooks = ["norms", "hessian"]            # lifecycle hooks (docs/lifecycle.md)
    cfg.hook_config = {"hessian.iters": 30}
    result = cfg.invoke()

Hook builders live in private attributes: not validated configuration, and they survive
``model_copy(update=...)``.
"""

from __future__ import annotations

import logging
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator

from policy_probes import ProbeBuilder
from policy_probes.components import ProbeSpec, add_probe
from policy_probes.probe_settings import ProbeSettings
from policy_probes.remedies import Remedy, check_remedy
from policy_probes.run import Run, default_run_dir
from policy_probes.run_lock import RunDirLocked
from policy_probes.runnable import ForkPoint, runnable
from policy_probes.session import ProbeSession
from policy_probes.sinks import SinkGroup
from policy_probes.torch_internals import quiet_output_only_backward_hooks
from policy_probes.user_errors import (
    SETUP_ERROR_TYPES,
    is_usage_error,
    mark_usage_error,
    usage_errors,
)
from trainers.callbacks import TrainerHook
from trainers.checkpoint import CheckpointHook
from trainers.cnn_policy import make_policy
from trainers.config import (
    CheckpointConfig,
    EnvConfig,
    EvalConfig,
    PolicyConfig,
    PPOConfig,
    Section,
)
from trainers.distributed import DistributedRun, RankStatisticsHook, per_rank_config
from trainers.envs import make_vector_env
from trainers.evaluation import EvaluationHook, final_evaluation_bound
from trainers.fork import apply_optimizer_config, check_fork_length, fork_checkpoint, parent_record
from trainers.policy import ActorCriticPolicy
from trainers.ppo import LOOP, METRIC_NAMESPACES, PPOTrainer, check_rollout_size
from trainers.run_control import (
    RunControl,
    refuse_finished_without_checkpoint,
    resume_trainer,
    select_checkpoint,
)

log = logging.getLogger("trainers")


@dataclass
class TrainResult:
    """What :meth:`TrainTool.invoke` returns."""

    run_dir: Path
    metrics: dict[str, Any]
    policy: ActorCriticPolicy
    epochs: int
    agent_step: int
    last_checkpoint: Path | None = None
    eval_scores: dict[str, float] = field(default_factory=dict)
    hook_errors: dict[str, str] = field(default_factory=dict)
    sink_failures: dict[str, str] = field(default_factory=dict)
    #: one line per output the run could not write (a metric sink switched off, failed
    #: checkpoints): what is missing and from which epoch
    lost_outputs: list[str] = field(default_factory=list)
    #: this process's rank and the number of processes; only rank 0 writes outputs and
    #: has ``metrics``
    rank: int = 0
    world_size: int = 1


def seed_everything(seed: int) -> None:
    """Seed Python ``random``, numpy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def lost_outputs(sinks: SinkGroup, checkpointer: CheckpointHook) -> list[str]:
    """What a run could not write, one line each (:attr:`TrainResult.lost_outputs`)."""
    out = []
    for name, reason in sinks.failures.items():
        record = sinks.failed_at.get(name)
        since = (
            f"the {record[1]} record of epoch {record[0]} and every later record are missing"
            if record is not None
            else "records after it was switched off are missing"
        )
        out.append(f"metric sink {name}: switched off ({reason}); {since}")
    checkpoints = checkpointer.lost()
    if checkpoints is not None:
        out.append(checkpoints)
    return out


def train_result(
    state: Any,
    session: ProbeSession,
    run: Run,
    checkpointer: CheckpointHook,
    dist_run: DistributedRun,
) -> TrainResult:
    """What a finished run hands back (:class:`TrainResult`)."""
    return TrainResult(
        run_dir=run.dir,
        metrics=dict(state.metrics),
        policy=state.policy,
        epochs=state.epoch,
        agent_step=state.agent_step,
        last_checkpoint=state.last_checkpoint,
        eval_scores=dict(state.eval_scores),
        hook_errors={
            **state.hook_errors,
            **{f"lifecycle.{n}": m for n, m in session.hooks.error_messages.items()},
        },
        sink_failures=dict(run.sinks.failures),
        lost_outputs=lost_outputs(run.sinks, checkpointer),
        rank=dist_run.rank,
        world_size=dist_run.world_size,
    )


def _slug(name: str) -> str:
    """``name`` as one directory name: letters and digits of any script, ``_``, ``.``,
    ``-``; other runs of characters become ``-`` (``ラン`` stays ``ラン``)."""
    return re.sub(r"[^\w.-]+", "-", name).strip("-.")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            "device=cuda requested but CUDA is not available; use device=cpu or device=auto"
        )
    return torch.device(device)


@runnable  # the contract `policy-probes run` relies on (policy_probes.runnable)
class TrainTool(Section, ProbeSettings):
    """One PPO training run: environment, policy, hyperparameters, outputs, probes (the
    probe settings are those of :class:`~policy_probes.probe_settings.ProbeSettings`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    name: str | None = Field(
        None, description="Short run name; the default run_dir is runs/<name>-<seed>-<time>."
    )
    env: EnvConfig = Field(default_factory=EnvConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    trainer: PPOConfig = Field(default_factory=PPOConfig)
    evaluation: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    seed: int = Field(1, ge=0)
    device: Literal["cpu", "cuda", "auto"] = Field(
        "cpu", description="cpu is fastest for small MLPs; auto = cuda when available."
    )
    run_dir: Path | None = Field(
        None, description="Output directory; default runs/<name>-<seed>-<time>."
    )
    torch_threads: int | None = Field(
        None, gt=0, description="torch.set_num_threads for the run (1 is fastest for small MLPs)."
    )
    progress: bool = Field(False, description="Rich progress bar (the CLI switches it on).")
    snapshot_every: int = Field(
        25, ge=0, description=ProbeSettings.model_fields["snapshot_every"].description
    )
    _builders: list[ProbeSpec] = PrivateAttr(default_factory=list)
    _remedies: list[tuple[str, Remedy]] = PrivateAttr(default_factory=list)
    _added_hooks: list[TrainerHook] = PrivateAttr(default_factory=list)
    _launch: dict[str, Any] = PrivateAttr(default_factory=dict)

    # ------------------------------------------------------------------ validation
    @field_validator("run_dir", mode="before")
    @classmethod
    def _run_dir_not_empty(cls, v: Any) -> Any:
        if isinstance(v, str | Path) and not str(v).strip():
            raise ValueError(
                "is empty (it would write the run into the current directory); give a "
                "directory such as run_dir=runs/cp3, or leave run_dir out for "
                "runs/<name>-<seed>-<time>"
            )
        return v

    @field_validator("name")
    @classmethod
    def _name_makes_a_directory(cls, v: str | None) -> str | None:
        if v is not None and not _slug(v):
            raise ValueError(
                f"{v!r} has no letter or digit for the run directory's name; give a name "
                f"with letters or digits"
            )
        return v

    @model_validator(mode="after")
    def _check_batch_sizes(self) -> TrainTool:
        check_rollout_size(self.trainer, self.rollout_size)
        return self

    # ------------------------------------------------------------------ probes and hooks
    def add_training_hook(
        self, component_name: str, builder: ProbeBuilder, **placement: Any
    ) -> TrainTool:
        """Attach a probe to a component name or glob, forward or backward as the probe
        says (a plain hook closure: forward); ``placement``: ``phases``, ``extractor``,
        ``layout``, ``per_layer``, ``schedule`` (those the probe takes). Returns self."""
        add_probe(self._builders, component_name, builder, None, placement)
        return self

    def add_training_backward_hook(
        self, component_name: str, builder: ProbeBuilder, **placement: Any
    ) -> TrainTool:
        """Attach a backward probe (or plain backward hook closure); a forward probe is
        refused when the run attaches it. Returns self."""
        add_probe(self._builders, component_name, builder, True, placement)
        return self

    def add_remedy(self, component_name: str, remedy: Remedy) -> TrainTool:
        """Attach a remedy (``policy_probes.remedies``) to a component name or glob;
        returns self. Its generator is seeded from :attr:`seed` unless it has its own."""
        self._remedies.append((component_name, check_remedy(remedy)))
        return self

    def add_trainer_hook(self, hook: TrainerHook) -> TrainTool:
        """Add a :class:`TrainerHook` (runs after the built-in ones); returns self."""
        if not isinstance(hook, TrainerHook):
            raise TypeError(f"expected a trainers.TrainerHook, got {type(hook).__name__}")
        self._added_hooks.append(hook)
        return self

    @property
    def hook_builders(self) -> list[ProbeSpec]:
        """``(pattern, builder, backward, placement)`` in the order they were added;
        ``backward`` is True for :meth:`add_training_backward_hook`, None (the probe's own
        direction) for :meth:`add_training_hook`."""
        return list(self._builders)

    def record_launch(self, target: str, overrides: list[str]) -> None:
        """Remember how the CLI built this run (written to ``config.json`` for ``resume``)."""
        self._launch = {"target": target, "overrides": list(overrides)}

    # ------------------------------------------------------------------ run
    def resolved_config(self) -> dict[str, Any]:
        """The configuration written to ``run_dir/config.json`` and given to the sinks."""
        return {
            "train_tool": self.model_dump(mode="json"),
            "recipe": self._launch.get("target"),
            "overrides": self._launch.get("overrides", []),
            "probes": [
                {
                    "component": pattern,
                    "builder": getattr(b, "name", getattr(b, "__name__", type(b).__name__)),
                    "backward": backward,
                    **({"placement": placement} if placement else {}),
                }
                for pattern, b, backward, placement in self._builders
            ],
            "added_remedies": [
                {"component": pattern, "remedy": repr(r)} for pattern, r in self._remedies
            ],
        }

    def default_run_dir(self) -> Path:
        name = self.name
        if name is None and self._launch.get("target"):
            name = re.split(r"[.:/]", self._launch["target"].removesuffix(".train"))[-1]
        name = _slug(name or "") or _slug(self.env.id)
        return default_run_dir(f"{name}-{self.seed}")

    def check_setup(self, *, overwrite: bool = False) -> dict[str, list[str]]:
        """Everything a run checks before its first environment step, writing nothing
        (``policy-probes run --dry-run``): device, run directory (not a file, not held by a
        live run, holding no other run unless ``overwrite``), environment, policy, and every
        probe attached to its components. Returns the components each probe pattern
        resolved to. Errors are those :meth:`invoke` would raise, tagged as usage errors."""
        with usage_errors():
            resolve_device(self.device)
            if self.run_dir is not None:
                Run(self.run_dir, overwrite=overwrite).check()  # reads only
            if self.sinks.enabled("wandb"):
                self.wandb.check_credentials()
            seed_everything(self.seed)
            envs = make_vector_env(self.env, gamma=self.trainer.gamma)
            try:
                policy = make_policy(
                    envs.single_observation_space, envs.single_action_space, self.policy
                )
                session = ProbeSession(policy, run=Run(main=False), probing=self, loop=LOOP)
                try:
                    attached = self._attach_probes(session)
                    # the trainer binds the loop: every remedy checks its names and probes
                    PPOTrainer(envs, policy, self.trainer, session=session)
                    session.check_remedy_triggers(self._metric_namespaces())
                finally:
                    session.close()
            finally:
                envs.close()
        return attached

    def build_policy(self) -> ActorCriticPolicy:
        """The run's policy as :meth:`invoke` builds it, on the CPU, without probes
        (``policy-probes trainability`` loads a checkpoint's parameters into it)."""
        with usage_errors():
            seed_everything(self.seed)
            envs = make_vector_env(self.env, num_envs=1, gamma=self.trainer.gamma)
            try:
                return make_policy(
                    envs.single_observation_space, envs.single_action_space, self.policy
                )
            finally:
                envs.close()

    @quiet_output_only_backward_hooks()
    def invoke(
        self,
        *,
        resume: bool | str | Path = False,
        overwrite: bool = False,
        fork_from: ForkPoint | None = None,
    ) -> TrainResult:
        """Build envs, policy, probes, sinks and trainer; train; always clean up (hook
        handles removed, envs and sinks closed, also after a failure or interruption).

        The run holds ``run_dir/run.lock``; a ``run_dir`` that already holds a run is
        refused unless ``overwrite`` (its outputs deleted first) or ``resume`` (``True``: its
        newest valid checkpoint; a path: that one). A signal or ``policy-probes ctl stop``
        ends the run at a minibatch boundary with a checkpoint, raising
        :class:`~trainers.run_control.RunStopped` (``docs/run_control.md``). ``fork_from``:
        start from the end of that epoch of another run (:mod:`trainers.fork`; with
        ``resume``, a fork without a checkpoint yet starts again from its parent's). Under
        torchrun every process calls it; rank 0 alone writes outputs (``docs/distributed.md``).
        """
        with usage_errors():
            device = resolve_device(self.device)
        with DistributedRun(device) as dist_run:
            run_dir = Path(self.run_dir) if self.run_dir is not None else self.default_run_dir()
            run_dir = dist_run.broadcast(run_dir)  # rank 0's choice (default names hold a time)
            run = Run(run_dir, resume=bool(resume), overwrite=overwrite, main=dist_run.is_main)
            refusal: str | None = None
            try:
                run.open(claim=False)  # the directory and its lock; the claim in _train
            except (RunDirLocked, OSError) as exc:
                if not dist_run.distributed:
                    raise
                refusal = str(exc)
            refusal = dist_run.broadcast(refusal)  # every rank stops, not only rank 0
            if refusal is not None:
                raise RunDirLocked(refusal)
            refused = False
            try:
                return self._train(dist_run, run, resume=resume, fork_from=fork_from)
            except BaseException as exc:
                refused = is_usage_error(exc)
                raise
            finally:  # a refused start leaves no empty directory behind
                run.close(refused=refused)

    def _attach_probes(self, session: ProbeSession) -> dict[str, list[str]]:
        """Attach the probes and remedies the recipe added (the ``probes`` and ``remedies``
        specs are the session's); returns the components each probe pattern resolved to."""
        for pattern, remedy in self._remedies:  # bound with the trainer's optimizer
            session.add_remedy(pattern, remedy, seed=self.seed)
        attached: dict[str, list[str]] = {}
        for pattern, builder, backward, placement in self._builders:
            before = len(session.policy.hook_handles)
            add = session.add_training_backward_hook if backward else session.add_training_hook
            add(pattern, builder, **placement)
            new = session.policy.hook_handles[before:]
            attached.setdefault(pattern, []).extend(h.component for h in new)
        return attached

    def _train(
        self,
        dist_run: DistributedRun,
        run: Run,
        *,
        resume: bool | str | Path = False,
        fork_from: ForkPoint | None = None,
    ) -> TrainResult:
        """:meth:`invoke` inside the process group ``dist_run``, holding the run directory's
        lock. Errors before the first environment step are the configuration's: tagged as
        usage errors; ``config.json`` is written only once the run starts, so a failed
        start or resume leaves the run as it was."""
        if self.torch_threads is not None:
            torch.set_num_threads(self.torch_threads)
        with usage_errors():
            run.claim()
            if resume is True and fork_from is None:
                num_epochs = self.trainer.total_timesteps // self.rollout_size
                refuse_finished_without_checkpoint(run, num_epochs)
            resume_from = select_checkpoint(run, resume)
            forked = fork_from is not None and resume_from is None
            if forked:
                resume_from = fork_checkpoint(fork_from, run.dir)
                check_fork_length(fork_from, self.trainer.total_timesteps // self.rollout_size)
            if resume_from is not None:
                self._check_seed(*resume_from, forked=fork_from is not None)
        config = self._run_config(run, dist_run, fork_from, None if forked else resume_from)
        dist_run.barrier()  # every rank checked run_dir before rank 0 writes into it
        seed_everything(self.seed)  # same on every rank: same initial policy
        with usage_errors():
            envs = make_vector_env(self.env, gamma=self.trainer.gamma)
        session: ProbeSession | None = None
        hooks: list[TrainerHook] = []
        training = False
        try:
            policy = make_policy(
                envs.single_observation_space, envs.single_action_space, self.policy
            ).to(dist_run.device)
            if self.progress:
                from rich.console import Console

                run.console = Console()
            session = ProbeSession(policy, run=run, probing=self, config=config, loop=LOOP)
            self._attach_probes(session)
            hooks, checkpointer, run_control = self._trainer_hooks(dist_run, run)
            trainer = PPOTrainer(
                envs,
                policy,
                per_rank_config(self.trainer, dist_run.world_size, self.env.num_envs),
                session=session,
                hooks=hooks,
                device=dist_run.device,
                seed=dist_run.seed(self.seed, self.env.num_envs),  # distinct envs per rank
            )
            session.check_remedy_triggers(self._metric_namespaces())
            if dist_run.distributed:
                trainer.wrap_ddp(dist_run.ddp_device_ids())
            if resume_from is not None:
                left = resume_trainer(trainer, run, resume_from, own_envs=dist_run.is_main)
                if not left:  # a finished run: nothing written, nothing changed
                    return train_result(trainer.state, session, run, checkpointer, dist_run)
            if forked:
                apply_optimizer_config(trainer, trainer.cfg)
                trainer.state.last_checkpoint = None  # the parent's is not this run's
            training = True
            with run_control.handling_signals():
                state = trainer.train()
        except SETUP_ERROR_TYPES as exc:
            if not training:
                mark_usage_error(exc)
            raise
        finally:
            if session is not None:
                session.remove_hooks()
            envs.close()
            for hook in hooks:
                if isinstance(hook, EvaluationHook) and hook.envs is not None:
                    hook.envs.close()
            run.sinks.close()
        return train_result(state, session, run, checkpointer, dist_run)

    def _metric_namespaces(self) -> tuple[str, ...] | None:
        """The first segments of the loop's keys; None when a trainer hook of the recipe's
        own may log others."""
        return None if self._added_hooks else METRIC_NAMESPACES

    def _check_seed(self, path: Path, ckpt: dict[str, Any], *, forked: bool) -> None:
        """Refuse a :attr:`seed` other than the checkpoint's: a resumed run or a fork
        continues the random streams the checkpoint holds, so another seed would only be
        recorded, changing nothing."""
        saved = ckpt.get("seed")
        if saved is None or int(saved) == self.seed:
            return
        what = (
            f"a fork continues its parent's random streams (seed {saved}, restored from {path})"
            if forked
            else f"a resumed run continues the random streams of {path} (seed {saved})"
        )
        raise ValueError(
            f"seed={self.seed} cannot take effect: {what}; drop seed={self.seed}, or start a "
            f"new run with seed={self.seed} to train with another seed"
        )

    @property
    def rollout_size(self) -> int:
        """Agent steps per epoch (all environments)."""
        return self.env.num_envs * self.trainer.num_steps

    def _run_config(
        self,
        run: Run,
        dist_run: DistributedRun,
        fork_from: ForkPoint | None,
        resumed_from: tuple[Path, Any] | None,
    ) -> dict[str, Any]:
        """:meth:`resolved_config` and where the run came from (fork, resume, process group)."""
        config = self.resolved_config()
        config["run_dir"] = str(run.dir)
        if fork_from is not None:
            config["parent"] = parent_record(fork_from)
        if resumed_from is not None:
            config["resumed_from"] = str(resumed_from[0])
        if dist_run.world_size > 1:
            config["distributed"] = {"world_size": dist_run.world_size, "backend": dist_run.backend}
        return config

    def _trainer_hooks(
        self, dist_run: DistributedRun, run: Run
    ) -> tuple[list[TrainerHook], CheckpointHook, RunControl]:
        """The trainer's callbacks in firing order, with the checkpointer and run control."""
        hooks: list[TrainerHook] = []
        if dist_run.distributed:
            hooks.append(RankStatisticsHook(dist_run.world_size))
        evaluation = self._evaluation_hook(dist_run.is_main)
        if evaluation is not None:
            hooks.append(evaluation)
        # the checkpoint section's fields are the hook's arguments
        checkpointer = CheckpointHook(run.dir / "checkpoints", **self.checkpoint.model_dump())
        if self.checkpoint.every_epochs > 0 or self.checkpoint.at_end:
            # on_epoch_end comes after the epoch's records: never ahead of the metrics
            hooks.append(checkpointer)
        if self.progress:
            from trainers.progress import ProgressHook

            hooks.append(ProgressHook(console=run.console))
        hooks.extend(self._added_hooks)
        run_control = RunControl(run.dir, checkpointer, run.sinks)  # signals, `ctl`
        hooks.append(run_control)
        return hooks, checkpointer, run_control

    def _evaluation_hook(self, main: bool) -> EvaluationHook | None:
        """The periodic and final evaluation, or None when both are off."""
        ev = self.evaluation
        if ev.every_epochs <= 0 and not ev.at_end:
            return None
        env_cfg, n_eval = self.env, ev.num_envs
        bound = None
        if ev.at_end and ev.short_run_bound:
            bound = final_evaluation_bound(self.trainer.total_timesteps, n_eval, ev.max_steps)
        if bound is not None and main:
            log.warning(
                f"the final evaluation ({ev.episodes} episodes on {n_eval} envs, up to "
                f"evaluation.max_steps={ev.max_steps} steps per env) could take longer than "
                f"this run's training ({self.trainer.total_timesteps} agent steps); it stops at "
                f"{bound} steps per env. evaluation.at_end=false skips it, "
                f"evaluation.short_run_bound=false lifts the cap"
            )
        return EvaluationHook(
            lambda: make_vector_env(env_cfg, num_envs=n_eval),
            every_epochs=ev.every_epochs,
            episodes=ev.episodes,
            at_end=ev.at_end,
            seed=self.seed,
            max_steps=ev.max_steps,
            final_max_steps=bound,
        )
