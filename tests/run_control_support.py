"""Helpers for the run-control and resume tests: a tiny recipe file, real subprocess runs,
an in-process uninterrupted baseline and the checks every test repeats."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from policy_probes.cli import apply_overrides
from policy_probes.recipe_launch import build_from_recipe
from trainers import TrainerHook
from trainers.checkpoint import list_checkpoints, load_checkpoint

EPOCHS = 6
#: seconds the recipe's SlowDown hook sleeps after each minibatch in a subprocess run
#: (8 minibatches per epoch: ~0.25 s per epoch, so a test can act between epochs)
MB_SLEEP = "0.03"


class StopAfter(TrainerHook):
    """Stops an in-process run at the end of epoch ``epoch`` (its checkpoint written):
    the first half of a stop-and-resume comparison."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_epoch_end(self, state) -> None:
        if state.epoch == self.epoch:
            state.stop_training = True


RECIPE = '''
import os
import time

from policy_probes.probes.fisher import attach_fisher_information_hooks
from policy_probes.probes.relu import attach_relu_activation_hooks
from trainers import EnvConfig, PolicyConfig, PPOConfig, TrainerHook, TrainTool


class SlowDown(TrainerHook):
    """Sleeps after every minibatch (TEST_MB_SLEEP seconds) so that a test can act
    while the run is in progress; sleeping changes nothing in the trajectory."""

    def __init__(self):
        self.delay = float(os.environ.get("TEST_MB_SLEEP", "0"))

    def on_mb_end(self, state):
        if self.delay:
            time.sleep(self.delay)


def train() -> TrainTool:
    tool = TrainTool(
        env=EnvConfig(id="CartPole-v1", num_envs=2),
        policy=PolicyConfig(hidden_sizes=[16, 16], activation="relu"),
        trainer=PPOConfig(
            total_timesteps=2 * 32 * EPOCHS, num_steps=32, num_minibatches=4, update_epochs=2
        ),
        evaluation={"every_epochs": 0, "at_end": False},
        checkpoint={"every_epochs": 2, "keep_last": 10},
        sinks={"console": False},
        wandb={"mode": "disabled"},
        hooks=["norms"],
        torch_threads=1,
        seed=5,
        # the default sampling (one pass in 16 of every epoch): resumed, forked and
        # uninterrupted runs observe the same passes
    )
    tool.add_training_hook("actor_mlp", attach_relu_activation_hooks())
    tool.add_training_backward_hook("actor_mlp", attach_fisher_information_hooks())
    tool.add_trainer_hook(SlowDown())
    return tool
'''.replace("EPOCHS", str(EPOCHS))


def write_recipe(directory: Path) -> str:
    """The recipe file in ``directory``; returns its CLI target."""
    path = directory / "tiny_recipe.py"
    path.write_text(RECIPE)
    return f"{path}:train"


def baseline_params(target: str, run_dir: Path, *overrides: str) -> dict[str, torch.Tensor]:
    """Final parameters of an uninterrupted in-process run of ``target``."""
    tool = apply_overrides(build_from_recipe(target), [*overrides, f"run_dir={run_dir}"])
    return tool.invoke().policy.state_dict()


def start_run(
    target: str, run_dir: Path, *overrides: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """``policy-probes run TARGET run_dir=... --no-progress`` as a real subprocess."""
    full_env = {
        **os.environ,
        "TEST_MB_SLEEP": MB_SLEEP,
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        **(env or {}),
    }
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "policy_probes.cli",
            "run",
            target,
            f"run_dir={run_dir}",
            *overrides,
            "--no-progress",
        ],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def epoch_lines(run_dir: Path) -> list[int]:
    """Epochs of the complete POST_EPOCH records in metrics.jsonl (so far)."""
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break  # being written
        record = json.loads(line)
        if record["hook_point"] == "POST_EPOCH":
            out.append(record["epoch"])
    return out


def wait_for(predicate, proc: subprocess.Popen | None = None, timeout: float = 60.0) -> None:
    """Poll ``predicate`` until true; fail with the run's output if it exits first."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"run exited with {proc.returncode} first:\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.02)


def wait_for_epoch(run_dir: Path, epoch: int, proc: subprocess.Popen) -> None:
    wait_for(lambda: epoch in epoch_lines(run_dir), proc)


def kill(proc: subprocess.Popen, sig: int = signal.SIGKILL, timeout: float = 60.0) -> int:
    proc.send_signal(sig)
    proc.communicate(timeout=timeout)
    return proc.returncode


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    """Parameters in the newest checkpoint (the end-of-training one once a run finished)."""
    newest = list_checkpoints(run_dir / "checkpoints")[-1]
    ckpt = load_checkpoint(newest)
    assert ckpt["epoch"] == EPOCHS and not ckpt["mid_epoch"], newest
    return ckpt["policy"]


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def assert_each_epoch_once(run_dir: Path, epochs: int = EPOCHS) -> list[dict[str, Any]]:
    """metrics.jsonl and metrics.csv hold whole records, one POST_EPOCH record per epoch
    1..epochs in order; returns the JSONL POST_EPOCH records."""
    raw = (run_dir / "metrics.jsonl").read_bytes()
    assert raw.endswith(b"\n")
    records = [json.loads(line) for line in raw.decode().splitlines()]
    main = [r for r in records if r["hook_point"] == "POST_EPOCH"]
    assert [r["epoch"] for r in main] == list(range(1, epochs + 1))
    assert [r["agent_step"] for r in main] == [64 * e for e in range(1, epochs + 1)]
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert all(None not in row and len(row) == len(rows[0]) for row in rows)  # no ragged rows
    csv_main = [int(r["epoch"]) for r in rows if r["hook_point"] == "POST_EPOCH"]
    assert csv_main == list(range(1, epochs + 1))
    return main
