"""Crash recovery and exact resume: a real run killed with SIGKILL (between epochs, while a
checkpoint is being written) resumes from its newest valid checkpoint to the parameters of
an uninterrupted run, with every epoch exactly once in metrics.jsonl and metrics.csv; a
corrupted checkpoint is named and skipped; a mid-epoch checkpoint resumes exactly; envs
whose state cannot be saved are re-seeded with a warning."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest
import torch
from run_control_support import (
    EPOCHS,
    assert_each_epoch_once,
    assert_same_params,
    kill,
    start_run,
    wait_for,
    wait_for_epoch,
)
from wandb_reader import history_rows, wandb_records

from policy_probes.cli import apply_overrides, main
from policy_probes.recipe_launch import build_from_recipe
from trainers import TrainerHook
from trainers.checkpoint import (
    SLOW_SAVE_ENV,
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
)
from trainers.run_control import RunStopped

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def baseline_records(recipe) -> list[dict]:
    """POST_EPOCH records of the uninterrupted baseline run."""
    target, _ = recipe
    return assert_each_epoch_once(Path(target.rpartition(":")[0]).parent / "baseline")


def assert_same_records(resumed: list[dict], plain: list[dict], approx_epoch: int = -1) -> None:
    """Every metric of every epoch equal (timings aside); probe sums of ``approx_epoch``
    (an epoch interrupted mid-update: its sums were reduced in two parts) to 1e-5."""
    for a, b in zip(resumed, plain, strict=True):
        assert a.keys() == b.keys()
        for key, value in b.items():
            if key == "time" or key.startswith(("perf/", "probes/overhead_")):
                continue
            if a["epoch"] == approx_epoch and key.startswith("probes/"):
                assert a[key] == pytest.approx(value, rel=1e-5), key
            else:
                assert a[key] == value, (a["epoch"], key)


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = load_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1])
    assert ckpt["epoch"] == EPOCHS and not ckpt["mid_epoch"]
    return ckpt["policy"]


@pytest.mark.parametrize("after_epoch", [1, 2, 3])
def test_sigkill_then_resume_equals_uninterrupted(recipe, baseline_records, tmp_path, after_epoch):
    target, baseline = recipe
    run_dir = tmp_path / "run"
    proc = start_run(target, run_dir)
    wait_for_epoch(run_dir, after_epoch, proc)
    assert kill(proc) == -signal.SIGKILL
    # checkpoints every 2 epochs, written just after the epoch's metrics: the kill may
    # also land between the two
    saved = list_checkpoints(run_dir / "checkpoints")
    assert [p.name for p in saved] in (
        [f"epoch_{e:06d}.pt" for e in range(2, after_epoch + 1, 2)],
        [f"epoch_{e:06d}.pt" for e in range(2, after_epoch, 2)],
    )
    if after_epoch == 3:
        # as if killed in the middle of writing a line: both files end in half a record
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write('{"epoch": 4, "agent_step": 256, "hook_po')
        with open(run_dir / "metrics.csv", "a") as f:
            f.write("4,256,POST_EP")
    assert main(["resume", str(run_dir), "--no-progress"]) == 0
    records = assert_each_epoch_once(run_dir)
    assert_same_params(final_params(run_dir), baseline)
    config = json.loads((run_dir / "config.json").read_text())
    if saved:
        assert config["resumed_from"] == str(saved[-1])
    else:  # killed before the first checkpoint: the run was replayed from its start
        assert "resumed_from" not in config
    # every metric as in the uninterrupted run: probes, losses, episode statistics and the
    # norms hook, whose initial weights the checkpoint carried
    assert any(k.startswith("norms/") for k in records[-1])
    assert_same_records(records, baseline_records)


def test_sigkill_while_a_checkpoint_is_written(recipe, tmp_path):
    target, baseline = recipe
    run_dir = tmp_path / "run"
    # the epoch-4 checkpoint sleeps between writing its temp file and renaming it
    proc = start_run(target, run_dir, env={SLOW_SAVE_ENV: "30@epoch_000004.pt"})
    ckpts = run_dir / "checkpoints"
    wait_for(lambda: any(ckpts.glob(".epoch_000004.pt.*.tmp")), proc)
    assert kill(proc) == -signal.SIGKILL
    assert [p.name for p in list_checkpoints(ckpts)] == ["epoch_000002.pt"]
    assert main(["resume", str(run_dir), "--no-progress"]) == 0
    assert not any(ckpts.glob(".*.tmp"))  # the dead temp file was cleaned up
    assert_each_epoch_once(run_dir)
    assert_same_params(final_params(run_dir), baseline)


def in_process_tool(target: str, run_dir: Path, *overrides: str):
    return apply_overrides(build_from_recipe(target), [*overrides, f"run_dir={run_dir}"])


def test_corrupted_checkpoint_is_named_and_skipped(recipe, tmp_path, caplog):
    target, baseline = recipe
    run_dir = tmp_path / "run"
    in_process_tool(target, run_dir, "checkpoint.every_epochs=1").invoke()
    newest = list_checkpoints(run_dir / "checkpoints")[-1]
    assert newest.name == f"epoch_{EPOCHS:06d}.pt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(CheckpointError, match=f"checkpoint {newest} is unreadable"):
        load_checkpoint(newest)

    caplog.set_level(logging.ERROR, logger="trainers")
    in_process_tool(target, run_dir, "checkpoint.every_epochs=1").invoke(resume=True)
    assert any(
        str(newest) in r.getMessage() and "unreadable" in r.getMessage() for r in caplog.records
    )
    assert json.loads((run_dir / "config.json").read_text())["resumed_from"].endswith(
        f"epoch_{EPOCHS - 1:06d}.pt"
    )
    assert_each_epoch_once(run_dir)
    assert_same_params(load_checkpoint(newest)["policy"], baseline)  # rewritten whole

    # every checkpoint unreadable: resume refuses with the files named
    for path in list_checkpoints(run_dir / "checkpoints"):
        path.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="no readable checkpoint") as info:
        in_process_tool(target, run_dir).invoke(resume=True)
    assert str(newest) in str(info.value)


class SignalAt(TrainerHook):
    """Sends this process SIGINT after optimizer step ``step`` (an in-process Ctrl-C)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_mb_end(self, state):
        if state.optimizer_step == self.step:
            os.kill(os.getpid(), signal.SIGINT)


def test_mid_epoch_checkpoint_resumes_exactly(recipe, baseline_records, tmp_path):
    target, baseline = recipe
    run_dir = tmp_path / "run"

    tool = in_process_tool(target, run_dir)
    tool.add_trainer_hook(SignalAt(19))  # epoch 3, update epoch 0, after its 3rd minibatch
    with pytest.raises(RunStopped) as info:
        tool.invoke()
    assert info.value.exit_code == 130
    assert info.value.checkpoint.name == "epoch_000003-step_000000019.pt"
    ckpt = load_checkpoint(info.value.checkpoint)
    assert ckpt["mid_epoch"]["update"]["next_minibatch"] == 3
    assert ckpt["mid_epoch"]["update"]["update_epoch"] == 0

    in_process_tool(target, run_dir).invoke(resume=True)
    assert_same_params(final_params(run_dir), baseline)
    assert_same_records(assert_each_epoch_once(run_dir), baseline_records, approx_epoch=3)


def test_async_envs_are_reseeded_with_a_warning(recipe, tmp_path, caplog):
    target, _ = recipe
    run_dir = tmp_path / "run"
    overrides = ("env.vectorization=async", "trainer.total_timesteps=128")
    in_process_tool(target, run_dir, *overrides).invoke()
    caplog.set_level(logging.WARNING, logger="trainers")
    result = in_process_tool(
        target, run_dir, "env.vectorization=async", "trainer.total_timesteps=192"
    ).invoke(resume=True)
    assert result.epochs == 3
    assert any(
        "re-seeded" in r.getMessage() and "AsyncVectorEnv" in r.getMessage() for r in caplog.records
    )
    assert_each_epoch_once(run_dir, epochs=3)


def test_resume_continues_the_same_wandb_run(recipe, tmp_path):
    target, _ = recipe
    run_dir = tmp_path / "run"
    tool = in_process_tool(target, run_dir, "wandb.mode=offline")
    tool.add_trainer_hook(SignalAt(19))  # stop in epoch 3: epochs 1-2 were logged
    with pytest.raises(RunStopped):
        tool.invoke()
    run_id = (run_dir / "wandb" / "policy_probes_run_id").read_text().strip()
    in_process_tool(target, run_dir, "wandb.mode=offline").invoke(resume=True)
    assert (run_dir / "wandb" / "policy_probes_run_id").read_text().strip() == run_id

    # both processes wrote offline files of the same run id; together they hold each
    # epoch's main record once (the stop checkpoint was exact: nothing to repeat)
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{run_id}.wandb" for f in files)
    epochs = [
        row["epoch"]
        for f in files
        for row in history_rows(wandb_records(f))
        if "train/policy_loss" in row
    ]
    assert sorted(epochs) == list(range(1, EPOCHS + 1))
