"""EvaluationHook: deterministic-policy episodes on separate environments.

Evaluation never touches the training environments or the trainer's generators, so it
does not change the training trajectory. Observation normalisation statistics are copied
from the training envs and frozen, so the policy sees observations scaled as in training.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from policy_probes.context import ComponentContext
from trainers.callbacks import TrainerHook, TrainerState
from trainers.envs import copy_observation_normalization


@torch.no_grad()
def evaluate_policy(
    policy: Any,
    envs: gym.vector.VectorEnv,
    episodes: int,
    *,
    seed: int,
    device: torch.device | str = "cpu",
    context: ComponentContext | None = None,
    max_steps: int = 100_000,
) -> dict[str, float]:
    """Run ``episodes`` greedy episodes (spread evenly over the envs) and return their
    mean/std/min/max return and mean length. Episode statistics come from the
    ``RecordEpisodeStatistics`` wrapper, i.e. raw (unnormalised) rewards."""
    previous = context.phase if context is not None else None
    if context is not None:
        context.phase = "eval"
    n = envs.num_envs
    quota = np.array([episodes // n + (1 if i < episodes % n else 0) for i in range(n)])
    returns: list[float] = []
    lengths: list[float] = []
    got = np.zeros(n, dtype=np.int64)
    action_shape = (n, *getattr(policy, "action_shape", ()))
    try:
        obs, _ = envs.reset(seed=seed)
        for _ in range(max_steps):
            x = torch.as_tensor(np.asarray(obs), dtype=torch.float32, device=device).view(n, -1)
            action = policy.deterministic_action(x).cpu().numpy().reshape(action_shape)
            obs, _r, _term, _trunc, info = envs.step(action)
            if "episode" in info:
                for i in np.flatnonzero(info["_episode"]):
                    if got[i] < quota[i]:
                        got[i] += 1
                        returns.append(float(info["episode"]["r"][i]))
                        lengths.append(float(info["episode"]["l"][i]))
            if (got >= quota).all():
                break
    finally:
        if context is not None:
            context.phase = previous
    if not returns:
        return {"episodes": 0.0}
    r = np.asarray(returns)
    return {
        "return_mean": float(r.mean()),
        "return_std": float(r.std()),
        "return_min": float(r.min()),
        "return_max": float(r.max()),
        "length_mean": float(np.mean(lengths)),
        "episodes": float(r.size),
    }


class EvaluationHook(TrainerHook):
    """Every ``every_epochs`` epochs (and after the last one when ``at_end``), run
    ``episodes`` deterministic episodes and store the scores in ``state.eval_scores``
    (with ``epoch`` = the epoch they belong to)."""

    def __init__(
        self,
        make_envs: Callable[[], gym.vector.VectorEnv],
        *,
        every_epochs: int = 10,
        episodes: int = 10,
        at_end: bool = True,
        seed: int = 0,
        max_steps: int = 100_000,
    ) -> None:
        self.make_envs = make_envs
        self.every_epochs = every_epochs
        self.episodes = episodes
        self.at_end = at_end
        self.seed = seed
        self.max_steps = max_steps
        self.envs: gym.vector.VectorEnv | None = None
        self.evaluations = 0

    def on_train_phase_end(self, state: TrainerState) -> None:
        # before the epoch's record is written, which reports the scores as eval/*
        due = self.every_epochs > 0 and state.epoch % self.every_epochs == 0
        last = self.at_end and (state.epoch == state.num_epochs or state.stop_training)
        if due or last:
            self.run(state)

    def run(self, state: TrainerState) -> dict[str, float]:
        if self.envs is None:
            self.envs = self.make_envs()
        trainer = state.trainer
        copy_observation_normalization(trainer.envs, self.envs)
        policy = state.policy
        was_training = policy.training
        policy.eval()
        try:
            scores = evaluate_policy(
                policy,
                self.envs,
                self.episodes,
                # a fresh, reproducible set of start states for every evaluation
                seed=self.seed + 1_000_003 * (self.evaluations + 1),
                device=trainer.device,
                context=state.context,
                max_steps=self.max_steps,
            )
        finally:
            policy.train(was_training)
        self.evaluations += 1
        scores["epoch"] = float(state.epoch)
        state.eval_scores = scores
        return scores

    def state_dict(self) -> dict[str, int]:
        """The evaluation count (it picks each evaluation's start states)."""
        return {"evaluations": self.evaluations}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.evaluations = int(state["evaluations"])

    def on_training_end(self, state: TrainerState) -> None:
        if self.envs is not None:
            self.envs.close()
            self.envs = None
