"""trainers.envs.RecordEpisodeStatistics (the cheaper step) records exactly what
gymnasium's RecordEpisodeStatistics records, in every env stack make_vector_env builds."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium.wrappers import vector as vw

import trainers.envs as envs_module
from trainers import EnvConfig
from trainers.env_state import capture_env_state, restore_env_state
from trainers.envs import RecordEpisodeStatistics, find_wrapper, make_vector_env

CONFIGS = [
    EnvConfig(id="CartPole-v1", num_envs=4, vectorization="sync"),
    EnvConfig(id="CartPole-v1", num_envs=3, vectorization="vector_entry_point"),
    EnvConfig(
        id="Pendulum-v1",
        num_envs=2,
        vectorization="sync",
        normalize_observation=True,
        normalize_reward=True,
        clip_observation=5.0,
        clip_reward=5.0,
        kwargs={"max_episode_steps": 37},
    ),
]
STATE = ("episode_returns", "episode_lengths", "prev_dones", "episode_count")
QUEUES = ("return_queue", "length_queue")


def build_pair(cfg: EnvConfig, monkeypatch):
    ours = make_vector_env(cfg)
    with monkeypatch.context() as m:  # the same stack with gymnasium's wrapper
        m.setattr(envs_module, "RecordEpisodeStatistics", vw.RecordEpisodeStatistics)
        reference = make_vector_env(cfg)
    assert type(find_wrapper(ours, vw.RecordEpisodeStatistics)) is RecordEpisodeStatistics
    assert type(find_wrapper(reference, vw.RecordEpisodeStatistics)) is vw.RecordEpisodeStatistics
    return ours, reference


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.id}-{c.vectorization}")
def test_same_steps_infos_and_statistics_as_gymnasium(cfg, monkeypatch):
    ours, reference = build_pair(cfg, monkeypatch)
    a, b = ours.reset(seed=7), reference.reset(seed=7)
    np.testing.assert_array_equal(a[0], b[0])
    ours.action_space.seed(3)
    episodes = 0
    for _ in range(600):
        action = ours.action_space.sample()
        got, want = ours.step(action), reference.step(action)
        for x, y in zip(got[:4], want[:4], strict=True):
            np.testing.assert_array_equal(x, y)
        assert got[4].keys() == want[4].keys()
        if "episode" in want[4]:
            episodes += int(want[4]["_episode"].sum())
            np.testing.assert_array_equal(got[4]["_episode"], want[4]["_episode"])
            for k in ("r", "l"):
                np.testing.assert_array_equal(got[4]["episode"][k], want[4]["episode"][k])
                assert got[4]["episode"][k].dtype == want[4]["episode"][k].dtype
            assert got[4]["episode"]["t"].shape == want[4]["episode"]["t"].shape
        ra = find_wrapper(ours, vw.RecordEpisodeStatistics)
        rb = find_wrapper(reference, vw.RecordEpisodeStatistics)
        for name in STATE:
            np.testing.assert_array_equal(getattr(ra, name), getattr(rb, name), err_msg=name)
        for name in QUEUES:
            assert list(getattr(ra, name)) == list(getattr(rb, name)), name
        assert len(ra.time_queue) == len(rb.time_queue)
    assert episodes >= 6  # episode ends (and the steps after them) were exercised
    ours.close()
    reference.close()


def test_env_state_checkpoints_restore_across_the_two_classes(monkeypatch):
    """The class keeps gymnasium's name, so an env state captured with one wrapper
    restores into a stack built with the other (and the runs continue identically)."""
    cfg = CONFIGS[0]
    ours, reference = build_pair(cfg, monkeypatch)
    reference.reset(seed=1)
    reference.action_space.seed(2)
    for _ in range(30):
        reference.step(reference.action_space.sample())
    restore_env_state(ours, capture_env_state(reference))
    actions = np.random.default_rng(0).integers(0, 2, size=(100, cfg.num_envs))
    for action in actions:
        got, want = ours.step(action), reference.step(action)
        np.testing.assert_array_equal(got[1], want[1])
        if "episode" in want[4]:
            np.testing.assert_array_equal(got[4]["episode"]["r"], want[4]["episode"]["r"])
    ours.close()
    reference.close()
