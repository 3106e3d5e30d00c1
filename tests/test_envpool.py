"""The EnvPool backend of ALE games (``env.backend=envpool``, issue 41) against the
gymnasium route, and the Atari recipe's training unchanged by its probes.

How the routes are compared: **bit for bit** where the emulator is deterministic, i.e.
with sticky actions off (``repeat_action_probability=0``) and exactly one no-op frame
after each reset (``noop_max=1``: both routes draw the count from 1..noop_max), on a
fixed action sequence: every observation (but those that end an episode, see
:mod:`trainers.envpool_envs`), reward, termination, truncation and logged episode return
and length is equal. With the recipe's random draws (sticky actions, up to 30 no-ops) the
two routes draw from different generators, so :func:`test_recipe_settings_give_the_same_statistics`
compares statistics under a seeded random policy instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from trainers import AtariConfig, EnvConfig
from trainers.env_state import EnvStateError, capture_env_state
from trainers.envs import make_vector_env

pytest.importorskip("envpool")

ROOT = Path(__file__).resolve().parent.parent
BREAKOUT = "ALE/Breakout-v5"
DETERMINISTIC = {"kwargs": {"repeat_action_probability": 0.0}, "atari": AtariConfig(noop_max=1)}


def play(backend: str, actions: np.ndarray, seed: int, **env: object) -> list[tuple]:
    """``(obs, reward, terminated, truncated, episode)`` of every step of ``actions``
    (the reset first), on ``len(actions[0])`` envs of ``backend`` (``episode``: the
    (return, length) of episodes that ended at that step, by env)."""
    envs = make_vector_env(
        EnvConfig(id=BREAKOUT, num_envs=actions.shape[1], backend=backend, **env)
    )
    try:
        obs, _ = envs.reset(seed=seed)
        out = [(obs, None, None, None, {})]
        for a in actions:
            obs, reward, terminated, truncated, info = envs.step(a)
            ended = {}
            if "episode" in info:
                for i in np.flatnonzero(info["_episode"]):
                    ended[int(i)] = (float(info["episode"]["r"][i]), int(info["episode"]["l"][i]))
            out.append((obs, reward, terminated, truncated, ended))
        return out
    finally:
        envs.close()


def test_envpool_matches_gymnasium_frame_for_frame():
    """Breakout, 2 envs x 500 agent steps of a seeded random action sequence, sticky
    actions off, one no-op frame: the same frames, rewards, ends and episode statistics
    (games end within these steps, so the autoreset path is compared too)."""
    actions = np.random.default_rng(0).integers(0, 4, size=(500, 2))
    gym_steps = play("gymnasium", actions, seed=3, **DETERMINISTIC)
    pool_steps = play("envpool", actions, seed=3, **DETERMINISTIC)
    obs0 = pool_steps[0][0]
    assert obs0.shape == (2, 4, 84, 84) and obs0.dtype == np.uint8
    assert np.array_equal(gym_steps[0][0], obs0)
    compared, ends = 0, 0
    for k in range(1, len(actions) + 1):
        g, p = gym_steps[k], pool_steps[k]
        assert p[0].dtype == np.uint8
        assert np.array_equal(g[1], p[1]), f"rewards at step {k}"
        assert np.array_equal(g[2], p[2]) and np.array_equal(g[3], p[3]), f"ends at step {k}"
        assert g[4] == p[4], f"episode statistics at step {k}"
        ended = g[2] | g[3]
        ends += int(ended.sum())
        for i in np.flatnonzero(~ended):  # the observation that ends an episode may differ
            assert np.array_equal(g[0][i], p[0][i]), f"env {i}, step {k}"
            compared += 1
    assert ends >= 2 and compared >= 2 * len(actions) - ends
    assert sum(r for s in gym_steps for r, _ in s[4].values()) > 0  # points were scored


def test_a_seeded_reset_replays_the_same_games():
    """EnvPool fixes its seeds at construction; ``reset(seed=s)`` makes the pool anew, so
    two seeded resets replay the same random no-ops and sticky actions, and another seed
    plays other games (the gymnasium route's meaning of a seed)."""
    envs = make_vector_env(EnvConfig(id=BREAKOUT, num_envs=2, backend="envpool"))
    actions = np.random.default_rng(1).integers(0, 4, size=(60, 2))

    def frames(seed: int) -> np.ndarray:
        obs, _ = envs.reset(seed=seed)
        seen = [obs]
        for a in actions:
            seen.append(envs.step(a)[0])
        return np.stack(seen)

    try:
        a, b, c = frames(5), frames(5), frames(6)
    finally:
        envs.close()
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_recipe_settings_give_the_same_statistics():
    """The recipe's environment (sticky actions 0.25, 1-30 no-op frames) under a seeded
    uniform random policy, 8 envs x 500 steps per route (about 20 games each). The draws
    differ, so statistics are compared: the mean episode length and return within 4
    standard errors of the difference of the means (random-play Breakout games last
    ~190 agent steps, std ~60, and score ~1.4, std ~1.5: a route that pressed FIRE at
    reset, ended at each lost life or skipped frames otherwise would be off by far
    more), and the mean of the newest frame's pixels within 1 % (measured 41.58 and
    41.57 over 1,500 steps; the screen is mostly the wall and the bricks)."""
    stats = {}
    for backend in ("gymnasium", "envpool"):
        envs = make_vector_env(EnvConfig(id=BREAKOUT, num_envs=8, backend=backend))
        rng = np.random.default_rng(7)
        lengths, returns, pixels = [], [], []
        try:
            envs.reset(seed=11)
            for _ in range(500):
                obs, _r, _t, _tr, info = envs.step(rng.integers(0, 4, 8))
                pixels.append(obs[:, -1].mean())
                if "episode" in info:
                    lengths.extend(info["episode"]["l"][info["_episode"]].tolist())
                    returns.extend(info["episode"]["r"][info["_episode"]].tolist())
        finally:
            envs.close()
        stats[backend] = (np.asarray(lengths, float), np.asarray(returns, float), np.mean(pixels))
    (lg, rg, pg), (lp, rp, pp) = stats["gymnasium"], stats["envpool"]
    assert lg.size >= 12 and lp.size >= 12
    for a, b in ((lg, lp), (rg, rp)):
        se = np.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)
        assert abs(a.mean() - b.mean()) <= 4 * se, (a.mean(), b.mean(), se)
    assert pp == pytest.approx(pg, rel=0.01)


# ------------------------------------------------------------------ settings refused
@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"atari": AtariConfig(terminal_on_life_loss=True)}, "env.atari.terminal_on_life_loss"),
        ({"atari": AtariConfig(noop_max=0)}, "env.atari.noop_max=0"),
        ({"kwargs": {"obs_type": "ram"}}, "env.kwargs.obs_type='ram'"),
        ({"kwargs": {"frameskip": 4}}, "set env.atari.frame_skip instead"),
        ({"kwargs": {"sound_obs": True}}, "env.kwargs.sound_obs=True"),
        ({"kwargs": {"render_mode": "human"}}, "env.kwargs.render_mode='human'"),
        ({"kwargs": {"mode": 99}}, "EnvPool refuses the settings of Breakout-v5"),
        ({"vectorization": "async"}, "env.vectorization=async"),
    ],
)
def test_settings_envpool_cannot_honour_are_refused(settings, message):
    with pytest.raises(ValueError) as info:
        make_vector_env(EnvConfig(id=BREAKOUT, num_envs=1, backend="envpool", **settings))
    assert message in str(info.value)


def test_envpool_backend_needs_an_ale_id():
    with pytest.raises(ValueError, match="env.backend=envpool runs ALE games only"):
        EnvConfig(id="CartPole-v1", backend="envpool")


def test_checkpoints_say_why_the_envpool_state_is_not_saved():
    envs = make_vector_env(EnvConfig(id=BREAKOUT, num_envs=1, backend="envpool"))
    try:
        envs.reset(seed=0)
        with pytest.raises(EnvStateError, match="EnvPool's C.. engine"):
            capture_env_state(envs)
    finally:
        envs.close()


def test_envpool_is_imported_only_when_chosen():
    """The gymnasium route (the default) builds and steps an ALE game without importing
    envpool (an extra, not a dependency of the core)."""
    code = (
        "import sys\n"
        "from trainers import EnvConfig\n"
        "from trainers.envs import make_vector_env\n"
        "envs = make_vector_env(EnvConfig(id='ALE/Breakout-v5', num_envs=1))\n"
        "envs.reset(seed=0)\n"
        "envs.step([1])\n"
        "envs.close()\n"
        "assert 'envpool' not in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]


# ------------------------------------------------------------------ the recipe
@pytest.mark.timeout(600)
def test_atari_recipe_trains_on_envpool_from_the_cli(tmp_path: Path):
    """``policy-probes run recipes.atari.train env.backend=envpool`` for 2,048 steps (8
    envs x 128 steps: 2 epochs) writes the recipe's probe keys and the rollout's episode
    statistics."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "policy_probes.cli",
        "run",
        "recipes.atari.train",
        "env.backend=envpool",
        "trainer.total_timesteps=2048",
        "evaluation.at_end=false",
        "checkpoint.at_end=false",
        "torch_threads=1",
        "sinks.wandb=false",
        "probe_budget=null",  # every pass: the last epoch has every key
        f"run_dir={run_dir}",
        "--no-progress",
    ]
    env = {**os.environ, "WANDB_MODE": "disabled", "WANDB_SILENT": "true"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["train_tool"]["env"]["backend"] == "envpool"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if r.get("hook_point") == "POST_EPOCH"]
    assert [r["agent_step"] for r in epochs] == [1024, 2048]
    last = epochs[-1]
    widths = {"encoder.conv_0": 32, "encoder.conv_1": 64, "encoder.conv_2": 64, "encoder.fc": 512}
    for name, width in widths.items():
        assert len(last[f"probes/relu/{name}/active_rate"]) == width
        assert last[f"probes/gradient_flow/{name}/mean"] > 0.0
    for name in ("encoder", "actor_head", "critic_head"):
        assert last[f"probes/fisher/{name}/trace"] > 0.0
    # 16 random-play Breakout games end in 2,048 steps: full games, returns of raw points
    finished = [r for r in epochs if r.get("rollout/episodes", 0) > 0]
    assert finished
    for r in finished:
        assert r["rollout/episode_length"] > 100  # five lives, not one
        assert r["rollout/episode_return"] >= 0.0


def train_atari(tmp_path: Path, name: str, probes: bool) -> tuple[dict, dict]:
    """Final parameters and last epoch's records of ``recipes.atari.train`` at 2,048
    steps, seed 1, with its probes observing every pass or with none."""
    from recipes.atari import train

    tool = train()
    if probes:
        tool.probe_budget = None  # every pass, not only the sampled ones
    else:
        tool = tool.model_copy(deep=True)
        private = {**tool.__pydantic_private__, "_builders": []}
        object.__setattr__(tool, "__pydantic_private__", private)
    tool = tool.model_copy(
        update={
            "run_dir": tmp_path / name,
            "device": "cpu",
            "seed": 1,
            "torch_threads": 1,
            "trainer": tool.trainer.model_copy(update={"total_timesteps": 2048}),
            "evaluation": tool.evaluation.model_copy(update={"at_end": False}),
            "checkpoint": tool.checkpoint.model_copy(update={"at_end": False}),
            "wandb": tool.wandb.model_copy(update={"mode": "disabled"}),
            "sinks": tool.sinks.model_copy(update={"console": False}),
        }
    )
    result = tool.invoke()
    return result.policy.state_dict(), result.metrics


@pytest.mark.timeout(900)  # two 2,048-step runs: 45 s at load 2, 4.5 minutes at load 10
def test_atari_recipe_probes_do_not_change_its_training(tmp_path: Path):
    """``recipes.atari.train`` (gymnasium route, sticky actions, 8 envs x 128 steps) at
    2,048 steps, seed fixed: the final parameters with the recipe's probes observing every
    pass equal those of the same run without probes, bit for bit."""
    with_probes, metrics = train_atari(tmp_path, "probes", probes=True)
    without, plain = train_atari(tmp_path, "none", probes=False)
    assert metrics["probes/fisher/encoder/trace"] > 0.0  # the probes did run
    assert not any(k.startswith("probes/relu") for k in plain)
    assert with_probes.keys() == without.keys()
    for k in with_probes:
        assert torch.equal(with_probes[k], without[k]), k
