"""Gymnasium vector environments for training and evaluation.

The stack, innermost first: the Atari preprocessing of ALE ids (:func:`atari_wrappers`),
the vector env (``gym.make_vec``; with ``env.backend=envpool``, EnvPool's C++ engine doing
the same preprocessing, :mod:`trainers.envpool_envs`), episode statistics on the raw
rewards, then the optional action clipping, observation permutation and normalisation
wrappers. The trainer relies on gymnasium's default ``NEXT_STEP`` autoreset (after a step
that ends an episode, the next ``step()`` returns the reset observation and ignores its
action) and refuses any other mode.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.wrappers import vector as vw

from trainers.config import AtariConfig, EnvConfig, is_atari


def atari_wrappers(cfg: AtariConfig) -> list[Callable[[gym.Env], gym.Env]]:
    """The per-env preprocessing of an ALE game: no-op starts, frame skip with max-pooling
    of the last two frames, grayscale resize, optional life-loss termination, frame stacking."""
    return [
        partial(
            gym.wrappers.AtariPreprocessing,
            noop_max=cfg.noop_max,
            frame_skip=cfg.frame_skip,
            screen_size=cfg.screen_size,
            terminal_on_life_loss=cfg.terminal_on_life_loss,
            grayscale_obs=True,
            scale_obs=False,  # uint8 frames: the policy scales by 1/255
        ),
        partial(gym.wrappers.FrameStackObservation, stack_size=cfg.frame_stack),
    ]


def make_vector_env(cfg: EnvConfig, num_envs: int | None = None, gamma: float = 0.99) -> VectorEnv:
    """The wrapped vector env described by ``cfg``, not reset yet (``num_envs`` overrides
    its count; ``gamma`` is the discount of the return whose std scales rewards)."""
    n = cfg.num_envs if num_envs is None else num_envs
    if cfg.backend == "envpool":
        from trainers.envpool_envs import make_envpool_env  # imports envpool

        return _wrap(make_envpool_env(cfg, n), cfg, gamma)
    mode = None if cfg.vectorization == "auto" else cfg.vectorization
    if mode == "vector_entry_point" and gym.spec(cfg.id).vector_entry_point is None:
        raise ValueError(
            f"environment {cfg.id!r} registers no vector_entry_point; use "
            f"env.vectorization=sync or env.vectorization=async"
        )
    kwargs, wrappers = cfg.kwargs, None
    if is_atari(cfg.id):
        if mode == "vector_entry_point":
            raise ValueError(
                f"environment {cfg.id!r}: ale-py's own vector env does its preprocessing in C++ "
                f"and cannot take env.atari's wrappers; use env.vectorization=sync or async"
            )
        if cfg.kwargs.get("frameskip", 1) != 1:
            raise ValueError(
                f"environment {cfg.id!r}: env.kwargs.frameskip={cfg.kwargs['frameskip']!r}; "
                f"the game is made with frameskip=1 and AtariPreprocessing skips frames: set "
                f"env.atari.frame_skip instead"
            )
        # frame skipping is AtariPreprocessing's (max of the last two frames), not the game's
        kwargs, wrappers = {**cfg.kwargs, "frameskip": 1}, atari_wrappers(cfg.atari)
        mode = mode or "sync"
    env = gym.make_vec(cfg.id, num_envs=n, vectorization_mode=mode, wrappers=wrappers, **kwargs)
    autoreset = env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP)
    if autoreset != AutoresetMode.NEXT_STEP:
        env.close()
        raise ValueError(
            f"environment {cfg.id!r} uses autoreset mode {autoreset}; the PPO trainer needs "
            f"gymnasium's default AutoresetMode.NEXT_STEP"
        )
    return _wrap(env, cfg, gamma)


def _wrap(env: VectorEnv, cfg: EnvConfig, gamma: float) -> VectorEnv:
    """The wrappers every backend gets: episode statistics on the raw rewards, then the
    optional action clipping, permutation, normalisation and clipping of ``cfg``."""
    env = vw.RecordEpisodeStatistics(env)
    if isinstance(env.single_action_space, gym.spaces.Box):
        env = vw.ClipAction(env)
    elif not isinstance(env.single_action_space, gym.spaces.Discrete):
        env.close()
        raise ValueError(
            f"environment {cfg.id!r} has action space {env.single_action_space}; the PPO "
            f"trainer supports Discrete and Box actions"
        )
    if not isinstance(env.single_observation_space, gym.spaces.Box):
        env.close()
        raise ValueError(
            f"environment {cfg.id!r} has observation space {env.single_observation_space}; "
            f"the policy needs a Box observation space"
        )
    if cfg.permute_obs_every:
        env = PermuteObservation(env, cfg.permute_obs_every)
    if cfg.normalize_observation:
        env = vw.NormalizeObservation(env)
    if cfg.clip_observation is not None:
        c = cfg.clip_observation
        env = vw.TransformObservation(env, lambda obs: np.clip(obs, -c, c))
    if cfg.normalize_reward:
        env = vw.NormalizeReward(env, gamma=gamma)
    if cfg.clip_reward is not None:
        env = vw.ClipReward(env, -cfg.clip_reward, cfg.clip_reward)
    return env


class PermuteObservation(gym.vector.VectorObservationWrapper):
    """Permutes the features of flat observations, with a new permutation every ``every``
    agent steps (summed over the sub-envs; a reset does not restart the count): period
    ``agent_steps // every`` uses :func:`permutation_of_period` of the first seed given to
    ``reset``. Counter and seed are plain attributes, so a checkpoint of the env
    (:mod:`trainers.env_state`) resumes the same sequence of permutations.
    """

    def __init__(self, env: VectorEnv, every: int) -> None:
        super().__init__(env)
        space = env.single_observation_space
        if not isinstance(space, gym.spaces.Box) or len(space.shape) != 1:
            raise ValueError(
                f"env.permute_obs_every needs flat (1-D Box) observations; this env has "
                f"{space}; set env.permute_obs_every=0"
            )
        if every < 1:
            raise ValueError(f"env.permute_obs_every must be >= 1 here, got {every}")
        # every period permutes the bounds too: one box that holds them all
        low = np.full(space.shape, space.low.min(), dtype=space.dtype)
        high = np.full(space.shape, space.high.max(), dtype=space.dtype)
        self.single_observation_space = gym.spaces.Box(low, high, dtype=space.dtype)
        self.observation_space = gym.vector.utils.batch_space(
            self.single_observation_space, env.num_envs
        )
        self.every = every
        self.agent_steps = 0
        self.seed: int | None = None
        self._period = -1
        self._order = np.arange(space.shape[0])

    def reset(self, *, seed: int | None = None, options: dict | None = None):  # noqa: ANN201
        if self.seed is None and seed is not None:
            self.seed = int(seed)
        return super().reset(seed=seed, options=options)

    def step(self, actions):  # noqa: ANN001, ANN201
        self.agent_steps += self.num_envs
        return super().step(actions)

    def observations(self, observations: np.ndarray) -> np.ndarray:
        return observations[:, self.permutation()]

    def permutation(self) -> np.ndarray:
        """The feature order of the current period."""
        period = self.agent_steps // self.every
        if period != self._period:
            self._order = permutation_of_period(self._order.shape[0], self.seed or 0, period)
            self._period = period
        return self._order


def permutation_of_period(n: int, seed: int, period: int) -> np.ndarray:
    """The feature order of ``period``: the identity for period 0, else
    ``np.random.default_rng([seed, period]).permutation(n)``, redrawn while it equals the
    previous period's."""
    order = np.arange(n)
    previous = order
    for k in range(1, period + 1):
        rng = np.random.default_rng([seed, k])
        order = rng.permutation(n)
        while n > 1 and np.array_equal(order, previous):
            order = rng.permutation(n)
        previous = order
    return order


def find_wrapper(env: VectorEnv, cls: type) -> VectorEnv | None:
    """The outermost wrapper of type ``cls`` in ``env``'s stack, or None."""
    while True:
        if isinstance(env, cls):
            return env
        inner = getattr(env, "env", None)
        if inner is None or inner is env:
            return None
        env = inner


def copy_observation_normalization(src: VectorEnv, dst: VectorEnv) -> None:
    """Give ``dst`` the running observation statistics of ``src`` and freeze them there
    (evaluation envs must see observations scaled exactly as the policy was trained)."""
    a = find_wrapper(src, vw.NormalizeObservation)
    b = find_wrapper(dst, vw.NormalizeObservation)
    if a is None or b is None:
        return
    b.obs_rms.mean = np.array(a.obs_rms.mean, copy=True)
    b.obs_rms.var = np.array(a.obs_rms.var, copy=True)
    b.obs_rms.count = a.obs_rms.count
    b.update_running_mean = False
