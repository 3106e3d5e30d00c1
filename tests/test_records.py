"""Records: values made plain (numpy scalars too), the series a RunRecords keeps from a
metrics.jsonl or fed live (bounded), and the module boundaries of the record store (a
leaf) and the sinks (no analysis)."""

from __future__ import annotations

import ast
import enum
import json
import logging
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

import policy_probes
from policy_probes import ProbeSession, ProbeSettings, Run
from policy_probes.records import Record, RunRecords, read_jsonl, to_plain
from policy_probes.sinks import SinksConfig, WandbConfig

PACKAGE = Path(policy_probes.__file__).parent


class Level(enum.IntEnum):
    HIGH = 3


def test_numpy_scalars_and_subclasses_become_plain_python_values():
    values = {
        "f64": np.float64(0.1),  # a float subclass: JSON writers refuse it
        "f32": np.float32(1.5),
        "i64": np.int64(7),
        "b": np.bool_(True),
        "enum": Level.HIGH,
        "vector": [np.float64(0.25), 1, None],
        "tensor": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
    }
    plain = {k: to_plain(v) for k, v in values.items()}
    assert plain == {
        "f64": 0.1,
        "f32": 1.5,
        "i64": 7,
        "b": True,
        "enum": 3,
        "vector": [0.25, 1, None],
        "tensor": [1.0, 2.0, 3.0, 4.0],
    }
    kinds = {k: type(v) for k, v in plain.items() if k not in ("vector", "tensor")}
    assert kinds == {"f64": float, "f32": float, "i64": int, "b": bool, "enum": int}
    assert [type(v) for v in plain["vector"]] == [float, int, type(None)]


def test_a_logged_numpy_mean_reaches_metrics_jsonl(tmp_path):
    """``session.log({"r": np.mean(x)})`` logs a np.float64; the JSONL sink writes it
    (it used to switch itself off: orjson refuses float subclasses)."""
    rewards = np.array([1.0, 2.5, 4.0])
    session = ProbeSession(
        nn.Linear(2, 2),
        run=Run(tmp_path),
        probing=ProbeSettings(
            sinks=SinksConfig(console=False, wandb=False), wandb=WandbConfig(mode="disabled")
        ),
    )
    with session:
        session.log({"rollout/episode_return": np.mean(rewards), "n": np.int64(3)})
        session.epoch_end(step=10)
        assert session.sinks.failures == {}
        assert session.sinks.names == ["jsonl", "csv"]
    (line,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert line["rollout/episode_return"] == (1.0 + 2.5 + 4.0) / 3 and line["n"] == 3
    header, row = (tmp_path / "metrics.csv").read_text().splitlines()
    cells = dict(zip(header.split(","), row.split(","), strict=True))
    assert float(cells["rollout/episode_return"]) == 2.5 and cells["n"] == "3"


def test_run_records_read_the_epoch_records_of_a_file_being_written(tmp_path, caplog):
    lines = [
        {"epoch": 1, "agent_step": 10, "hook_point": "PRE_STEP", "x": 100.0},
        {"epoch": 1, "agent_step": 10, "hook_point": "POST_EPOCH", "x": 1.0, "v": [0.5, None]},
        {"epoch": 2, "agent_step": 20, "hook_point": "POST_EPOCH", "x": None, "flag": True},
        {"epoch": 2, "agent_step": 20, "hook_point": "POST_EPOCH", "x": 2.0, "s": "text"},
        {"epoch": 3, "agent_step": 30, "hook_point": "POST_EPOCH", "x": None, "_nonfinite": ["x"]},
        {"epoch": 4, "hook_point": "POST_EPOCH", "x": 4, "time": 1.5},
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (tmp_path / "metrics.jsonl").write_text(text + "not json\n" + '{"epoch": 5, "x"')
    with caplog.at_level(logging.WARNING, logger="policy_probes.sinks"):
        run = RunRecords.read(tmp_path)
    # the damaged line is reported, the line being written is not
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'metrics.jsonl'}:7 is not valid JSON; skipped"
    ]
    assert run.records == 6 and run.last_epoch == 4 and run.epochs == [1, 2, 3, 4]
    assert run.agent_step == {1: 10, 2: 20, 3: 30}
    # the epochs' own records only; the last record of an epoch wins; None is NaN
    x = run.series("x")
    assert x[:2] == [(1, 1.0), (2, 2.0)] and math.isnan(x[2][1]) and x[3] == (4, 4.0)
    assert run.scalars["flag"] == {2: True} and "s" not in run.scalars
    assert run.vectors == {"v": {1: [0.5, None]}}
    assert not {"time", "_nonfinite", "epoch"} & (run.scalars.keys() | run.vectors.keys())


def test_a_live_store_keeps_the_chosen_keys_of_its_last_epochs():
    run = RunRecords(keep=lambda key: key.startswith("probes/"), max_epochs=3)
    for epoch in range(1, 8):
        metrics = {"probes/a": epoch / 2, "probes/v": [float(epoch)] * 2, "train/loss": 1.0}
        run.add(Record.of(metrics, epoch, "POST_EPOCH", 10 * epoch))
        run.add(Record.of({"probes/a": -1.0}, epoch, "SNAPSHOT", 10 * epoch))
    assert run.series("probes/a") == [(5, 2.5), (6, 3.0), (7, 3.5)]
    assert run.vectors["probes/v"] == {e: [float(e)] * 2 for e in (5, 6, 7)}
    assert "train/loss" not in run.scalars and run.agent_step == {5: 50, 6: 60, 7: 70}
    assert run.records == 14 and run.revision == 0
    run.add(Record.of({"probes/a": 9.0}, 7))  # an epoch again: readers read afresh
    assert run.revision == 1 and run.series("probes/a")[-1] == (7, 9.0)


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function."""
    found = set()
    package = "policy_probes." + ".".join(path.relative_to(PACKAGE).parent.parts)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package
                parts = package.rstrip(".").split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return found


def test_sinks_import_nothing_from_the_analysis_and_records_nothing_from_the_package():
    sink_modules = sorted((PACKAGE / "sinks").glob("*.py"))
    assert len(sink_modules) >= 8
    for path in sink_modules:
        analysis = {m for m in imported_modules(path) if m.startswith("policy_probes.analysis")}
        assert analysis == set(), path.name
    records = imported_modules(PACKAGE / "records.py")
    assert {m for m in records if m.startswith("policy_probes")} == set()
