"""CSVSink: ``run_dir/metrics.csv``, one row per emit, scalars only.

Per-unit vectors are summarised as ``<key>/mean``, ``<key>/min`` and ``<key>/max`` over
their finite elements. Columns are ``epoch, agent_step, hook_point, time`` followed by the
metric columns in order of first appearance. When an emit brings new columns the file is
rewritten with the wider header: the old file is streamed row by row into a temporary file
in the same directory, which is fsynced and renamed over the original (``os.replace``), so
a reader or a crash only ever sees a complete CSV, and memory stays O(one row) however long
the file is.
"""

from __future__ import annotations

import csv
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from policy_probes.plugins import register
from policy_probes.records import Record, vector_stats
from policy_probes.sinks.base import FSYNC_SECONDS, AppendFileSink
from policy_probes.sinks.config import SinkSetup
from policy_probes.sinks.jsonl import fsync_dir, repair_truncated_tail

logger = logging.getLogger("policy_probes.sinks")

METRICS_CSV = "metrics.csv"
BASE_COLUMNS = ("epoch", "agent_step", "hook_point", "time")


@register
class CSVSink(AppendFileSink):
    """Wide CSV of scalar metrics with atomic header growth."""

    name = "csv"
    newline = ""

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
        dropped = repair_truncated_tail(self.path)
        if dropped:
            logger.warning(
                "%s ended in a truncated row (%d bytes); it was removed", self.path, dropped
            )
        self.columns: list[str] = read_header(self.path)
        self._index: dict[str, int] = {c: i for i, c in enumerate(self.columns)}
        self._open_append()
        #: number of header rewrites so far (for tests and diagnostics)
        self.rewrites = 0

    @classmethod
    def from_setup(cls, setup: SinkSetup) -> CSVSink:
        return cls(setup.run_dir, fsync_seconds=setup.sinks.fsync_seconds)

    # ------------------------------------------------------------------ emit
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
        """Rewrite the file with ``new_columns`` appended to the header (atomic, streaming)."""
        self._file.close()
        columns = self.columns + new_columns
        try:
            with open(self.tmp_path, "w", encoding="utf-8", newline="") as dst:
                writer = csv.writer(dst)
                writer.writerow(columns)
                pad = [""] * len(new_columns)
                if self.columns:
                    with open(self.path, encoding="utf-8", newline="") as src:
                        reader = csv.reader(src)
                        next(reader, None)  # old header
                        for row in reader:
                            writer.writerow(row + pad)
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(self.tmp_path, self.path)
            fsync_dir(self.path.parent)
        except BaseException:
            if self.tmp_path.exists():
                self.tmp_path.unlink()
            raise
        finally:
            self._open_append()
        self.columns = columns
        self._index = {c: i for i, c in enumerate(columns)}
        self.rewrites += 1

    # ------------------------------------------------------------------ lifecycle
    def _open_append(self) -> None:
        super()._open_append()
        self._writer = csv.writer(self._file)

    def rewind(self, last_epoch: int) -> int:
        """Drop rows of epochs after ``last_epoch`` (atomic, streaming). Returns rows dropped."""
        self.close()
        dropped = 0
        try:
            if self.columns:
                col = self._index["epoch"]
                with (
                    open(self.path, encoding="utf-8", newline="") as src,
                    open(self.tmp_path, "w", encoding="utf-8", newline="") as dst,
                ):
                    reader, writer = csv.reader(src), csv.writer(dst)
                    writer.writerow(next(reader))
                    for row in reader:
                        try:
                            later = int(row[col]) > last_epoch
                        except (ValueError, IndexError):
                            later = True
                        if later:
                            dropped += 1
                        else:
                            writer.writerow(row)
                    dst.flush()
                    os.fsync(dst.fileno())
                os.replace(self.tmp_path, self.path)
                fsync_dir(self.path.parent)
        finally:
            self._open_append()
        return dropped

    def __repr__(self) -> str:
        return f"CSVSink({str(self.path)!r})"


def read_header(path: Path) -> list[str]:
    """The header row of a CSV file ([] when the file is absent or empty)."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return next(csv.reader(f), [])
    except FileNotFoundError:
        return []


def scalar_columns(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The CSV cells of a record's plain metrics: scalars as they are (None -> empty, bool
    -> 0/1), vectors as ``/mean``, ``/min``, ``/max`` of their finite elements (empty when
    none)."""
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
