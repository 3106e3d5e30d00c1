"""PPO (Schulman et al. 2017) with the implementation details of Huang et al. 2022 / CleanRL.

Read top to bottom: :func:`ppo_loss` is the clipped objective, :class:`PPOTrainer` the
loop (collect a rollout, compute GAE, several update epochs of shuffled minibatches).
Details that matter and where they are:

* orthogonal init, separate actor/critic networks: ``trainers/policy.py``
* Adam with eps 1e-5, linear learning-rate annealing: :meth:`PPOTrainer.__init__`
* GAE with gymnasium's NEXT_STEP autoreset handled: ``trainers/rollout.py``
* per-minibatch advantage normalisation: :func:`normalize_advantages`
* clipped surrogate, clipped value loss, entropy bonus: :func:`ppo_loss`
* global gradient clipping, gradient accumulation over micro-batches, target-KL early
  stop: :meth:`PPOTrainer.train_minibatch` and :meth:`PPOTrainer.update`

Per-step statistics stay on the device and are transferred once per epoch. Lifecycle
hooks (``docs/lifecycle.md``) fire at PRE_EPOCH, POST_ROLLOUT, PRE_STEP/POST_STEP
(only when a selected hook fires there), POST_EPOCH and SNAPSHOT.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
from gymnasium.wrappers import vector as vw
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from policy_probes.context import ComponentContext
from policy_probes.lifecycle import STEP_POINTS, HookManager, HookPoint, TrainingHook, snapshot_due
from policy_probes.lifecycle.hooks import StatsReporterHook
from trainers.callbacks import CallbackList, TrainerHook, TrainerState
from trainers.config import PPOConfig
from trainers.envs import find_wrapper
from trainers.metrics_hook import epoch_metrics
from trainers.model_context import PPOModelDataContext
from trainers.nonfinite_guard import (
    NonFiniteInputError,
    describe_nonfinite_input,
    rollout_inputs_finite,
)
from trainers.policy import ActorCriticPolicy
from trainers.rollout import Minibatch, RolloutStorage

log = logging.getLogger("trainers")

#: order of the statistics that ppo_loss returns stacked in one tensor
LOSS_STATS = ("policy_loss", "value_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac")


def normalize_advantages(batch: Minibatch) -> Minibatch:
    """Advantages rescaled to mean 0, std 1 within the minibatch (before micro-batching)."""
    adv = batch.advantages
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    return Minibatch(batch.obs, batch.actions, batch.logprobs, batch.values, adv, batch.returns)


class EvaluateActions(nn.Module):
    """``policy.evaluate_actions`` as a module's ``forward``.

    DistributedDataParallel averages gradients only for passes through the forward of
    the module it wraps, and the PPO loss needs ``evaluate_actions``, not the policy's
    ``forward``; the trainer wraps this module instead (:meth:`PPOTrainer.wrap_ddp`).
    Probes stay on the policy's own components, which this module calls unchanged.
    """

    def __init__(self, policy: ActorCriticPolicy) -> None:
        super().__init__()
        self.policy = policy

    def forward(
        self, obs: torch.Tensor, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.policy.evaluate_actions(obs, actions)


def ppo_loss(
    policy: ActorCriticPolicy,
    batch: Minibatch,
    cfg: PPOConfig,
    *,
    evaluate: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PPO loss on ``batch`` (advantages used as given) and its statistics.

    Returns ``(loss, stats)`` where ``stats`` is a detached 1-D tensor ordered as
    :data:`LOSS_STATS`. The loss is a mean over the batch's samples. ``evaluate``
    replaces ``policy.evaluate_actions`` (the DDP-wrapped :class:`EvaluateActions` of a
    multi-process run).
    """
    evaluate = policy.evaluate_actions if evaluate is None else evaluate
    newlogprob, entropy, newvalue = evaluate(batch.obs, batch.actions)
    logratio = newlogprob - batch.logprobs
    ratio = logratio.exp()

    # Clipped surrogate objective: max of the two pessimistic losses.
    neg_adv = -batch.advantages
    pg_loss1 = neg_adv * ratio
    pg_loss2 = neg_adv * torch.clamp(ratio, 1 - cfg.clip_coef, 1 + cfg.clip_coef)
    pg_loss = torch.max(pg_loss1, pg_loss2).mean()

    # Value loss, clipped around the rollout's value estimate.
    v_loss_unclipped = (newvalue - batch.returns).square()
    if cfg.clip_vloss:
        v_clipped = batch.values + torch.clamp(
            newvalue - batch.values, -cfg.clip_coef, cfg.clip_coef
        )
        v_loss = 0.5 * torch.max(v_loss_unclipped, (v_clipped - batch.returns).square()).mean()
    else:
        v_loss = 0.5 * v_loss_unclipped.mean()

    entropy_loss = entropy.mean()
    loss = pg_loss - cfg.ent_coef * entropy_loss + cfg.vf_coef * v_loss

    with torch.no_grad():
        # KL estimators of http://joschu.net/blog/kl-approx.html (k1 and k3).
        old_approx_kl = (-logratio).mean()
        ratio_m1 = ratio - 1
        approx_kl = (ratio_m1 - logratio).mean()
        clipfrac = (ratio_m1.abs() > cfg.clip_coef).float().mean()
        # (stack under no_grad: the result is detached, no per-statistic detach needed)
        stats = torch.stack([pg_loss, v_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac])
    return loss, stats


@dataclass
class EpochHookMetrics:
    """What the lifecycle hooks reported in one epoch (host values).

    ``metrics``: PRE_EPOCH, POST_ROLLOUT, POST_EPOCH and SNAPSHOT metrics plus the
    per-epoch means of the step points (the epoch's main record). ``snapshot``: the
    SNAPSHOT metrics in epochs where SNAPSHOT fired, else ``None``. ``steps``: per step
    point (``"PRE_STEP"``, ``"POST_STEP"``) the per-epoch means of its metrics.
    ``complete``: POST_EPOCH has fired (the epoch's hooks are done).
    """

    epoch: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    snapshot: dict[str, Any] | None = None
    steps: dict[str, dict[str, Any]] = field(default_factory=dict)
    complete: bool = False


@dataclass
class UpdateProgress:
    """Where the update phase of the current epoch stands: the running sums of the loss
    statistics, the update epoch, its minibatch order and the next minibatch. A mid-epoch
    checkpoint saves it, so a resumed run trains on exactly the remaining minibatches."""

    learning_rate: float
    sums: torch.Tensor
    update_epoch: int = 0
    next_minibatch: int = 0
    order: torch.Tensor | None = None
    steps: int = 0
    update_epochs_run: int = 0
    last_stats: torch.Tensor | None = None


class PPOTrainer:
    """The PPO loop over a gymnasium vector env and an :class:`ActorCriticPolicy`.

    One *epoch* is one rollout of ``num_steps`` x ``num_envs`` steps followed by
    ``update_epochs`` passes of ``num_minibatches`` minibatches over it.
    ``context.phase`` is ``"rollout"`` while collecting and ``"train"`` while updating.

    ``lifecycle_hooks`` (see :func:`policy_probes.lifecycle.select_hooks`) run through
    :attr:`manager`; the ``stats_reporter`` hook is always added, because it is the one
    path by which the probe trackers become metrics. ``snapshot_every`` paces SNAPSHOT
    (0 = never); ``lifecycle_config`` is what hooks see as ``RunDataContext.config``
    (TrainTool passes itself; default: the :class:`PPOConfig`).
    """

    def __init__(
        self,
        envs: gym.vector.VectorEnv,
        policy: ActorCriticPolicy,
        cfg: PPOConfig,
        *,
        context: ComponentContext | None = None,
        hooks: Iterable[TrainerHook] = (),
        device: torch.device | str = "cpu",
        seed: int = 0,
        run_dir: Path | None = None,
        config: dict[str, Any] | None = None,
        lifecycle_hooks: Iterable[TrainingHook] = (),
        snapshot_every: int = 0,
        lifecycle_config: Any = None,
    ) -> None:
        self.envs, self.policy, self.cfg = envs, policy, cfg
        self.context = context if context is not None else ComponentContext()
        self.hooks = hooks if isinstance(hooks, CallbackList) else CallbackList(hooks)
        self.device = torch.device(device)
        self.seed = seed
        self.num_envs = envs.num_envs
        self.batch_size = self.num_envs * cfg.num_steps
        self.num_epochs = cfg.total_timesteps // self.batch_size
        if self.num_epochs < 1:
            raise ValueError(
                f"trainer.total_timesteps={cfg.total_timesteps} is less than one rollout "
                f"(env.num_envs * trainer.num_steps = {self.batch_size}); raise total_timesteps"
            )
        if cfg.num_minibatches * cfg.micro_batches * 2 > self.batch_size:
            raise ValueError(
                f"rollout of {self.batch_size} samples is too small for {cfg.num_minibatches} "
                f"minibatches of {cfg.micro_batches} micro-batches (need at least 2 samples "
                f"each); lower trainer.num_minibatches / trainer.micro_batches"
            )

        # fused: one kernel per step for all parameters instead of a dozen ops per tensor
        # (same Adam update; supported on CPU and CUDA for float parameters).
        self.optimizer = torch.optim.Adam(
            policy.parameters(), lr=cfg.learning_rate, eps=cfg.adam_eps, fused=True
        )
        num_epochs = self.num_epochs
        anneal = cfg.anneal_lr

        def lr_factor(done_epochs: int) -> float:
            # epoch i (1-based) trains with lr * (1 - (i - 1) / num_epochs)
            return 1.0 - done_epochs / num_epochs if anneal else 1.0

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor)
        self.storage = RolloutStorage(
            cfg.num_steps,
            self.num_envs,
            policy.obs_dim,
            policy.act_dim,
            policy.discrete,
            self.device,
            obs_dtype=policy.obs_dtype,
        )
        # Own generators: action sampling and minibatch order never touch the global RNGs,
        # so hooks that draw random numbers cannot change the trajectory.
        self.sample_generator = torch.Generator(device=self.device).manual_seed(seed)
        self.shuffle_generator = torch.Generator().manual_seed(seed + 1)
        self.state = TrainerState(
            trainer=self,
            policy=policy,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            context=self.context,
            config=config or {},
            run_dir=run_dir,
            num_epochs=self.num_epochs,
        )
        self._next_obs: np.ndarray | None = None
        self._prev_done = np.zeros(self.num_envs, dtype=bool)
        self._episode_returns: list[np.ndarray] = []
        self._episode_lengths: list[np.ndarray] = []
        self._start_time = 0.0
        self._trained_time = 0.0
        #: the update phase under way (set during update(); restored from a mid-epoch
        #: checkpoint, in which case train() continues that epoch's update phase)
        self.update_progress: UpdateProgress | None = None

        # Lifecycle hooks. stats_reporter is always present (one metrics pipeline for the
        # probes); the per-step fire() calls are skipped unless a hook fires at a step
        # point or needs gradients, so an empty selection costs one bool check per step.
        selected = list(lifecycle_hooks)
        if not any(h.name == StatsReporterHook.name for h in selected):
            selected.append(StatsReporterHook())
        self.manager = HookManager(
            selected,
            loop="ppo",
            model=policy,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            config=lifecycle_config if lifecycle_config is not None else cfg,
            component_context=self.context,
        )
        if snapshot_every < 0:
            raise ValueError(f"snapshot_every must be >= 0 (0 = never), got {snapshot_every}")
        self.snapshot_every = snapshot_every
        m = self.manager
        self._fire_steps = bool(
            any(m.hooks_at(p) for p in STEP_POINTS) or m.needs_grads or m.needs_prev_step_grads
        )
        self._fire_post_rollout = bool(m.hooks_at(HookPoint.POST_ROLLOUT))
        self._model_data_context: PPOModelDataContext | None = None
        #: True once a rollout and its advantages are in the storage (POST_ROLLOUT)
        self.rollout_ready = False
        #: this epoch's lifecycle metrics (filled by :meth:`fire_epoch_end_points`)
        self.hook_metrics = EpochHookMetrics()

    # ================================================================== the loop
    def train(self) -> TrainerState:
        """Run all epochs; returns the final :class:`TrainerState`."""
        state = self.state
        self.hooks.fire("on_new_training_run", state)
        try:
            if self._next_obs is None:
                self.reset_envs()
            self._start_time = time.perf_counter() - self._trained_time  # resumed: clock goes on
            resuming_update = self.update_progress is not None  # mid-epoch checkpoint
            while (state.epoch < self.num_epochs or resuming_update) and not state.stop_training:
                if not resuming_update:
                    state.epoch += 1
                    self.fire_epoch_start_point()  # PRE_EPOCH
                    self.hooks.fire("on_rollout_start", state)
                    self.collect_rollout()
                    self.fire_rollout_point()  # POST_ROLLOUT
                    self.hooks.fire("on_rollout_end", state)
                resuming_update = False
                self.update()  # PRE_STEP / POST_STEP around every optimizer step
                self.scheduler.step()
                self.hooks.fire("on_train_phase_end", state)
                # EvaluationHook, MetricsHook, which calls fire_epoch_end_points()
                # (POST_EPOCH, SNAPSHOT) and emits the metrics, then CheckpointHook.
                self.hooks.fire("on_epoch_end", state)
                self.fire_epoch_end_points()  # no-op when a callback already fired them
        except BaseException as exc:
            state.error = exc
            raise
        finally:
            self._fire_training_end()
        return state

    def reset_envs(self) -> None:
        """Seed and reset the environments (``train()`` does this on its first call)."""
        self._next_obs, _ = self.envs.reset(seed=self.seed)
        self.envs.action_space.seed(self.seed)
        self._prev_done[:] = False

    # ================================================================== lifecycle hooks
    def model_data_context(self) -> PPOModelDataContext:
        """The :class:`PPOModelDataContext` interventions use (built on first use)."""
        if self._model_data_context is None:
            self._model_data_context = PPOModelDataContext(self)
        return self._model_data_context

    def _hook_epoch(self) -> int:
        return self.state.epoch - 1  # hook epochs count from 0, TrainerState.epoch from 1

    def fire_epoch_start_point(self) -> None:
        """PRE_EPOCH: parameters as the last update left them, before the rollout."""
        state = self.state
        self.hook_metrics = EpochHookMetrics(epoch=state.epoch)
        self.hook_metrics.metrics.update(
            self.manager.fire(
                HookPoint.PRE_EPOCH,
                epoch=self._hook_epoch(),
                step=state.optimizer_step,
                agent_step=state.agent_step,
                model_ctx=self.model_data_context,
            )
        )

    def fire_rollout_point(self) -> None:
        """POST_ROLLOUT: the rollout and its advantages are ready, no update yet."""
        self.rollout_ready = True
        if not self._fire_post_rollout:
            return
        state, st = self.state, self.storage
        observations = st.obs.view(st.num_steps * st.num_envs, -1)[st.valid_indices]
        self.hook_metrics.metrics.update(
            self.manager.fire(
                HookPoint.POST_ROLLOUT,
                epoch=self._hook_epoch(),
                step=state.optimizer_step,
                agent_step=state.agent_step,
                observations=observations,
                stats={f"rollout/{k}": v for k, v in state.rollout_stats.items()},
                model_ctx=self.model_data_context,
            )
        )

    def _fire_step_point(self, point: HookPoint, batch: Minibatch, stats: torch.Tensor) -> None:
        state = self.state
        self.manager.fire(
            point,
            epoch=self._hook_epoch(),
            step=state.optimizer_step,
            agent_step=state.agent_step,
            update_epoch=state.update_epoch,
            minibatch=state.mb_idx,
            batch=batch,
            loss=self.loss_from_stats(stats),
            learning_rate=self.optimizer.param_groups[0]["lr"],
            model_ctx=self.model_data_context,
        )

    def fire_epoch_end_points(self) -> EpochHookMetrics:
        """POST_EPOCH, then SNAPSHOT when due, then the flush of the step-point metrics;
        once per epoch (later calls return the same result).

        Runs after the update phase, the scheduler step and (when MetricsHook calls it
        from ``on_epoch_end``) after EvaluationHook, so ``stats`` holds this epoch's
        ``train/``, ``rollout/``, ``perf/`` and ``eval/`` statistics.
        """
        state, out = self.state, self.hook_metrics
        if out.epoch == state.epoch and out.complete:
            return out
        if out.epoch != state.epoch:  # PRE_EPOCH did not fire (epoch driven by hand)
            out = self.hook_metrics = EpochHookMetrics(epoch=state.epoch)
        epoch = self._hook_epoch()
        common = {
            "epoch": epoch,
            "step": state.optimizer_step,
            "agent_step": state.agent_step,
            "learning_rate": state.loss_stats.get("learning_rate"),
            "model_ctx": self.model_data_context,
        }
        idle = self._only_idle_reporter()
        if not idle:
            out.metrics.update(
                self.manager.fire(HookPoint.POST_EPOCH, stats=epoch_metrics(state), **common)
            )
        if snapshot_due(epoch, self.snapshot_every):
            out.snapshot = {} if idle else self.manager.fire(HookPoint.SNAPSHOT, **common)
            out.metrics.update(out.snapshot)
        flushed = self.manager.flush()
        out.metrics.update(flushed.summary)
        out.steps = {point.value: values for point, values in flushed.by_point.items()}
        out.complete = True
        return out

    def _only_idle_reporter(self) -> bool:
        """No hook selected and no probe attached: the one hook, stats_reporter, would
        report nothing, so its dispatch (~0.15 ms, mostly saving the RNG states) is
        skipped."""
        hooks, ctx = self.manager.hooks, self.context
        return (
            len(hooks) == 1
            and hooks[0].name == StatsReporterHook.name
            and not ctx.model_metrics
            and not ctx.probe_errors
        )

    def _fire_training_end(self) -> None:
        try:
            self.hooks.fire("on_training_end", self.state)
        except Exception:
            if self.state.error is None:
                raise
            # a critical hook failing during cleanup must not hide the original error

    # ================================================================== rollout
    def collect_rollout(self) -> None:
        """Fill the rollout storage with ``num_steps`` steps of every env, then GAE."""
        cfg, st, state = self.cfg, self.storage, self.state
        policy, envs, gen = self.policy, self.envs, self.sample_generator
        n = self.num_envs
        action_shape = (n, *policy.action_shape)
        on_cpu = self.device.type == "cpu"
        self.context.phase = "rollout"
        t0 = time.perf_counter()
        obs = self._next_obs
        actions, logprobs, values = [], [], []
        with torch.inference_mode():
            obs_steps = st.obs.unbind(0)  # views into the storage, one per step
            # On the CPU the env's observations are written straight into the storage's
            # memory through a numpy view (no tensor ops per step).
            obs_host = st.obs.numpy().reshape(cfg.num_steps, *obs.shape) if on_cpu else None
            for step in range(cfg.num_steps):
                if obs_host is not None:
                    obs_host[step] = obs
                else:
                    obs_steps[step].copy_(torch.from_numpy(np.asarray(obs)).view(n, -1))
                if step == 0:
                    # Skip nn.Module hook dispatch while no probe records in this phase
                    # (the default probes record in "train" only); checked once per rollout.
                    forward = policy.rollout_forward(obs_steps[0]) if policy.hooks_idle() else None
                action, logprob, value = policy.act(obs_steps[step], gen, forward=forward)
                actions.append(action)
                logprobs.append(logprob)
                values.append(value)
                # The one host transfer the environment needs.
                env_action = action.numpy() if on_cpu else action.cpu().numpy()
                obs, reward, terminated, truncated, info = envs.step(
                    env_action.reshape(action_shape)
                )
                st.rewards[step] = reward
                st.terminated[step] = terminated
                st.truncated[step] = truncated
                if "episode" in info:
                    done = info["_episode"]
                    self._episode_returns.append(info["episode"]["r"][done])
                    self._episode_lengths.append(info["episode"]["l"][done])
            torch.stack(actions, out=st.actions)
            torch.stack(logprobs, out=st.logprobs)
            torch.stack(values, out=st.values)
            # V(s_T) bootstraps the last step (the final observation if it ended an episode).
            st.next_value.copy_(
                policy.value(torch.from_numpy(np.asarray(obs)).view(n, -1).to(st.obs))
            )
        # What the envs returned enters training only if finite (one read per rollout).
        if not rollout_inputs_finite(st.obs, st.rewards, obs):
            raise NonFiniteInputError(
                describe_nonfinite_input(
                    st.obs,
                    st.rewards,
                    obs,
                    epoch=state.epoch,
                    agent_step=state.agent_step,
                    last_checkpoint=state.last_checkpoint,
                    normalized=find_wrapper(envs, vw.NormalizeObservation) is not None,
                )
            )
        # The step after an episode end is the autoreset step: not a transition.
        dones = st.terminated | st.truncated
        st.valid[0] = ~self._prev_done
        st.valid[1:] = ~dones[:-1]
        self._next_obs, self._prev_done = obs, dones[-1].copy()
        st.compute_returns(cfg.gamma, cfg.gae_lambda)
        state.agent_step += self.batch_size
        elapsed = time.perf_counter() - t0
        state.rollout_stats = self._episode_stats()
        state.rollout_stats["rollout_sps"] = self.batch_size / max(elapsed, 1e-9)
        state.rollout_stats["valid_fraction"] = st.size / self.batch_size

    def _episode_stats(self) -> dict[str, float]:
        """Mean return and length of the episodes that ended during this rollout."""
        if not self._episode_returns:
            return {"episodes": 0.0}
        r = np.concatenate(self._episode_returns).astype(np.float64)
        ln = np.concatenate(self._episode_lengths).astype(np.float64)
        self._episode_returns.clear()
        self._episode_lengths.clear()
        return {
            "episodes": float(r.size),
            "episode_return": float(r.mean()),
            "episode_return_max": float(r.max()),
            "episode_return_min": float(r.min()),
            "episode_length": float(ln.mean()),
        }

    # ================================================================== update
    def update(self) -> None:
        """``update_epochs`` passes over the rollout in shuffled minibatches."""
        cfg, state = self.cfg, self.state
        t0 = time.perf_counter()
        self.context.phase = "train"
        if self.update_progress is None:  # else: resumed in the middle of this phase
            self.update_progress = UpdateProgress(
                learning_rate=self.optimizer.param_groups[0]["lr"],
                sums=torch.zeros(len(LOSS_STATS) + 1, device=self.device),
            )
        p = self.update_progress
        # Every minibatch's statistics (device tensors, no sync) and where it ran, to find
        # non-finite losses once per epoch without a per-step host transfer.
        step_stats: list[torch.Tensor] = []
        step_where: list[tuple[int, int, int]] = []
        while p.update_epoch < cfg.update_epochs:
            state.update_epoch = p.update_epoch
            if p.order is None:
                p.order = self.storage.shuffled_order(self.shuffle_generator)
            batches = self.storage.minibatches(p.order, cfg.num_minibatches)
            first = p.next_minibatch  # > 0 only when resumed mid-phase
            for mb_idx, batch in enumerate(itertools.islice(batches, first, None), first):
                state.mb_idx = mb_idx
                stats = self.train_minibatch(batch, fire_hooks=self._fire_steps)
                step_stats.append(stats)
                step_where.append((p.update_epoch, mb_idx, state.optimizer_step))
                p.sums += stats
                p.steps += 1
                p.next_minibatch, p.last_stats = mb_idx + 1, stats
                state.optimizer_step += 1
                # a minibatch boundary: run control may checkpoint, pause or stop here
                self.hooks.fire("on_mb_end", state)
            p.update_epochs_run += 1
            p.update_epoch, p.order, p.next_minibatch = p.update_epoch + 1, None, 0
            if self.kl_exceeds_target(p.last_stats):
                break
        self.update_progress = None
        # [count, index of the first] of the minibatches whose loss is NaN or infinite
        if step_stats:
            bad = ~torch.isfinite(self.loss_from_stats(torch.stack(step_stats, 1)))
            first = torch.where(bad.any(), bad.to(torch.uint8).argmax(), -1)
            nonfinite = torch.stack([bad.sum(), first]).to(p.sums.dtype)
        else:  # resumed from a checkpoint taken after the last minibatch
            nonfinite = torch.tensor([0.0, -1.0], dtype=p.sums.dtype, device=p.sums.device)
        # the one transfer of the update phase
        *means, bad_steps, first_bad = torch.cat([p.sums / max(p.steps, 1), nonfinite]).tolist()
        loss_stats = dict(zip((*LOSS_STATS, "grad_norm"), means, strict=True))
        loss_stats["nonfinite_loss_steps"] = bad_steps
        if bad_steps:
            update_epoch, minibatch, step = step_where[int(first_bad)]
            log.warning(
                "non-finite loss at epoch %d, update epoch %d, minibatch %d (step %d); "
                "%d of this epoch's %d optimizer steps had a non-finite loss",
                state.epoch,
                update_epoch,
                minibatch,
                step,
                int(bad_steps),
                len(step_stats),
            )
        loss_stats["explained_variance"] = self.storage.explained_variance()
        loss_stats["learning_rate"] = p.learning_rate
        loss_stats["update_epochs_run"] = float(p.update_epochs_run)
        loss_stats["batch_size"] = float(self.storage.size)
        state.loss_stats = loss_stats
        self._trained_time = time.perf_counter() - self._start_time
        state.rollout_stats["sps"] = state.agent_step / max(self._trained_time, 1e-9)
        state.rollout_stats["update_seconds"] = time.perf_counter() - t0

    def train_minibatch(self, batch: Minibatch, *, fire_hooks: bool = False) -> torch.Tensor:
        """One optimizer step on ``batch``; returns its statistics (device tensor,
        :data:`LOSS_STATS` then the pre-clip gradient norm).

        With ``fire_hooks`` the lifecycle points PRE_STEP (gradients of every
        micro-batch accumulated, before clipping) and POST_STEP (right after
        ``optimizer.step()``) fire around the step.
        """
        stats = self.accumulate_gradients(batch, sync=True)
        if fire_hooks:
            self._fire_step_point(HookPoint.PRE_STEP, batch, stats)
        grad_norm = self.clip_and_step()
        if fire_hooks:
            self._fire_step_point(HookPoint.POST_STEP, batch, stats)
        return torch.cat([stats, grad_norm.detach().reshape(1).to(stats)])

    def minibatch_loss(
        self, batch: Minibatch, policy: ActorCriticPolicy | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`ppo_loss` on ``batch`` with the trainer's advantage normalisation, in
        one pass (no micro-batches): the loss the update minimises on that minibatch."""
        if self.cfg.norm_adv:
            batch = normalize_advantages(batch)
        return ppo_loss(self.policy if policy is None else policy, batch, self.cfg)

    #: DistributedDataParallel around :class:`EvaluateActions` of the policy in a
    #: multi-process run (:meth:`wrap_ddp`); None in a single process
    ddp: DistributedDataParallel | None = None

    def wrap_ddp(self, device_ids: list[int] | None = None) -> DistributedDataParallel:
        """Average the loop's gradients over the processes of the default group.

        Wraps :class:`EvaluateActions` of the policy in DistributedDataParallel (which
        broadcasts rank 0's parameters, so every rank starts from the same policy). The
        policy, its probes, the optimizer and the lifecycle hooks keep using the plain
        module; only :meth:`accumulate_gradients` with ``sync=True`` (the loop's own
        step) goes through DDP. Call it on every rank before :meth:`train`.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "wrap_ddp() needs an initialised torch.distributed process group; launch with "
                "torchrun (trainers.distributed.DistributedRun creates the group)"
            )
        # no buffer broadcast before every forward: the policy has no buffers to keep equal
        self.ddp = DistributedDataParallel(
            EvaluateActions(self.policy), device_ids=device_ids, forward_sync_buffers=False
        )
        return self.ddp

    def accumulate_gradients(self, batch: Minibatch, *, sync: bool = False) -> torch.Tensor:
        """``zero_grad`` then backward of the PPO loss on ``batch``; returns the loss
        statistics (:data:`LOSS_STATS`, a device tensor).

        With ``micro_batches = k`` the minibatch is split into k micro-batches whose
        gradients accumulate: each backpropagates ``loss * (micro_size / minibatch_size)``
        and ``context.loss_scale`` holds that factor while it runs (the Fisher probe
        divides it out to recover per-sample gradients).

        ``sync=True`` (the training loop's step) averages the gradients over all ranks
        through DDP when :meth:`wrap_ddp` was called: micro-batches run under
        ``no_sync()`` except the last, whose backward all-reduces the accumulated
        gradients once. Lifecycle interventions call it with ``sync=False``; their extra
        passes run on rank 0 alone and must not wait for the other ranks.
        """
        cfg = self.cfg
        ddp = self.ddp if sync else None
        if cfg.norm_adv:
            batch = normalize_advantages(batch)
        # optimizer.zero_grad(set_to_none=True) without its profiler and foreach bookkeeping
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        if cfg.micro_batches == 1:
            loss, stats = ppo_loss(self.policy, batch, cfg, evaluate=ddp)
            loss.backward()
            return self._mean_stats_over_ranks(stats, ddp)
        micro = batch.split(cfg.micro_batches)
        n = len(batch)
        stats = torch.zeros(len(LOSS_STATS), device=self.device)
        try:
            for i, part in enumerate(micro):
                scale = len(part) / n
                self.context.loss_scale = scale
                last = i == len(micro) - 1
                with ddp.no_sync() if ddp is not None and not last else nullcontext():
                    loss, part_stats = ppo_loss(self.policy, part, cfg, evaluate=ddp)
                    (loss * scale if scale != 1.0 else loss).backward()
                stats += part_stats * scale
        finally:
            self.context.loss_scale = 1.0
        return self._mean_stats_over_ranks(stats, ddp)

    def _mean_stats_over_ranks(
        self, stats: torch.Tensor, ddp: DistributedDataParallel | None
    ) -> torch.Tensor:
        """``stats`` averaged over the ranks when the target-KL early stop needs it."""
        if ddp is not None and self.cfg.target_kl is not None:
            # the target-KL early stop must be the same decision on every rank
            dist.all_reduce(stats)
            stats /= dist.get_world_size()
        return stats

    def kl_exceeds_target(self, stats: torch.Tensor) -> bool:
        """Target-KL early stop: the last minibatch's approx_kl is above ``target_kl``
        (one host sync per update epoch, only when ``target_kl`` is set)."""
        target = self.cfg.target_kl
        return target is not None and float(stats[LOSS_STATS.index("approx_kl")]) > target

    def loss_from_stats(self, stats: torch.Tensor) -> torch.Tensor:
        """The minibatch loss recomposed from its statistics, as :func:`ppo_loss` composes
        it (so the loop computes no extra tensor when no hook wants the loss)."""
        i = LOSS_STATS.index
        cfg = self.cfg
        return (
            stats[i("policy_loss")]
            - cfg.ent_coef * stats[i("entropy")]
            + cfg.vf_coef * stats[i("value_loss")]
        )

    def clip_and_step(self, step: bool = True) -> torch.Tensor:
        """Global gradient-norm clipping of the optimizer's parameters, then
        ``optimizer.step()`` (when ``step``); returns the gradient norm before clipping
        (device tensor)."""
        cfg = self.cfg
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm is not None else math.inf
        # the optimizer's parameters: the policy's (a listing of param_groups costs a
        # twentieth of policy.parameters())
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)
        if step:
            self.optimizer.step()
        return grad_norm

    # ================================================================== state
    def normalization_state(self) -> dict[str, Any]:
        """Running statistics of the observation/reward normalisation wrappers (tensors)."""
        out: dict[str, Any] = {}
        obs_norm = find_wrapper(self.envs, vw.NormalizeObservation)
        if obs_norm is not None:
            rms = obs_norm.obs_rms
            out["obs_rms"] = {
                "mean": torch.as_tensor(np.asarray(rms.mean, dtype=np.float64)),
                "var": torch.as_tensor(np.asarray(rms.var, dtype=np.float64)),
                "count": float(rms.count),
            }
        rew_norm = find_wrapper(self.envs, vw.NormalizeReward)
        if rew_norm is not None:
            rms = rew_norm.return_rms
            out["return_rms"] = {
                "mean": torch.as_tensor(np.asarray(rms.mean, dtype=np.float64)),
                "var": torch.as_tensor(np.asarray(rms.var, dtype=np.float64)),
                "count": float(rms.count),
            }
        return out

    def load_normalization_state(self, state: dict[str, Any]) -> None:
        for key, cls, attr in (
            ("obs_rms", vw.NormalizeObservation, "obs_rms"),
            ("return_rms", vw.NormalizeReward, "return_rms"),
        ):
            wrapper = find_wrapper(self.envs, cls)
            if key in state and wrapper is not None:
                rms = getattr(wrapper, attr)
                rms.mean = state[key]["mean"].numpy().astype(np.asarray(rms.mean).dtype)
                rms.var = state[key]["var"].numpy().astype(np.asarray(rms.var).dtype)
                rms.count = state[key]["count"]
