"""Reliability as a new user meets it (issue 17): every defect reproduced as a user would
meet it (the CLI as a subprocess, in-process ``main()``, or the public Python API) and
checked against what the user should see. ``docs/reliability.md`` lists each case.

Sections: the run_dir lock, resume overrides, one error path for the CLI, non-finite
inputs, ProbeSession (existing runs, phase inference), ranges, W&B after a crash, the
end-of-run summary and the demo.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cli
from run_control_support import (
    EPOCHS,
    assert_each_epoch_once,
    kill,
    start_run,
    wait_for,
    wait_for_epoch,
    write_recipe,
)
from test_reliability import _drop_dac_override
from torch import nn
from wandb_reader import history_rows, wandb_records

from policy_probes import ProbeSession, ProbeSettings, Run
from policy_probes.cli import main
from policy_probes.probes.relu import attach_relu_activation_hooks
from policy_probes.records import Record, read_jsonl
from policy_probes.run import RunDirConflict
from policy_probes.run_lock import LOCK_FILE, RunDirLock, RunDirLocked, lock_owner
from policy_probes.sinks import JSONLSink, SinksConfig, WandbConfig
from trainers import TrainerHook, TrainTool
from trainers.checkpoint import CheckpointError, list_checkpoints, load_checkpoint
from trainers.nonfinite_guard import (
    NonFiniteInputError,
    NonFiniteParametersError,
    describe_nonfinite_input,
    rollout_inputs_finite,
)

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
NO_WANDB = {"sinks": SinksConfig(console=False, csv=False), "wandb": WandbConfig(mode="disabled")}


def assert_one_line_error(proc: subprocess.CompletedProcess, *expected: str) -> str:
    """Exit status 2, no traceback, and one ``policy-probes: error:`` line holding
    every ``expected`` fragment; returns that line."""
    assert proc.returncode == 2, proc.stderr
    return assert_one_error_line(proc.stderr, *expected)


def assert_one_error_line(stderr: str, *expected: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("policy-probes")]
    assert len(lines) == 1, stderr
    for fragment in expected:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def run_main(capsys: pytest.CaptureFixture, *args: str) -> str:
    """In-process ``policy-probes ARGS`` that must exit 2; returns its stderr (the same
    code path as the subprocess; a traceback would fail the test with the exception)."""
    capsys.readouterr()
    assert main(list(args)) == 2
    return capsys.readouterr().err


# =========================================================================== 1. the lock
def test_a_live_run_refuses_resume_run_and_session_then_its_stale_lock_is_taken_over(tmp_path):
    target = write_recipe(tmp_path)
    run_dir = tmp_path / "run"
    # ~8 s per epoch (48 s in all): alive for the whole check however slowly the second
    # process starts (12 s in all was outlived under 12 parallel test workers); the check
    # kills it as soon as it is done, so the test is no slower
    proc = start_run(target, run_dir, env={"TEST_MB_SLEEP": "1.0"})
    try:
        wait_for(lambda: (run_dir / LOCK_FILE).is_file() and lock_owner(run_dir), proc)
        assert lock_owner(run_dir)["pid"] == proc.pid
        # `policy-probes resume` of the live run, as a second process
        resumed = cli("resume", str(run_dir), "--no-progress")
        assert_one_line_error(resumed, "is in use by a live run", f"pid {proc.pid}", "ctl")
        # `policy-probes run` into the same run_dir, and a ProbeSession there
        assert main(["run", target, f"run_dir={run_dir}", "--no-progress"]) == 2
        assert main(["run", target, f"run_dir={run_dir}", "--overwrite"]) == 2  # not deleted
        with pytest.raises(RunDirLocked, match=f"pid {proc.pid}"):
            ProbeSession(nn.Linear(2, 2), run=Run(run_dir), probing=ProbeSettings(**NO_WANDB))
        assert proc.poll() is None  # none of them disturbed the live run
    finally:
        assert kill(proc) == -signal.SIGKILL
    # kill -9 leaves the lock behind; its pid is gone, so resume takes it over
    assert lock_owner(run_dir)["pid"] == proc.pid
    assert main(["resume", str(run_dir), "--no-progress"]) == 0
    assert not (run_dir / LOCK_FILE).exists()  # released at the end
    assert_each_epoch_once(run_dir)


def test_lock_is_released_on_errors_and_refuses_a_second_holder_in_the_same_process(tmp_path):
    with RunDirLock(tmp_path) as lock:
        assert lock.held and lock_owner(tmp_path)["pid"] == os.getpid()
        with pytest.raises(RunDirLocked, match="already in use by this process"):
            RunDirLock(tmp_path).acquire()
    assert not (tmp_path / LOCK_FILE).exists()
    # a failing run releases it too
    tool = TrainTool(run_dir=tmp_path / "r", device="cpu").add_training_hook(
        "no_such_component", attach_relu_activation_hooks()
    )
    with pytest.raises(KeyError):
        tool.invoke()
    assert not (tmp_path / "r" / LOCK_FILE).exists()


# =========================================================================== 2. resume overrides
def tiny_args(run_dir: Path) -> list[str]:
    return [f"run_dir={run_dir}", "--no-progress", "wandb.mode=disabled"]


def test_a_failed_resume_leaves_config_json_as_it_was(tmp_path):
    target = write_recipe(tmp_path)
    run_dir = tmp_path / "run"
    assert main(["run", target, *tiny_args(run_dir)]) == 0
    before = (run_dir / "config.json").read_bytes()
    # an override the checkpoint cannot take: exit 2, nothing written
    assert main(["resume", str(run_dir), "policy.hidden_sizes=[128,128]"]) == 2
    assert (run_dir / "config.json").read_bytes() == before
    # a bad value: refused before anything is built
    assert main(["resume", str(run_dir), "trainer.learning_rate=fast"]) == 2
    assert (run_dir / "config.json").read_bytes() == before
    # so a plain resume still works
    assert main(["resume", str(run_dir), "--no-progress"]) == 0
    config = json.loads((run_dir / "config.json").read_text())
    assert config["train_tool"]["policy"]["hidden_sizes"] == [16, 16]
    assert not any("hidden_sizes" in o for o in config["overrides"])


# =========================================================================== 3./4. one error path
RECIPE_HEAD = """
from policy_probes.probes.fisher import attach_fisher_information_hooks
from policy_probes.probes.relu import attach_relu_activation_hooks
from trainers import TrainTool


def train() -> TrainTool:
    tool = TrainTool(
        env={"num_envs": 2},
        policy={"hidden_sizes": [8, 8]},
        trainer={"total_timesteps": 64, "num_steps": 32, "num_minibatches": 2, "update_epochs": 1},
        evaluation={"every_epochs": 0, "at_end": False},
        sinks={"console": False},
        wandb={"mode": "disabled"},
    )
"""

BAD_RECIPES = {
    "unknown_component": (
        'tool.add_training_hook("actor_mpl", attach_relu_activation_hooks())',
        ["unknown component 'actor_mpl'. Closest: actor_mlp"],
    ),
    "glob_matching_nothing": (
        'tool.add_training_hook("policy_net.*", attach_relu_activation_hooks())',
        ["unknown glob pattern 'policy_net.*'"],
    ),
    "builder_without_parentheses": (
        'tool.add_training_hook("actor_mlp", attach_relu_activation_hooks)',
        ["did you forget the parentheses", "attach_relu_activation_hooks()"],
    ),
    "forward_probe_added_as_backward": (
        'tool.add_training_backward_hook("actor_mlp", attach_relu_activation_hooks())',
        ["'relu' probe is a forward probe", "add_training_hook"],
    ),
}


def bad_recipe(directory: Path, case: str) -> str:
    line, _ = BAD_RECIPES[case]
    path = directory / f"{case}.py"
    path.write_text(RECIPE_HEAD + f"    {line}\n    return tool\n")
    return f"{path}:train"


@pytest.mark.parametrize("case", sorted(BAD_RECIPES))
def test_recipe_mistakes_exit_2_in_one_line_and_dry_run_fails_the_same_way(tmp_path, capsys, case):
    target = bad_recipe(tmp_path, case)
    run_dir = tmp_path / "run"
    _, expected = BAD_RECIPES[case]
    # --dry-run builds the policy and attaches the probes: it fails where the run would
    dry = run_main(capsys, "run", target, f"run_dir={run_dir}", "--dry-run")
    line = assert_one_error_line(dry, *expected)
    assert assert_one_error_line(run_main(capsys, "run", target, f"run_dir={run_dir}")) == line
    if case == "unknown_component":  # once end to end, as a process
        assert_one_line_error(cli("run", target, f"run_dir={run_dir}"), *expected)
    # the failed run left nothing that blocks rerunning into the same run_dir
    assert not (run_dir / "config.json").exists() and not (run_dir / LOCK_FILE).exists()
    fixed = tmp_path / "fixed.py"
    fixed.write_text(
        RECIPE_HEAD
        + '    tool.add_training_hook("actor_mlp", attach_relu_activation_hooks())\n'
        + "    return tool\n"
    )
    assert main(["run", f"{fixed}:train", f"run_dir={run_dir}", "--no-progress"]) == 0
    assert [r["epoch"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1]


def test_environment_and_run_dir_mistakes_exit_2_in_one_line(tmp_path, capsys):
    target = write_recipe(tmp_path)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    err = run_main(capsys, "run", target, f"run_dir={blocker}")
    assert_one_error_line(err, "is a file", "choose a directory path")
    err = run_main(capsys, "run", target, f"run_dir={blocker / 'sub'}", "--dry-run")
    assert_one_error_line(err, f"'{blocker}' is a file")
    # a directory the user cannot write to (as root: without CAP_DAC_OVERRIDE)
    locked = tmp_path / "read_only"
    locked.mkdir(mode=0o555)
    preexec = _drop_dac_override if os.geteuid() == 0 else None
    ran = cli("run", target, f"run_dir={locked / 'run'}", preexec_fn=preexec)
    assert_one_line_error(ran, "is not writable", "choose a directory you can write to")
    if not torch.cuda.is_available():  # where CUDA exists, device=cuda is a valid choice
        err = run_main(capsys, "run", target, f"run_dir={tmp_path / 'gpu'}", "device=cuda")
        assert_one_error_line(err, "device=cuda requested but CUDA is not available")
        assert not (tmp_path / "gpu").exists()
    # resume --checkpoint of a file that does not exist
    run_dir = tmp_path / "run"
    assert main(["run", target, *tiny_args(run_dir)]) == 0
    missing = run_dir / "checkpoints" / "missing.pt"
    err = run_main(capsys, "resume", str(run_dir), "--checkpoint", str(missing))
    line = assert_one_error_line(err, f"'{missing}' does not exist")
    assert "epoch_000006.pt" in line  # names the ones there are


# =========================================================================== 5. non-finite input
POISON_RECIPE = """
import gymnasium as gym
import numpy as np
from policy_probes.probes.relu import attach_relu_activation_hooks
from trainers import EnvConfig, PolicyConfig, PPOConfig, TrainTool

POISON_ENV, FEATURE, AFTER = 1, 2, 2 * 32 + 5  # env 1, feature 2: epoch 3, rollout step 5
KIND = "KIND_VALUE"
_made = []


class Poison(gym.Wrapper):
    \"\"\"One env's observations from the AFTER-th on (counting the reset observation as
    the 0th, so the count is the vector step) carry NaN in one feature, or the rewards of
    the steps that return them are NaN.\"\"\"

    def __init__(self, env, poisoned):
        super().__init__(env)
        self.poisoned, self.seen = poisoned, -1

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self.seen += 1
        return self._obs(obs), info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.seen += 1
        if self.poisoned and self.seen >= AFTER and KIND == "reward":
            reward = float("nan")
        return self._obs(obs), reward, terminated, truncated, info

    def _obs(self, obs):
        if self.poisoned and self.seen >= AFTER and KIND == "obs":
            obs = np.array(obs, copy=True)
            obs[FEATURE] = np.nan
        return obs


def make(**kwargs):
    _made.append(None)
    return Poison(gym.make("CartPole-v1", **kwargs), poisoned=len(_made) - 1 == POISON_ENV)


gym.register("PoisonedCartPole-KIND_VALUE-v0", entry_point=make)


def train() -> TrainTool:
    tool = TrainTool(
        env=EnvConfig(id="PoisonedCartPole-KIND_VALUE-v0", num_envs=2),
        policy=PolicyConfig(hidden_sizes=[16, 16], activation="relu"),
        trainer=PPOConfig(
            total_timesteps=2 * 32 * 5, num_steps=32, num_minibatches=2, update_epochs=1
        ),
        evaluation={"every_epochs": 0, "at_end": True},
        checkpoint={"every_epochs": 1, "keep_last": 10},
        sinks={"console": False},
        wandb={"mode": "disabled"},
        torch_threads=1,
    )
    tool.add_training_hook("actor_mlp", attach_relu_activation_hooks())
    return tool
"""


def poison_recipe(directory: Path, kind: str) -> str:
    path = directory / f"poison_{kind}.py"
    path.write_text(POISON_RECIPE.replace("KIND_VALUE", kind))
    return f"{path}:train"


def test_a_nan_observation_feature_stops_the_run_naming_env_feature_and_step(tmp_path):
    run_dir = tmp_path / "run"
    ran = cli("run", poison_recipe(tmp_path, "obs"), f"run_dir={run_dir}", "--no-progress")
    assert ran.returncode == 2, ran.stderr
    assert "Traceback" not in ran.stderr and "final evaluation" not in ran.stdout
    # observation 69 of env 1 (the reset observation is the 0th) is stored at epoch 3,
    # rollout step 69 - 2 * 32 = 5: agent step 2 * 32 * 2 + 5 * 2 + 1 = 139
    assert (
        "non-finite input from env 1: observation feature 2 = nan at epoch 3, rollout step 5 "
        "(agent step 139)" in ran.stderr
    )
    # the last finite checkpoint is kept; none after it, none with NaN parameters
    saved = list_checkpoints(run_dir / "checkpoints")
    assert [p.name for p in saved] == ["epoch_000001.pt", "epoch_000002.pt"]
    assert f"the last finite checkpoint is {saved[-1]}" in ran.stderr
    for path in saved:
        assert all(torch.isfinite(t).all() for t in load_checkpoint(path)["policy"].values())
    epochs = [r["epoch"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert epochs == [1, 2]  # epoch 3 never trained on the NaN


def test_a_nan_reward_stops_the_run_through_the_python_api(tmp_path):
    sys.path.insert(0, str(tmp_path))
    try:
        poison_recipe(tmp_path, "reward")
        import poison_reward  # noqa: PLC0415 - the recipe file written above
    finally:
        sys.path.remove(str(tmp_path))
    tool = poison_reward.train().model_copy(update={"run_dir": tmp_path / "run"})
    with pytest.raises(
        NonFiniteInputError, match=r"from env 1: reward = nan at epoch 3, rollout step 4"
    ):
        tool.invoke()
    # the reward of the 69th step is the reward stored at step 68 - 64 = 4 of epoch 3
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == [
        "epoch_000001.pt",
        "epoch_000002.pt",
    ]


class PoisonWeights(TrainerHook):
    """Sets one actor weight to NaN at the end of epoch ``at`` (after its update)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_phase_end(self, state) -> None:
        if state.epoch == self.at:
            with torch.no_grad():
                next(state.policy.parameters()).view(-1)[0] = float("nan")


def test_no_checkpoint_is_written_with_non_finite_parameters(tmp_path):
    tool = TrainTool(
        run_dir=tmp_path,
        env={"num_envs": 2},
        policy={"hidden_sizes": [8, 8]},
        trainer={"total_timesteps": 64 * 4, "num_steps": 32, "num_minibatches": 2},
        evaluation={"every_epochs": 0, "at_end": False},
        checkpoint={"every_epochs": 1},
        **NO_WANDB,
    ).add_trainer_hook(PoisonWeights(at=3))
    with pytest.raises(NonFiniteParametersError, match=r"non-finite at epoch 3") as exc:
        tool.invoke()
    assert exc.value.exit_code == 2
    names = [p.name for p in list_checkpoints(tmp_path / "checkpoints")]
    assert names == ["epoch_000001.pt", "epoch_000002.pt"]


# =========================================================================== 6./7. ProbeSession
class Agent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.actor(x)


def session_epochs(run_dir: Path, n: int, **kw: object) -> list[int]:
    with ProbeSession(
        Agent(), run=Run(run_dir, **kw), probing=ProbeSettings(**NO_WANDB)
    ) as session:
        for step in range(n):
            session.log({"train/loss": float(step)})
            session.epoch_end(step=step)
    return [r["epoch"] for r in read_jsonl(run_dir / "metrics.jsonl")]


def test_probe_session_refuses_an_existing_run_unless_resumed_or_overwritten(tmp_path):
    assert session_epochs(tmp_path, 2) == [1, 2]
    with pytest.raises(RunDirConflict, match="resume=True to continue it, overwrite=True"):
        session_epochs(tmp_path, 2)
    assert [r["epoch"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]  # untouched
    assert session_epochs(tmp_path, 2, resume=True) == [1, 2, 3, 4]  # epochs go on
    assert session_epochs(tmp_path, 2, overwrite=True) == [1, 2]
    with pytest.raises(ValueError, match="exclude each other"):
        session_epochs(tmp_path, 1, resume=True, overwrite=True)


def test_probe_session_without_set_phase_does_not_record_no_grad_rollouts(tmp_path, caplog):
    """A CleanRL-style loop that never calls set_phase: its rollout forwards run under
    torch.no_grad() and must not enter the training statistics."""
    torch.manual_seed(0)
    agent = Agent()
    opt = torch.optim.Adam(agent.parameters(), lr=1e-3)
    rollout_batches = [torch.randn(4, 4) for _ in range(128)]  # 512 rows under no_grad
    train_rows: list[torch.Tensor] = []
    caplog.set_level(logging.WARNING, logger="policy_probes")
    with ProbeSession(agent, run=Run(tmp_path), probing=ProbeSettings(**NO_WANDB)) as session:
        session.add_training_hook("actor.1", attach_relu_activation_hooks())
        for obs in rollout_batches:
            with torch.no_grad():
                agent(obs)
        with torch.inference_mode():
            agent(torch.randn(8, 4))
        data = torch.cat(rollout_batches)
        for mb in data.split(64):  # 8 minibatches: 512 training rows
            out = agent.actor[:2](mb)  # the probed ReLU output, recorded by the hook
            train_rows.append(out.detach())
            opt.zero_grad()
            agent.actor[2](out).square().mean().backward()
            opt.step()
        metrics = session.epoch_end(step=512)
    rows = torch.cat(train_rows)
    assert metrics["probes/relu/actor.1/samples"] == rows.shape[0] == 512
    expected_active = (rows > 0).double().mean(0)
    assert metrics["probes/relu/actor.1/active_rate"] == pytest.approx(
        expected_active.tolist(), abs=1e-9
    )
    warned = [r for r in caplog.records if "no phase set" in r.getMessage()]
    assert len(warned) == 1  # once, not per forward


def test_set_phase_turns_the_inference_off(tmp_path):
    agent = Agent()
    with ProbeSession(agent, run=Run(tmp_path), probing=ProbeSettings(**NO_WANDB)) as session:
        session.add_training_hook("actor.1", attach_relu_activation_hooks(), phases=("rollout",))
        session.set_phase("rollout")
        with torch.no_grad():
            agent(torch.randn(10, 4))
        metrics = session.epoch_end(step=10)
    assert metrics["probes/relu/actor.1/samples"] == 10  # explicit phase: recorded


# =========================================================================== 8. ranges
def test_hook_config_and_cli_arguments_out_of_range_exit_2(tmp_path, capsys):
    target = write_recipe(tmp_path)
    base = ["run", target, f"run_dir={tmp_path / 'run'}", "--dry-run"]
    cases = [
        (
            ["--hooks", "hessian", "--hook-config", "hessian.iters=-2"],
            "iters: Input should be greater than or equal to 1",
        ),
        (
            ["--hooks", "hessian", "--hook-config", "hessian.tol=0"],
            "tol: Input should be greater than 0",
        ),
        (
            ["--hooks", "feature_rank", "--hook-config", "feature_rank.delta=1.5"],
            "delta: Input should be less than 1",
        ),
        (
            ["--hooks", "policy_fisher", "--hook-config", "policy_fisher.max_samples=0"],
            "max_samples",
        ),
        (
            [
                "--hooks",
                "norms",
                "--hook-config",
                "norms.min_epoch=5",
                "--hook-config",
                "norms.max_epoch=2",
            ],
            "min_epoch=5 is after max_epoch=2",
        ),
        (["--hooks", "counterfactual", "--hook-config", "counterfactual.replays=0"], "replays"),
    ]
    for extra, expected in cases:
        assert main([*base, *extra]) == 2, extra
        assert expected in capsys.readouterr().err, extra
    with pytest.raises(SystemExit) as exc:
        main(["report", str(tmp_path), "--max-heatmap-epochs", "-3"])
    assert exc.value.code == 2
    assert "--max-heatmap-epochs: must be >= 1, got -3" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["ctl", str(tmp_path), "stop", "--timeout", "0"])
    assert exc.value.code == 2
    # report --out where no file can be written
    sink = JSONLSink(tmp_path)
    sink.emit(Record.of({"train/value_loss": 1.0}, 0, "POST_EPOCH"))
    sink.close()
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    capsys.readouterr()
    assert main(["report", str(tmp_path), "--out", str(blocker / "report.html")]) == 2
    assert "cannot write the report" in capsys.readouterr().err


class Anything:
    """An object a training checkpoint never holds (weights_only refuses its global)."""


def test_a_corrupted_checkpoint_is_reported_without_torchs_weights_only_advice(tmp_path):
    path = tmp_path / "epoch_000001.pt"
    torch.save({"format": 1, "epoch": 1, "policy": {}, "x": Anything()}, path)
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(path)
    message = str(exc.value)
    assert "Unsupported global" in message and "unreadable" in message
    assert "weights_only" not in message and "\n" not in message


# =========================================================================== 9. W&B after a crash
def test_wandb_after_kill_and_resume_has_every_epoch_once_on_one_increasing_step(tmp_path):
    target = write_recipe(tmp_path)
    run_dir = tmp_path / "run"
    proc = start_run(target, run_dir, "wandb.mode=offline")
    wait_for_epoch(run_dir, 3, proc)  # checkpoints every 2 epochs: epoch 3 is logged twice
    assert kill(proc) == -signal.SIGKILL
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["epoch_000002.pt"]
    assert main(["resume", str(run_dir), "--no-progress", "wandb.mode=offline"]) == 0

    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2
    rows = [row for f in files for row in history_rows(wandb_records(f))]
    epochs = [row["epoch"] for row in rows if "train/policy_loss" in row]
    assert epochs == list(range(1, EPOCHS + 1))  # each once, in order
    steps = [row["_step"] for row in rows]
    assert steps == list(range(len(rows)))  # one step axis, continued by the resume
    # what W&B got for each epoch is what metrics.jsonl holds
    records = {r["epoch"]: r for r in assert_each_epoch_once(run_dir)}
    for row in rows:
        if "train/policy_loss" in row:
            assert row["train/policy_loss"] == pytest.approx(
                records[row["epoch"]]["train/policy_loss"], rel=1e-6
            )


# =========================================================================== 11. summary, demo
def summary_of_a_run(tmp_path: Path, path: str) -> str:
    """Stdout of a tiny CLI run into ``tmp_path/"my run"`` with offline W&B, with
    ``path`` as PATH."""
    target = write_recipe(tmp_path)
    run_dir = tmp_path / "my run"
    env = {**os.environ, "PATH": path, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    ran = subprocess.run(
        [sys.executable, "-m", "policy_probes.cli", "run", target, f"run_dir={run_dir}"]
        + ["--no-progress", "wandb.mode=offline"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    return ran.stdout


def test_end_of_run_summary_names_report_and_wandb_sync(tmp_path):
    bin_dir = Path(sys.executable).parent  # the environment activated: its scripts on PATH
    out = summary_of_a_run(tmp_path, f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    # paths quoted for the shell (a space in the run directory's name)
    assert f"policy-probes report '{tmp_path / 'my run'}'" in out
    assert f"wandb sync '{tmp_path / 'my run'}/wandb/'offline-run-*" in out


def test_the_demo_recipe_probes_say_what_they_measure(capsys):
    assert main(["run", "recipes.cartpole.train", "--dry-run"]) == 0
    resolved = json.loads(capsys.readouterr().out)
    assert resolved["train_tool"]["policy"]["activation"] == "relu"
    builders = {p["builder"] for p in resolved["probes"]}
    # a ReLU network gets the ReLU probes; saturation_tanh keys would read as tanh units
    assert not any(b.startswith("saturation") for b in builders)
    assert resolved["attached"]["actor_mlp"] == ["actor_mlp"] * len(
        [p for p in resolved["probes"] if p["component"] == "actor_mlp"]
    )
    readme = (ROOT / "README.md").read_text()
    assert "source .venv/bin/activate" in readme


def test_nan_guard_is_not_fooled_by_finite_runs(tmp_path):
    """A run with finite inputs is untouched by the guard (the control for the NaN tests)."""
    tool = TrainTool(
        run_dir=tmp_path,
        env={"num_envs": 2},
        policy={"hidden_sizes": [8, 8]},
        trainer={"total_timesteps": 128, "num_steps": 32, "num_minibatches": 2},
        evaluation={"every_epochs": 0, "at_end": False},
        **NO_WANDB,
    )
    result = tool.invoke()
    assert result.epochs == 2 and math.isfinite(result.metrics["train/policy_loss"])
    assert all(bool(torch.isfinite(p).all()) for p in result.policy.parameters())
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["epoch_000002.pt"]


def test_the_rollout_check_and_its_message_on_hand_made_rollouts():
    obs = torch.full((4, 2, 3), 3e38)  # finite, but their sum overflows float32
    rewards, last = np.zeros((4, 2), dtype=np.float32), np.zeros((2, 3), dtype=np.float32)
    assert rollout_inputs_finite(obs, rewards, last)
    assert rollout_inputs_finite(torch.zeros(4, 2, 3, dtype=torch.uint8), rewards, last)
    obs = torch.zeros(4, 2, 3)
    obs[2, 1, 0] = float("inf")
    rewards[3, 0] = float("nan")  # later than the observation: the observation is named
    assert not rollout_inputs_finite(obs, rewards, last)
    text = describe_nonfinite_input(
        obs, rewards, last, epoch=7, agent_step=100, last_checkpoint=None
    )
    assert "from env 1: observation feature 0 = inf at epoch 7, rollout step 2" in text
    assert "(agent step 105)" in text and "no checkpoint was written" in text  # 100 + 2*2 + 1
    obs[2, 1, 0] = 0.0
    last[0, 2] = float("nan")  # the bootstrap observation comes after every stored step
    text = describe_nonfinite_input(
        obs, rewards, last, epoch=7, agent_step=100, last_checkpoint=None
    )
    assert "from env 0: reward = nan at epoch 7, rollout step 3" in text
    rewards[3, 0] = 0.0
    assert not rollout_inputs_finite(obs, rewards, last)
    text = describe_nonfinite_input(
        obs, rewards, last, epoch=7, agent_step=100, last_checkpoint=None
    )
    assert (
        "observation feature 2 = nan" in text
        and "the observation after the rollout's last step" in text
    )
