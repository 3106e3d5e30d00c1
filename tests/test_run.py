"""Run (one run directory for every driver) and ProbeSettings (one model for the probe
settings): the claim, the records a resumed loop rewinds, and the keyword forms of
earlier versions."""

from __future__ import annotations

import csv
import inspect
import json

import pytest
import torch
from conftest import TinyPolicy

from policy_probes import ProbeSession, ProbeSettings, Run, attach_relu_activation_hooks
from policy_probes.records import read_jsonl
from policy_probes.run import RunDirConflict
from policy_probes.run_lock import RunDirLocked
from policy_probes.sinks import SinksConfig, WandbConfig

QUIET = ProbeSettings(sinks=SinksConfig(console=False), wandb=WandbConfig(mode="disabled"))


def two_epochs(run, **kw) -> list[dict]:
    policy = TinyPolicy()
    with ProbeSession(policy, run=run, probing=QUIET, **kw) as session:
        session.add_training_hook("actor_mlp", attach_relu_activation_hooks())
        for epoch in range(2):
            with session.phase("train"):
                policy(torch.randn(4, 5)).sum().backward()
            session.epoch_end(step=epoch)
    return read_jsonl(run.dir / "metrics.jsonl")


def test_a_run_is_claimed_once_resumed_after_its_last_record_or_replaced(tmp_path):
    first = two_epochs(Run(tmp_path / "r", config={"lr": 1}))
    assert [r["epoch"] for r in first] == [1, 2]
    assert json.loads((tmp_path / "r" / "config.json").read_text())["lr"] == 1
    assert Run(tmp_path / "r").last_recorded_epoch() == 2
    with pytest.raises(RunDirConflict, match="resume=True to continue it, overwrite=True"):
        Run(tmp_path / "r").open()
    assert not (tmp_path / "r" / "run.lock").exists()  # a refused open holds no lock
    resumed = two_epochs(Run(tmp_path / "r", resume=True))
    assert [r["epoch"] for r in resumed] == [1, 2, 3, 4]
    replaced = two_epochs(Run(tmp_path / "r", overwrite=True))
    assert [r["epoch"] for r in replaced] == [1, 2]


def test_rewind_drops_the_later_records_and_the_lock_is_held_until_close(tmp_path):
    two_epochs(Run(tmp_path / "r"))
    run = Run(tmp_path / "r", resume=True).open()
    with pytest.raises(RunDirLocked, match="already in use by this process"):
        Run(tmp_path / "r", resume=True).open()
    run.open_sinks(QUIET.sinks, QUIET.wandb)
    run.rewind(1)
    run.close()
    assert [r["epoch"] for r in read_jsonl(tmp_path / "r" / "metrics.jsonl")] == [1]
    assert not (tmp_path / "r" / "run.lock").exists()
    with pytest.raises(ValueError, match="exclude each other"):
        Run(tmp_path / "r", resume=True, overwrite=True)


def test_a_refused_open_removes_the_directories_it_made(tmp_path):
    run_dir = tmp_path / "a" / "b"
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b").mkdir()
    (run_dir / "config.json").write_text("{}")
    held = Run(run_dir)
    with pytest.raises(RunDirConflict):
        held.open()
    assert run_dir.is_dir()  # it existed before: left as it was
    fresh = Run(tmp_path / "x" / "y")
    fresh.open()
    fresh.close(refused=True)
    assert not (tmp_path / "x").exists()


def test_the_session_takes_twelve_keywords_and_refuses_any_other(tmp_path):
    params = inspect.signature(ProbeSession.__init__).parameters.values()
    keywords = [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert len(keywords) <= 12
    session = ProbeSession(
        TinyPolicy(),
        run=Run(tmp_path / "old"),
        probing=ProbeSettings(
            hooks=["norms"],
            probe_budget=None,
            sinks=SinksConfig(console=False),
            wandb=WandbConfig(mode="disabled"),
        ),
    )
    with session:
        assert session.probing.hooks == ["norms"] and session.probing.probe_budget is None
        assert session.sampler.budget is None
        assert [h.name for h in session.hooks.hooks] == ["training_metrics", "norms"]
        assert session.run_dir == tmp_path / "old"
    for wrong in ({"strict": True}, {"run_dir": tmp_path / "x"}, {"colour": 1}):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(wrong))}'"):
            ProbeSession(TinyPolicy(), run=tmp_path / "y", probing=QUIET, **wrong)
    assert not (tmp_path / "y").exists()


def test_probe_settings_check_their_values_once_for_every_driver():
    assert ProbeSettings(hooks="norms,adam_dynamics").hooks == ["norms", "adam_dynamics"]
    assert ProbeSettings(probe_schedule="every_k:4").probe_schedule == "every_k:4"
    with pytest.raises(ValueError, match="probe_budget is a fraction"):
        ProbeSettings(probe_budget=2.0)
    with pytest.raises(ValueError, match="unknown hook 'norm'"):
        ProbeSettings(hooks=["norm"])


def test_a_run_with_only_a_csv_resumes_after_its_last_row(tmp_path):
    csv_only = ProbeSettings(
        sinks=SinksConfig(console=False, jsonl=False), wandb=WandbConfig(mode="disabled")
    )
    for resume in (False, True):
        run = Run(tmp_path / "r", resume=resume)
        with ProbeSession(TinyPolicy(), run=run, probing=csv_only) as session:
            for step in range(2):
                session.log({"x": float(step)})
                session.epoch_end(step=step)
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
    with open(tmp_path / "r" / "metrics.csv", encoding="utf-8", newline="") as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == [1, 2, 3, 4]
