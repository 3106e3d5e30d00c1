"""JSONLSink: one record per emit with the real probe values, truncated-tail repair,
non-finite handling, rewind for resumed runs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from sinks_support import emit_probe_run, rewind_and_emit

from policy_probes import ProbeSettings, Run
from policy_probes.records import Record, read_jsonl
from policy_probes.sinks import JSONLSink, repair_truncated_tail, rewind_jsonl
from policy_probes.sinks.csv_sink import CSVSink


def test_one_record_per_emit_with_epoch_step_and_values(tmp_path):
    sink = JSONLSink(tmp_path)
    emitted = emit_probe_run(sink, epochs=3, snapshot_every=2)
    sink.close()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    # POST_EPOCH for 0, 1, 2 and a SNAPSHOT after epoch 1
    assert [(r["epoch"], r["hook_point"]) for r in records] == [
        (0, "POST_EPOCH"),
        (1, "POST_EPOCH"),
        (1, "SNAPSHOT"),
        (2, "POST_EPOCH"),
    ]
    posts = [r for r in records if r["hook_point"] == "POST_EPOCH"]
    for rec, (epoch, step, metrics) in zip(posts, emitted, strict=True):
        assert rec["epoch"] == epoch and rec["agent_step"] == step
        assert set(metrics) <= set(rec)
        for key, value in metrics.items():
            assert rec[key] == value, key  # floats round-trip exactly, vectors stay lists
        rate = rec["probes/relu/actor_mlp.layer_0/active_rate"]
        assert isinstance(rate, list) and len(rate) == 12
        # dead_fraction is the share of units with active_rate 0, from the stored vector
        assert rec["probes/relu/actor_mlp.layer_0/dead_fraction"] == sum(r == 0 for r in rate) / 12


def test_each_line_is_flushed_before_close(tmp_path):
    sink = JSONLSink(tmp_path)
    sink.emit(Record.of({"train/x": 1.25}, 0, "POST_STEP", 7))
    # another reader sees the record without close() or flush()
    line = (tmp_path / "metrics.jsonl").read_text().splitlines()[0]
    assert json.loads(line)["train/x"] == 1.25
    sink.close()


def test_nonfinite_nested_torch_and_numpy_values(tmp_path):
    sink = JSONLSink(tmp_path)
    sink.emit(
        Record.of(
            {
                "a": float("nan"),
                "b": [1.0, float("inf"), None],
                "hessian": {"top": np.float32(2.5), "per_layer": {"l0": torch.tensor(3.0)}},
                "t": torch.tensor([1.0, 2.0]),
                "flag": True,
                "n": np.int64(4),
                "epoch": 99,  # the record's own epoch wins
            },
            5,
            "POST_EPOCH",
        )
    )
    sink.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    (rec,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert rec["epoch"] == 5 and rec["agent_step"] is None
    assert rec["a"] is None and rec["b"] == [1.0, None, None]
    assert sorted(rec["_nonfinite"]) == ["a", "b"]
    assert rec["hessian/top"] == 2.5 and rec["hessian/per_layer/l0"] == 3.0
    assert rec["t"] == [1.0, 2.0] and rec["flag"] is True and rec["n"] == 4


def test_truncated_last_line_is_repaired_on_open(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"epoch": e, "x": e * 0.5}) for e in range(3)]
    partial = '{"epoch": 3, "x": 1.'
    path.write_text("\n".join(good) + "\n" + partial)
    sink = JSONLSink(tmp_path)
    sink.emit(Record.of({"x": 9.0}, 3, "POST_EPOCH"))
    sink.close()
    records = read_jsonl(path)
    assert [r["epoch"] for r in records] == [0, 1, 2, 3]
    assert records[-1]["x"] == 9.0
    assert path.read_text().count("\n") == 4
    # a whole file, or one without any newline, is handled too
    assert repair_truncated_tail(path) == 0
    lone = tmp_path / "lone.jsonl"
    lone.write_text('{"epoch": 0')
    assert repair_truncated_tail(lone) == len('{"epoch": 0') and lone.read_text() == ""


def test_repair_reads_only_the_tail_of_a_large_file(tmp_path):
    path = tmp_path / "big.jsonl"
    line = json.dumps({"epoch": 1, "v": [0.5] * 200}) + "\n"
    with open(path, "w") as f:
        for _ in range(2000):
            f.write(line)
        f.write(line[:-7])
    size = path.stat().st_size
    dropped = repair_truncated_tail(path, chunk=256)
    assert dropped == len(line) - 7 and path.stat().st_size == size - dropped
    assert len(read_jsonl(path)) == 2000


def test_rewind_drops_later_epochs(tmp_path):
    assert rewind_and_emit(JSONLSink(tmp_path), 5, keep=2, key="x", again=30.0) == 2
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["epoch"], r["x"]) for r in records] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]
    assert rewind_jsonl(tmp_path / "absent.jsonl", 0) == 0
    assert all(1e9 < r["time"] < 1e11 for r in records)  # Unix seconds


def test_record_vectors_keep_finite_values_and_replace_nonfinite_ones():
    """Vectors of finite numbers are written as they are (bools and ints too); one NaN or
    inf is replaced by None and the key listed under _nonfinite; numpy floats inside a
    list become Python floats."""
    import numpy as np

    from policy_probes.sinks.jsonl import json_line

    metrics = {
        "finite": [0.5, 1, True, -2.0],
        "one_nan": [0.5, float("nan"), 2.0],
        "numpy": [np.float64(0.25), np.float32(1.5)],
    }
    plain = Record.of(metrics, 3, "POST_EPOCH", 7)
    assert plain.metrics["numpy"] == [0.25, 1.5]
    assert [type(v) for v in plain.metrics["numpy"]] == [float, float]
    record = json_line(plain)
    assert record["finite"] == [0.5, 1, True, -2.0]
    assert record["one_nan"] == [0.5, None, 2.0]
    assert record["numpy"] == [0.25, 1.5]
    assert record["_nonfinite"] == ["one_nan"]


def fsync_counter(monkeypatch):
    """Count the real os.fsync calls per file descriptor (each still reaches the disk)."""
    import os

    real, calls = os.fsync, []

    def counting(fd):
        calls.append(fd)
        return real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    return calls


@pytest.mark.parametrize("make", [JSONLSink, CSVSink])
def test_epoch_ends_fsync_at_most_once_per_interval_and_flush_always(tmp_path, monkeypatch, make):
    calls = fsync_counter(monkeypatch)
    sink = make(tmp_path, fsync_seconds=3600.0)
    sink.emit(
        Record.of({"train/x": 0.0, "train/y": 0.0}, 0, "POST_EPOCH")
    )  # (the CSV header is written)
    assert calls  # the first epoch end fsyncs
    calls.clear()
    for epoch in range(1, 5):
        sink.emit(Record.of({"train/x": float(epoch)}, epoch, "POST_EPOCH"))
    assert calls == []  # the next four fall within the interval
    # every record reached the OS already: another reader sees all five
    assert len(sink.path.read_text().splitlines()) == 5 + (make is CSVSink)
    sink.flush()
    assert calls == [sink._file.fileno()]
    sink.close()

    every = make(tmp_path / "every", fsync_seconds=0.0)
    every.emit(Record.of({"train/x": 0.0, "train/y": 0.0}, 0, "POST_EPOCH"))
    calls.clear()
    for epoch in range(1, 4):
        every.emit(Record.of({"train/x": float(epoch)}, epoch, "POST_EPOCH"))
        every.emit(Record.of({"train/y": 1.0}, epoch, "POST_STEP"))  # only epoch ends fsync
    assert calls == [every._file.fileno()] * 3
    every.close()


def test_session_checkpoint_fsyncs_the_records_it_covers(tmp_path, monkeypatch):
    from torch import nn

    from policy_probes import ProbeSession
    from policy_probes.sinks import SinksConfig, WandbConfig

    session = ProbeSession(
        nn.Sequential(nn.Linear(2, 2)),
        components={"body": "0"},
        run=Run(tmp_path),
        probing=ProbeSettings(
            sinks=SinksConfig(console=False, csv=False, wandb=False, fsync_seconds=3600.0),
            wandb=WandbConfig(mode="disabled"),
        ),
    )
    session.epoch_start()  # the sinks open when the first epoch starts
    (jsonl,) = list(session.sinks)
    fd = jsonl._file.fileno()
    calls = fsync_counter(monkeypatch)
    for step in range(3):
        session.log({"train/x": float(step)})
        session.epoch_end(step=step)
    assert calls.count(fd) == 1  # the first epoch end; the next two fall within the interval
    session.state_dict()
    assert calls.count(fd) == 2
    assert [r["train/x"] for r in read_jsonl(jsonl.path)] == [0.0, 1.0, 2.0]
    session.close()


def test_fsync_interval_must_not_be_negative():
    from policy_probes.sinks import SinksConfig

    with pytest.raises(ValueError, match="fsync_seconds"):
        SinksConfig(fsync_seconds=-1)
