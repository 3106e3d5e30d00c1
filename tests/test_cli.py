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
    # backward None: placed by the probe's own direction (add_training_hook)
    relu = {"component": "actor_mlp", "builder": "relu", "backward": None}
    assert relu | {"placement": {"per_layer": True}} in out["probes"]  # the recipe's placement


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


FAKE_RECIPE = '''
import json
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, PrivateAttr

CALLS = []


@dataclass
class Result:
    run_dir: Path
    last_checkpoint: Path | None = None
    eval_scores: dict = field(default_factory=dict)
    sink_failures: dict = field(default_factory=dict)
    rank: int = 0


class Tool(BaseModel):
    """A trainer that is not trainers.TrainTool: the CLI drives it through the protocol."""

    run_dir: str = "unset"
    lr: float = 0.1
    progress: bool = False
    _launch: dict = PrivateAttr(default_factory=dict)

    def invoke(self, *, resume=False, overwrite=False):
        CALLS.append({"lr": self.lr, "progress": self.progress, "resume": resume,
                      "launch": dict(self._launch)})
        Path(self.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(self.run_dir) / "config.json").write_text(json.dumps(self.resolved_config()))
        return Result(Path(self.run_dir))

    def record_launch(self, target, overrides):
        self._launch = {"recipe": target, "overrides": list(overrides)}

    def resolved_config(self):
        return {"tool": self.model_dump(), **self._launch}

    def check_setup(self, *, overwrite=False):
        return {}


class Partial(BaseModel):
    def invoke(self, *, resume=False, overwrite=False):
        return None


def train() -> Tool:
    return Tool()


def partial() -> Partial:
    return Partial()
'''


def test_a_runnable_that_is_not_train_tool_runs_and_resumes_through_one_path(tmp_path, capsys):
    import sys

    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "fake.py").write_text(FAKE_RECIPE)
    sys.path.insert(0, str(tmp_path))
    try:
        from fakepkg import fake

        run_dir = tmp_path / "run"
        assert main(["run", "fakepkg.fake.train", "lr=0.5", f"run_dir={run_dir}"]) == 0
        assert main(["resume", str(run_dir), "lr = 0.25", "--no-progress"]) == 0
        assert [c["lr"] for c in fake.CALLS] == [0.5, 0.25]
        assert [c["progress"] for c in fake.CALLS] == [True, False]
        assert [c["resume"] for c in fake.CALLS] == [False, True]
        assert fake.CALLS[1]["launch"] == {
            "recipe": "fakepkg.fake.train",
            "overrides": ["lr=0.5", "lr = 0.25", f'run_dir="{run_dir}"'],
        }
        assert f"run directory: {run_dir}" in capsys.readouterr().out
        assert main(["run", "--list", "--package", "fakepkg"]) == 0  # by protocol, not by name
        listed = capsys.readouterr().out
        assert "fakepkg.fake.train" in listed and "fakepkg.fake.partial" not in listed
        assert main(["run", "fakepkg.fake.partial"]) == 2
        assert capsys.readouterr().err == (
            "policy-probes: error: recipe fakepkg.fake.partial returned Partial; a recipe must "
            "return a TrainTool or another Runnable (policy_probes.runnable: a pydantic model "
            "with invoke(), record_launch(), resolved_config(), check_setup()); Partial has no "
            "record_launch(), resolved_config(), check_setup()\n"
        )
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("fakepkg")]:
            del sys.modules[name]


def test_runnable_decorator_checks_the_class_when_it_is_defined():
    from pydantic import BaseModel

    from policy_probes.runnable import Runnable, runnable
    from trainers import TrainTool

    assert isinstance(TrainTool(), Runnable)
    with pytest.raises(TypeError, match=r"NoResume is not a Runnable: it has no record_launch"):

        @runnable
        class NoResume(BaseModel):
            def invoke(self) -> None: ...

    with pytest.raises(TypeError, match="has an invoke\\(\\) without the resume and overwrite"):

        @runnable
        class Bare(BaseModel):
            def invoke(self) -> None: ...
            def record_launch(self, target, overrides) -> None: ...
            def resolved_config(self) -> dict: ...
            def check_setup(self, *, overwrite=False) -> dict: ...


def test_one_value_rule_for_overrides_and_hook_config():
    """Both former parsers in one rule: JSON, then Python's True/False/None, else the
    stripped text; --hook-config values follow it too (before, "True" stayed a string)."""
    from policy_probes.lifecycle.registry import parse_hook_config
    from policy_probes.overrides import parse_value as engine_parse_value

    assert engine_parse_value is parse_value
    cases = {
        "3": 3,
        " 2.5e-4 ": 2.5e-4,
        "true": True,
        "True": True,
        "None": None,
        "null": None,
        '{"a": [1, 2]}': {"a": [1, 2]},
        " runs/x ": "runs/x",
        "tanh": "tanh",
        "'q'": "'q'",
    }
    for text, value in cases.items():
        assert parse_value(text) == value and type(parse_value(text)) is type(value), text
    assert parse_value(7) == 7  # configuration given from Python: as it is
    parsed = parse_hook_config(["hessian.iters= 30", "norms.enabled=True", "x.name=a b"])
    assert parsed == {"hessian": {"iters": 30}, "norms": {"enabled": True}, "x": {"name": "a b"}}
    with pytest.raises(ValueError, match=r"hook config 'hessian' must look like name.param=value"):
        parse_hook_config(["hessian"])
