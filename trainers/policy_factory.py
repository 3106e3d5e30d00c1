"""make_policy: the actor-critic a :class:`~trainers.config.PolicyConfig` selects."""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from trainers.cnn_policy import CNNActorCriticPolicy
from trainers.config import PolicyConfig
from trainers.policy import ActorCriticPolicy


def make_policy(
    observation_space: gym.spaces.Space,
    action_space: gym.spaces.Space,
    cfg: PolicyConfig | None = None,
) -> ActorCriticPolicy:
    """The policy ``cfg.encoder`` selects: :class:`~trainers.policy.ActorCriticPolicy` (``none``) or
    :class:`~trainers.cnn_policy.CNNActorCriticPolicy` (``nature_cnn``)."""
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
