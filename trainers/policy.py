"""The built-in MLP actor-critic: separate actor and critic networks with named components.

Components (``docs/policies.md``): ``actor_mlp`` and ``critic_mlp`` (MLPs ending in their
activation; hidden layers ``<mlp>.layer_<i>`` with ``.linear`` and ``.act``), ``actor_head``
(logits or Gaussian mean) and ``critic_head`` (state value); Gaussian policies also hold a
state-independent ``log_std``. The action distributions are written out instead of going
through ``torch.distributions``: the rollout step stays a handful of tensor ops and samples
from the trainer's own ``torch.Generator``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from policy_probes.components import PolicyAutoBuilder
from policy_probes.layers import HiddenLayer, LinearSpec, MLPSpec
from policy_probes.torch_internals import global_module_hooks_installed
from trainers.config import PolicyConfig

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)

#: a policy forward without hooks: ``obs -> (logits or Gaussian mean, value)``
Forward = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def action_dims(action_space: gym.spaces.Space) -> tuple[bool, int, tuple[int, ...]]:
    """``(discrete, act_dim, action_shape)``: ``act_dim`` is the number of logits or of
    Gaussian mean entries, ``action_shape`` that of one action (``()`` when discrete)."""
    if isinstance(action_space, gym.spaces.Discrete):
        return True, int(action_space.n), ()
    if isinstance(action_space, gym.spaces.Box):
        return False, int(np.prod(action_space.shape)), tuple(action_space.shape)
    raise ValueError(f"unsupported action space {action_space}; use Discrete or Box")


def layer_init(layer: nn.Module, gain: float) -> None:
    """CleanRL's ``layer_init``: an orthogonal weight of ``gain`` and a zero bias."""
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)


class ActorCriticPolicy(PolicyAutoBuilder):
    """MLP actor-critic for a flat Box observation space and Discrete or Box actions."""

    #: dtype of the observations in the rollout storage (what the first layer reads)
    obs_dtype: torch.dtype = torch.float32
    #: which components read each component's output (remedies zero outgoing weights there)
    component_consumers: dict[str, tuple[str, ...]] = {
        "actor_mlp": ("actor_head",),
        "critic_mlp": ("critic_head",),
    }

    def __init__(
        self,
        observation_space: gym.spaces.Box,
        action_space: gym.spaces.Space,
        cfg: PolicyConfig | None = None,
    ) -> None:
        cfg = cfg or self.default_config()
        obs_shape = self.observation_shape(observation_space)
        self.discrete, act_dim, self.action_shape = action_dims(action_space)
        PolicyAutoBuilder.__init__(self, self.build_components(obs_shape, act_dim, cfg))
        self.obs_shape, self.obs_dim, self.act_dim = obs_shape, int(np.prod(obs_shape)), act_dim
        if not self.discrete:
            self.log_std = nn.Parameter(torch.full((act_dim,), float(cfg.init_log_std)))
        self.reset_parameters()
        self.trace_outputs(torch.zeros(1, *obs_shape, dtype=self.obs_dtype))

    @staticmethod
    def default_config() -> PolicyConfig:
        """The configuration of a policy built without one."""
        return PolicyConfig()

    def observation_shape(self, observation_space: gym.spaces.Space) -> tuple[int, ...]:
        """One observation's shape as the first layer reads it: flat for the MLPs."""
        return (int(np.prod(observation_space.shape)),)

    def build_components(
        self, obs_shape: tuple[int, ...], act_dim: int, cfg: PolicyConfig
    ) -> dict[str, Any]:
        """The named components: actor and critic MLPs, each with its head."""
        (obs_dim,) = obs_shape
        critic_sizes = cfg.critic_hidden_sizes or cfg.hidden_sizes
        return {
            "actor_mlp": MLPSpec(
                in_features=obs_dim,
                hidden_sizes=cfg.hidden_sizes,
                activation=cfg.activation,
                layer_norm=cfg.layer_norm,
            ),
            "actor_head": LinearSpec(in_features=cfg.hidden_sizes[-1], out_features=act_dim),
            "critic_mlp": MLPSpec(
                in_features=obs_dim,
                hidden_sizes=critic_sizes,
                activation=cfg.critic_activation or cfg.activation,
                layer_norm=cfg.layer_norm,
            ),
            "critic_head": LinearSpec(in_features=critic_sizes[-1], out_features=1),
        }

    def reset_parameters(self) -> None:
        """Orthogonal init (Engstrom et al. 2020, CleanRL): gain sqrt(2) on hidden layers,
        zero biases, and :meth:`_init_heads`."""
        for mlp in (self.actor_mlp, self.critic_mlp):
            for m in mlp.modules():
                if isinstance(m, nn.Linear):
                    layer_init(m, math.sqrt(2))
        self._init_heads()

    def _init_heads(self) -> None:
        """CleanRL's head gains: 0.01 on the policy head (near-uniform initial policy), 1.0
        on the value head."""
        layer_init(self.actor_head, 0.01)
        layer_init(self.critic_head, 1.0)

    # ------------------------------------------------------------------ networks
    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits or Gaussian mean, value)`` for a batch of flat observations."""
        return self.actor_head(self.actor_mlp(obs)), self.value(obs)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic_head(self.critic_mlp(obs)).squeeze(-1)

    # ------------------------------------------------------------------ hook-free path
    def hooks_idle(self) -> bool:
        """True when no torch hook is installed on the policy's modules, nor globally:
        then :meth:`rollout_forward` and :meth:`evaluate_actions` call the layers'
        ``forward`` directly, skipping ``nn.Module.__call__``'s dispatch (a large part of a
        small MLP's cost on the CPU). Probes install their hooks only in the phases they
        record in, so an installed hook always fires."""
        return (
            type(self).forward is ActorCriticPolicy.forward
            and not global_module_hooks_installed()
            and not self.hooks_installed()
        )

    def _forward_direct(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` without ``nn.Module.__call__``: same operations, same result."""
        return (
            _linear(self.actor_head, _mlp(self.actor_mlp, obs)),
            _linear(self.critic_head, _mlp(self.critic_mlp, obs)).squeeze(-1),
        )

    def rollout_forward(self, example: torch.Tensor) -> Forward:
        """The forward for a rollout of hook-free steps: ``obs -> (logits or mean, value)``;
        call it once per rollout, under ``torch.inference_mode()`` and only when
        :meth:`hooks_idle`. On the CPU it is :class:`StackedMLPs` when that reproduces
        :meth:`forward` bit for bit on ``example`` (a batch of the rollout's shape: the
        rounding depends on the BLAS kernels the shapes select), else :meth:`_forward_direct`.
        """
        if example.device.type == "cpu":
            stacked = StackedMLPs.build(self)
            if stacked is not None and stacked.reproduces(self, example):
                return stacked
        return self._forward_direct

    # ------------------------------------------------------------------ distributions
    def act(
        self,
        obs: torch.Tensor,
        generator: torch.Generator | None = None,
        *,
        forward: Forward | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample ``(action, log_prob, value)``; ``forward`` replaces ``self(obs)`` (the
        trainer passes :meth:`rollout_forward` for hook-free rollouts).

        Categorical actions are drawn by inverse transform sampling (exact in distribution,
        cheaper than ``torch.multinomial``): the first action whose cumulative probability
        exceeds a uniform ``u``, clamped to the last for a cumulative sum rounded below 1.
        """
        out, value = self(obs) if forward is None else forward(obs)
        if self.discrete:
            log_probs = torch.log_softmax(out, dim=-1)
            u = torch.rand(
                (*out.shape[:-1], 1), generator=generator, device=out.device, dtype=out.dtype
            )
            cdf = log_probs.exp().cumsum(-1)
            action = torch.searchsorted(cdf, u, right=True).clamp_(max=out.shape[-1] - 1)
            return action.squeeze(-1), log_probs.gather(-1, action).squeeze(-1), value
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


@dataclass(eq=False)
class StackedMLPs:
    """Actor and critic MLPs of the same shape evaluated as one network (rollout steps):
    about half the tensor ops of the two networks: the first hidden layer is one
    ``F.linear`` on both weight matrices concatenated (``[B, 2h]``), every later one a
    ``torch.baddbmm`` over the two halves (``[2, B, h]``); the activation runs once on both.
    The stacked weights are copies: build it per rollout, use it once :meth:`reproduces` holds.
    """

    first: tuple[torch.Tensor, torch.Tensor]
    rest: list[tuple[torch.Tensor, torch.Tensor]]
    activation: nn.Module
    actor_head: nn.Linear
    critic_head: nn.Linear

    @classmethod
    def build(cls, policy: ActorCriticPolicy) -> StackedMLPs | None:
        """The stacked network of ``policy``, or None when the two MLPs differ in layer
        sizes or activation, or are not plain ``HiddenLayer(linear, act)`` blocks."""
        actor, critic = list(policy.actor_mlp.children()), list(policy.critic_mlp.children())
        if not actor or len(actor) != len(critic):
            return None
        for a, c in zip(actor, critic, strict=True):
            if not (type(a) is type(c) is HiddenLayer and type(a.linear) is type(c.linear)):
                return None
            if type(a.linear) is not nn.Linear or a.linear.bias is None or c.linear.bias is None:
                return None
            if a.norm is not None or c.norm is not None:  # layer_norm: the per-layer path
                return None
            if a.linear.weight.shape != c.linear.weight.shape:
                return None
        # one elementwise, parameter-free activation, configured alike, on every layer
        acts = [layer.act for layer in actor + critic]
        if any(
            type(m) is not type(acts[0])
            or m.extra_repr() != acts[0].extra_repr()
            or any(True for _ in m.parameters(recurse=False))
            for m in acts
        ):
            return None
        first = (
            torch.cat([actor[0].linear.weight, critic[0].linear.weight]),
            torch.cat([actor[0].linear.bias, critic[0].linear.bias]),
        )
        rest = [
            (
                torch.stack([a.linear.weight, c.linear.weight]).transpose(1, 2),
                torch.stack([a.linear.bias, c.linear.bias]).unsqueeze(1),
            )
            for a, c in zip(actor[1:], critic[1:], strict=True)
        ]
        return cls(first, rest, actor[0].act, policy.actor_head, policy.critic_head)

    def __call__(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits or mean, value)`` for a ``[B, obs_dim]`` batch."""
        act = self.activation.forward
        h = act(F.linear(obs, *self.first))
        h = h.view(obs.shape[0], 2, -1).transpose(0, 1)  # [2, B, h]: actor, critic
        for weight, bias in self.rest:
            h = act(torch.baddbmm(bias, h, weight))
        return _linear(self.actor_head, h[0]), _linear(self.critic_head, h[1]).squeeze(-1)

    def reproduces(self, policy: ActorCriticPolicy, example: torch.Tensor) -> bool:
        """True if the stacked network gives exactly the module path's outputs on
        ``example`` (one host sync)."""
        out, value = self(example)
        ref_out, ref_value = policy._forward_direct(example)
        return torch.equal(out, ref_out) and torch.equal(value, ref_value)


def _linear(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, linear.weight, linear.bias)


def _mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An :class:`~policy_probes.layers.MLP` through its layers' ``forward`` methods."""
    for layer in mlp.children():
        x = _linear(layer.linear, x)
        if layer.norm is not None:
            x = F.layer_norm(
                x, layer.norm.normalized_shape, layer.norm.weight, layer.norm.bias, layer.norm.eps
            )
        x = layer.act.forward(x)
    return x
