"""Issue 42, item 21: dead ends. Every state a kill, a refusal or a second script leaves
behind has a working next step, and the advice names it: a fork killed while it starts
is started again by the same fork command; killing ``arms`` stops its children and a
rerun continues them; a second SB3 script takes ``resume=True`` / ``overwrite=True``; a
finished run without a checkpoint is not silently retrained; ``--dry-run`` refuses what
``run`` refuses and removes nothing; ``arms --measure`` refuses a key it does not know."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cli_error_line
from run_control_support import (
    EPOCHS,
    RECIPE,
    assert_same_params,
    epoch_lines,
    final_params,
    wait_for,
)

from policy_probes.cli import apply_overrides, main
from policy_probes.recipe_launch import build_from_recipe
from policy_probes.records import read_jsonl
from policy_probes.run_lock import RunDirLock, lock_owner, pid_alive

FORK_EPOCH = 3
#: the tiny recipe, with a hook that SIGKILLs the process as its first rollout starts
#: when TEST_KILL_AT=rollout: after config.json and the metric files, before any record
KILL_RECIPE = RECIPE.replace(
    "def train() -> TrainTool:",
    """class KillAtStart(TrainerHook):
    def on_rollout_start(self, state):
        if os.environ.get("TEST_KILL_AT") == "rollout":
            os.kill(os.getpid(), 9)


def train() -> TrainTool:""",
).replace("    return tool\n", "    tool.add_trainer_hook(KillAtStart())\n    return tool\n")


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``policy-probes ARGS`` as a real process (the test's PYTHONPATH, W&B off)."""
    full = {**os.environ, "WANDB_MODE": "disabled", **(env or {})}
    command = [sys.executable, "-m", "policy_probes.cli", *args]
    return subprocess.run(command, env=full, capture_output=True, text=True, timeout=600)


def digests(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("recipe") / "kill_recipe.py"
    path.write_text(KILL_RECIPE)
    return f"{path}:train"


@pytest.fixture(scope="module")
def parent(tmp_path_factory: pytest.TempPathFactory, target: str) -> Path:
    """A finished run of the tiny recipe with a checkpoint after every epoch."""
    run_dir = tmp_path_factory.mktemp("runs") / "parent"
    argv = ["run", target, f"run_dir={run_dir}", "checkpoint.every_epochs=1", "--no-progress"]
    assert main(argv) == 0
    return run_dir


# ------------------------------------------------------------- a fork killed while starting
def test_a_fork_killed_while_starting_is_started_again_by_the_same_fork_command(
    parent: Path, tmp_path: Path, capsys
) -> None:
    child = tmp_path / "child"
    fork = ["fork", str(parent), "--epoch", str(FORK_EPOCH), str(child), "--no-progress"]
    killed = cli(*fork, env={"TEST_KILL_AT": "rollout"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert json.loads((child / "config.json").read_text())["parent"]["epoch"] == FORK_EPOCH
    assert epoch_lines(child) == [] and not (child / "checkpoints").exists()

    assert main(fork) == 0  # the very command that was killed
    # an unchanged fork repeats its parent: the parent's own final parameters
    assert_same_params(final_params(child), final_params(parent))
    assert sorted(set(epoch_lines(child))) == list(range(FORK_EPOCH + 1, EPOCHS + 1))

    # a fork with epochs of its own is kept; the advice continues it with its parent
    line = cli_error_line(capsys, *fork)
    assert "already holds this fork" in line and f"resume {child}" in line


def test_a_fork_stopped_before_its_config_is_retried_and_resume_names_the_fork(
    parent: Path, tmp_path: Path, capsys
) -> None:
    """What a start killed before config.json leaves (its lock, empty metric files, as the
    code before the redesign left): resume cannot know the parent, so it names the fork
    command and shows the lock's command line; the fork command itself starts it."""
    child = tmp_path / "child"
    leave = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from policy_probes.run_lock import RunDirLock\n"
        "from policy_probes.sinks import SinksConfig, WandbConfig, build_sink_group\n"
        "run_dir = Path(sys.argv[1])\n"
        "run_dir.mkdir(parents=True)\n"
        "RunDirLock(run_dir).acquire()\n"
        "build_sink_group(run_dir, SinksConfig(console=False), WandbConfig(mode='disabled'), {})\n"
        "os.kill(os.getpid(), 9)\n"
    )
    proc = subprocess.run([sys.executable, "-c", leave, str(child)], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    line = cli_error_line(capsys, "resume", str(child))
    assert f"policy-probes fork PARENT --epoch N {child}" in line
    assert "its lock says" in line

    fork = ["fork", str(parent), "--epoch", str(FORK_EPOCH), str(child), "--no-progress"]
    assert main(fork) == 0
    assert_same_params(final_params(child), final_params(parent))
    assert json.loads((child / "config.json").read_text())["parent"]["epoch"] == FORK_EPOCH


# ------------------------------------------------------------------- killing arms
def child_pids(out: Path) -> dict[str, int]:
    """The pid in each child's run.lock (the children that have started)."""
    found = {}
    for lock in out.glob("parent/*/run.lock"):
        owner = lock_owner(lock.parent)
        if owner and isinstance(owner.get("pid"), int):
            found[lock.parent.name] = owner["pid"]
    return found


def test_killing_arms_stops_its_children_and_a_rerun_continues_them(
    parent: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "arms"  # one arm, one child: what holds for one holds for each
    args = ["arms", str(parent), "--epoch", "2", "--arm", "none", "--out", str(out), "--no-report"]
    env = {**os.environ, "WANDB_MODE": "disabled", "TEST_MB_SLEEP": "0.5"}  # ~4 s an epoch
    command = [sys.executable, "-m", "policy_probes.cli", *args]

    earlier: set[int] = set()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        arms = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)

        def started(earlier: set[int] = earlier) -> bool:  # this attempt's child runs
            pids = set(child_pids(out).values()) - earlier
            return len(pids) == 1 and all(pid_alive(p) for p in pids)

        wait_for(started, arms, timeout=300)
        pids = child_pids(out)
        earlier |= set(pids.values())
        arms.send_signal(sig)
        _, err = arms.communicate(timeout=300)
        assert arms.returncode == (143 if sig == signal.SIGTERM else -signal.SIGKILL)
        if sig == signal.SIGTERM:  # arms waited for its children, and says what to do
            assert not any(pid_alive(p) for p in pids.values())
            assert "run the same command again" in err
        # SIGKILL: the kernel sends each child SIGTERM (no orphan keeps training)
        wait_for(lambda pids=pids: not any(pid_alive(p) for p in pids.values()), timeout=300)

    # a live run in a child's directory: refused up front, saying what to do
    with RunDirLock(out / "parent" / "none"):
        line = cli_error_line(capsys, *args)
    assert "still training" in line and "ctl" in line

    assert main(args) == 0
    text = (out / "parent" / "none.log").read_bytes()
    assert b"\0" not in text
    assert text.count(b"--- policy-probes arms") == 3  # every attempt's lines are kept
    parent_rows = {r["epoch"]: r for r in read_jsonl(parent / "metrics.jsonl")}
    rows = read_jsonl(out / "parent" / "none" / "metrics.jsonl")
    post = [r for r in rows if r["hook_point"] == "POST_EPOCH"]
    assert [r["epoch"] for r in post] == list(range(3, EPOCHS + 1))  # each epoch once
    ret = "rollout/episode_return"
    assert [r.get(ret) for r in post] == [parent_rows[e].get(ret) for e in range(3, EPOCHS + 1)]
    assert_same_params(final_params(out / "parent" / "none"), final_params(parent))


def test_arms_refuses_an_unknown_measure_before_training(
    parent: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "arms"
    args = ["arms", str(parent), "--epoch", "2", "--arm", "none", "--out", str(out)]
    line = cli_error_line(capsys, *args, "--measure", "dormant_fracton")
    assert "'dormant_fracton'" in line and "did you mean dormant_fraction" in line
    assert not (out / "parent").exists()  # no child was started
    line = cli_error_line(capsys, *args, "--measure", "no_such_metric_at_all")
    assert "is not a measure" in line and "did you mean" not in line
    assert "return_last" in line and "dormant_fraction" in line


# --------------------------------------------------------------------- SB3 second script
def test_a_second_sb3_script_takes_the_resume_or_overwrite_its_error_advises(tmp_path) -> None:
    from conftest import sb3_cartpole

    from policy_probes import attach_relu_activation_hooks
    from policy_probes.integrations.sb3 import ProbeCallback
    from policy_probes.probe_settings import ProbeSettings
    from policy_probes.run import RunDirConflict
    from policy_probes.sinks import SinksConfig

    rows = 2 * 16  # n_envs * n_steps: one cycle

    def script(cycles: int, **options: bool) -> None:
        model = sb3_cartpole(seed=1)
        callback = ProbeCallback(
            probes=[("actor_mlp", attach_relu_activation_hooks())],
            run_dir=tmp_path,
            probing=ProbeSettings(sinks=SinksConfig(console=False, wandb=False)),
            **options,
        )
        model.learn(cycles * rows, callback=callback)

    script(2)
    with pytest.raises(RunDirConflict) as refused:
        script(1)
    message = str(refused.value)
    assert "resume=True" in message and "overwrite=True" in message and "ProbeCallback" in message

    script(3, resume=True)  # the records go on from the first script's last cycle
    epochs = [r["epoch"] for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert epochs == [1, 2, 3, 4, 5]
    script(1, overwrite=True)  # replaced: one cycle, numbered from 1
    assert [r["epoch"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1]
    with pytest.raises(ValueError, match="exclude each other"):
        ProbeCallback(run_dir=tmp_path, resume=True, overwrite=True)


# ------------------------------------------------ resume of a run without a checkpoint
def test_resume_refuses_a_finished_run_without_a_checkpoint(
    target: str, tmp_path: Path, capsys
) -> None:
    run_dir = tmp_path / "r"
    no_checkpoints = ["checkpoint.every_epochs=0", "checkpoint.at_end=false"]
    assert main(["run", target, f"run_dir={run_dir}", *no_checkpoints, "--no-progress"]) == 0
    before = digests(run_dir)
    line = cli_error_line(capsys, "resume", str(run_dir), "--no-progress")
    assert f"finished its {EPOCHS} epochs and holds no checkpoint" in line
    assert "nothing to resume from" in line and "--overwrite" in line
    assert digests(run_dir) == before  # nothing retrained, nothing rewritten


# ---------------------------------------------------------------- --dry-run and run agree
@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc (Linux)")
def test_dry_run_refuses_the_run_dirs_run_refuses(target: str, tmp_path: Path, capsys) -> None:
    dangling = tmp_path / "link"
    dangling.symlink_to(tmp_path / "gone")
    for run_dir in (dangling, dangling / "sub", Path("/proc"), Path("/proc/policy-probes-x")):
        argv = ["run", target, f"run_dir={run_dir}", "--no-progress"]
        line = cli_error_line(capsys, *argv)
        assert cli_error_line(capsys, *argv, "--dry-run") == line
        assert "symbolic link" in line if "link" in str(run_dir) else "not writable" in line
    assert not (tmp_path / "gone").exists()


def test_a_dry_run_says_what_it_would_remove_and_removes_nothing(
    target: str, parent: Path, tmp_path: Path, capsys, caplog: pytest.LogCaptureFixture
) -> None:
    aborted = tmp_path / "aborted"  # what a run killed while it started leaves
    aborted.mkdir()
    (aborted / "metrics.jsonl").write_text("")
    (aborted / "metrics.csv").write_text("")
    before = {d: digests(d) for d in (aborted, parent)}
    for run_dir, extra in ((aborted, []), (parent, ["--overwrite"])):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="policy_probes"):
            assert main(["run", target, f"run_dir={run_dir}", "--dry-run", *extra]) == 0
        said = [r.getMessage() for r in caplog.records if "remove" in r.getMessage()]
        assert len(said) == 1 and said[0].startswith("would remove the previous run's"), said
    assert {d: digests(d) for d in (aborted, parent)} == before
    capsys.readouterr()


# ------------------------------------------- item 18: probes on a compiled run's parameters
#: the tiny recipe without its two probes (and both without lifecycle hooks)
PROBED = RECIPE.replace('hooks=["norms"]', "hooks=[]")
BARE = PROBED.replace(
    '    tool.add_training_hook("actor_mlp", attach_relu_activation_hooks())\n', ""
).replace(
    '    tool.add_training_backward_hook("actor_mlp", attach_fisher_information_hooks())\n', ""
)
#: docs/compile.md: inductor runs with and without probes, 8 epochs of this recipe
INDUCTOR_RTOL = 1e-5


def trained(directory: Path, recipe: str, name: str, *overrides: str) -> dict[str, torch.Tensor]:
    """Final parameters of an 8-epoch in-process run of ``recipe``."""
    path = directory / f"{name}.py"
    path.write_text(recipe)
    tool = apply_overrides(
        build_from_recipe(f"{path}:train"),
        [f"run_dir={directory / name}", f"trainer.total_timesteps={64 * 8}", *overrides],
    )
    return tool.invoke().policy.state_dict()


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest ``max |a - b| / max |b|`` over the parameter tensors."""
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)


@pytest.mark.parametrize("backend", [None, "aot_eager", "inductor"])
def test_probes_change_a_compiled_runs_parameters_only_under_inductor_within_the_bound(
    tmp_path: Path, backend: str | None
) -> None:
    """Observed passes run eagerly: with no compile, or a backend whose kernels are
    eager's, the parameters with and without probes are bit-identical; inductor's kernels
    round differently from eager's, so they differ, by at most the documented bound."""
    if backend == "inductor" and shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("inductor on the CPU needs a C++ compiler")
    options = (
        [] if backend is None else ["trainer.compile=true", f"trainer.compile_backend={backend}"]
    )
    torch._dynamo.reset()
    probed = trained(tmp_path, PROBED, "probed", *options)
    torch._dynamo.reset()
    bare = trained(tmp_path, BARE, "bare", *options)
    torch._dynamo.reset()
    if backend == "inductor":
        assert relative_difference(probed, bare) <= INDUCTOR_RTOL
    else:
        assert_same_params(probed, bare)
