"""CSVSink: ``run_dir/metrics.csv``, one row per emit, scalars only (a vector becomes
``<key>/mean``, ``/min``, ``/max`` of its finite elements). Columns are ``epoch, agent_step,
hook_point, time``, then the metrics in order of first appearance; new columns rewrite the
file with the wider header (streaming and atomic: :func:`~.jsonl.rewrite_atomic`)."""

from __future__ import annotations

import csv
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from policy_probes.plugins import register
from policy_probes.records import Record, vector_stats
from policy_probes.sinks.base import AppendFileSink
from policy_probes.sinks.config import FSYNC_SECONDS
from policy_probes.sinks.jsonl import rewrite_atomic

METRICS_CSV = "metrics.csv"
BASE_COLUMNS = ("epoch", "agent_step", "hook_point", "time")


@register
class CSVSink(AppendFileSink):
    """Wide CSV of scalar metrics with atomic header growth."""

    name = "csv"
    newline = ""
    entry = "row"

    def __init__(
        self,
        run_dir: str | Path,
        filename: str = METRICS_CSV,
        *,
        fsync_seconds: float = FSYNC_SECONDS,
    ) -> None:
        super().__init__(Path(run_dir) / filename, fsync_seconds)
        self.tmp_path = self.path.with_name(self.path.name + ".tmp")
        if self.tmp_path.exists():  # left by a crash during a rewrite; the original is whole
            self.tmp_path.unlink()
        self.columns: list[str] = read_header(self.path)
        self._index: dict[str, int] = {c: i for i, c in enumerate(self.columns)}
        self._open_append()
        #: number of header rewrites so far (for tests and diagnostics)
        self.rewrites = 0

    def emit(self, record: Record) -> None:
        values = scalar_columns(record.metrics)
        values["epoch"] = record.epoch
        step = record.agent_step
        values["agent_step"] = "" if step is None else step
        values["hook_point"] = record.hook_point
        values["time"] = round(time.time(), 3)
        new = [c for c in BASE_COLUMNS if c not in self._index]
        new += [c for c in values if c not in self._index and c not in BASE_COLUMNS]
        if new:
            self._widen(new)
        row = [""] * len(self.columns)
        for key, value in values.items():
            row[self._index[key]] = value
        self._writer.writerow(row)
        self.written(record.hook_point)

    def _widen(self, new_columns: list[str]) -> None:
        columns = self.columns + new_columns
        pad = [""] * len(new_columns)
        self._rewrite(columns, lambda row: row + pad)
        self.columns = columns
        self._index = {c: i for i, c in enumerate(columns)}
        self.rewrites += 1

    def _rewrite(self, header: list[str], change: Callable[[list[str]], list[str] | None]) -> None:
        """Rewrite the file with ``header`` and ``change(row)`` of each row (None: drop it)."""

        def write(dst: IO[str]) -> None:
            writer = csv.writer(dst)
            writer.writerow(header)
            for row in self._rows():
                changed = change(row)
                if changed is not None:
                    writer.writerow(changed)

        with self.reopened():
            rewrite_atomic(self.path, write, newline="")

    def _rows(self) -> Iterator[list[str]]:
        if self.columns:
            with open(self.path, encoding="utf-8", newline="") as src:
                reader = csv.reader(src)
                next(reader, None)
                yield from reader

    def _open_append(self) -> None:
        super()._open_append()
        self._writer = csv.writer(self._file)

    def rewind(self, last_epoch: int) -> int:
        """Drop the rows of epochs after ``last_epoch``; returns how many."""
        if not self.columns:
            return 0
        col, dropped = self._index["epoch"], 0

        def earlier(row: list[str]) -> list[str] | None:
            nonlocal dropped
            try:
                if int(row[col]) <= last_epoch:
                    return row
            except (ValueError, IndexError):
                pass
            dropped += 1
            return None

        self._rewrite(self.columns, earlier)
        return dropped


def read_header(path: Path) -> list[str]:
    """The header row of a CSV file ([] when the file is absent or empty)."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return next(csv.reader(f), [])
    except FileNotFoundError:
        return []


def scalar_columns(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The CSV cells of a record's plain metrics: scalars as they are (None -> empty, bool
    -> 0/1, line breaks in strings -> spaces), vectors as ``/mean``, ``/min``, ``/max`` of
    their finite elements (empty when none)."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, list):
            mean, low, high = vector_stats(value) or ("", "", "")
            out[f"{key}/mean"], out[f"{key}/min"], out[f"{key}/max"] = mean, low, high
        elif value is None:
            out[key] = ""
        elif isinstance(value, bool):
            out[key] = int(value)
        elif isinstance(value, str):
            out[key] = value.replace("\r", " ").replace("\n", " ")
        else:
            out[key] = value
    return out
