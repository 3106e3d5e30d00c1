"""The pixel actor-critic: a NatureCNN encoder shared by a linear actor head and a linear
critic head (CleanRL ``ppo_atari.py``); and :func:`make_policy`, the policy a config selects.

Components (``docs/policies.md``): ``encoder`` (:class:`~trainers.nature_cnn.NatureCNN`),
``actor_head`` and ``critic_head``, both reading the encoder's 512 features. Observations
stay uint8 in the rollout storage. The action distributions are those of
:class:`~trainers.policy.ActorCriticPolicy`.
"""

from __future__ import annotations

import math
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from policy_probes.layers import LinearSpec
from trainers.config import PolicyConfig
from trainers.nature_cnn import NatureCNN
from trainers.policy import ActorCriticPolicy, Forward, layer_init


def image_shape(observation_space: gym.spaces.Space) -> tuple[int, int, int]:
    """``(C, H, W)`` of a uint8 image Box space; a clear error for anything else."""
    shape = getattr(observation_space, "shape", None) or ()
    if (
        not isinstance(observation_space, gym.spaces.Box)
        or len(shape) != 3
        or observation_space.dtype != np.uint8
    ):
        raise ValueError(
            f"policy.encoder=nature_cnn needs uint8 image observations of shape (C, H, W) "
            f"(Atari ids such as ALE/Breakout-v5 give (4, 84, 84)); this environment's "
            f"observation space is {observation_space}. Use policy.encoder=none for vector "
            f"observations"
        )
    return int(shape[0]), int(shape[1]), int(shape[2])


class CNNActorCriticPolicy(ActorCriticPolicy):
    """NatureCNN actor-critic for uint8 ``(C, H, W)`` frames and Discrete or Box actions."""

    obs_dtype = torch.uint8
    component_consumers = {"encoder": ("actor_head", "critic_head")}

    @staticmethod
    def default_config() -> PolicyConfig:
        return PolicyConfig(encoder="nature_cnn")

    def observation_shape(self, observation_space: gym.spaces.Space) -> tuple[int, ...]:
        return image_shape(observation_space)

    def build_components(
        self, obs_shape: tuple[int, ...], act_dim: int, cfg: PolicyConfig
    ) -> dict[str, Any]:
        """The encoder and the two heads reading its features."""
        encoder = NatureCNN(obs_shape, layer_norm=cfg.layer_norm)
        return {
            "encoder": encoder,
            "actor_head": LinearSpec(in_features=encoder.out_features, out_features=act_dim),
            "critic_head": LinearSpec(in_features=encoder.out_features, out_features=1),
        }

    def reset_parameters(self) -> None:
        """Orthogonal init as CleanRL ``ppo_atari.py``: gain sqrt(2) on every convolution
        and the 512-unit layer, zero biases, and the heads' gains."""
        for m in self.encoder.modules():
            if isinstance(m, nn.Conv2d | nn.Linear):
                layer_init(m, math.sqrt(2))
        self._init_heads()

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits or Gaussian mean, value)`` for a batch of frames (``(B, C, H, W)`` or
        flattened ``(B, C*H*W)``, raw pixel values)."""
        features = self.encoder(obs)
        return self.actor_head(features), self.critic_head(features).squeeze(-1)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic_head(self.encoder(obs)).squeeze(-1)

    def deterministic_action(self, obs: torch.Tensor) -> torch.Tensor:
        out = self.actor_head(self.encoder(obs))
        return out.argmax(-1) if self.discrete else out

    def hooks_idle(self) -> bool:
        """Always False: rollouts and updates go through the modules (the MLP policy's
        hook-free shortcuts save module dispatch, a small cost next to convolutions)."""
        return False

    def rollout_forward(self, example: torch.Tensor) -> Forward:
        """The module path (see :meth:`hooks_idle`)."""
        return self

    def _forward_direct(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self(obs)


def make_policy(
    observation_space: gym.spaces.Space,
    action_space: gym.spaces.Space,
    cfg: PolicyConfig | None = None,
) -> ActorCriticPolicy:
    """The policy ``cfg.encoder`` selects: :class:`~trainers.policy.ActorCriticPolicy`
    (``none``) or :class:`CNNActorCriticPolicy` (``nature_cnn``)."""
    cfg = cfg or PolicyConfig()
    if cfg.encoder == "nature_cnn":
        return CNNActorCriticPolicy(observation_space, action_space, cfg)
    shape = getattr(observation_space, "shape", None) or ()
    if len(shape) == 3 and getattr(observation_space, "dtype", None) == np.uint8:
        raise ValueError(
            f"observation space {observation_space} looks like stacked image frames; the MLP "
            f"policy would flatten {int(np.prod(shape))} pixels into its first layer. Set "
            f"policy.encoder=nature_cnn"
        )
    return ActorCriticPolicy(observation_space, action_space, cfg)
