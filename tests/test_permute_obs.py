"""``env.permute_obs_every``: the observations are the plain env's with their features
reordered by the documented permutation of each period, switching exactly every N agent
steps, and a checkpointed env continues the same sequence."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from trainers.config import EnvConfig
from trainers.env_state import capture_env_state, restore_env_state
from trainers.envs import PermuteObservation, make_vector_env

SEED = 11
NUM_ENVS = 3
EVERY = 12  # agent steps: a new period every 4 vector steps


def expected_order(period: int, n: int = 4) -> np.ndarray:
    """The rule of the docs, written out: identity first, then a seeded draw per period
    (drawn again while equal to the previous period's)."""
    orders = [np.arange(n)]
    for k in range(1, period + 1):
        rng = np.random.default_rng([SEED, k])
        order = rng.permutation(n)
        while np.array_equal(order, orders[-1]):
            order = rng.permutation(n)
        orders.append(order)
    return orders[period]


def actions(step: int) -> np.ndarray:
    return np.array([(step + i) % 2 for i in range(NUM_ENVS)])


def test_observations_are_the_plain_envs_permuted_per_period():
    plain = make_vector_env(EnvConfig(num_envs=NUM_ENVS))
    permuted = make_vector_env(EnvConfig(num_envs=NUM_ENVS, permute_obs_every=EVERY))
    raw, _ = plain.reset(seed=SEED)
    obs, _ = permuted.reset(seed=SEED)
    np.testing.assert_array_equal(obs, raw)  # period 0: the identity
    seen = set()
    for step in range(1, 40):
        raw, *_ = plain.step(actions(step))
        obs, *_ = permuted.step(actions(step))
        period = step * NUM_ENVS // EVERY
        np.testing.assert_array_equal(obs, raw[:, expected_order(period)])
        seen.add(tuple(expected_order(period)))
    assert len(seen) > 3  # the orders really change
    assert permuted.single_observation_space.shape == (4,)
    assert permuted.single_observation_space.contains(obs[0])


def test_a_restored_env_continues_the_same_permutations():
    cfg = EnvConfig(num_envs=NUM_ENVS, permute_obs_every=EVERY)
    env = make_vector_env(cfg)
    env.reset(seed=SEED)
    for step in range(1, 10):
        env.step(actions(step))
    saved = capture_env_state(env)
    fresh = make_vector_env(cfg)
    fresh.reset(seed=SEED + 100)  # as a resume does before restoring
    restore_env_state(fresh, saved)
    for step in range(10, 30):
        a, *_ = env.step(actions(step))
        b, *_ = fresh.step(actions(step))
        np.testing.assert_array_equal(a, b)


def test_permutation_needs_flat_observations():
    env = gym.make_vec("CartPole-v1", num_envs=1)
    env.single_observation_space = gym.spaces.Box(0, 1, (2, 2))
    with pytest.raises(ValueError, match="flat"):
        PermuteObservation(env, 4)
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        EnvConfig(permute_obs_every=-1)
