"""The policy-probes CLI: run, overrides, unknown keys, bad values, --dry-run, --list."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from policy_probes.cli import apply_overrides, main, parse_value
from recipes.cartpole import train as cartpole

torch.set_num_threads(1)

FAST = [
    "trainer.total_timesteps=512",
    "wandb.mode=disabled",
    "sinks.console=false",
    "evaluation.every_epochs=0",
    "evaluation.episodes=2",
    "evaluation.num_envs=2",
]


def test_parse_value():
    assert parse_value("3") == 3 and isinstance(parse_value("3"), int)
    assert parse_value("2.5e-4") == 2.5e-4
    assert parse_value("true") is True and parse_value("False") is False
    assert parse_value("null") is None and parse_value("None") is None
    assert parse_value("[64, 64]") == [64, 64]
    assert parse_value("runs/cp3") == "runs/cp3"


def test_overrides_apply_validate_and_keep_builders():
    tool = cartpole()
    new = apply_overrides(
        tool,
        [
            "trainer.total_timesteps=1000",
            "policy.activation=tanh",
            "seed=3",
            "policy.hidden_sizes=[32,32]",
            "env.kwargs.max_episode_steps=100",
        ],
    )
    assert new.trainer.total_timesteps == 1000 and new.policy.activation == "tanh" and new.seed == 3
    assert new.policy.hidden_sizes == [32, 32] and new.env.kwargs == {"max_episode_steps": 100}
    assert len(new.hook_builders) == len(tool.hook_builders) == 8
    assert tool.trainer.total_timesteps == 200_000  # the original is untouched


def test_unknown_key_exits_2_with_closest(capsys):
    assert main(["run", "recipes.cartpole.train", "trainer.total_timestep=5"]) == 2
    err = capsys.readouterr().err
    assert "unknown configuration key 'trainer.total_timestep'" in err
    assert "trainer.total_timesteps" in err
    assert main(["run", "recipes.cartpole.train", "seed.value=1"]) == 2
    assert "has no sub-keys" in capsys.readouterr().err


def test_bad_values_exit_2(capsys):
    assert main(["run", "recipes.cartpole.train", "trainer.total_timesteps=-5"]) == 2
    assert "trainer.total_timesteps" in capsys.readouterr().err
    assert main(["run", "recipes.cartpole.train", "trainer.num_minibatches=100000"]) == 2
    assert "larger than the rollout batch" in capsys.readouterr().err
    assert main(["run", "recipes.cartpole.train", "policy.activation=rleu"]) == 2
    assert "unknown activation" in capsys.readouterr().err
    assert main(["run", "recipes.cartpole.train", "seed"]) == 2
    assert "key=value" in capsys.readouterr().err


def test_dry_run_prints_resolved_config(capsys):
    assert main(["run", "recipes.cartpole.train", "trainer.total_timesteps=4096", "--dry-run"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["train_tool"]["trainer"]["total_timesteps"] == 4096
    assert out["recipe"] == "recipes.cartpole.train"
    assert out["overrides"] == ["trainer.total_timesteps=4096"]
    assert {"component": "actor_mlp", "builder": "relu", "backward": False} in out["probes"]


def test_list_finds_recipes_without_running_them(capsys):
    assert main(["run", "--list"]) == 0
    out = capsys.readouterr().out
    for target in (
        "recipes.cartpole.train",
        "recipes.cartpole_tanh.train",
        "recipes.pendulum.train",
    ):
        assert target in out


def test_recipe_must_return_a_train_tool(tmp_path, capsys):
    f = tmp_path / "bad_recipe.py"
    f.write_text("def make():\n    return {'env': 'CartPole-v1'}\n")
    assert main(["run", f"{f}:make"]) == 2
    assert "returned dict; a recipe must return a TrainTool" in capsys.readouterr().err
    assert main(["run", f"{f}:maek"]) == 2
    assert "Did you mean make" in capsys.readouterr().err
    assert main(["run", "recipes.nope.train"]) == 2
    assert "cannot import recipe module" in capsys.readouterr().err


def test_run_from_file_target_writes_outputs(tmp_path, capsys):
    f = tmp_path / "my_recipe.py"
    f.write_text(
        "from trainers import TrainTool\n"
        "from policy_probes.probes.relu import attach_relu_activation_hooks\n"
        "def train() -> TrainTool:\n"
        "    t = TrainTool(policy={'activation': 'relu'}, torch_threads=1)\n"
        "    return t.add_training_hook('actor_mlp', attach_relu_activation_hooks())\n"
    )
    run_dir = tmp_path / "out"
    rc = main(["run", f"{f}:train", *FAST, f"run_dir={run_dir}", "seed=2", "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert str(run_dir) in out and "metrics.jsonl" in out
    config = json.loads((run_dir / "config.json").read_text())
    assert config["recipe"] == f"{f}:train" and "seed=2" in config["overrides"]
    assert config["train_tool"]["progress"] is False
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["epoch"] == 1 and "probes/relu/actor_mlp/dead_fraction" in rows[0]


def test_console_script_help():
    out = subprocess.run(
        [sys.executable, "-m", "policy_probes.cli", "run", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "key=value" in out and "--dry-run" in out and "--list" in out


@pytest.mark.parametrize("argv", [[], ["run"]])
def test_missing_target_is_usage_error(argv, capsys):
    assert main(argv) == 2
