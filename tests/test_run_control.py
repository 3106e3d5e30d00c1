"""Run control against real `policy-probes run` subprocesses: SIGINT/SIGTERM stop with a
checkpoint and exit 130/143; `ctl pause|resume|checkpoint|stop` are served and
acknowledged; a run_dir holding another run is refused unless --overwrite or resume."""

from __future__ import annotations

import json
import re
import signal
import socket
from pathlib import Path

import pytest
import torch
from run_control_support import (
    assert_each_epoch_once,
    assert_same_params,
    epoch_lines,
    final_params,
    start_run,
    wait_for,
    wait_for_epoch,
)

from policy_probes.cli import main
from trainers.checkpoint import list_checkpoints, load_checkpoint

torch.set_num_threads(1)


def optimizer_step(ack: str) -> int:
    """The optimizer step a ``ctl`` acknowledgement names (``... (optimizer step N)``)."""
    match = re.search(r"\(optimizer step (\d+)\)", ack)
    assert match, ack
    return int(match[1])


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_checkpoints_flushes_and_exits_with_status(recipe, tmp_path, capsys, sig, status):
    target, baseline = recipe
    run_dir = tmp_path / "run"
    proc = start_run(target, run_dir)
    wait_for_epoch(run_dir, 1, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == status, err
    assert "finishing the current minibatch" in err and "policy-probes resume" in err

    # the stop checkpoint is the newest, written at a minibatch boundary after epoch 1
    newest = list_checkpoints(run_dir / "checkpoints")[-1]
    ckpt = load_checkpoint(newest)
    assert newest.name in err
    assert ckpt["optimizer_step"] >= 8  # at or after the end of epoch 1 (8 minibatches)
    if ckpt["mid_epoch"]:
        assert newest.name == f"epoch_{ckpt['epoch']:06d}-step_{ckpt['optimizer_step']:09d}.pt"
        done = ckpt["epoch"] - 1
    else:
        done = ckpt["epoch"]
    # every completed epoch was flushed whole to both metric files, none beyond
    assert_each_epoch_once(run_dir, epochs=done)
    assert not (run_dir / "control" / "run.json").exists()  # no longer serving ctl

    if sig == signal.SIGINT:  # resume to the end: the same parameters as never stopping
        assert main(["resume", str(run_dir), "--no-progress"]) == 0
        assert_each_epoch_once(run_dir)
        assert_same_params(final_params(run_dir), baseline)


def ctl(run_dir: Path, command: str, capsys) -> tuple[int, str]:
    code = main(["ctl", str(run_dir), command, "--timeout", "30"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_ctl_pause_checkpoint_resume_stop(recipe, tmp_path, capsys):
    target, baseline = recipe
    run_dir = tmp_path / "run"
    proc = start_run(target, run_dir)
    wait_for_epoch(run_dir, 1, proc)

    # paused inside epoch 2 or at an epoch's end: either is valid
    code, text = ctl(run_dir, "pause", capsys)
    assert code == 0 and text.startswith("acknowledged: paused "), text
    paused_at = optimizer_step(text)
    lines = len(epoch_lines(run_dir))

    # served while paused, at the step it paused at
    code, text = ctl(run_dir, "checkpoint", capsys)
    assert code == 0 and "acknowledged: checkpoint written" in text, text
    assert optimizer_step(text) == paused_at
    path = Path(text.rsplit(": ", 1)[1].strip())
    ckpt = load_checkpoint(path)
    assert path.parent == run_dir / "checkpoints" and ckpt["epoch"] >= 1
    assert ckpt["optimizer_step"] == paused_at
    assert len(epoch_lines(run_dir)) == lines and proc.poll() is None

    # nothing trained from the pause to the resume, however long it took
    code, text = ctl(run_dir, "resume", capsys)
    assert code == 0 and "acknowledged: resumed" in text, text
    assert optimizer_step(text) == paused_at
    wait_for(lambda: len(epoch_lines(run_dir)) > lines, proc)  # training goes on

    code, text = ctl(run_dir, "stop", capsys)
    assert code == 0 and "acknowledged: stopped by `policy-probes ctl stop`" in text, text
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    stop_ckpt = Path(text.split("checkpoint ", 1)[1].split(";", 1)[0])
    assert stop_ckpt == list_checkpoints(run_dir / "checkpoints")[-1]

    code, text = ctl(run_dir, "pause", capsys)  # nobody serves the channel any more
    assert code == 1 and "no running training run" in text

    # the run paused, checkpointed and stopped: resumed to the end it equals a plain run
    assert main(["resume", str(run_dir), "--no-progress"]) == 0
    assert_each_epoch_once(run_dir)
    assert_same_params(final_params(run_dir), baseline)


def test_ctl_checkpoint_does_not_change_the_trajectory(recipe, tmp_path, capsys):
    target, baseline = recipe
    run_dir = tmp_path / "run"
    proc = start_run(target, run_dir)
    wait_for_epoch(run_dir, 1, proc)
    code, text = ctl(run_dir, "checkpoint", capsys)  # inside epoch 2 or at an epoch's end
    assert code == 0 and "acknowledged: checkpoint written" in text, text
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert_each_epoch_once(run_dir)
    assert_same_params(final_params(run_dir), baseline)

    # that mid-epoch checkpoint resumes to the same end as well
    mid = Path(text.rsplit(": ", 1)[1].strip())
    assert main(["resume", str(run_dir), "--checkpoint", str(mid), "--no-progress"]) == 0
    assert_each_epoch_once(run_dir)
    assert_same_params(final_params(run_dir), baseline)


def test_run_dir_holding_a_run_is_refused_unless_overwrite(recipe, tmp_path, capsys):
    target, baseline = recipe
    run_dir = tmp_path / "run"
    assert main(["run", target, f"run_dir={run_dir}", "--no-progress"]) == 0
    capsys.readouterr()
    first = (run_dir / "config.json").read_text()

    assert main(["run", target, f"run_dir={run_dir}", "seed=6", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"run_dir '{run_dir}' already holds a run" in err
    assert "--overwrite" in err and f"policy-probes resume {run_dir}" in err
    assert (run_dir / "config.json").read_text() == first  # untouched
    assert_each_epoch_once(run_dir)

    assert main(["run", target, f"run_dir={run_dir}", "--overwrite", "--no-progress"]) == 0
    assert_each_epoch_once(run_dir)  # replaced, not appended
    assert_same_params(final_params(run_dir), baseline)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["recipe"] == target


def test_resume_without_checkpoint_and_ctl_without_run_are_clear_errors(tmp_path, capsys):
    assert main(["resume", str(tmp_path)]) == 2
    assert "holds no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"recipe": None, "overrides": []}))
    assert main(["resume", str(tmp_path)]) == 2
    assert "was not started by `policy-probes run`" in capsys.readouterr().err
    assert main(["ctl", str(tmp_path / "nope"), "stop"]) == 1
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "control").mkdir()
    (tmp_path / "control" / "run.json").write_text(
        json.dumps({"pid": 2**22 + 12345, "host": socket.gethostname()})
    )
    assert main(["ctl", str(tmp_path), "pause"]) == 1
    assert "is no longer running" in capsys.readouterr().err
