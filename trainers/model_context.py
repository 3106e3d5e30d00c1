"""PPOModelDataContext: what lifecycle interventions may do inside the PPO trainer.

It is :class:`~policy_probes.lifecycle.LoopModelDataContext` pointed at the trainer's
rollout storage and its update step (:meth:`PPOTrainer.accumulate_gradients`,
:meth:`PPOTrainer.clip_and_step`, the target-KL early stop), so a replayed update epoch is
exactly the one the loop runs; nothing of the PPO update is written twice.

An ``order`` is a tensor of flat rollout indices (``t * num_envs + env``), as
:meth:`RolloutStorage.shuffled_order` returns; ``None`` is the natural order of the valid
transitions.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch

from policy_probes.lifecycle import LoopModelDataContext
from policy_probes.lifecycle.model_context import Grads
from trainers.config import PPOConfig
from trainers.policy import ActorCriticPolicy
from trainers.rollout import Minibatch, RolloutStorage


class PPOLoop(Protocol):
    """What :class:`PPOModelDataContext` uses of :class:`~trainers.ppo.PPOTrainer` (this
    module does not import it)."""

    cfg: PPOConfig
    policy: ActorCriticPolicy
    optimizer: torch.optim.Optimizer
    scheduler: Any
    storage: RolloutStorage
    sample_generator: torch.Generator
    shuffle_generator: torch.Generator
    rollout_ready: bool

    def minibatch_loss(
        self, batch: Minibatch, policy: ActorCriticPolicy | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def accumulate_gradients(self, batch: Minibatch, *, sync: bool = False) -> torch.Tensor: ...

    def clip_and_step(self, step: bool = True) -> torch.Tensor: ...

    def kl_exceeds_target(self, stats: torch.Tensor) -> bool: ...


class PPOModelDataContext(LoopModelDataContext):
    """The :class:`~policy_probes.lifecycle.ModelDataContext` of one
    :class:`~trainers.ppo.PPOTrainer` run (its policy, Adam, LR schedule and rollout).
    Its checkpoints also hold the trainer's own generators (action sampling, minibatch
    order), so not even a hook that draws from them can change the trajectory.
    """

    def __init__(self, trainer: PPOLoop) -> None:
        cfg = trainer.cfg
        super().__init__(
            trainer.policy,
            trainer.optimizer,
            lambda policy, batch: trainer.minibatch_loss(batch, policy)[0],
            scheduler=trainer.scheduler,
            max_grad_norm=cfg.max_grad_norm,
            update_epochs=cfg.update_epochs,
            sample_fn=lambda policy, obs: policy.act(obs)[0],
            log_prob_fn=lambda policy, obs, actions: policy.evaluate_actions(obs, actions)[0],
        )
        self.trainer = trainer
        self.storage = trainer.storage
        self._kl_stopped = False
        self._last_stats: torch.Tensor | None = None
        self._generators: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _trainer_generators(self) -> tuple[torch.Generator, torch.Generator]:
        return self.trainer.sample_generator, self.trainer.shuffle_generator

    def save_checkpoint(self, full: bool = True) -> int:
        token = super().save_checkpoint(full)
        if full:
            self._generators[token] = tuple(g.get_state() for g in self._trainer_generators())
        return token

    def restore_checkpoint(self, token: int) -> None:
        super().restore_checkpoint(token)
        saved = self._generators.get(token)
        if saved is not None:
            for gen, state in zip(self._trainer_generators(), saved, strict=True):
                gen.set_state(state)
        self._kl_stopped = False

    def discard_checkpoint(self, token: int) -> None:
        super().discard_checkpoint(token)
        self._generators.pop(token, None)

    def restore_pre_epoch(self) -> None:
        super().restore_pre_epoch()
        self._kl_stopped = False

    def _require_data(self) -> None:
        if not self.trainer.rollout_ready:
            raise RuntimeError(
                "no rollout yet: the PPO model context has data from POST_ROLLOUT of the "
                "first epoch on (at PRE_EPOCH it holds the previous epoch's rollout); fire "
                "the intervention at POST_ROLLOUT or later"
            )

    def set_data(self, **_: Any) -> None:
        """The data is always the trainer's current rollout; nothing to set."""

    def num_samples(self) -> int:
        self._require_data()
        return self.storage.size

    def random_order(self, generator: torch.Generator | None = None) -> torch.Tensor:
        self._require_data()
        return self.storage.shuffled_order(generator)

    def minibatches(self, order: Any = None) -> Iterator[Minibatch]:
        self._require_data()
        st = self.storage
        idx = st.valid_indices if order is None else torch.as_tensor(order, device=st.device)
        yield from st.minibatches(idx, self.trainer.cfg.num_minibatches)

    def rows(self, idx: torch.Tensor) -> Minibatch:
        """The rollout's valid transitions ``idx`` (0 .. num_samples - 1) as one minibatch
        (the probe batch of ``policy_probes.sampling``)."""
        self._require_data()
        st = self.storage
        return st.gather(st.valid_indices[idx.to(st.valid_indices.device)])

    def observations(self) -> torch.Tensor:
        self._require_data()
        return self.storage.valid_observations()

    def train_minibatch(self, batch: Minibatch, step: bool = True) -> list[torch.Tensor | None]:
        """The trainer's own step on ``batch`` (micro-batches, clipping, Adam); returns
        the gradients before clipping."""
        trainer = self.trainer
        self._last_stats = trainer.accumulate_gradients(batch)
        params = self.named_parameters().values()
        grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
        trainer.clip_and_step(step=step)
        return grads

    def run_training_epoch(self, order: Any = None, step: bool = True) -> Grads:
        """One update epoch as the loop runs it. Like the loop, once an epoch ends with
        approx_kl above ``target_kl`` the update phase is over: further stepping epochs
        do nothing (and return zero gradients) until a checkpoint or the pre-epoch state
        is restored."""
        if step and self._kl_stopped:
            return {n: torch.zeros_like(p) for n, p in self.named_parameters().items()}
        grads = super().run_training_epoch(order, step)
        stats = self._last_stats
        if step and stats is not None and self.trainer.kl_exceeds_target(stats):
            self._kl_stopped = True
        return grads
