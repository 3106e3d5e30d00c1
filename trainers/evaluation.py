"""EvaluationHook: deterministic-policy episodes on separate environments.

Evaluation never touches the training environments or the trainer's generators, so it
does not change the training trajectory. Observation normalisation statistics are copied
from the training envs and frozen, so the policy sees observations scaled as in training.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from policy_probes.context import ComponentContext
from trainers.callbacks import TrainerHook, TrainerState
from trainers.envs import copy_observation_normalization

log = logging.getLogger("trainers")

#: the final evaluation of a short run takes at most this many agent steps, or as many as
#: the run trained, whichever is more (an ALE game lasts up to 27,000 steps per episode)
FINAL_EVAL_MIN_BOUND = 2_000
#: seconds between the progress lines of a long evaluation
PROGRESS_SECONDS = 10.0


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
    progress: Callable[[int, int, int], None] | None = None,
) -> dict[str, float]:
    """Run ``episodes`` greedy episodes (spread evenly over the envs) and return their
    mean/std/min/max return and mean length. Episode statistics come from the
    ``RecordEpisodeStatistics`` wrapper, i.e. raw (unnormalised) rewards. ``progress``
    is called every 100 steps with (episodes done, episodes asked, steps per env)."""
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
        for step in range(max_steps):
            if progress is not None and step % 100 == 0 and step:
                progress(int(got.sum()), episodes, step)
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


@dataclass(eq=False, repr=False)
class EvaluationHook(TrainerHook):
    """Every ``every_epochs`` epochs (and after the last one when ``at_end``), run
    ``episodes`` deterministic episodes and store the scores in ``state.eval_scores``
    (with ``epoch`` = the epoch they belong to)."""

    make_envs: Callable[[], gym.vector.VectorEnv]
    _: KW_ONLY
    every_epochs: int = 10
    episodes: int = 10
    at_end: bool = True
    seed: int = 0
    max_steps: int = 100_000
    #: the step cap per env of the evaluation after the last epoch (None: max_steps)
    final_max_steps: int | None = None
    envs: gym.vector.VectorEnv | None = field(default=None, init=False)
    evaluations: int = field(default=0, init=False)

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
        final = state.epoch == state.num_epochs or state.stop_training
        max_steps = self.max_steps
        if final and self.final_max_steps is not None:
            max_steps = min(max_steps, self.final_max_steps)
        started, said = time.monotonic(), [time.monotonic()]

        def progress(done: int, asked: int, steps: int) -> None:  # every 100 steps
            now = time.monotonic()
            if now - said[0] >= PROGRESS_SECONDS:
                said[0] = now
                log.info(
                    f"evaluation after epoch {state.epoch}: {done} of {asked} episodes done, "
                    f"{steps} of at most {max_steps} steps per env, {now - started:.0f} s "
                    f"(evaluation.episodes, evaluation.max_steps; evaluation.at_end=false "
                    f"skips the final one)"
                )

        try:
            scores = evaluate_policy(
                policy,
                self.envs,
                self.episodes,
                # a fresh, reproducible set of start states for every evaluation
                seed=self.seed + 1_000_003 * (self.evaluations + 1),
                device=trainer.device,
                context=state.context,
                max_steps=max_steps,
                progress=progress,
            )
        finally:
            policy.train(was_training)
        if scores.get("episodes", 0) < self.episodes:
            why = "; raise evaluation.max_steps to finish them"
            if max_steps < self.max_steps:
                why = " (the bound of a short run's final evaluation)"
            log.warning(
                f"evaluation after epoch {state.epoch} stopped at {max_steps} steps per env "
                f"with {int(scores.get('episodes', 0))} of {self.episodes} episodes finished{why}"
            )
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


def final_evaluation_bound(total_timesteps: int, num_envs: int, max_steps: int) -> int | None:
    """The step cap per env of a short run's final evaluation, or None when its
    ``max_steps`` already keeps it within ``max(total_timesteps, FINAL_EVAL_MIN_BOUND)``
    agent steps: a 2048-step smoke run of an ALE game is not held up by 4 full games
    (up to 108,000 agent steps); it evaluates for as many agent steps as it trained."""
    budget = max(total_timesteps, FINAL_EVAL_MIN_BOUND)
    if max_steps * num_envs <= budget:
        return None
    return max(1, budget // num_envs)
