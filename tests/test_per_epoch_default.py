"""The default sampling is per epoch and reproducible: every epoch of a recipe run carries
every attached probe, in metrics.jsonl and in the offline W&B run alike, and two runs of
one seed give identical probe columns. (Resume after SIGKILL and fork at the default are
in test_resume.py and test_fork.py, whose tiny recipe runs at the default; SB3 and
RecurrentPPO in test_sb3_callback.py and test_recurrent.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from wandb_reader import history_rows, run_file, wandb_records

from policy_probes.cli import apply_overrides
from policy_probes.recipe_launch import build_from_recipe
from policy_probes.records import read_jsonl
from policy_probes.sampling import DEFAULT_STRIDE

REPO = Path(__file__).resolve().parent.parent
#: the cartpole recipe: 4 envs x 128 steps per epoch, 4 minibatches, 4 update epochs
ROLLOUT, MINIBATCHES, UPDATE_EPOCHS = 4 * 128, 4, 4
KEYS = ("probes/relu/actor_mlp/dead_fraction", "probes/fisher/actor_mlp/trace")
#: keys that measure time, not the run
WALL_CLOCK = ("probes/overhead_",)


def post_epoch(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["hook_point"] == "POST_EPOCH"]


def test_the_cli_run_reports_every_probe_in_every_epoch_to_jsonl_and_wandb(tmp_path):
    run_dir = tmp_path / "cp"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    argv = [sys.executable, "-m", "policy_probes.cli", "run", "recipes.cartpole.train"]
    argv += ["trainer.total_timesteps=4096", f"run_dir={run_dir}", "--no-progress"]
    argv += ["evaluation.episodes=2", "evaluation.num_envs=2"]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    records = post_epoch(run_dir)
    assert [r["epoch"] for r in records] == list(range(1, 9))
    rows_per_pass = ROLLOUT // MINIBATCHES
    passes = MINIBATCHES * UPDATE_EPOCHS
    for r in records:
        for key in KEYS:
            assert isinstance(r[key], float), (r["epoch"], key)
        # one pass in DEFAULT_STRIDE of every epoch, whole minibatches
        observed = -(-passes // DEFAULT_STRIDE)
        assert r["probes/relu/actor_mlp/passes_observed"] == observed
        # the trainer leaves out the steps it does not train on, so a minibatch holds
        # at most ROLLOUT / MINIBATCHES rows
        rows = r["probes/relu/actor_mlp/rows_observed"]
        assert 0 < rows <= observed * rows_per_pass
        assert r["probes/relu/actor_mlp/samples"] == rows
        assert r["probes/fisher/actor_mlp/samples"] == rows
        assert r["probes/relu/observe_every"] == DEFAULT_STRIDE
    rows = {
        row["epoch"]: row
        for row in history_rows(wandb_records(run_file(run_dir)))
        if KEYS[0] in row
    }
    assert sorted(rows) == list(range(1, 9))
    for r in records:
        for key in KEYS:
            assert rows[r["epoch"]][key] == r[key], (r["epoch"], key)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["probe_sampling"]["observe_every"]["relu"] == DEFAULT_STRIDE


def probe_columns(records: list[dict]) -> list[dict]:
    return [
        {k: v for k, v in r.items() if k.startswith("probes/") and not k.startswith(WALL_CLOCK)}
        for r in records
    ]


def run_cartpole(run_dir: Path, *overrides: str) -> list[dict]:
    torch.set_num_threads(1)
    tool = apply_overrides(
        build_from_recipe("recipes.cartpole.train"),
        [
            "trainer.total_timesteps=2048",
            f"run_dir={run_dir}",
            "sinks.console=false",
            "wandb.mode=disabled",
            "evaluation.every_epochs=0",
            "evaluation.at_end=false",
            "seed=5",
            *overrides,
        ],
    )
    tool.invoke()
    return post_epoch(run_dir)


@pytest.mark.parametrize("schedule", [None, "every_k:3"])
def test_two_runs_of_one_seed_give_identical_probe_columns(tmp_path, schedule):
    """Every probe value of every epoch equal, bit for bit (timings aside), at the
    default and with a fixed schedule that observes a different pass in each epoch."""
    overrides = [] if schedule is None else [f"probe_schedule={schedule}"]
    a = probe_columns(run_cartpole(tmp_path / "a", *overrides))
    b = probe_columns(run_cartpole(tmp_path / "b", *overrides))
    assert len(a) == 4 and all(KEYS[0] in r and KEYS[1] in r for r in a)
    assert a == b
