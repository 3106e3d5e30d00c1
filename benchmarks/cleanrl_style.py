"""A CleanRL-style PPO loop on Atari: the timing baseline of the trainer.

:func:`cleanrl_atari` is one self-contained loop in the manner of CleanRL's
``ppo_atari.py`` (Huang et al., "The 37 implementation details of PPO"), so that the
trainer (the ``ours`` case of :mod:`benchmarks.cases`) can be timed against it on the same
machine and device. It is a **timing baseline, not a learning reference**.

Settings as ``ppo_atari.py`` (the constants below; ``cudnn.deterministic``, restored on
return). Rollout storage lives on the device, one ``.cpu().numpy()`` per step for the env,
and CleanRL's ``.item()`` calls are kept (its TensorBoard writes are not). ``p`` is
``cases.DEFAULTS`` with the benchmark's params; the steps are whole rollouts.

Differences from CleanRL's script, so that only the loop differs from the trainer's run:
the environment is the trainer's (:func:`trainers.envs.make_vector_env`, sync, the
:class:`~trainers.config.AtariConfig` defaults), not CleanRL's SB3 wrappers; and with
gymnasium's ``NEXT_STEP`` autoreset, this loop keeps CleanRL's ``next_done`` bookkeeping,
so the reset step after an episode's end enters the batch as a spurious transition and
truncations count as terminations (the trainer masks the one and bootstraps the other: a
negligible difference in work on Atari-length episodes).

    python -m benchmarks.cases cleanrl_atari '{"env_id": "ALE/Breakout-v5", "clip_reward": 1.0, "num_envs": 2, "num_steps": 64, "total_timesteps": 256}'
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical

from benchmarks.clocks import Clocks

LEARNING_RATE = 2.5e-4
ADAM_EPS = 1e-5
GAMMA = 0.99
GAE_LAMBDA = 0.95
CLIP_COEF = 0.1
ENT_COEF = 0.01
VF_COEF = 0.5
MAX_GRAD_NORM = 0.5


def orthogonal(layer: nn.Module, gain: float = float(np.sqrt(2))) -> nn.Module:
    """Orthogonal weights of the given gain, zero bias."""
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class NatureAgent(nn.Module):
    """NatureCNN body shared by a categorical actor head and a value head."""

    def __init__(self, observation_shape: tuple[int, ...], num_actions: int) -> None:
        super().__init__()
        channels, height, width = observation_shape
        for kernel, stride in ((8, 4), (4, 2), (3, 1)):  # unpadded convolutions
            height, width = (height - kernel) // stride + 1, (width - kernel) // stride + 1
        self.body = nn.Sequential(
            orthogonal(nn.Conv2d(channels, 32, kernel_size=8, stride=4)),
            nn.ReLU(),
            orthogonal(nn.Conv2d(32, 64, kernel_size=4, stride=2)),
            nn.ReLU(),
            orthogonal(nn.Conv2d(64, 64, kernel_size=3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
            orthogonal(nn.Linear(64 * height * width, 512)),
            nn.ReLU(),
        )
        self.actor = orthogonal(nn.Linear(512, num_actions), gain=0.01)
        self.critic = orthogonal(nn.Linear(512, 1), gain=1.0)

    def value(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.critic(self.body(pixels / 255.0)).squeeze(-1)

    def policy_and_value(
        self, pixels: torch.Tensor, action: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(action, its log-probability, the policy's entropy, V); samples an action when
        none is given."""
        hidden = self.body(pixels / 255.0)
        dist = Categorical(logits=self.actor(hidden))
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.critic(hidden).squeeze(-1)


def cleanrl_atari(p: dict[str, Any]) -> dict[str, Any]:
    """Train with the CleanRL-style loop; the JSON line of a case (:class:`Clocks`), with
    the last logged losses, whether every logged loss was finite, and the episodes."""
    previous_deterministic = torch.backends.cudnn.deterministic
    try:
        return _train(p)
    finally:
        torch.backends.cudnn.deterministic = previous_deterministic


def _train(p: dict[str, Any]) -> dict[str, Any]:
    from trainers.config import AtariConfig, EnvConfig
    from trainers.envs import make_vector_env
    from trainers.train_tool import seed_everything

    num_envs, num_steps = p["num_envs"], p["num_steps"]
    batch_size = num_envs * num_steps
    minibatch_size = batch_size // p["num_minibatches"]
    num_iterations = p["total_timesteps"] // batch_size
    if num_iterations < 1:
        raise ValueError(
            f"total_timesteps={p['total_timesteps']} is less than one rollout "
            f"(num_envs * num_steps = {batch_size})"
        )
    seed = p["seed"]
    device = torch.device(p.get("device", "cpu"))

    clocks = Clocks()
    # ---- seeding (CleanRL: random, numpy, torch, cudnn.deterministic)
    seed_everything(seed)
    torch.backends.cudnn.deterministic = True

    # ---- environment: exactly the trainer's
    envs = make_vector_env(
        EnvConfig(
            id=p["env_id"],
            num_envs=num_envs,
            vectorization="sync",
            clip_reward=p["clip_reward"],
            atari=AtariConfig(),
        ),
        gamma=GAMMA,
    )
    obs_shape = envs.single_observation_space.shape

    agent = NatureAgent(obs_shape, int(envs.single_action_space.n)).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=LEARNING_RATE, eps=ADAM_EPS)

    # ---- rollout storage, on the device
    obs = torch.zeros((num_steps, num_envs, *obs_shape), device=device)
    actions = torch.zeros((num_steps, num_envs), dtype=torch.long, device=device)
    logprobs = torch.zeros((num_steps, num_envs), device=device)
    rewards = torch.zeros((num_steps, num_envs), device=device)
    dones = torch.zeros((num_steps, num_envs), device=device)
    values = torch.zeros((num_steps, num_envs), device=device)

    agent_steps = 0
    episode_returns: list[float] = []
    logged: dict[str, float] = {}
    all_finite = True
    next_obs_np, _ = envs.reset(seed=seed)
    next_obs = torch.as_tensor(next_obs_np, dtype=torch.float32).to(device)
    next_done = torch.zeros(num_envs, device=device)

    for iteration in range(1, num_iterations + 1):
        # linear learning-rate annealing: lr at iteration i is lr * (1 - (i - 1) / N)
        optimizer.param_groups[0]["lr"] = LEARNING_RATE * (1.0 - (iteration - 1.0) / num_iterations)

        # ---- rollout: num_steps steps of every env
        for step in range(num_steps):
            agent_steps += num_envs
            obs[step] = next_obs
            dones[step] = next_done
            with torch.no_grad():
                action, logprob, _, value = agent.policy_and_value(next_obs)
            values[step] = value
            actions[step] = action
            logprobs[step] = logprob
            next_obs_np, reward, terminated, truncated, info = envs.step(action.cpu().numpy())
            rewards[step] = torch.as_tensor(reward, dtype=torch.float32).to(device)
            next_obs = torch.as_tensor(next_obs_np, dtype=torch.float32).to(device)
            next_done = torch.as_tensor(
                np.logical_or(terminated, truncated), dtype=torch.float32
            ).to(device)
            if "episode" in info:
                episode_returns.extend(info["episode"]["r"][info["_episode"]].tolist())

        # ---- GAE, bootstrapping the last step from V(next_obs)
        with torch.no_grad():
            next_value = agent.value(next_obs)
            advantages = torch.zeros_like(rewards)
            last_gae = torch.zeros(num_envs, device=device)
            for t in reversed(range(num_steps)):
                if t == num_steps - 1:
                    not_done, following_value = 1.0 - next_done, next_value
                else:
                    not_done, following_value = 1.0 - dones[t + 1], values[t + 1]
                delta = rewards[t] + GAMMA * following_value * not_done - values[t]
                last_gae = delta + GAMMA * GAE_LAMBDA * not_done * last_gae
                advantages[t] = last_gae
            returns = advantages + values

        # ---- flatten the rollout
        b_obs = obs.reshape(-1, *obs_shape)
        b_actions = actions.reshape(-1)
        b_logprobs = logprobs.reshape(-1)
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)
        b_values = values.reshape(-1)

        # ---- update: update_epochs passes of num_minibatches shuffled minibatches
        indices = np.arange(batch_size)
        clip_fractions = []
        for _epoch in range(p["update_epochs"]):
            np.random.shuffle(indices)
            for start in range(0, batch_size, minibatch_size):
                mb = torch.as_tensor(indices[start : start + minibatch_size], device=device)
                _, new_logprob, entropy, new_value = agent.policy_and_value(
                    b_obs[mb], b_actions[mb]
                )
                log_ratio = new_logprob - b_logprobs[mb]
                ratio = log_ratio.exp()
                with torch.no_grad():
                    approx_kl = ((ratio - 1.0) - log_ratio).mean()  # k3 estimator
                    clip_fractions.append(((ratio - 1.0).abs() > CLIP_COEF).float().mean().item())

                adv = b_advantages[mb]
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)

                # clipped surrogate objective (as a loss: the max of the negatives)
                pg_loss = torch.max(
                    -adv * ratio, -adv * torch.clamp(ratio, 1.0 - CLIP_COEF, 1.0 + CLIP_COEF)
                ).mean()

                # clipped value loss: the new value may move at most CLIP_COEF from the old
                value_clipped = b_values[mb] + torch.clamp(
                    new_value - b_values[mb], -CLIP_COEF, CLIP_COEF
                )
                v_loss = (
                    0.5
                    * torch.max(
                        (new_value - b_returns[mb]) ** 2, (value_clipped - b_returns[mb]) ** 2
                    ).mean()
                )

                entropy_mean = entropy.mean()
                loss = pg_loss - ENT_COEF * entropy_mean + VF_COEF * v_loss

                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), MAX_GRAD_NORM)
                optimizer.step()

        # ---- what CleanRL logs per iteration (its host transfers included)
        y_pred, y_true = b_values.cpu().numpy(), b_returns.cpu().numpy()
        var_y = np.var(y_true)
        logged = {
            "policy_loss": pg_loss.item(),
            "value_loss": v_loss.item(),
            "entropy": entropy_mean.item(),
            "approx_kl": approx_kl.item(),
            "clipfrac": float(np.mean(clip_fractions)),
            "explained_variance": float("nan")
            if var_y == 0
            else float(1.0 - np.var(y_true - y_pred) / var_y),
        }
        all_finite = all_finite and all(
            np.isfinite(v) for k, v in logged.items() if k != "explained_variance"
        )

    clocks.stop()
    envs.close()
    return clocks.result(
        agent_steps,
        losses_finite=all_finite,
        last_losses=logged,
        episodes=len(episode_returns),
        mean_episode_return=float(np.mean(episode_returns)) if episode_returns else None,
    )
