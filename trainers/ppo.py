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

Per-step statistics stay on the device and are transferred once per epoch.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
from gymnasium.wrappers import vector as vw
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from policy_probes.run import Run
from policy_probes.session import ProbeSession
from trainers.callbacks import CallbackList, TrainerHook, TrainerState
from trainers.config import PPOConfig
from trainers.env_state import EnvStateError, capture_env_state, restore_env_state
from trainers.envs import find_wrapper
from trainers.model_context import PPOModelDataContext
from trainers.nonfinite_guard import (
    NonFiniteInputError,
    describe_nonfinite_input,
    rollout_inputs_finite,
)
from trainers.policy import ActorCriticPolicy
from trainers.rollout import Minibatch, RolloutStorage

log = logging.getLogger("trainers")

#: the loop type lifecycle hooks see (``loop_points``)
LOOP = "ppo"
#: the first segments of the keys this loop writes into a record (``epoch_statistics``)
METRIC_NAMESPACES = ("train", "rollout", "perf", "eval", "trainer")

#: order of the statistics that ppo_loss returns stacked in one tensor
LOSS_STATS = ("policy_loss", "value_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac")
#: rollout statistics reported as ``rollout/*`` and ``perf/*``
ROLLOUT_KEYS = (
    "episode_return",
    "episode_length",
    "episodes",
    "episode_return_max",
    "episode_return_min",
    "valid_fraction",
)
PERF_KEYS = ("sps", "rollout_sps", "update_seconds")
#: wrapper attribute (also the state key) -> wrapper class of the running statistics a
#: checkpoint keeps
NORMALIZATION_WRAPPERS = {"obs_rms": vw.NormalizeObservation, "return_rms": vw.NormalizeReward}


def normalize_advantages(batch: Minibatch) -> Minibatch:
    """Advantages rescaled to mean 0, std 1 within the minibatch (before micro-batching)."""
    adv = batch.advantages
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    return Minibatch(batch.obs, batch.actions, batch.logprobs, batch.values, adv, batch.returns)


class EvaluateActions(nn.Module):
    """``policy.evaluate_actions`` as a module's ``forward``: DistributedDataParallel
    averages gradients only for passes through the forward of the module it wraps
    (:meth:`PPOTrainer.wrap_ddp`). Probes stay on the policy's components, called unchanged."""

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
    """The PPO loss on ``batch`` (advantages used as given; a mean over its samples) and
    its statistics, a detached 1-D tensor ordered as :data:`LOSS_STATS`. ``evaluate``
    replaces ``policy.evaluate_actions`` (DDP-wrapped or compiled :class:`EvaluateActions`).
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
        stats = torch.stack([pg_loss, v_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac])
    return loss, stats


#: DDP's switch for the buffer broadcast before every forward (``broadcast_buffers`` before
#: torch 2.13)
NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


def check_rollout_size(cfg: PPOConfig, batch: int) -> None:
    """Refuse a run shorter than one rollout of ``batch`` samples, or a rollout too small
    for its minibatches of micro-batches of at least 2 samples."""
    if cfg.total_timesteps < batch:
        raise ValueError(
            f"trainer.total_timesteps={cfg.total_timesteps} is smaller than one rollout "
            f"(env.num_envs * trainer.num_steps = {batch}); raise total_timesteps or lower "
            f"num_steps / num_envs"
        )
    if cfg.num_minibatches > batch:
        raise ValueError(
            f"trainer.num_minibatches={cfg.num_minibatches} is larger than the rollout batch "
            f"(env.num_envs * trainer.num_steps = {batch}): the minibatch would be larger "
            f"than the batch; lower num_minibatches"
        )
    if batch // cfg.num_minibatches < 2 * cfg.micro_batches:
        raise ValueError(
            f"minibatches of {batch // cfg.num_minibatches} samples cannot be split into "
            f"trainer.micro_batches={cfg.micro_batches} micro-batches of at least 2 samples; "
            f"lower micro_batches or num_minibatches"
        )


def learning_rate_factor(anneal: bool, num_epochs: int) -> Callable[[int], float]:
    """The scheduler's factor: epoch i (1-based) trains with lr * (1 - (i - 1) / num_epochs)
    when annealing, else lr."""
    return lambda done_epochs: 1.0 - done_epochs / num_epochs if anneal else 1.0


def compiled_evaluate(policy: ActorCriticPolicy, cfg: PPOConfig) -> Callable[..., Any] | None:
    """``policy.evaluate_actions`` under ``torch.compile`` (``trainer.compile``), or None."""
    if not cfg.compile:
        return None
    mode = None if cfg.compile_mode == "default" else cfg.compile_mode
    return torch.compile(EvaluateActions(policy), backend=cfg.compile_backend, mode=mode)


@dataclass
class UpdateProgress:
    """Where the update phase of the current epoch stands (running sums of the loss
    statistics, update epoch, its minibatch order, next minibatch); a mid-epoch checkpoint
    saves it, so a resumed run trains on exactly the remaining minibatches."""

    learning_rate: float
    sums: torch.Tensor
    update_epoch: int = 0
    next_minibatch: int = 0
    order: torch.Tensor | None = None
    steps: int = 0
    update_epochs_run: int = 0
    last_stats: torch.Tensor | None = None
    #: (statistics, (update epoch, minibatch, step)) of every minibatch run in the phase
    #: (not checkpointed): non-finite losses are located once per epoch, not per step
    ran: list[tuple[torch.Tensor, tuple[int, int, int]]] = field(default_factory=list)

    def minibatches(
        self, storage: Any, cfg: PPOConfig, generator: torch.Generator
    ) -> Iterator[tuple[int, Minibatch]]:
        """``(index, minibatch)`` of this update epoch from :attr:`next_minibatch` on (> 0
        only when resumed mid-phase), in an order drawn once per update epoch."""
        if self.order is None:
            self.order = storage.shuffled_order(generator)
        batches = storage.minibatches(self.order, cfg.num_minibatches)
        first = self.next_minibatch
        return enumerate(itertools.islice(batches, first, None), first)

    def minibatch_done(self, index: int, stats: torch.Tensor, step: int) -> None:
        self.sums += stats
        self.steps += 1
        self.next_minibatch, self.last_stats = index + 1, stats
        self.ran.append((stats, (self.update_epoch, index, step)))

    def update_epoch_done(self) -> None:
        self.update_epochs_run += 1
        self.update_epoch, self.order, self.next_minibatch = self.update_epoch + 1, None, 0

    def summary(self, loss_from_stats: Callable, epoch: int) -> dict[str, float]:
        """The phase's mean statistics (:data:`LOSS_STATS`, ``grad_norm``) and
        ``nonfinite_loss_steps`` in one host transfer, warning where the first non-finite
        loss was."""
        sums = self.sums
        if self.ran:  # [count, index of the first] of the non-finite losses
            bad = ~torch.isfinite(loss_from_stats(torch.stack([s for s, _ in self.ran], 1)))
            first = torch.where(bad.any(), bad.to(torch.uint8).argmax(), -1)
            nonfinite = torch.stack([bad.sum(), first]).to(sums.dtype)
        else:  # resumed from a checkpoint taken after the last minibatch
            nonfinite = torch.tensor([0.0, -1.0], dtype=sums.dtype, device=sums.device)
        *means, bad_steps, first_bad = torch.cat([sums / max(self.steps, 1), nonfinite]).tolist()
        out = dict(zip((*LOSS_STATS, "grad_norm"), means, strict=True))
        out["nonfinite_loss_steps"] = bad_steps
        if bad_steps:
            update_epoch, minibatch, step = self.ran[int(first_bad)][1]
            log.warning(
                f"non-finite loss at epoch {epoch}, update epoch {update_epoch}, minibatch "
                f"{minibatch} (step {step}); {int(bad_steps)} of this epoch's {len(self.ran)} "
                f"optimizer steps had a non-finite loss"
            )
        return out


class PPOTrainer:
    """The PPO loop over a gymnasium vector env and an :class:`ActorCriticPolicy`. One
    *epoch* is one rollout of ``num_steps`` x ``num_envs`` steps, then ``update_epochs``
    passes of ``num_minibatches`` minibatches over it.

    Probes, lifecycle hooks and sinks reach the loop through ``session`` (a
    :class:`~policy_probes.session.ProbeSession` on ``policy``, driven with the calls of
    ``docs/external.md``); without one the trainer makes one that writes nothing (the
    records are only returned, in ``state.metrics``).
    """

    def __init__(
        self,
        envs: gym.vector.VectorEnv,
        policy: ActorCriticPolicy,
        cfg: PPOConfig,
        *,
        session: ProbeSession | None = None,
        hooks: Iterable[TrainerHook] = (),
        device: torch.device | str = "cpu",
        seed: int = 0,
    ) -> None:
        self.envs, self.policy, self.cfg = envs, policy, cfg
        if session is None:  # a run that writes nothing
            session = ProbeSession(policy, run=Run(main=False), loop=LOOP)
        self.session = session
        self.context = session.context
        self.hooks = hooks if isinstance(hooks, CallbackList) else CallbackList(hooks)
        self.device = torch.device(device)
        self.seed = seed
        self.num_envs = envs.num_envs
        self.batch_size = self.num_envs * cfg.num_steps
        self.num_epochs = cfg.total_timesteps // self.batch_size
        check_rollout_size(cfg, self.batch_size)
        # fused: one kernel per step for all parameters (same Adam update)
        self.optimizer = torch.optim.Adam(
            policy.parameters(),
            lr=cfg.learning_rate,
            eps=cfg.adam_eps,
            betas=tuple(cfg.adam_betas),
            fused=True,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, learning_rate_factor(cfg.anneal_lr, self.num_epochs)
        )
        #: the update's forward under torch.compile (trainer.compile); None: eager
        self.compiled_evaluate = compiled_evaluate(policy, cfg)
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
            config=session.config,
            run_dir=session.run.dir if session.run.main else None,
            num_epochs=self.num_epochs,
        )
        #: the observation the next rollout starts from and which envs just finished
        self.next_obs: np.ndarray | None = None
        self.prev_done = np.zeros(self.num_envs, dtype=bool)
        #: returns and lengths of the episodes that ended in the rollout under way
        self.episode_returns: list[np.ndarray] = []
        self.episode_lengths: list[np.ndarray] = []
        #: seconds of training so far (rollouts and updates; pauses excluded)
        self.trained_seconds = 0.0
        self._clock_start = 0.0
        #: the update phase under way (also restored from a mid-epoch checkpoint)
        self.update_progress: UpdateProgress | None = None
        #: True once a rollout and its advantages are in the storage (POST_ROLLOUT)
        self.rollout_ready = False
        self._model_data_context: PPOModelDataContext | None = None
        session.bind(
            self.optimizer, scheduler=self.scheduler, model_context=self.model_data_context
        )
        self._fire_steps = session.wants_steps  # else one bool check per step

    # ================================================================== the loop
    def train(self) -> TrainerState:
        """Run all epochs; returns the final :class:`TrainerState`."""
        state, session = self.state, self.session
        self.hooks.on_new_training_run(state)
        try:
            if self.next_obs is None:
                self.reset_envs()
            self._clock_start = time.perf_counter() - self.trained_seconds  # resumed: goes on
            resuming_update = self.update_progress is not None  # mid-epoch checkpoint
            while (state.epoch < self.num_epochs or resuming_update) and not state.stop_training:
                if not resuming_update:
                    state.epoch += 1
                    session.optimizer_step = state.optimizer_step
                    session.epoch_start(agent_step=state.agent_step)  # PRE_EPOCH
                    self.hooks.on_rollout_start(state)
                    session.set_phase("rollout")
                    self.collect_rollout()  # rollout and GAE
                    self.rollout_end()  # the probes' and hooks' POST_ROLLOUT
                    self.hooks.on_rollout_end(state)
                resuming_update = False
                session.set_phase("train")
                self.update()  # the minibatch loop; PRE_STEP / POST_STEP around each step
                self.scheduler.step()
                self.hooks.on_train_phase_end(state)  # evaluation, rank statistics
                session.optimizer_step = state.optimizer_step
                # POST_EPOCH, SNAPSHOT and the epoch's records (docs/trainer.md)
                state.metrics = session.epoch_end(state.agent_step, **self.epoch_statistics())
                state.probe_metrics = {
                    k: v for k, v in state.metrics.items() if k.startswith("probes/")
                }
                self.hooks.on_epoch_end(state)  # checkpoints, progress, run control
        except BaseException as exc:
            state.error = exc
            raise
        finally:
            self._fire_training_end()
        return state

    def reset_envs(self) -> None:
        """Seed and reset the environments (``train()`` does this on its first call)."""
        self.next_obs, _ = self.envs.reset(seed=self.seed)
        self.envs.action_space.seed(self.seed)
        self.prev_done[:] = False

    def rollout_end(self) -> None:
        """The rollout and its advantages are ready, no update yet: the session's
        ``rollout_end`` (the rollout's observations when a probe or hook reads them)."""
        session, state = self.session, self.state
        observations = self.storage.valid_observations() if session.wants_observations else None
        stats = {f"rollout/{k}": v for k, v in state.rollout_stats.items()}
        session.rollout_end(observations=observations, agent_step=state.agent_step, stats=stats)

    def epoch_statistics(self) -> dict[str, Any]:
        """The trainer's own statistics of the epoch as ``section/name`` keys: ``train/*``
        (losses, KL, clipfrac, explained variance, learning rate, grad norm),
        ``rollout/*`` (episodes that ended in the rollout), ``perf/*`` (SPS), ``eval/*``
        (epochs with an evaluation) and ``trainer/hook_errors``."""
        state, rs = self.state, self.state.rollout_stats
        out: dict[str, Any] = {f"train/{k}": v for k, v in state.loss_stats.items()}
        out.update({f"rollout/{k}": rs[k] for k in ROLLOUT_KEYS if k in rs})
        out.update({f"perf/{k}": rs[k] for k in PERF_KEYS if k in rs})
        if state.eval_scores.get("epoch") == float(state.epoch):
            out.update({f"eval/{k}": v for k, v in state.eval_scores.items() if k != "epoch"})
        if state.hook_errors:
            out["trainer/hook_errors"] = float(len(state.hook_errors))
        return out

    def exclude_from_clock(self, seconds: float) -> None:
        """Leave ``seconds`` (a pause) out of the training time, so ``perf/sps`` stays
        the speed of training."""
        self._clock_start += seconds

    # ================================================================== lifecycle hooks
    def model_data_context(self) -> PPOModelDataContext:
        """The :class:`PPOModelDataContext` interventions use (built on first use)."""
        if self._model_data_context is None:
            self._model_data_context = PPOModelDataContext(self)
        return self._model_data_context

    def _step_fields(self, batch: Minibatch, stats: torch.Tensor) -> dict[str, Any]:
        state = self.state
        return {
            "batch": batch,
            "loss": self.loss_from_stats(stats),
            "step": state.optimizer_step,
            "agent_step": state.agent_step,
            "update_epoch": state.update_epoch,
            "minibatch": state.mb_idx,
            "learning_rate": self.optimizer.param_groups[0]["lr"],
        }

    def _fire_training_end(self) -> None:
        try:
            self.session.sinks.flush()
            self.hooks.on_training_end(self.state)
        except Exception:
            if self.state.error is None:
                raise
            # (a critical hook failing during cleanup must not hide the original error)

    # ================================================================== rollout
    def collect_rollout(self) -> None:
        """Fill the rollout storage with ``num_steps`` steps of every env, then GAE."""
        cfg, st, state = self.cfg, self.storage, self.state
        policy, envs, gen = self.policy, self.envs, self.sample_generator
        n = self.num_envs
        action_shape = (n, *policy.action_shape)
        on_cpu = self.device.type == "cpu"
        t0 = time.perf_counter()
        obs = self.next_obs
        actions, logprobs, values = [], [], []
        with torch.inference_mode():
            obs_steps = st.obs.unbind(0)  # views into the storage, one per step
            # on the CPU the observations go straight into the storage through a numpy view
            obs_host = st.obs.numpy().reshape(cfg.num_steps, *obs.shape) if on_cpu else None
            for step in range(cfg.num_steps):
                if obs_host is not None:
                    obs_host[step] = obs
                else:
                    obs_steps[step].copy_(torch.from_numpy(np.asarray(obs)).view(n, -1))
                if step == 0:
                    # no nn.Module hook dispatch while no probe records in this phase
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
                    self.episode_returns.append(info["episode"]["r"][done])
                    self.episode_lengths.append(info["episode"]["l"][done])
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
        st.valid[0] = ~self.prev_done
        st.valid[1:] = ~dones[:-1]
        self.next_obs, self.prev_done = obs, dones[-1].copy()
        st.compute_returns(cfg.gamma, cfg.gae_lambda)  # GAE
        self.rollout_ready = True
        state.agent_step += self.batch_size
        elapsed = time.perf_counter() - t0
        state.rollout_stats = self._episode_stats()
        state.rollout_stats["rollout_sps"] = self.batch_size / max(elapsed, 1e-9)
        state.rollout_stats["valid_fraction"] = st.size / self.batch_size

    def _episode_stats(self) -> dict[str, float]:
        """Mean return and length of the episodes that ended during this rollout."""
        if not self.episode_returns:
            return {"episodes": 0.0}
        r = np.concatenate(self.episode_returns).astype(np.float64)
        ln = np.concatenate(self.episode_lengths).astype(np.float64)
        self.episode_returns.clear()
        self.episode_lengths.clear()
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
        if self.update_progress is None:  # else: resumed in the middle of this phase
            self.update_progress = UpdateProgress(
                learning_rate=self.optimizer.param_groups[0]["lr"],
                sums=torch.zeros(len(LOSS_STATS) + 1, device=self.device),
            )
        p = self.update_progress
        while p.update_epoch < cfg.update_epochs:
            state.update_epoch = p.update_epoch
            for mb_idx, batch in p.minibatches(self.storage, cfg, self.shuffle_generator):
                state.mb_idx = mb_idx
                stats = self.train_minibatch(batch, step_points=self._fire_steps)
                p.minibatch_done(mb_idx, stats, state.optimizer_step)
                state.optimizer_step += 1
                # a minibatch boundary: run control may checkpoint, pause or stop here
                self.hooks.on_mb_end(state)
            p.update_epoch_done()
            if self.kl_exceeds_target(p.last_stats):
                break
        self.update_progress = None
        loss_stats = p.summary(self.loss_from_stats, state.epoch)
        # explained variance and the value targets' scale (one transfer)
        loss_stats.update(self.storage.value_statistics())
        loss_stats["learning_rate"] = p.learning_rate
        loss_stats["update_epochs_run"] = float(p.update_epochs_run)
        loss_stats["batch_size"] = float(self.storage.size)
        state.loss_stats = loss_stats
        self.trained_seconds = time.perf_counter() - self._clock_start
        state.rollout_stats["sps"] = state.agent_step / max(self.trained_seconds, 1e-9)
        state.rollout_stats["update_seconds"] = time.perf_counter() - t0

    def train_minibatch(self, batch: Minibatch, *, step_points: bool = False) -> torch.Tensor:
        """One optimizer step on ``batch``; returns its statistics (device tensor,
        :data:`LOSS_STATS` then the pre-clip gradient norm). ``step_points``: fire
        PRE_STEP and POST_STEP around the optimizer step (the loop's own steps)."""
        # zero_grad, loss, backward (micro-batches, DDP all-reduce)
        stats = self.accumulate_gradients(batch, sync=True)
        if step_points:
            self.session.pre_step(**self._step_fields(batch, stats))
        grad_norm = self.clip_and_step()  # global norm clipping, optimizer.step()
        if step_points:
            self.session.post_step(**self._step_fields(batch, stats))
        return torch.cat([stats, grad_norm.detach().reshape(1).to(stats)])

    def minibatch_loss(
        self, batch: Minibatch, policy: ActorCriticPolicy | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`ppo_loss` on ``batch`` with the trainer's advantage normalisation, in
        one pass (no micro-batches)."""
        if self.cfg.norm_adv:
            batch = normalize_advantages(batch)
        return ppo_loss(self.policy if policy is None else policy, batch, self.cfg)

    #: DDP around :class:`EvaluateActions` of the policy (:meth:`wrap_ddp`); None alone
    ddp: DistributedDataParallel | None = None

    def wrap_ddp(self, device_ids: list[int] | None = None) -> DistributedDataParallel:
        """Average the loop's gradients over the processes of the default group: wraps
        :class:`EvaluateActions` in DDP (which broadcasts rank 0's parameters). Only
        :meth:`accumulate_gradients` with ``sync=True`` goes through DDP; the probes,
        optimizer and lifecycle hooks use the plain policy. Call it on every rank before
        :meth:`train`."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "wrap_ddp() needs an initialised torch.distributed process group; launch with "
                "torchrun (trainers.distributed.DistributedRun creates the group)"
            )
        # no buffer broadcast before every forward: the policy has no buffers to keep equal
        self.ddp = DistributedDataParallel(
            EvaluateActions(self.policy), device_ids=device_ids, **NO_FORWARD_BUFFER_SYNC
        )
        return self.ddp

    def accumulate_gradients(self, batch: Minibatch, *, sync: bool = False) -> torch.Tensor:
        """``zero_grad`` then backward of the PPO loss on ``batch``; returns the loss
        statistics (:data:`LOSS_STATS`, a device tensor).

        With ``micro_batches = k`` the k micro-batches' gradients accumulate: each
        backpropagates ``loss * (micro_size / minibatch_size)``, the factor that
        ``context.loss_scale`` holds meanwhile (the Fisher probe divides it out).
        ``sync=True`` (the loop's step) averages the gradients over the ranks through DDP
        (one all-reduce, in the last micro-batch's backward); lifecycle interventions use
        ``sync=False``: their passes run on rank 0 alone.
        """
        cfg = self.cfg
        ddp = self.ddp if sync else None
        evaluate = ddp if ddp is not None else self.compiled_evaluate
        if cfg.norm_adv:
            batch = normalize_advantages(batch)
        # optimizer.zero_grad(set_to_none=True) without its bookkeeping
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        if cfg.micro_batches == 1:
            loss, stats = ppo_loss(self.policy, batch, cfg, evaluate=evaluate)
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
                    loss, part_stats = ppo_loss(self.policy, part, cfg, evaluate=evaluate)
                    (loss * scale if scale != 1.0 else loss).backward()
                stats += part_stats * scale
        finally:
            self.context.loss_scale = 1.0
        return self._mean_stats_over_ranks(stats, ddp)

    def _mean_stats_over_ranks(
        self, stats: torch.Tensor, ddp: DistributedDataParallel | None
    ) -> torch.Tensor:
        """``stats`` averaged over the ranks when the target-KL early stop needs it (the
        same decision on every rank)."""
        if ddp is not None and self.cfg.target_kl is not None:
            dist.all_reduce(stats)
            stats /= dist.get_world_size()
        return stats

    def kl_exceeds_target(self, stats: torch.Tensor) -> bool:
        """Target-KL early stop: the last minibatch's approx_kl is above ``target_kl``
        (one host sync per update epoch, only when ``target_kl`` is set)."""
        target = self.cfg.target_kl
        return target is not None and float(stats[LOSS_STATS.index("approx_kl")]) > target

    def loss_from_stats(self, stats: torch.Tensor) -> torch.Tensor:
        """The minibatch loss recomposed from its statistics as :func:`ppo_loss` composes it
        (the loop computes no extra tensor when no hook wants the loss)."""
        policy_loss, value_loss, entropy = stats[:3]  # LOSS_STATS order
        return policy_loss - self.cfg.ent_coef * entropy + self.cfg.vf_coef * value_loss

    def clip_and_step(self, step: bool = True) -> torch.Tensor:
        """Global gradient-norm clipping of the optimizer's parameters, then
        ``optimizer.step()`` (when ``step``); returns the pre-clip norm (device tensor)."""
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else math.inf
        # the policy's parameters (param_groups lists them faster than policy.parameters())
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)
        if step:
            self.optimizer.step()
        return grad_norm

    # ================================================================== state
    def normalization_state(self) -> dict[str, Any]:
        """Running statistics of the observation/reward normalisation wrappers (tensors)."""
        out: dict[str, Any] = {}
        for key, cls in NORMALIZATION_WRAPPERS.items():
            wrapper = find_wrapper(self.envs, cls)
            if wrapper is not None:
                rms = getattr(wrapper, key)
                out[key] = {
                    "mean": torch.as_tensor(np.asarray(rms.mean, dtype=np.float64)),
                    "var": torch.as_tensor(np.asarray(rms.var, dtype=np.float64)),
                    "count": float(rms.count),
                }
        return out

    def load_normalization_state(self, state: dict[str, Any]) -> None:
        for key, cls in NORMALIZATION_WRAPPERS.items():
            wrapper = find_wrapper(self.envs, cls)
            if key in state and wrapper is not None:
                rms = getattr(wrapper, key)
                for stat in ("mean", "var"):
                    dtype = np.asarray(getattr(rms, stat)).dtype
                    setattr(rms, stat, state[key][stat].numpy().astype(dtype))
                rms.count = state[key]["count"]

    def state_dict(self) -> dict[str, Any]:
        """Everything an exact continuation of this run needs except the process-wide RNGs
        (a checkpoint adds those; its layout: :mod:`trainers.checkpoint`), as tensors,
        numpy arrays and plain containers. ``mid_epoch`` (None at an epoch boundary) holds
        the update phase's position, the rollout storage and its statistics."""
        s = self.state
        try:
            env: dict[str, Any] = {"state": capture_env_state(self.envs), "reason": None}
        except EnvStateError as exc:
            env = {"state": None, "reason": str(exc)}
        mid = None
        if (p := self.update_progress) is not None:
            mid = {
                "update": {k: v for k, v in vars(p).items() if k != "ran"},
                "storage": self.storage.state_dict(),
                "rollout_stats": dict(s.rollout_stats),
            }
        return {
            "epoch": s.epoch,
            "num_epochs": s.num_epochs,
            "agent_step": s.agent_step,
            "optimizer_step": s.optimizer_step,
            "seed": self.seed,
            "policy": self.policy.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "trainer_rng": {
                "sample": self.sample_generator.get_state(),
                "shuffle": self.shuffle_generator.get_state(),
            },
            "normalization": self.normalization_state(),
            "env": env,
            "next_obs": self.next_obs,
            "prev_done": self.prev_done,
            "episodes": {"returns": self.episode_returns, "lengths": self.episode_lengths},
            "trained_seconds": float(self.trained_seconds),
            "session": self.session.state_dict(),
            "trainer_hooks": {
                type(h).__name__: h.state_dict() for h in self.hooks if hasattr(h, "state_dict")
            },
            "mid_epoch": mid,
        }

    def load_state_dict(self, state: Mapping[str, Any], *, restore_envs: bool = True) -> None:
        """Inverse of :meth:`state_dict` into a trainer built with the same configuration.

        ``restore_envs=False`` (ranks other than 0 of a distributed run) re-seeds the
        environments and keeps the probe trackers empty; envs whose state was not saved
        are re-seeded too, with a warning (not bit-identical to an uninterrupted run).
        Raises ``ValueError`` when the policy or optimizer does not fit."""
        try:
            self.policy.load_state_dict(state["policy"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise ValueError(
                f"the saved state does not fit this run's policy/optimizer ({exc}); resume "
                f"with the configuration it was written with (policy sizes, activations, "
                f"environment)"
            ) from None
        self.scheduler.load_state_dict(state["scheduler"])
        self.sample_generator.set_state(state["trainer_rng"]["sample"])
        self.shuffle_generator.set_state(state["trainer_rng"]["shuffle"])
        s = self.state
        s.epoch, s.agent_step = int(state["epoch"]), int(state["agent_step"])
        s.optimizer_step = int(state["optimizer_step"])
        if not restore_envs:
            self._reseed_envs("the saved state holds another rank's environments")
        elif state["env"]["state"] is None or state["next_obs"] is None:
            self._reseed_envs(f"the environment state was not saved ({state['env']['reason']})")
        else:
            self.envs.reset(seed=self.seed)  # builds every lazily created attribute
            restore_env_state(self.envs, state["env"]["state"])
            self.next_obs = _numpy(state["next_obs"])
            self.prev_done = _numpy(state["prev_done"]).astype(bool)
            episodes = state["episodes"]
            self.episode_returns = [_numpy(r) for r in episodes["returns"]]
            self.episode_lengths = [_numpy(n) for n in episodes["lengths"]]
        self.load_normalization_state(state["normalization"])
        self.trained_seconds = float(state["trained_seconds"])
        self.session.load_state_dict(state["session"], trackers=restore_envs)
        for hook in self.hooks:
            saved = state["trainer_hooks"].get(type(hook).__name__)
            if saved is not None and hasattr(hook, "load_state_dict"):
                hook.load_state_dict(saved)
        mid = state["mid_epoch"]
        self.update_progress = None
        if mid:
            update = mid["update"].items()
            u = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in update}
            self.update_progress = UpdateProgress(**u)
            self.storage.load_state_dict(mid["storage"])
            s.rollout_stats = dict(mid["rollout_stats"])
            self.rollout_ready = True

    def _reseed_envs(self, why: str) -> None:
        seed = self.seed + self.state.agent_step
        log.warning(
            f"{why}: the environments are re-seeded with seed {seed}, so the resumed run is "
            f"not bit-identical to an uninterrupted one"
        )
        self.next_obs, _ = self.envs.reset(seed=seed)
        self.prev_done[:] = False


def _numpy(value: np.ndarray | torch.Tensor) -> np.ndarray:
    """A numpy copy of a saved array (a tensor once it went through a checkpoint)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    return np.array(value, copy=True)
