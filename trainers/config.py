"""Configuration sections of a training run: environment, policy, PPO, evaluation, checkpoints.

Checks that need several sections at once (minibatch size against batch size) live in
:class:`trainers.train_tool.TrainTool`.
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any, Literal

import gymnasium as gym
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from policy_probes.layers import ACTIVATIONS

VectorizationMode = Literal["auto", "sync", "async", "vector_entry_point"]
EnvBackend = Literal["gymnasium", "envpool"]

#: entry point of the Arcade Learning Environment's single-game env (ale-py)
ALE_ENTRY_POINT = "ale_py.env:AtariEnv"


def register_ale_envs() -> bool:
    """Register ale-py's Atari ids (``ALE/Breakout-v5``, ...) with gymnasium; False when
    ale-py is not installed."""
    try:
        import ale_py
    except ImportError:
        return False
    gym.register_envs(ale_py)
    return True


def is_atari(env_id: str) -> bool:
    """True for an id registered by ale-py (every ALE game and version)."""
    return gym.spec(env_id).entry_point == ALE_ENTRY_POINT


def _numeric(annotation: Any) -> bool:
    """Whether a field holds an int or float (possibly optional), not a bool."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return annotation in (int, float) or (union and any(map(_numeric, typing.get_args(annotation))))


class Section(BaseModel):
    """A configuration model: unknown keys (a typo such as ``trainer.num_step=64``),
    non-finite floats and ``true``/``false`` for a number are refused, each with the key's
    name (pydantic would otherwise take ``seed=true`` as seed 1)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(v, bool) and field is not None and _numeric(field.annotation):
            raise ValueError(f"expected a number, got {str(v).lower()}")
        return v


class AtariConfig(Section):
    """Preprocessing of ALE ids (Mnih et al. 2015; Machado et al. 2018): gymnasium's
    ``AtariPreprocessing`` on an env made with ``frameskip=1``, then
    ``FrameStackObservation``; uint8 frames of shape ``(frame_stack, screen_size, screen_size)``."""

    noop_max: int = Field(30, ge=0, description="Up to N random no-op actions after reset.")
    frame_skip: int = Field(
        4,
        gt=0,
        description="Repeat each action N frames; the observation is the max of the "
        "last two (the env itself is made with frameskip=1).",
    )
    screen_size: int = Field(84, ge=36, description="Square grayscale frames of this size.")
    terminal_on_life_loss: bool = Field(
        False,
        description="End the episode (terminated) when a life is lost; the next reset restarts "
        "the game, and episode statistics are then per life.",
    )
    frame_stack: int = Field(4, gt=0, description="Stack the last N frames as channels.")


class EnvConfig(Section):
    """Gymnasium vector environments for training (and, with the same settings, evaluation)."""

    id: str = Field("CartPole-v1", description="Gymnasium environment id.")
    num_envs: int = Field(4, gt=0, description="Parallel environments.")
    backend: EnvBackend = Field(
        "gymnasium",
        description="gymnasium: gymnasium's vector env and wrappers; envpool: EnvPool's C++ "
        "Atari engine with the same preprocessing (ALE ids only; the envpool extra; "
        "trainers.envpool_envs).",
    )
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
    atari: AtariConfig = Field(
        default_factory=AtariConfig, description="Preprocessing of ALE ids (ignored otherwise)."
    )
    permute_obs_every: int = Field(
        0,
        ge=0,
        description="Permute the observation features every N agent steps (period k > 0 "
        "uses a fixed permutation drawn from the reset seed and k; 0 = never): a task whose "
        "input mapping keeps changing, for plasticity experiments (trainers.envs).",
    )

    @field_validator("id")
    @classmethod
    def _known_env(cls, v: str) -> str:
        # ale-py's ids are registered lazily, only for an id gymnasium does not know yet
        if _registered(v) or (register_ale_envs() and _registered(v)):
            return v
        close = difflib.get_close_matches(v, list(gym.registry), n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(
            f"unknown gymnasium environment id {v!r}.{hint} "
            f"(`python -c 'import gymnasium; gymnasium.pprint_registry()'` lists them)"
        )

    @model_validator(mode="after")
    def _atari_settings_need_an_atari_id(self) -> EnvConfig:
        if self.atari != AtariConfig() and not is_atari(self.id):
            changed = sorted(
                f"env.atari.{k}"
                for k, v in self.atari.model_dump().items()
                if v != AtariConfig.model_fields[k].default
            )
            raise ValueError(
                f"{', '.join(changed)} applies to Atari (ALE/...) ids only and env.id="
                f"{self.id!r} is not one; drop {changed[0]} or use an ALE id such as "
                f"ALE/Breakout-v5"
            )
        return self

    @model_validator(mode="after")
    def _envpool_runs_atari_only(self) -> EnvConfig:
        if self.backend == "envpool" and not is_atari(self.id):
            raise ValueError(
                f"env.backend=envpool runs ALE games only and env.id={self.id!r} is not one; "
                f"use env.backend=gymnasium or an ALE id such as ALE/Breakout-v5"
            )
        return self


def _registered(env_id: str) -> bool:
    try:
        gym.spec(env_id)
    except Exception:  # gymnasium raises several error types for unknown ids
        return False
    return True


class PolicyConfig(Section):
    """The actor-critic (see ``docs/policies.md`` for its component names): separate MLPs
    on vector observations, or a shared NatureCNN encoder on pixels."""

    encoder: Literal["none", "nature_cnn"] = Field(
        "none",
        description="none: actor and critic MLPs on the flat observation; nature_cnn: a shared "
        "NatureCNN encoder on uint8 (C, H, W) frames with linear actor and critic heads "
        "(hidden_sizes and activation then do not apply).",
    )

    hidden_sizes: list[int] = Field(
        default_factory=lambda: [64, 64], min_length=1, description="Actor hidden layer sizes."
    )
    activation: str = Field("tanh", description="Hidden activation of actor and critic.")
    critic_hidden_sizes: list[int] | None = Field(
        None, description="Critic hidden sizes; null = same as the actor."
    )
    critic_activation: str | None = Field(None, description="null = same as the actor.")
    init_log_std: float = Field(0.0, description="Initial log std of Gaussian policies.")
    layer_norm: bool = Field(
        False,
        description="LayerNorm between every hidden layer and its activation (MLP: "
        "nn.LayerNorm; NatureCNN: nn.GroupNorm(1, C) on the feature maps, nn.LayerNorm on fc).",
    )

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


class PPOConfig(Section):
    """PPO hyperparameters (defaults: CleanRL ``ppo.py``)."""

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
    adam_betas: tuple[float, float] = Field(
        (0.9, 0.999),
        description="Adam's (beta1, beta2); Dohare et al. 2024 use (0.99, 0.99) against "
        "plasticity loss in PPO.",
    )

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
    compile: bool = Field(
        False,
        description="torch.compile the update's forward (policy.evaluate_actions); passes "
        "the probes observe run eagerly (docs/compile.md).",
    )
    compile_backend: str = Field(
        "inductor", description="torch.compile backend (inductor, aot_eager, eager)."
    )
    compile_mode: str = Field(
        "default", description="torch.compile mode: default or max-autotune-no-cudagraphs."
    )

    @field_validator("compile_mode")
    @classmethod
    def _no_cuda_graphs(cls, mode: str) -> str:
        if mode in ("reduce-overhead", "max-autotune"):
            raise ValueError(
                f"trainer.compile_mode={mode} records CUDA graphs, which probes cannot "
                f"observe; use trainer.compile_mode=default or max-autotune-no-cudagraphs"
            )
        if mode not in ("default", "max-autotune-no-cudagraphs"):
            raise ValueError(
                f"trainer.compile_mode must be default or max-autotune-no-cudagraphs, got {mode!r}"
            )
        return mode

    @field_validator("adam_betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"Adam betas must be in [0, 1), got {list(v)}")
        return v


class EvalConfig(Section):
    """Deterministic-policy evaluation on separate environments."""

    every_epochs: int = Field(10, ge=0, description="Evaluate every N epochs; 0 = never.")
    at_end: bool = Field(True, description="Also evaluate after the last epoch.")
    episodes: int = Field(10, gt=0)
    num_envs: int = Field(10, gt=0)
    max_steps: int = Field(
        100_000, gt=0, description="Safety cap on steps per evaluation (per environment)."
    )
    short_run_bound: bool = Field(
        True,
        description="Cap the final evaluation at max(total_timesteps, 2000) agent steps "
        "when max_steps x num_envs is more (a smoke run is not held up by full ALE games).",
    )


class CheckpointConfig(Section):
    """Checkpoints under ``run_dir/checkpoints``."""

    every_epochs: int = Field(25, ge=0, description="Checkpoint every N epochs; 0 = never.")
    at_end: bool = Field(True, description="Also checkpoint after the last epoch.")
    keep_last: int = Field(3, gt=0, description="Keep the newest K checkpoints.")
