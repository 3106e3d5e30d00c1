"""EnvPool backend of ALE games (``env.backend=envpool``): EnvPool's C++ engine steps the
games and does their preprocessing in its own threads, with the semantics of the gymnasium
route (:func:`trainers.envs.atari_wrappers`).

:func:`envpool_arguments` maps every ALE argument and ``env.atari`` setting to
``envpool.make``'s and refuses, naming the setting, what EnvPool cannot do the same way.
:class:`EnvPoolVectorEnv` presents the pool as a gymnasium ``VectorEnv`` (the default
``NEXT_STEP`` autoreset, as EnvPool's own; ``reset(seed=...)`` seeds it anew), so
:func:`trainers.envs.make_vector_env` puts the same wrappers on top as on the gymnasium
route: episode statistics on the raw rewards (full games, as episodic life is off),
then reward clipping. ``envpool`` is imported only when this backend is built.

What is the same, bit for bit with sticky actions off and one no-op frame
(``tests/test_envpool.py``): the emulator (ALE's reset, the game's frames), the no-op
frames after reset (one to ``noop_max``), ``frame_skip`` repeats of the action with the
max of the last two frames, ALE's grey palette, ``INTER_AREA`` resize, the stacked frames
(the reset frame repeated after a reset); sticky actions are ALE's own on both, per
emulator frame. What differs: the random draws (no-op counts and sticky actions come
from EnvPool's generators, seeded ``seed + i`` for env ``i``, not from numpy's), the
observation that ends an episode when the game ends before the last skipped frame (it is
never trained on: the next step is the autoreset step), and the time limit: EnvPool
counts agent steps from the end of the no-ops (``max_num_frames_per_episode /
frame_skip``), ALE counts frames from reset, no-ops included (up to
``ceil(noop_max / frame_skip)`` agent steps sooner).
"""

from __future__ import annotations

import math
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from trainers.config import EnvConfig

#: EnvPool's limit for "no time limit" (its step counter is a C int)
NO_LIMIT = 2**31 - 1
#: ale-py ``AtariEnv`` arguments with the value EnvPool can honour (None: any value)
ALE_ARGUMENTS: dict[str, Any] = {
    "game": None,
    "mode": None,
    "difficulty": None,
    "obs_type": None,  # the preprocessing reads ALE's grey screen whatever this is, but "ram"
    "frameskip": 1,
    "repeat_action_probability": None,
    "full_action_space": None,
    "max_num_frames_per_episode": None,
    "continuous": False,
    "continuous_action_threshold": None,  # used only with continuous=True
    "render_mode": None,
    "sound_obs": False,
}


def envpool_arguments(cfg: EnvConfig) -> tuple[str, dict[str, Any]]:
    """EnvPool's task id and ``envpool.make`` keyword arguments (all but ``num_envs`` and
    ``seed``) for the ALE game and preprocessing ``cfg`` describes. ``ValueError`` names
    each setting EnvPool cannot honour with the gymnasium route's meaning."""
    if cfg.vectorization in ("async", "vector_entry_point"):
        raise ValueError(
            f"env.vectorization={cfg.vectorization} applies to env.backend=gymnasium; "
            f"EnvPool steps its games in its own threads: drop env.vectorization or use "
            f"env.backend=gymnasium"
        )
    if cfg.kwargs.get("frameskip", 1) != 1:
        raise ValueError(
            f"env.kwargs.frameskip={cfg.kwargs['frameskip']!r}: frames are skipped by the "
            f"preprocessing (max of the last two): set env.atari.frame_skip instead"
        )
    ale = {**gym.spec(cfg.id).kwargs, **cfg.kwargs, "frameskip": 1}
    for key, value in ale.items():
        if key not in ALE_ARGUMENTS:
            raise ValueError(
                f"env.kwargs.{key}: EnvPool's Atari engine has no such setting (it takes "
                f"{', '.join(sorted(ALE_ARGUMENTS))}); drop it or use env.backend=gymnasium"
            )
        wanted = ALE_ARGUMENTS[key]
        if wanted is not None and value != wanted:
            raise ValueError(
                f"env.kwargs.{key}={value!r}: EnvPool supports only {key}={wanted!r}; "
                f"drop it or use env.backend=gymnasium"
            )
    if ale.get("obs_type", "rgb") not in ("rgb", "grayscale"):
        raise ValueError(
            f"env.kwargs.obs_type={ale['obs_type']!r}: the Atari preprocessing makes grey "
            f"frames; EnvPool has no RAM observations: use env.backend=gymnasium"
        )
    if ale.get("render_mode") is not None:
        raise ValueError(
            f"env.kwargs.render_mode={ale['render_mode']!r}: EnvPool's Atari engine does not "
            f"render; drop it or use env.backend=gymnasium"
        )
    a = cfg.atari
    if a.terminal_on_life_loss:
        raise ValueError(
            "env.atari.terminal_on_life_loss=true restarts the game after every lost life on "
            "the gymnasium route; EnvPool's episodic_life plays on with the next life "
            "(another task): use env.backend=gymnasium"
        )
    if a.noop_max < 1:
        raise ValueError(
            "env.atari.noop_max=0: EnvPool always plays at least one no-op frame after a "
            "reset (and envpool 1.2 crashes on noop_max=0); set env.atari.noop_max>=1 "
            "(noop_max=1 is exactly one no-op frame on both backends) or use "
            "env.backend=gymnasium"
        )
    frames = ale.get("max_num_frames_per_episode")
    max_steps = NO_LIMIT if not frames else math.ceil(frames / a.frame_skip)
    game = str(ale["game"])
    task_id = "".join(part.capitalize() for part in game.split("_")) + "-v5"
    mode, difficulty = ale.get("mode"), ale.get("difficulty")
    kwargs = {
        "task": game,
        "frame_skip": a.frame_skip,
        "noop_max": a.noop_max,
        "img_height": a.screen_size,
        "img_width": a.screen_size,
        "stack_num": a.frame_stack,
        "gray_scale": True,
        "use_inter_area_resize": True,
        "use_fire_reset": False,  # AtariPreprocessing does not press FIRE after reset
        "episodic_life": False,
        "reward_clip": False,  # env.clip_reward's wrapper clips, after the statistics
        "zero_discount_on_life_loss": False,
        "repeat_action_probability": float(ale.get("repeat_action_probability", 0.25)),
        "full_action_space": bool(ale.get("full_action_space", False)),
        "max_episode_steps": max_steps,
        "mode": -1 if mode is None else int(mode),
        "difficulty": -1 if difficulty is None else int(difficulty),
    }
    return task_id, kwargs


def import_envpool() -> Any:
    """The ``envpool`` module, or an ``ImportError`` that says how to install it."""
    try:
        import envpool
    except ImportError as exc:
        raise ImportError(
            f"env.backend=envpool needs the envpool package ({exc}); install the extra: "
            f"pip install 'policy-probes[envpool]', or use env.backend=gymnasium"
        ) from None
    return envpool


class EnvPoolVectorEnv(VectorEnv):
    """An EnvPool Atari pool as a gymnasium ``VectorEnv`` with ``NEXT_STEP`` autoreset.

    EnvPool fixes its seeds when the pool is made, so the pool is made at the first
    ``reset`` and made again at every ``reset(seed=s)``: sub-env ``i`` is seeded ``s + i``,
    and a second ``reset(seed=s)`` replays the same games, as on the gymnasium route.
    Its state lives in C++: a checkpoint cannot capture it (:mod:`trainers.env_state`).
    """

    metadata = {"autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(self, task_id: str, num_envs: int, kwargs: dict[str, Any]) -> None:
        envpool = import_envpool()
        if task_id not in envpool.list_all_envs():
            raise ValueError(
                f"EnvPool has no Atari game {task_id!r} (env.kwargs.game="
                f"{kwargs['task']!r}); use env.backend=gymnasium for this game"
            )
        self._envpool, self._task_id, self._kwargs = envpool, task_id, dict(kwargs)
        try:  # checks mode, difficulty and the rest before the first reset
            spec = envpool.make_spec(task_id, num_envs=num_envs, **self._kwargs)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"EnvPool refuses the settings of {task_id}: {exc}") from None
        self.num_envs = num_envs
        self.single_observation_space = spec.gymnasium_observation_space
        self.single_action_space = spec.gymnasium_action_space
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self._pool: Any = None

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        if options:
            raise ValueError(f"EnvPoolVectorEnv.reset takes no options, got {options!r}")
        if self._pool is None or seed is not None:
            if seed is None:
                seed = int(np.random.SeedSequence().generate_state(1)[0] >> 1)
            self.close()
            self._pool = self._envpool.make(
                self._task_id,
                env_type="gymnasium",
                num_envs=self.num_envs,
                seed=int(seed),
                **self._kwargs,
            )
        obs, info = self._pool.reset()
        return obs, {"lives": info["lives"]}

    def step(
        self, actions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        if self._pool is None:
            raise RuntimeError("EnvPoolVectorEnv.step before reset")
        obs, reward, terminated, truncated, info = self._pool.step(np.asarray(actions))
        return obs, reward, terminated, truncated, {"lives": info["lives"]}

    def close(self, **kwargs: Any) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def make_envpool_env(cfg: EnvConfig, num_envs: int) -> EnvPoolVectorEnv:
    """The unwrapped EnvPool vector env of ``cfg`` (an ALE id), not reset yet."""
    task_id, kwargs = envpool_arguments(cfg)
    return EnvPoolVectorEnv(task_id, num_envs, kwargs)
