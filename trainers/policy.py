"""The built-in MLP actor-critic: separate actor and critic networks with named components.

Components (see ``docs/policies.md``): ``actor_mlp`` and ``critic_mlp`` (MLPs ending in
their activation, so probes on them see post-activation values; hidden layers are
``<mlp>.layer_<i>`` with ``.linear`` and ``.act``), ``actor_head`` (logits or Gaussian
mean) and ``critic_head`` (state value). Gaussian policies also hold a state-independent
``log_std`` parameter.

The action distributions are written out (log-softmax categorical, diagonal Gaussian)
instead of going through ``torch.distributions`` so the rollout step stays a handful of
tensor ops and samples from the trainer's own ``torch.Generator``.
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module

from policy_probes.components import PolicyAutoBuilder
from policy_probes.layers import LinearSpec, MLPSpec
from trainers.config import PolicyConfig

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


class ActorCriticPolicy(PolicyAutoBuilder):
    """MLP actor-critic for a flat Box observation space and Discrete or Box actions."""

    def __init__(
        self,
        observation_space: gym.spaces.Box,
        action_space: gym.spaces.Space,
        cfg: PolicyConfig | None = None,
    ) -> None:
        cfg = cfg or PolicyConfig()
        obs_dim = int(np.prod(observation_space.shape))
        self.discrete = isinstance(action_space, gym.spaces.Discrete)
        if self.discrete:
            act_dim = int(action_space.n)
            self.action_shape: tuple[int, ...] = ()
        elif isinstance(action_space, gym.spaces.Box):
            act_dim = int(np.prod(action_space.shape))
            self.action_shape = tuple(action_space.shape)
        else:
            raise ValueError(f"unsupported action space {action_space}; use Discrete or Box")
        critic_sizes = cfg.critic_hidden_sizes or cfg.hidden_sizes
        critic_act = cfg.critic_activation or cfg.activation
        super().__init__(
            {
                "actor_mlp": MLPSpec(
                    in_features=obs_dim, hidden_sizes=cfg.hidden_sizes, activation=cfg.activation
                ),
                "actor_head": LinearSpec(in_features=cfg.hidden_sizes[-1], out_features=act_dim),
                "critic_mlp": MLPSpec(
                    in_features=obs_dim, hidden_sizes=critic_sizes, activation=critic_act
                ),
                "critic_head": LinearSpec(in_features=critic_sizes[-1], out_features=1),
            }
        )
        self.obs_dim = obs_dim
        self.act_dim = act_dim
        if not self.discrete:
            self.log_std = nn.Parameter(torch.full((act_dim,), float(cfg.init_log_std)))
        self.reset_parameters()
        self.trace_outputs(torch.zeros(1, obs_dim))

    def reset_parameters(self) -> None:
        """Orthogonal init (Engstrom et al. 2020, CleanRL): gain sqrt(2) on hidden layers,
        0.01 on the policy head (near-uniform initial policy), 1.0 on the value head,
        zero biases."""
        for mlp in (self.actor_mlp, self.critic_mlp):
            for m in mlp.modules():
                if isinstance(m, nn.Linear):
                    nn.init.orthogonal_(m.weight, math.sqrt(2))
                    nn.init.zeros_(m.bias)
        nn.init.orthogonal_(self.actor_head.weight, 0.01)
        nn.init.zeros_(self.actor_head.bias)
        nn.init.orthogonal_(self.critic_head.weight, 1.0)
        nn.init.zeros_(self.critic_head.bias)

    # ------------------------------------------------------------------ networks
    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits or Gaussian mean, value)`` for a batch of flat observations."""
        return self.actor_head(self.actor_mlp(obs)), self.critic_head(self.critic_mlp(obs)).squeeze(
            -1
        )

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic_head(self.critic_mlp(obs)).squeeze(-1)

    # ------------------------------------------------------------------ hook-free path
    def hooks_idle(self) -> bool:
        """True when no torch hook is installed on the policy's modules, nor globally.

        Then :meth:`act` (with ``fast=True``) and :meth:`evaluate_actions` run the layers'
        ``forward`` directly instead of going through ``nn.Module.__call__``, whose
        dispatch is a large part of a small MLP's cost on the CPU. Probes keep their torch
        hooks installed only in the phases they record in (see
        :class:`~policy_probes.components.ProbeHandle`), so with the default ``("train",)``
        probes the rollout is hook-free; any hook that is installed keeps the ordinary
        path, so it always fires.
        """
        return (
            type(self).forward is ActorCriticPolicy.forward
            and not _global_module_hooks()
            and not self.hooks_installed()
        )

    def _forward_direct(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` without ``nn.Module.__call__`` (no hooks fire): same operations,
        same result."""
        return (
            _linear(self.actor_head, _mlp(self.actor_mlp, obs)),
            _linear(self.critic_head, _mlp(self.critic_mlp, obs)).squeeze(-1),
        )

    # ------------------------------------------------------------------ distributions
    def act(
        self, obs: torch.Tensor, generator: torch.Generator | None = None, *, fast: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample ``(action, log_prob, value)``; one forward through both networks.

        ``fast=True`` skips the module hook dispatch; pass it only when
        :meth:`hooks_idle` is True (the trainer checks once per rollout).
        """
        out, value = self._forward_direct(obs) if fast else self(obs)
        if self.discrete:
            log_probs = torch.log_softmax(out, dim=-1)
            action = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(-1)
            return action, log_probs.gather(-1, action.unsqueeze(-1)).squeeze(-1), value
        std = self.log_std.exp()
        noise = torch.randn(out.shape, generator=generator, device=out.device, dtype=out.dtype)
        action = out + std * noise
        log_prob = (-0.5 * noise.square() - self.log_std - LOG_SQRT_2PI).sum(-1)
        return action, log_prob, value

    def evaluate_actions(
        self, obs: torch.Tensor, action: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(log_prob, entropy, value)`` of given actions under the current parameters
        (through the hooks unless :meth:`hooks_idle`)."""
        out, value = self._forward_direct(obs) if self.hooks_idle() else self(obs)
        if self.discrete:
            log_probs = torch.log_softmax(out, dim=-1)
            log_prob = log_probs.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)
            entropy = -(log_probs.exp() * log_probs).sum(-1)
            return log_prob, entropy, value
        z = (action - out) * torch.exp(-self.log_std)
        log_prob = (-0.5 * z.square() - self.log_std - LOG_SQRT_2PI).sum(-1)
        entropy = (0.5 + LOG_SQRT_2PI + self.log_std).sum().expand(out.shape[0])
        return log_prob, entropy, value

    def deterministic_action(self, obs: torch.Tensor) -> torch.Tensor:
        """Greedy action: argmax logits, or the Gaussian mean."""
        out = self.actor_head(self.actor_mlp(obs))
        return out.argmax(-1) if self.discrete else out


def _linear(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, linear.weight, linear.bias)


def _mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An :class:`~policy_probes.layers.MLP` through its layers' ``forward`` methods."""
    for layer in mlp.children():
        x = layer.act.forward(_linear(layer.linear, x))
    return x


def _global_module_hooks() -> bool:
    """True if torch has global module hooks (they must fire on every module call)."""
    m = torch_module
    return bool(
        m._global_forward_hooks
        or m._global_forward_pre_hooks
        or m._global_backward_hooks
        or m._global_backward_pre_hooks
    )
