"""Vector-env state capture: a restored env continues exactly as the original would."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from trainers.config import EnvConfig
from trainers.env_state import EnvStateError, capture_env_state, restore_env_state
from trainers.envs import make_vector_env


def roll(env, actions) -> list:
    out = []
    for a in actions:
        obs, rew, term, trunc, info = env.step(a)
        out.append(
            (
                obs.copy(),
                np.asarray(rew).copy(),
                term.copy(),
                trunc.copy(),
                {k: str(v) for k, v in info.items()},
            )
        )
    return out


@pytest.mark.parametrize(
    ("env_id", "mode"),
    [("CartPole-v1", "sync"), ("CartPole-v1", "vector_entry_point"), ("Pendulum-v1", "sync")],
)
def test_restored_env_continues_identically(env_id: str, mode: str) -> None:
    cfg = EnvConfig(id=env_id, num_envs=3, vectorization=mode)
    rng = np.random.default_rng(0)
    original = make_vector_env(cfg)
    original.reset(seed=11)
    sample = (
        (lambda: rng.integers(0, 2, size=3))
        if env_id.startswith("Cart")
        else (lambda: rng.uniform(-2, 2, size=(3, 1)).astype(np.float32))
    )
    roll(original, [sample() for _ in range(40)])  # mid-episode, some envs already reset
    state = capture_env_state(original)
    buf = io.BytesIO()
    torch.save(state, buf)  # the state survives a weights_only round trip
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    actions = [sample() for _ in range(300)]  # CartPole episodes end within these
    expected = roll(original, actions)
    fresh = make_vector_env(cfg)
    fresh.reset(seed=999)  # a different seed: everything must come from the checkpoint
    restore_env_state(fresh, loaded)
    got = roll(fresh, actions)
    for (o1, r1, t1, u1, i1), (o2, r2, t2, u2, i2) in zip(expected, got, strict=True):
        assert np.array_equal(o1, o2) and np.array_equal(r1, r2)
        assert np.array_equal(t1, t2) and np.array_equal(u1, u2)
        assert i1.keys() == i2.keys()
    assert any(t.any() or u.any() for _, _, t, u, _ in expected)


def test_async_env_is_refused_with_a_clear_error() -> None:
    env = make_vector_env(EnvConfig(id="CartPole-v1", num_envs=2, vectorization="async"))
    try:
        with pytest.raises(EnvStateError, match="other processes.*vectorization=sync"):
            capture_env_state(env)
    finally:
        env.close()


def test_restore_into_a_different_stack_is_refused() -> None:
    state = capture_env_state(
        make_vector_env(EnvConfig(id="CartPole-v1", num_envs=2, vectorization="sync"))
    )
    other = make_vector_env(EnvConfig(id="CartPole-v1", num_envs=3, vectorization="sync"))
    with pytest.raises(EnvStateError, match="stack differs"):
        restore_env_state(other, state)
