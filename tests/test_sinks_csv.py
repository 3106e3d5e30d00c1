"""CSVSink: scalar columns and vector summaries from a real probe run, header growth
through an atomic streaming rewrite, bounded memory, crash leftovers."""

from __future__ import annotations

import csv
import math
import os
import tracemalloc
from fractions import Fraction

import numpy as np
import pytest
from sinks_support import emit_probe_run, rewind_and_emit

from policy_probes.records import Record, vector_stats
from policy_probes.sinks import CSVSink
from policy_probes.sinks.csv_sink import BASE_COLUMNS, scalar_columns


def read_rows(path):
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        rows = [dict(zip(header, r, strict=True)) for r in reader]
    return header, rows


def test_scalars_and_vector_summaries_of_a_real_run(tmp_path):
    sink = CSVSink(tmp_path)
    emitted = emit_probe_run(sink, epochs=3)
    sink.close()
    header, rows = read_rows(tmp_path / "metrics.csv")
    assert header[:4] == list(BASE_COLUMNS)
    assert len(rows) == 3
    for row, (epoch, step, metrics) in zip(rows, emitted, strict=True):
        assert int(row["epoch"]) == epoch and int(row["agent_step"]) == step
        assert row["hook_point"] == "POST_EPOCH"
        for key, value in metrics.items():
            if isinstance(value, list):
                assert key not in row  # vectors never become columns themselves
                assert float(row[f"{key}/mean"]) == pytest.approx(
                    math.fsum(value) / len(value), rel=1e-12
                )
                assert float(row[f"{key}/min"]) == min(value)
                assert float(row[f"{key}/max"]) == max(value)
            else:
                assert float(row[key]) == value, key


def test_header_growth_keeps_old_rows_and_leaves_no_temp_file(tmp_path):
    sink = CSVSink(tmp_path)
    sink.emit(Record.of({"a": 1.0}, 0, "POST_EPOCH"))
    sink.emit(Record.of({"a": 2.0, "b": [1.0, 3.0, float("nan")]}, 1, "POST_EPOCH"))
    sink.emit(Record.of({"c": True, "a": None}, 2, "SNAPSHOT"))
    sink.emit(Record.of({"a": 4.0}, 3, "POST_EPOCH"))
    assert sink.rewrites == 3  # the first header, then b/*, then c
    sink.close()
    header, rows = read_rows(tmp_path / "metrics.csv")
    assert header == [*BASE_COLUMNS, "a", "b/mean", "b/min", "b/max", "c"]
    assert [r["a"] for r in rows] == ["1.0", "2.0", "", "4.0"]
    assert (rows[0]["b/mean"], rows[1]["b/mean"], rows[1]["b/min"], rows[1]["b/max"]) == (
        "",
        "2.0",
        "1.0",
        "3.0",
    )
    assert [r["c"] for r in rows] == ["", "", "1", ""]
    assert [r["hook_point"] for r in rows] == ["POST_EPOCH", "POST_EPOCH", "SNAPSHOT", "POST_EPOCH"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv"]


def test_failed_rewrite_leaves_the_original_file_whole(tmp_path, monkeypatch):
    sink = CSVSink(tmp_path)
    for epoch in range(3):
        sink.emit(Record.of({"a": float(epoch)}, epoch, "POST_EPOCH"))
    before = (tmp_path / "metrics.csv").read_bytes()

    def no_space(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)  # the rename is the commit point
    with pytest.raises(OSError, match="No space"):
        sink.emit(Record.of({"a": 3.0, "new": 1.0}, 3, "POST_EPOCH"))
    monkeypatch.undo()
    assert (tmp_path / "metrics.csv").read_bytes() == before
    assert not sink.tmp_path.exists()
    # the sink still works with its old header afterwards
    sink.emit(Record.of({"a": 4.0}, 4, "POST_EPOCH"))
    sink.close()
    _, rows = read_rows(tmp_path / "metrics.csv")
    assert [r["a"] for r in rows] == ["0.0", "1.0", "2.0", "4.0"]


def test_leftovers_of_a_crash_are_cleaned_on_open(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("epoch,agent_step,hook_point,time,a\n0,10,POST_EPOCH,1.0,0.5\n1,20,POST_EP")
    (tmp_path / "metrics.csv.tmp").write_text("epoch,agent_step,hook_point,time,a,b\n0,10,POST")
    sink = CSVSink(tmp_path)
    sink.emit(Record.of({"a": 0.75}, 1, "POST_EPOCH", 20))
    sink.close()
    header, rows = read_rows(path)
    assert header == [*BASE_COLUMNS, "a"]
    assert [(r["epoch"], r["a"]) for r in rows] == [("0", "0.5"), ("1", "0.75")]
    assert not (tmp_path / "metrics.csv.tmp").exists()


def test_rewrite_streams_with_bounded_memory(tmp_path):
    path = tmp_path / "metrics.csv"
    cols = [f"m{i}" for i in range(40)]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*BASE_COLUMNS, *cols])
        for epoch in range(20_000):
            w.writerow(
                [epoch, epoch * 64, "POST_EPOCH", 1.0, *[epoch * 0.001 + i for i in range(40)]]
            )
    size = path.stat().st_size
    assert size > 5_000_000
    sink = CSVSink(tmp_path)
    assert not any(isinstance(v, list) and len(v) > 100 for v in vars(sink).values())
    tracemalloc.start()
    try:
        sink.emit(Record.of({"m0": 1.0, "wider": 2.0}, 20_000, "POST_EPOCH"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    sink.close()
    assert sink.rewrites == 1
    assert peak < size / 20, (peak, size)  # streaming: far below the file size
    header, rows = read_rows(path)
    assert header[-1] == "wider" and len(rows) == 20_001
    assert rows[123]["m5"] == str(123 * 0.001 + 5) and rows[123]["wider"] == ""
    assert rows[-1]["wider"] == "2.0"


def test_rewind_drops_later_epochs(tmp_path):
    assert rewind_and_emit(CSVSink(tmp_path), 4, keep=1, key="a", again=20.0) == 2
    _, rows = read_rows(tmp_path / "metrics.csv")
    assert [(r["epoch"], r["a"]) for r in rows] == [("0", "0.0"), ("1", "1.0"), ("2", "20.0")]


def test_scalar_columns_of_odd_values():
    odd = {"s": "a\nb", "none": None, "flag": False, "v": [None, float("inf")], "d": {"x": 2}}
    cells = scalar_columns(Record.of(odd, 0).metrics)
    assert cells == {
        "s": "a b",
        "none": "",
        "flag": 0,
        "v/mean": "",
        "v/min": "",
        "v/max": "",
        "d/x": 2,
    }


@pytest.mark.parametrize(
    "values",
    [
        [0.25, -1.5, 3.0, 1e-300],
        [3, 1, 2],
        [True, False, True],
        [1.0, float("nan"), -2.0],
        [float("inf"), 4.0, float("-inf"), 2.0],
        [None, 5.0, "x", 1.0],
        [1e308, 1e308, -1e308],
        [],
        [None, float("nan")],
    ],
)
def test_vector_stats_are_those_of_the_finite_numbers(values):
    """Mean (exact sum over the count), min and max of the finite numeric elements,
    against numpy on the elements filtered by hand; None when there are none."""
    finite = np.array(
        [float(v) for v in values if isinstance(v, (int, float)) and np.isfinite(float(v))],
        dtype=np.float64,
    )
    stats = vector_stats(values)
    if finite.size == 0:
        assert stats is None
        return
    mean, low, high = stats
    exact = sum(map(Fraction, finite.tolist())) / finite.size
    assert mean == pytest.approx(float(exact), rel=1e-15)
    assert (low, high) == (finite.min(), finite.max())
    assert all(type(v) is float for v in stats)
