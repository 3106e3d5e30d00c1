"""A sink that fails is reported once, switched off, and never stops training; the
other sinks keep every epoch. Failures are real: a full disk (/dev/full), a path that is
a directory, W&B online without an API key."""

from __future__ import annotations

import csv
import logging
import signal
from pathlib import Path

import pytest
from sinks_support import emit_probe_run, tiny_cartpole

from policy_probes.records import Record, read_jsonl
from policy_probes.sinks import (
    CSVSink,
    JSONLSink,
    MetricSink,
    SinkGroup,
    SinksConfig,
    WandbConfig,
    build_sink_group,
)


class FailsFromEpoch(MetricSink):
    """A sink that raises from ``epoch`` on (a stand-in for any broken output)."""

    name = "flaky"

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.fail_from = epoch
        self.calls: list[int] = []
        self.flushes = 0

    def emit(self, record):
        self.calls.append(record.epoch)
        if record.epoch >= self.fail_from:
            raise RuntimeError(f"output broke at epoch {record.epoch}")

    def flush(self):
        self.flushes += 1


def sink_errors(caplog) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records if r.name == "policy_probes.sinks" and r.levelno >= logging.ERROR
    ]


def csv_epochs(path: Path) -> list[int]:
    with open(path, newline="") as f:
        return [int(row["epoch"]) for row in csv.DictReader(f)]


def test_failing_sink_is_reported_once_and_the_others_keep_every_epoch(tmp_path, caplog):
    flaky = FailsFromEpoch(1)
    group = SinkGroup([JSONLSink(tmp_path), flaky, CSVSink(tmp_path)])
    emit_probe_run(group, epochs=4)
    group.close()
    assert flaky.calls == [0, 1]  # switched off after the first fault
    assert list(group.failures) == ["flaky"]
    assert "RuntimeError: output broke at epoch 1" in group.failures["flaky"]
    errors = sink_errors(caplog)
    assert len(errors) == 1 and "output broke at epoch 1" in errors[0].getMessage()
    assert [r["epoch"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
    assert csv_epochs(tmp_path / "metrics.csv") == [0, 1, 2, 3]


def test_disk_full_switches_the_sink_off(tmp_path, caplog):
    (tmp_path / "full.jsonl").symlink_to("/dev/full")  # every write fails with ENOSPC
    group = SinkGroup([JSONLSink(tmp_path, filename="full.jsonl"), CSVSink(tmp_path)])
    emit_probe_run(group, epochs=3)
    group.close()
    assert "No space left on device" in group.failures["jsonl"]
    assert len(sink_errors(caplog)) == 1
    assert csv_epochs(tmp_path / "metrics.csv") == [0, 1, 2]


def test_sinks_that_cannot_start_are_left_out(tmp_path, monkeypatch, caplog):
    (tmp_path / "metrics.csv").mkdir()  # the CSV path is not writable as a file
    group = build_sink_group(
        tmp_path,
        SinksConfig(console=False, wandb=False),
        WandbConfig(),
        {},
    )
    assert [s.name for s in group] == ["jsonl"]
    assert "could not start" in group.failures["csv"]
    assert "IsADirectoryError" in group.failures["csv"]
    emit_probe_run(group, epochs=2)
    group.close()
    assert [r["epoch"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1]
    assert len(sink_errors(caplog)) == 1


def test_training_goes_on_when_wandb_and_csv_cannot_start(tmp_path):
    # a file where W&B's folder goes: the W&B sink cannot start (wandb.mode=online without
    # credentials is refused before training: test_round4_cli_b.py); a directory blocks
    # metrics.csv
    run_dir = tmp_path / "run"
    (run_dir / "metrics.csv").mkdir(parents=True)
    (run_dir / "wandb").write_text("not a folder\n")
    tool = tiny_cartpole(
        run_dir,
        epochs=3,
        sinks=SinksConfig(console=False, csv=True, wandb=True),
        wandb=WandbConfig(mode="offline"),
    )
    result = tool.invoke()
    assert result.epochs == 3
    assert set(result.sink_failures) == {"csv", "wandb"}
    assert "wandb" in result.sink_failures["wandb"]
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["epoch"] for r in records if r["hook_point"] == "POST_EPOCH"] == [1, 2, 3]
    assert all("probes/relu/actor_mlp/dead_fraction" in r for r in records)


def test_close_and_flush_faults_are_isolated(tmp_path):
    class BadClose(FailsFromEpoch):
        name = "bad_close"

        def close(self):
            raise OSError("cannot close")

    jsonl = JSONLSink(tmp_path)
    group = SinkGroup([BadClose(99), jsonl])
    group.emit(Record.of({"x": 1.0}, 0, "POST_EPOCH"))
    group.close()
    group.close()  # idempotent
    assert "cannot close" in group.failures["bad_close"]
    assert jsonl._file.closed
    assert [r["x"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1.0]


@pytest.fixture
def sigint_handler():
    """Sets SIGINT's handler for a test and restores the one the process had: under
    ``nohup`` or as a background job SIGINT starts out ignored (SIG_IGN), not Python's
    ``default_int_handler``, so a test must not assume either."""
    original = signal.getsignal(signal.SIGINT)

    def use(handler):
        signal.signal(signal.SIGINT, handler)
        return handler

    yield use
    signal.signal(signal.SIGINT, original)


def test_signal_flushes_every_sink_then_chains_to_the_previous_handler(tmp_path, sigint_handler):
    previous = sigint_handler(signal.default_int_handler)  # as in an interactive shell
    flaky = FailsFromEpoch(99)
    group = SinkGroup([flaky, JSONLSink(tmp_path)])
    restore = group.install_signal_flush()
    try:
        assert signal.getsignal(signal.SIGINT) == group._on_signal
        group.emit(Record.of({"x": 2.0}, 0, "POST_STEP"))
        with pytest.raises(KeyboardInterrupt):  # the previous SIGINT handler still runs
            signal.raise_signal(signal.SIGINT)
        assert flaky.flushes == 1
    finally:
        restore()
    assert signal.getsignal(signal.SIGINT) == previous
    group.close()
    assert [r["x"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [2.0]


def test_signal_flush_keeps_an_ignored_sigint_ignored(tmp_path, sigint_handler):
    sigint_handler(signal.SIG_IGN)  # as under nohup or in a background job
    flaky = FailsFromEpoch(99)
    group = SinkGroup([flaky, JSONLSink(tmp_path)])
    restore = group.install_signal_flush()
    try:
        group.emit(Record.of({"x": 3.0}, 0, "POST_STEP"))
        signal.raise_signal(signal.SIGINT)  # flushed; nothing raised, the process goes on
        assert flaky.flushes == 1
    finally:
        restore()
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    group.close()
    assert [r["x"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [3.0]


class AsksForFigures(MetricSink):
    """Asks for the run's figures at even epochs and at close; keeps what it is handed."""

    name = "asks"

    def __init__(self, broken: bool = False) -> None:
        super().__init__()
        self.broken = broken
        self.handed: list[tuple[int, object]] = []
        self.final: object = None

    def wants_figures(self, record):
        if self.broken:
            raise RuntimeError("cannot tell")
        return record is None or record.epoch % 2 == 0

    def emit(self, record):
        self.handed.append((record.epoch, record.figures))

    def final_figures(self, figures):
        self.final = figures


def test_figures_are_drawn_once_for_the_sinks_that_ask_and_only_for_them(tmp_path, caplog):
    drawings: list[dict] = []

    def draw():
        drawings.append({"heatmaps/x": (f"png {len(drawings)}".encode(), "caption")})
        return drawings[-1]

    first, second, broken = AsksForFigures(), AsksForFigures(), AsksForFigures(broken=True)
    group = SinkGroup([first, JSONLSink(tmp_path), broken, second])
    group.draw_figures = draw
    for epoch in (1, 2, 3):
        group.emit(Record.of({"x": float(epoch)}, epoch, "POST_EPOCH"))
    assert len(drawings) == 1  # epoch 2's, drawn once for both sinks that asked
    for sink in (first, second):
        assert sink.handed == [(1, None), (2, drawings[0]), (3, None)]
    assert "wants_figures() raised RuntimeError" in group.failures["asks"]
    assert [r["x"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1.0, 2.0, 3.0]
    assert "heatmaps/x" not in (tmp_path / "metrics.jsonl").read_text()
    group.close()
    assert len(drawings) == 2 and first.final is second.final is drawings[1]

    # a drawing that fails costs the figures, never the records
    def fails():
        raise ValueError("no figure")

    sink = AsksForFigures()
    group = SinkGroup([sink])
    group.draw_figures = fails
    group.emit(Record.of({"x": 1.0}, 2))
    group.close()
    assert sink.handed == [(2, None)] and sink.final is None and group.failures == {}
    assert any("drawing the run's figures failed" in r.getMessage() for r in caplog.records)
