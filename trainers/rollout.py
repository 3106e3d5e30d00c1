"""Preallocated rollout storage, GAE, and minibatches of a rollout.

Autoreset (gymnasium ``NEXT_STEP``): when step ``t`` of env ``i`` ends an episode
(terminated or truncated), the observation it returns is the episode's *final*
observation, stored as ``obs[t+1, i]``; step ``t+1`` then resets that env, ignores its
action and returns reward 0. So

* step ``t+1`` is not a transition of any episode: ``valid[t+1, i] = False``, it gets
  advantage 0 and is left out of every minibatch;
* a truncated step bootstraps from ``V(obs[t+1, i]) = V(final observation)``, which the
  rollout computed anyway at step ``t+1``; a terminated step does not bootstrap;
* no advantage flows across an episode boundary (``1 - done`` cuts the GAE recursion).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch


@dataclass
class Minibatch:
    """Flat tensors of one minibatch (samples on the first dimension)."""

    obs: torch.Tensor
    actions: torch.Tensor
    logprobs: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor

    def __len__(self) -> int:
        return self.obs.shape[0]

    def split(self, k: int) -> list[Minibatch]:
        """``k`` contiguous parts of (almost) equal size (views): minibatches of a gathered
        rollout, micro-batches of a minibatch."""
        parts = [torch.tensor_split(getattr(self, f.name), k) for f in fields(self)]
        return [Minibatch(*p) for p in zip(*parts, strict=True)]


def compute_gae(
    rewards: np.ndarray,
    values: np.ndarray,
    next_values: np.ndarray,
    terminated: np.ndarray,
    dones: np.ndarray,
    valid: np.ndarray,
    gamma: float,
    gae_lambda: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation (Schulman et al. 2016), arrays of shape (T, N).

    ``next_values[t]`` is V of the observation step ``t`` returned (the final observation
    when the step ended an episode). ``dones = terminated | truncated`` stops the
    recursion at episode ends; ``terminated`` alone removes the bootstrap term, so
    truncation bootstraps from V(final observation). Invalid (autoreset) steps get
    advantage 0. Returns ``(advantages, returns)`` with ``returns = advantages + values``.
    """
    advantages = np.zeros_like(values)
    last = np.zeros(values.shape[1], dtype=values.dtype)
    not_terminated = 1.0 - terminated.astype(values.dtype)
    not_done = 1.0 - dones.astype(values.dtype)
    for t in reversed(range(values.shape[0])):
        # delta_t = r_t + gamma * V(s_{t+1}) * (1 - terminated_t) - V(s_t)
        delta = rewards[t] + gamma * next_values[t] * not_terminated[t] - values[t]
        # A_t = delta_t + gamma * lambda * (1 - done_t) * A_{t+1}
        last = delta + gamma * gae_lambda * not_done[t] * last
        advantages[t] = last
    advantages[~valid] = 0.0
    return advantages, advantages + values


class RolloutStorage:
    """Buffers for ``num_steps`` x ``num_envs`` transitions, allocated once: what the
    policy reads on the training device, what the environment returns (rewards,
    terminated, truncated, valid) in numpy on the host (moved once per rollout)."""

    def __init__(
        self,
        num_steps: int,
        num_envs: int,
        obs_dim: int,
        act_dim: int,
        discrete: bool,
        device: torch.device | str = "cpu",
        obs_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.num_steps, self.num_envs = num_steps, num_envs
        self.device = torch.device(device)
        T, N = num_steps, num_envs
        # flat observations in the dtype the policy reads (uint8 pixels for a CNN policy)
        self.obs = torch.zeros((T, N, obs_dim), dtype=obs_dtype, device=self.device)
        if discrete:
            self.actions = torch.zeros((T, N), dtype=torch.long, device=self.device)
        else:
            self.actions = torch.zeros((T, N, act_dim), device=self.device)
        self.logprobs = torch.zeros((T, N), device=self.device)
        self.values = torch.zeros((T, N), device=self.device)
        self.next_value = torch.zeros(N, device=self.device)
        self.advantages = torch.zeros((T, N), device=self.device)
        self.returns = torch.zeros((T, N), device=self.device)
        self.rewards = np.zeros((T, N), dtype=np.float32)
        self.terminated = np.zeros((T, N), dtype=bool)
        self.truncated = np.zeros((T, N), dtype=bool)
        self.valid = np.ones((T, N), dtype=bool)
        self.valid_indices = torch.arange(T * N, device=self.device)

    @property
    def size(self) -> int:
        """Number of valid transitions (the batch the update phase trains on)."""
        return int(self.valid_indices.numel())

    def compute_returns(self, gamma: float, gae_lambda: float) -> None:
        """Fill :attr:`advantages` and :attr:`returns` from the finished rollout."""
        values = self.values.cpu().numpy()
        next_values = np.concatenate([values[1:], self.next_value.cpu().numpy()[None]], axis=0)
        dones = self.terminated | self.truncated
        adv, ret = compute_gae(
            self.rewards, values, next_values, self.terminated, dones, self.valid, gamma, gae_lambda
        )
        self.advantages.copy_(torch.from_numpy(adv))
        self.returns.copy_(torch.from_numpy(ret))
        valid = np.flatnonzero(self.valid.reshape(-1))
        self.valid_indices = torch.from_numpy(valid).to(self.device)

    def state_dict(self) -> dict[str, torch.Tensor | np.ndarray]:
        """The rollout's buffers (a mid-epoch checkpoint resumes its update phase on them)."""
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor | np.ndarray)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict` (tensors or numpy arrays, any device)."""
        for key, value in state.items():
            current = getattr(self, key)
            if isinstance(current, np.ndarray):
                if isinstance(value, torch.Tensor):
                    value = value.cpu().numpy()
                setattr(self, key, np.array(value, dtype=current.dtype, copy=True))
            elif current.shape == value.shape:
                current.copy_(torch.as_tensor(value))
            else:  # valid_indices: its length is the rollout's
                setattr(self, key, torch.as_tensor(value).to(self.device))

    def gather(self, idx: torch.Tensor) -> Minibatch:
        """The transitions at flat indices ``idx`` (``t * num_envs + env``)."""
        flat = self.num_steps * self.num_envs
        return Minibatch(
            obs=self.obs.view(flat, -1)[idx],
            actions=self.actions.view(flat, *self.actions.shape[2:])[idx],
            logprobs=self.logprobs.view(flat)[idx],
            values=self.values.view(flat)[idx],
            advantages=self.advantages.view(flat)[idx],
            returns=self.returns.view(flat)[idx],
        )

    def valid_observations(self) -> torch.Tensor:
        """The observations of the valid transitions, one row each."""
        return self.obs.view(self.num_steps * self.num_envs, -1)[self.valid_indices]

    def shuffled_order(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """The valid flat indices in a random order (one update epoch's order)."""
        perm = torch.randperm(self.size, generator=generator, device="cpu").to(self.device)
        return self.valid_indices[perm]

    def minibatches(self, order: torch.Tensor, num_minibatches: int) -> Iterator[Minibatch]:
        """Split ``order`` (flat indices) into ``num_minibatches`` (almost) equal minibatches:
        contiguous slices of the transitions gathered once in ``order`` (one index op per
        field instead of one per field and minibatch)."""
        yield from self.gather(order).split(num_minibatches)

    def value_statistics(self) -> dict[str, float]:
        """Over the valid transitions, in one host transfer: ``explained_variance``
        (1 - Var[R - V] / Var[R]) and the scale of the value targets R (the GAE returns),
        ``value_target_abs_mean`` = mean |R| and ``value_target_std`` = std(R) (Lyle et al.,
        "Disentangling the causes of plasticity loss", 2024)."""
        flat = self.num_steps * self.num_envs
        y = self.returns.view(flat)[self.valid_indices].double()
        v = self.values.view(flat)[self.valid_indices].double()
        var_y = torch.var(y, unbiased=False)
        ev = torch.where(var_y > 0, 1 - torch.var(y - v, unbiased=False) / var_y, torch.nan)
        ev, abs_mean, std = torch.stack([ev, y.abs().mean(), var_y.sqrt()]).tolist()
        return dict(explained_variance=ev, value_target_abs_mean=abs_mean, value_target_std=std)
