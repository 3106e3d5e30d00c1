"""Reliability, fourth round (issue 42), items 13-17 and 19: the command line's edges as a
user meets them (``policy-probes`` in-process, a ``ProbeSession`` script). Each expected
value comes from the files the run wrote, read here with ``json``, or from the documented
rule, never from the code under test."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from conftest import cli_error_line
from torch import nn

from policy_probes import ProbeSession, ProbeSettings, Run
from policy_probes.cli import main
from policy_probes.probes.relu import attach_relu_activation_hooks
from policy_probes.remedies import redo

torch.set_num_threads(1)

EPOCHS = 4
SEED = 5

RECIPE = """
from policy_probes.probes.relu import attach_relu_activation_hooks
from trainers import EnvConfig, PolicyConfig, PPOConfig, TrainTool


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
        torch_threads=1,
        seed=SEED,
    )
    tool.add_training_hook("actor_mlp", attach_relu_activation_hooks())
    return tool
""".replace("EPOCHS", str(EPOCHS)).replace("SEED", str(SEED))


def contents(directory: Path) -> dict[str, bytes | None]:
    """Every entry under ``directory`` (bytes of files, None for directories), but the
    lock file a live run holds."""
    return {
        str(p.relative_to(directory)): p.read_bytes() if p.is_file() else None
        for p in sorted(directory.rglob("*"))
        if p.name != "run.lock"
    }


def epochs_in(run_dir: Path) -> list[int]:
    """The epochs of ``run_dir/metrics.jsonl``, read with ``json``."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return sorted({json.loads(line)["epoch"] for line in lines if line.strip()})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("recipe") / "round4_recipe.py"
    path.write_text(RECIPE)
    return f"{path}:train"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, tiny: str) -> Path:
    """A finished tiny run: 4 epochs of 64 agent steps, checkpoints at epochs 2 and 4."""
    run_dir = tmp_path_factory.mktemp("runs") / "done"
    assert main(["run", tiny, f"run_dir={run_dir}", "--no-progress"]) == 0
    return run_dir


# --------------------------------------------- item 13: fork into a blank destination
@pytest.mark.parametrize(
    ("destination", "said"),
    [
        ("", "NEW_RUN_DIR is empty"),
        ("   ", "NEW_RUN_DIR is empty"),
        ("a_file/child", "'a_file' is a file"),
        ("n" * 300, "file systems allow 255"),
    ],
    ids=["empty", "blank", "under_a_file", "name_too_long"],
)
def test_fork_into_a_refused_destination_exits_2_and_writes_nothing(
    finished_run: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    destination: str,
    said: str,
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "a_file").write_text("not a directory\n")
    monkeypatch.chdir(cwd)
    parent = contents(finished_run)
    line = cli_error_line(capsys, "fork", str(finished_run), "--epoch", "2", destination)
    assert said in line
    assert sorted(os.listdir(cwd)) == ["a_file"]  # nothing written where the user stands
    assert contents(finished_run) == parent


# ------------------------------------- item 14: resuming a finished run, W&B folders
def offline_runs(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))


def test_resume_of_a_finished_run_changes_no_file_and_refused_resumes_add_no_wandb_run(
    tiny: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "wandb_run"
    assert main(["run", tiny, f"run_dir={run_dir}", "wandb.mode=offline", "--no-progress"]) == 0
    assert len(offline_runs(run_dir)) == 1
    before = contents(run_dir)

    with caplog.at_level(logging.WARNING, logger="trainers"):
        assert main(["resume", str(run_dir), "--no-progress"]) == 0
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "nothing is left to train" in said and "no file changed" in said
    assert contents(run_dir) == before  # config.json, checkpoints, W&B files: byte-identical

    refusals = {
        "seed=6": f"seed=6 cannot take effect: a resumed run continues the random streams of "
        f"{run_dir / 'checkpoints' / 'epoch_000004.pt'} (seed {SEED})",
        "trainer.total_timesteps=64": "nothing would be trained",
        "trainer.learning_rate=-1": "trainer.learning_rate",
    }
    for override, message in refusals.items():
        line = cli_error_line(capsys, "resume", str(run_dir), override)
        assert message in line, line
        assert contents(run_dir) == before, override  # no new offline-run-* folder either


def test_resume_with_another_seed_is_refused_before_anything_changes(
    finished_run: Path, capsys: pytest.CaptureFixture
) -> None:
    before = contents(finished_run)
    line = cli_error_line(
        capsys, "resume", str(finished_run), "seed=7", "trainer.total_timesteps=512"
    )
    assert "seed=7 cannot take effect" in line and f"(seed {SEED})" in line
    assert "start a new run with seed=7" in line
    assert contents(finished_run) == before


# ------------------------------------------------- item 17: seed= in a fork or an arm
def test_a_fork_with_another_seed_is_refused_and_one_with_its_parents_runs(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    parent = contents(finished_run)
    child = tmp_path / "child"
    line = cli_error_line(capsys, "fork", str(finished_run), "--epoch", "2", str(child), "seed=6")
    assert "a fork continues its parent's random streams" in line and f"(seed {SEED}" in line
    assert not child.exists()
    assert contents(finished_run) == parent

    # the parent's own seed changes nothing: accepted, and the child repeats the parent
    fork = ["fork", str(finished_run), "--epoch", "2", str(child), f"seed={SEED}"]
    assert main([*fork, "--no-progress"]) == 0
    assert epochs_in(child) == [3, 4]
    key = "probes/relu/actor_mlp/dead_fraction"
    parent_values = {
        r["epoch"]: r[key]
        for r in map(json.loads, (finished_run / "metrics.jsonl").read_text().splitlines())
        if key in r
    }
    for line in (child / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if key in record:
            assert record[key] == parent_values[record["epoch"]]


def test_an_arm_with_a_seed_is_refused_before_any_child_starts(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "arms"
    argv = ["arms", str(finished_run), "--epoch", "2", "--arm", "none", "--arm", "seed=6"]
    line = cli_error_line(capsys, *argv, "--out", str(out))
    assert "an arm is a fork, which continues its parent's random streams" in line
    assert "one parent run per seed" in line
    assert not out.exists()


# ------------------------- item 15: fractional epochs, non-finite values in config.json
@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["remedies=redo@actor_mlp:every_epochs=1.5"], "every_epochs must be a positive integer"),
        (["remedies=redo@actor_mlp:every_epochs=inf"], "every_epochs must be a positive integer"),
        (
            ["remedies=redo@actor_mlp:every_epochs=2,cooldown=0.5"],
            "cooldown must be an integer >= 0, got 0.5",
        ),
        (["remedies=redo@actor_mlp:tau=inf,every_epochs=2"], "tau must be finite and >= 0"),
        (["remedies=redo@actor_mlp:tau=nan,every_epochs=2"], "tau must be finite and >= 0"),
        (["sinks.fsync_seconds=inf"], "sinks.fsync_seconds"),
        (["sinks.fsync_seconds=Infinity"], "sinks.fsync_seconds"),
        (["hooks=hessian", 'hook_config={"hessian.tol": Infinity}'], "finite number"),
    ],
    ids=[
        "every_1.5",
        "every_inf",
        "cooldown_0.5",
        "tau_inf",
        "tau_nan",
        "fsync_inf",
        "fsync_Infinity",
        "hook_tol_inf",
    ],
)
def test_fractional_epochs_and_non_finite_values_exit_2_and_write_nothing(
    tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture, overrides: list[str], said: str
) -> None:
    run_dir = tmp_path / "r"
    line = cli_error_line(capsys, "run", tiny, f"run_dir={run_dir}", *overrides)
    assert said in line, line
    assert not run_dir.exists()


def test_whole_epochs_written_as_a_float_fire_at_their_multiples_and_config_is_json(
    tiny: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "r"
    spec = "remedies=reset_layers@actor_mlp:last=1,every_epochs=2.0"
    assert main(["run", tiny, f"run_dir={run_dir}", spec, "--no-progress"]) == 0
    key = "remedies/reset_layers/actor_mlp/fired"
    fired = [
        r["epoch"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if r.get(key) == 1.0
    ]
    assert fired == [e for e in range(1, EPOCHS + 1) if e % 2 == 0]

    def no_constant(name: str) -> None:
        raise AssertionError(f"config.json holds {name}, which is not JSON")

    json.loads((run_dir / "config.json").read_text(), parse_constant=no_constant)


# ------------------------------------- item 16: a threshold no record of the run holds
@pytest.mark.parametrize(
    ("when", "said"),
    [
        (
            "probes/fisher/actor_mlp/trace>1",
            "no attached probe is named 'fisher' (attached: relu)",
        ),
        (
            "probes/relu/critic_mlp/dormant_fraction>0.1",
            "the relu probe does not observe 'critic_mlp' (it observes: actor_mlp",
        ),
        (
            "dormant_fraction>0.1",
            "this run writes no key under 'dormant_fraction/'",
        ),
    ],
    ids=["probe_not_attached", "component_not_observed", "unrelated_key"],
)
@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry_run"])
def test_a_threshold_no_record_can_hold_is_refused_at_set_up(
    tiny: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    when: str,
    said: str,
    dry_run: bool,
) -> None:
    run_dir = tmp_path / "r"
    spec = f"remedies=redo@actor_mlp:when={when}"
    args = ["run", tiny, f"run_dir={run_dir}", spec, *(["--dry-run"] if dry_run else [])]
    line = cli_error_line(capsys, *args)
    assert "remedy redo@actor_mlp" in line and said in line, line
    assert "so this remedy would never fire" in line
    if when != "probes/fisher/actor_mlp/trace>1":  # a key of the relu probe is named
        assert "did you mean 'probes/relu/actor_mlp/dormant_fraction'" in line, line
    assert not run_dir.exists()


@pytest.mark.parametrize(
    "when",
    [
        "probes/relu/actor_mlp.layer_0/dormant_fraction>2",  # a layer of the observed component
        "probes/relu/actor_mlp/rarely_active_fraction>2",  # a metric the plugin does not list
        "rollout/episode_return>100000",  # the loop's own key
        "agent_step>100000",  # a key of every record
        "probes/overhead_fraction>5",  # the session's own key
    ],
)
def test_a_threshold_a_record_can_hold_passes_the_set_up_check(
    tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture, when: str
) -> None:
    spec = f"remedies=redo@actor_mlp:when={when}"
    assert main(["run", tiny, f"run_dir={tmp_path / 'r'}", spec, "--dry-run"]) == 0


def test_a_session_script_with_a_threshold_on_a_probe_not_attached_fails_before_writing(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("body", nn.Sequential(nn.Linear(5, 8), nn.ReLU()))
    model.add_module("head", nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probing = ProbeSettings(sinks={"console": False, "wandb": False})
    session = ProbeSession(model, run=Run(tmp_path / "s"), probing=probing, optimizer=opt)
    session.add_training_hook("body", attach_relu_activation_hooks())
    when = "probes/saturation/body/saturated_fraction>0.5"
    session.add_remedy("body", redo(when=when, consumer="head", seed=1))
    with pytest.raises(ValueError, match="no attached probe is named 'saturation'"):
        session.epoch_start()
    session.close()
    assert not (tmp_path / "s" / "config.json").exists()
    assert not (tmp_path / "s" / "metrics.jsonl").exists()


# ------------------------------------------------ item 19: diagnose with too few epochs
def write_records(run_dir: Path, epochs: int) -> None:
    """``epochs`` records of a steady dormant fraction (0.05) for ``actor_mlp``."""
    run_dir.mkdir()
    key = "probes/relu/actor_mlp/dormant_fraction_ref"
    lines = [
        json.dumps({"epoch": e, "agent_step": 64 * e, key: 0.05}) for e in range(1, epochs + 1)
    ]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def diagnose(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    status = main(["diagnose", *args])
    return status, capsys.readouterr().out


def test_diagnose_of_a_run_too_short_says_nothing_could_be_judged_and_exits_3(
    finished_run: Path, capsys: pytest.CaptureFixture
) -> None:
    epochs = len(epochs_in(finished_run))
    status, out = diagnose(capsys, str(finished_run))
    assert status == 3
    assert "no findings" not in out
    assert f"nothing could be judged: the run has {epochs} epoch records" in out
    # the last 5 epochs against 5 epochs 3 windows earlier, never the first 20: 40 epochs
    assert "with 5 epochs 3 windows earlier, never the first 20" in out
    assert f"dormant_units ({epochs} of 40)" in out and f"dead_units ({epochs} of 40)" in out


def test_diagnose_of_an_empty_file_says_there_is_no_epoch_record(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    status, out = diagnose(capsys, str(tmp_path))
    assert status == 3
    assert out.strip() == "nothing could be judged: the run has no epoch record"


def test_diagnose_window_100_on_100_epochs_cannot_judge_and_window_5_can(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run_dir = tmp_path / "steady"
    write_records(run_dir, 100)
    status, out = diagnose(capsys, str(run_dir), "--window", "100")
    assert status == 3
    assert "the run has 100 epoch records and a rule compares its last 100 epochs" in out
    assert "dormant_units (100 of 800)" in out  # 400 skipped + 100 of baseline + 300 of lag

    status, out = diagnose(capsys, str(run_dir), "--window", "100", "--json")
    assert status == 3
    coverage = json.loads(out)["coverage"]
    assert coverage["epochs"] == 100 and not coverage["judged"]
    assert coverage["needed"] == {"dormant_units": 800}

    status, out = diagnose(capsys, str(run_dir))  # 100 >= 40: judged, and steady
    assert status == 0
    assert out.strip() == "no findings: no direct test shows a problem"
