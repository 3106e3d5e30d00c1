"""Breakout (ALE) from pixels: PPO with a NatureCNN encoder, CleanRL ``ppo_atari.py``
hyperparameters, and probes on every encoder layer and both heads.

The probes: dead/dormant ReLU units of each encoder layer (``encoder.conv_0`` ...
``encoder.fc``, post-activation), and Fisher information and gradient flow of each
encoder layer and of ``actor_head`` and ``critic_head``. The heads are linear (logits and
value), so the ReLU probe stays on the encoder. Another game: ``env.id=ALE/Pong-v5``.

    policy-probes run recipes.atari.train trainer.total_timesteps=100000 seed=3
"""

from __future__ import annotations

from policy_probes.probes.fisher import attach_fisher_information_hooks
from policy_probes.probes.gradient_flow import attach_gradient_flow_hooks
from policy_probes.probes.relu import attach_relu_activation_hooks
from trainers import (
    AtariConfig,
    CheckpointConfig,
    EnvConfig,
    EvalConfig,
    PolicyConfig,
    PPOConfig,
    TrainTool,
)

#: every encoder layer (conv_0, conv_1, conv_2, fc), each post-activation
ENCODER_LAYERS = "encoder.*"
HEADS = ("actor_head", "critic_head")


def train() -> TrainTool:
    """CleanRL ``ppo_atari.py`` (8 envs x 128 steps, 4 minibatches, 4 update epochs,
    lr 2.5e-4 annealed, gamma 0.99, lambda 0.95, clip 0.1, ent 0.01, vf 0.5, max grad
    norm 0.5) on ALE/Breakout-v5 (sticky actions, 30 no-op starts, frame skip 4, 84x84
    grayscale, 4 stacked frames, rewards clipped to [-1, 1]), 10M environment steps."""
    cfg = TrainTool(
        name="atari",
        env=EnvConfig(
            id="ALE/Breakout-v5",
            num_envs=8,
            vectorization="sync",
            clip_reward=1.0,  # ALE rewards are integers: clipping to [-1, 1] is their sign
            atari=AtariConfig(),
        ),
        policy=PolicyConfig(encoder="nature_cnn"),
        trainer=PPOConfig(
            total_timesteps=10_000_000,
            num_steps=128,
            num_minibatches=4,
            update_epochs=4,
            learning_rate=2.5e-4,
            anneal_lr=True,
            gamma=0.99,
            gae_lambda=0.95,
            clip_coef=0.1,
            ent_coef=0.01,
            vf_coef=0.5,
            max_grad_norm=0.5,
        ),
        # an ALE episode can last 27k agent steps: evaluate rarely, on few episodes
        evaluation=EvalConfig(every_epochs=500, episodes=4, num_envs=4, max_steps=27_000),
        checkpoint=CheckpointConfig(every_epochs=250),
        device="auto",
    )
    return add_probes(cfg)


def add_probes(cfg: TrainTool) -> TrainTool:
    """The recipe's probes on a NatureCNN policy (the benchmarks attach the same set):
    ReLU activations of every encoder layer; Fisher information and gradient flow of
    every encoder layer and both heads."""
    cfg.add_training_hook(ENCODER_LAYERS, attach_relu_activation_hooks())
    for pattern in (ENCODER_LAYERS, *HEADS):
        cfg.add_training_backward_hook(pattern, attach_fisher_information_hooks())
        cfg.add_training_backward_hook(pattern, attach_gradient_flow_hooks(beta=0.95))
    return cfg
