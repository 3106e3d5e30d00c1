"""Breakout (ALE) from pixels: PPO with a NatureCNN encoder, CleanRL ``ppo_atari.py``
hyperparameters, and probes on every encoder layer and both heads (:func:`add_probes`).
Another game: ``env.id=ALE/Pong-v5``.

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

#: the NatureCNN component; its layers (conv_0, conv_1, conv_2, fc) are reported per layer
ENCODER = "encoder"
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
        # ppo_atari.py departs from PPOConfig's defaults (CleanRL ppo.py) in clip_coef only
        trainer=PPOConfig(total_timesteps=10_000_000, clip_coef=0.1),
        # an ALE episode can last 27k agent steps: evaluate rarely, on few episodes
        evaluation=EvalConfig(every_epochs=500, episodes=4, num_envs=4, max_steps=27_000),
        checkpoint=CheckpointConfig(every_epochs=250),
        device="auto",
    )
    return add_probes(cfg)


def add_probes(cfg: TrainTool) -> TrainTool:
    """The recipe's probes on a NatureCNN policy (the benchmarks attach the same set): ReLU
    activations of the encoder and each of its layers (per channel on the conv layers; the
    heads are linear); Fisher information and gradient flow of the encoder (per layer) and
    both heads."""
    cfg.add_training_hook(ENCODER, attach_relu_activation_hooks())
    for pattern in (ENCODER, *HEADS):
        cfg.add_training_backward_hook(pattern, attach_fisher_information_hooks())
        cfg.add_training_backward_hook(pattern, attach_gradient_flow_hooks(beta=0.95))
    return cfg
