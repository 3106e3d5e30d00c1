"""Configuration sections of a training run: environment, policy, PPO, evaluation, checkpoints.

Every model rejects unknown fields (``extra="forbid"``) so a typo on the command line
(``trainer.num_step=64``) fails with the list of valid keys instead of being ignored.
Checks that need several sections at once (minibatch size against batch size) live in
:class:`trainers.train_tool.TrainTool`.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

import gymnasium as gym
from pydantic import BaseModel, ConfigDict, Field, field_validator

from policy_probes.layers import ACTIVATIONS

VectorizationMode = Literal["auto", "sync", "async", "vector_entry_point"]


class EnvConfig(BaseModel):
    """Gymnasium vector environments for training (and, with the same settings, evaluation)."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field("CartPole-v1", description="Gymnasium environment id.")
    num_envs: int = Field(4, gt=0, description="Parallel environments.")
    vectorization: VectorizationMode = Field(
        "auto",
        description="sync | async | vector_entry_point (the env's own batched implementation) | "
        "auto (vector_entry_point when the env registers one, else sync).",
    )
    normalize_observation: bool = Field(
        False, description="Running mean/std observation normalisation (gymnasium wrapper)."
    )
    normalize_reward: bool = Field(
        False, description="Scale rewards by the running std of the discounted return."
    )
    clip_observation: float | None = Field(
        None, gt=0, description="Clip (normalised) observations to [-c, c]."
    )
    clip_reward: float | None = Field(None, gt=0, description="Clip (scaled) rewards to [-c, c].")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the environment constructor."
    )

    @field_validator("id")
    @classmethod
    def _known_env(cls, v: str) -> str:
        try:
            gym.spec(v)
        except Exception:  # gymnasium raises several error types for unknown ids
            close = difflib.get_close_matches(v, list(gym.registry), n=3, cutoff=0.5)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(
                f"unknown gymnasium environment id {v!r}.{hint} "
                f"(`python -c 'import gymnasium; gymnasium.pprint_registry()'` lists them)"
            ) from None
        return v


class PolicyConfig(BaseModel):
    """The MLP actor-critic (see ``docs/policies.md`` for its component names)."""

    model_config = ConfigDict(extra="forbid")

    hidden_sizes: list[int] = Field(
        default_factory=lambda: [64, 64], min_length=1, description="Actor hidden layer sizes."
    )
    activation: str = Field("tanh", description="Hidden activation of actor and critic.")
    critic_hidden_sizes: list[int] | None = Field(
        None, description="Critic hidden sizes; null = same as the actor."
    )
    critic_activation: str | None = Field(None, description="null = same as the actor.")
    init_log_std: float = Field(0.0, description="Initial log std of Gaussian policies.")

    @field_validator("hidden_sizes", "critic_hidden_sizes")
    @classmethod
    def _positive(cls, v: list[int] | None) -> list[int] | None:
        if v is not None:
            if not v:
                raise ValueError("needs at least one hidden layer")
            if any(h <= 0 for h in v):
                raise ValueError(f"hidden sizes must be positive, got {v}")
        return v

    @field_validator("activation", "critic_activation")
    @classmethod
    def _known_activation(cls, v: str | None) -> str | None:
        if v is not None and v not in ACTIVATIONS:
            close = difflib.get_close_matches(v, ACTIVATIONS, n=3)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(
                f"unknown activation {v!r}; choose one of {sorted(ACTIVATIONS)}.{hint}"
            )
        return v


class PPOConfig(BaseModel):
    """PPO hyperparameters (defaults: CleanRL ``ppo.py``)."""

    model_config = ConfigDict(extra="forbid")

    total_timesteps: int = Field(500_000, gt=0, description="Environment steps over all envs.")
    num_steps: int = Field(128, gt=0, description="Steps per environment per rollout.")
    num_minibatches: int = Field(4, gt=0)
    update_epochs: int = Field(4, gt=0, description="Passes over each rollout.")
    micro_batches: int = Field(
        1, gt=0, description="Split each minibatch into k micro-batches (gradient accumulation)."
    )
    learning_rate: float = Field(2.5e-4, gt=0)
    anneal_lr: bool = Field(True, description="Linear learning-rate decay to 0.")
    adam_eps: float = Field(1e-5, gt=0)
    gamma: float = Field(0.99, ge=0, le=1)
    gae_lambda: float = Field(0.95, ge=0, le=1)
    norm_adv: bool = Field(True, description="Per-minibatch advantage normalisation.")
    clip_coef: float = Field(0.2, gt=0)
    clip_vloss: bool = Field(True, description="Clipped value loss.")
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float | None = Field(0.5, gt=0, description="Global gradient-norm clip.")
    target_kl: float | None = Field(
        None, gt=0, description="Stop the update phase when approx_kl exceeds this."
    )


class EvalConfig(BaseModel):
    """Deterministic-policy evaluation on separate environments."""

    model_config = ConfigDict(extra="forbid")

    every_epochs: int = Field(10, ge=0, description="Evaluate every N epochs; 0 = never.")
    at_end: bool = Field(True, description="Also evaluate after the last epoch.")
    episodes: int = Field(10, gt=0)
    num_envs: int = Field(10, gt=0)
    max_steps: int = Field(
        100_000, gt=0, description="Safety cap on steps per evaluation (per environment)."
    )


class CheckpointConfig(BaseModel):
    """Checkpoints under ``run_dir/checkpoints``."""

    model_config = ConfigDict(extra="forbid")

    every_epochs: int = Field(25, ge=0, description="Checkpoint every N epochs; 0 = never.")
    at_end: bool = Field(True, description="Also checkpoint after the last epoch.")
    keep_last: int = Field(3, gt=0, description="Keep the newest K checkpoints.")
