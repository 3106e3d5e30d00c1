"""What a loop logs with ``session.log`` reaches every sink: numpy scalars and arrays as
numbers, and a value no sink can write is dropped with a warning naming its key, while
every sink goes on writing (issue 40, item 3)."""

from __future__ import annotations

import csv
import logging

import numpy as np
import torch
from torch import nn
from wandb_reader import history_rows, run_file, wandb_records

from policy_probes import ProbeSettings
from policy_probes.records import read_jsonl
from policy_probes.session import ProbeSession
from policy_probes.sinks import SinksConfig, WandbConfig

EPOCHS = 3


def _session(tmp_path) -> ProbeSession:
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    settings = ProbeSettings(
        sinks=SinksConfig(console=False, csv=True, wandb=True),
        wandb=WandbConfig(mode="offline"),
    )
    return ProbeSession(policy, run=tmp_path, probing=settings)


def _csv_rows(tmp_path) -> list[dict[str, str]]:
    with open(tmp_path / "metrics.csv", newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _wandb_rows(tmp_path) -> dict[int, dict]:
    rows = history_rows(wandb_records(run_file(tmp_path)))
    return {row["epoch"]: row for row in rows if "epoch" in row and "np/f64" in row}


def test_numpy_scalars_and_arrays_reach_jsonl_csv_and_wandb_as_numbers(tmp_path):
    logged = []
    with _session(tmp_path) as session:
        for epoch in range(EPOCHS):
            values = {
                "np/f64": np.float64(0.1 + epoch),
                "np/f32": np.float32(0.25 * (epoch + 1)),
                "np/i64": np.int64(7 * epoch - 3),
                "np/zero_d": np.array(1.5 * epoch),
                "np/vector": np.arange(3, dtype=np.float32) + epoch,
            }
            logged.append(values)
            session.log(values)
            session.epoch_end(step=10 * epoch)
        assert session.sinks.failures == {}

    jsonl = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["hook_point"] == "POST_EPOCH"]
    table = _csv_rows(tmp_path)
    wandb_rows = _wandb_rows(tmp_path)
    assert [r["epoch"] for r in jsonl] == [1, 2, 3] and len(table) == EPOCHS
    assert sorted(wandb_rows) == [1, 2, 3]
    for values, rec, row in zip(logged, jsonl, table, strict=True):
        wb = wandb_rows[rec["epoch"]]
        for key in ("np/f64", "np/f32", "np/i64", "np/zero_d"):
            expected = values[key].item()  # Python's own number for the numpy value
            assert rec[key] == expected and type(rec[key]) is type(expected), key
            assert float(row[key]) == expected, key
            assert wb[key] == expected, key
        vector = values["np/vector"].astype(np.float64)
        assert rec["np/vector"] == vector.tolist()
        assert float(row["np/vector/mean"]) == vector.mean()
        assert float(row["np/vector/min"]) == vector.min()
        assert float(row["np/vector/max"]) == vector.max()


class _NoText:
    def __str__(self) -> str:
        raise RuntimeError("this value has no text")


def test_an_unwritable_value_is_dropped_with_a_warning_and_no_sink_stops(tmp_path, caplog):
    wide = 2**70  # past the 64 bits JSON writers take as integers
    with caplog.at_level(logging.WARNING, logger="policy_probes"), _session(tmp_path) as session:
        for epoch in range(EPOCHS):
            session.log(
                {
                    "np/f64": np.float64(epoch),
                    "user/wide_int": wide + epoch,
                    "user/lone_surrogate": "a\ud800b",
                    "user/no_text": _NoText() if epoch == 1 else epoch,
                }
            )
            session.epoch_end(step=epoch)
        assert session.sinks.failures == {}
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 1 and "'user/no_text'" in dropped[0]

    jsonl = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["hook_point"] == "POST_EPOCH"]
    table = _csv_rows(tmp_path)
    wandb_rows = _wandb_rows(tmp_path)
    assert [r["epoch"] for r in jsonl] == [1, 2, 3] and len(table) == EPOCHS
    assert sorted(wandb_rows) == [1, 2, 3]
    for epoch, (rec, row) in enumerate(zip(jsonl, table, strict=True)):
        assert rec["np/f64"] == float(epoch) == float(row["np/f64"])
        assert rec["user/wide_int"] == float(wide + epoch)
        assert float(row["user/wide_int"]) == float(wide + epoch)
        assert rec["user/lone_surrogate"] == row["user/lone_surrogate"] == "a\\ud800b"
        if epoch == 1:
            assert "user/no_text" not in rec and row["user/no_text"] == ""
        else:
            assert rec["user/no_text"] == epoch == int(row["user/no_text"])
        assert wandb_rows[epoch + 1]["np/f64"] == float(epoch)
