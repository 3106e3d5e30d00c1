"""The pathologies of the labelled findings benchmark (``benchmarks/findings_bench.py``),
each a trainer callback that harms a healthy run from its injection epoch on, and the
recorder every run of the benchmark carries.

Each injection acts at ``on_rollout_start`` of its ``epoch`` (that epoch's rollout and
update are the first under it) and draws what it draws from its own generator seeded with
the run's seed: the same seed injects the same thing. None reads or changes the probes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gymnasium.wrappers import vector as vw

from trainers import TrainerHook
from trainers.callbacks import TrainerState

#: the policy's hidden MLPs (their hidden layers are ``<mlp>.layer_<i>.linear``)
MLPS = ("actor_mlp", "critic_mlp")


class Injection(TrainerHook):
    """Base class: :meth:`inject` once at the start of epoch :attr:`epoch`; the
    observation transform it applies from then on (:meth:`observe`) lets the benchmark's
    label measurements see the inputs the network sees."""

    #: a label: which independent measurement the pathology is expected to move
    expected = ""

    def __init__(self, epoch: int, seed: int) -> None:
        self.epoch, self.seed = epoch, seed
        self.generator = np.random.default_rng([seed, 39])

    def on_rollout_start(self, state: TrainerState) -> None:
        if state.epoch == self.epoch:
            self.inject(state)

    def inject(self, state: TrainerState) -> None:
        raise NotImplementedError

    def observe(self, obs: np.ndarray) -> np.ndarray:
        """The observation the policy gets after the injection for the env's ``obs``."""
        return obs

    def wrap_observations(self, state: TrainerState) -> None:
        """From now on the trainer's envs return :meth:`observe` of every observation (the
        pending first observation of the rollout included)."""
        trainer = state.trainer
        trainer.envs = vw.TransformObservation(trainer.envs, self.observe)
        trainer.next_obs = self.observe(trainer.next_obs)


class KillUnits(Injection):
    """``fraction`` of the hidden units of every hidden layer of both MLPs made
    permanently dead: incoming weights 0, bias -10 (their ReLU output and its gradient are
    0 on every input), and Adam's moments of those rows cleared (no stale momentum
    revives them)."""

    expected = "plasticity_lost, dead_on_heldout"

    def __init__(self, epoch: int, seed: int, fraction: float = 0.75) -> None:
        super().__init__(epoch, seed)
        self.fraction = fraction

    def inject(self, state: TrainerState) -> None:
        with torch.no_grad():
            for name, module in state.policy.named_modules():
                if not (name.startswith(MLPS) and isinstance(module, torch.nn.Linear)):
                    continue
                n = module.out_features
                rows = torch.as_tensor(
                    self.generator.choice(n, round(self.fraction * n), replace=False)
                )
                module.weight[rows] = 0.0
                module.bias[rows] = -10.0
                for p in (module.weight, module.bias):
                    for moment in state.optimizer.state.get(p, {}).values():
                        if isinstance(moment, torch.Tensor) and moment.shape == p.shape:
                            moment[rows] = 0.0


class LrJump(Injection):
    """The learning rate multiplied by ``factor`` from the injection on: the scheduler's
    base rates are raised, so an annealed schedule goes on from ``factor`` x its value."""

    expected = "harms_learning"

    def __init__(self, epoch: int, seed: int, factor: float = 30.0) -> None:
        super().__init__(epoch, seed)
        self.factor = factor

    def inject(self, state: TrainerState) -> None:
        sched = state.scheduler
        sched.base_lrs = [lr * self.factor for lr in sched.base_lrs]
        for group in state.optimizer.param_groups:
            group["lr"] *= self.factor


class RewardScale(Injection):
    """Every reward multiplied by ``factor`` from the injection on (the episode statistics
    stay on the raw rewards: the wrapper sits outside them)."""

    expected = "value_target_scale_grew"

    def __init__(self, epoch: int, seed: int, factor: float = 100.0) -> None:
        super().__init__(epoch, seed)
        self.factor = factor

    def inject(self, state: TrainerState) -> None:
        state.trainer.envs = vw.TransformReward(state.trainer.envs, lambda r: r * self.factor)


class ObsShift(Injection):
    """A constant offset and scale on every observation feature from the injection on:
    ``obs * scale + offset``, offsets drawn from N(0, ``shift``^2) per feature."""

    expected = "input shift (dead_on_heldout on the shifted inputs)"

    def __init__(self, epoch: int, seed: int, shift: float = 5.0, scale: float = 3.0) -> None:
        super().__init__(epoch, seed)
        self.shift, self.scale = shift, scale
        self.offset: np.ndarray | None = None

    def inject(self, state: TrainerState) -> None:
        dim = state.trainer.envs.single_observation_space.shape[0]
        self.offset = self.generator.normal(0.0, self.shift, dim).astype(np.float32)
        self.wrap_observations(state)

    def observe(self, obs: np.ndarray) -> np.ndarray:
        return (obs * self.scale + self.offset).astype(np.float32)


class PermuteObs(Injection):
    """The observation features permuted once at the injection (a new task with the same
    dynamics: Juliani & Ash's permute shift), a derangement drawn from the seed."""

    expected = "harms_learning (a task switch)"

    def __init__(self, epoch: int, seed: int) -> None:
        super().__init__(epoch, seed)
        self.perm: np.ndarray | None = None

    def inject(self, state: TrainerState) -> None:
        dim = state.trainer.envs.single_observation_space.shape[0]
        perm = np.arange(dim)
        while (perm == np.arange(dim)).any():
            perm = self.generator.permutation(dim)
        self.perm = perm
        self.wrap_observations(state)

    def observe(self, obs: np.ndarray) -> np.ndarray:
        return obs[..., self.perm]


class RewardFlip(Injection):
    """Every reward negated from the injection on (a sign error in the reward pipeline):
    the policy is now taught to do what it was taught not to."""

    expected = "harms_learning (the objective reversed)"

    def inject(self, state: TrainerState) -> None:
        state.trainer.envs = vw.TransformReward(state.trainer.envs, lambda r: -r)


INJECTIONS: dict[str, type[Injection]] = {
    "kill_units": KillUnits,
    "lr_jump": LrJump,
    "reward_scale": RewardScale,
    "obs_shift": ObsShift,
    "permute_obs": PermuteObs,
    "reward_flip": RewardFlip,
}


class RolloutRecorder(TrainerHook):
    """Per epoch, from the rollout storage after GAE (the benchmark's own measurements,
    not the probes'): mean |reward|, std and mean |.| of the GAE returns over the valid
    transitions, mean |observation| and the learning rate; one JSON line per epoch in
    ``run_dir/labels.jsonl``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: list[dict[str, Any]] = []

    def on_rollout_end(self, state: TrainerState) -> None:
        st = state.trainer.storage
        valid = st.valid.reshape(-1)
        returns = st.returns.reshape(-1).numpy()[valid]
        obs = st.obs.reshape(-1, st.obs.shape[-1]).numpy()[valid]
        self.lines.append(
            dict(
                epoch=state.epoch,
                reward_abs=float(np.abs(st.rewards.reshape(-1)[valid]).mean()),
                return_std=float(returns.std()),
                return_abs=float(np.abs(returns).mean()),
                obs_abs=float(np.abs(obs).mean()),
                lr=float(state.optimizer.param_groups[0]["lr"]),
            )
        )

    def on_training_end(self, state: TrainerState) -> None:
        self.path.write_text("".join(json.dumps(line) + "\n" for line in self.lines))
