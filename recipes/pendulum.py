"""Pendulum-v1 (continuous actions, diagonal Gaussian policy) with saturation and Fisher
probes. Hyperparameters as measured in docs/learning.md: gamma 0.9 (Pendulum's reward is
dense and its useful horizon short; 0.99 learns far slower), no entropy bonus, observation
and reward normalisation.
"""

from __future__ import annotations

from policy_probes.probes.fisher import attach_fisher_information_hooks
from policy_probes.probes.saturation import attach_saturated_activation_hooks
from trainers import EnvConfig, EvalConfig, PolicyConfig, PPOConfig, TrainTool


def train() -> TrainTool:
    """PPO on Pendulum-v1, 1M environment steps."""
    cfg = TrainTool(
        name="pendulum",
        env=EnvConfig(
            id="Pendulum-v1",
            num_envs=8,
            normalize_observation=True,
            normalize_reward=True,
            clip_observation=10.0,
            clip_reward=10.0,
        ),
        policy=PolicyConfig(hidden_sizes=[64, 64], activation="tanh", init_log_std=0.0),
        # what departs from PPOConfig's defaults (CleanRL ppo.py's)
        trainer=PPOConfig(
            total_timesteps=1_000_000,
            num_steps=256,
            num_minibatches=32,
            update_epochs=10,
            learning_rate=1e-3,
            gamma=0.9,
            ent_coef=0.0,
        ),
        evaluation=EvalConfig(every_epochs=10, episodes=10, num_envs=10),
        torch_threads=1,
    )
    cfg.add_training_hook("actor_mlp", attach_saturated_activation_hooks(activation="tanh"))
    cfg.add_training_backward_hook("actor_mlp", attach_fisher_information_hooks())
    return cfg
