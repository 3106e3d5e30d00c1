"""JSONLSink: ``run_dir/metrics.jsonl``, one JSON object per emit.

``{"epoch", "agent_step", "hook_point", "time", <metrics>}`` with vectors as lists, written
with one ``write`` per emit; non-finite floats become ``null``, their keys listed under
``"_nonfinite"``. A truncated last line (a crash mid-write) is cut off on open."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import orjson

from policy_probes.plugins import register
from policy_probes.records import METRICS_JSONL, NONFINITE_KEY, Record
from policy_probes.sinks.base import AppendFileSink, repair_truncated_tail
from policy_probes.sinks.config import FSYNC_SECONDS

logger = logging.getLogger("policy_probes.sinks")


@register
class JSONLSink(AppendFileSink):
    """Append-only JSON Lines file of every emit."""

    name = "jsonl"

    def __init__(
        self,
        run_dir: str | Path,
        filename: str = METRICS_JSONL,
        *,
        fsync_seconds: float = FSYNC_SECONDS,
    ) -> None:
        super().__init__(Path(run_dir) / filename, fsync_seconds)
        self._open_append()
        self._warned_nonfinite: set[str] = set()

    def emit(self, record: Record) -> None:
        line = json_line(record)
        for key in line.get(NONFINITE_KEY, ()):
            if key not in self._warned_nonfinite:
                self._warned_nonfinite.add(key)
                logger.warning("metric %r has non-finite values; written as null", key)
        # orjson: ~15x faster than json on a record of per-unit vectors, the same floats
        # (shortest round-trip digits)
        self._file.write(orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE).decode())
        self.written(record.hook_point)

    def rewind(self, last_epoch: int) -> int:
        """Drop the records of epochs after ``last_epoch`` (:func:`rewind_jsonl`)."""
        with self.reopened():
            return rewind_jsonl(self.path, last_epoch)


def json_line(record: Record) -> dict[str, Any]:
    """The JSON object of one record: its fields first, then its metrics, non-finite
    floats replaced by None and listed under ``"_nonfinite"``."""
    line: dict[str, Any] = {
        "epoch": record.epoch,
        "agent_step": record.agent_step,
        "hook_point": record.hook_point,
        "time": round(time.time(), 3),
    }
    nonfinite: list[str] = []
    for key, value in record.metrics.items():
        clean, had_nonfinite = _finite_or_none(value)
        if had_nonfinite:
            nonfinite.append(key)
        line[key] = clean
    if nonfinite:
        line[NONFINITE_KEY] = nonfinite
    return line


def _nonfinite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _finite_or_none(value: Any) -> tuple[Any, bool]:
    if _nonfinite(value):
        return None, True
    if isinstance(value, list):
        try:  # the common case, every element a finite number: one C-level pass
            if all(map(math.isfinite, value)):
                return value, False
        except TypeError:  # None, strings or nested lists among the elements
            pass
        if any(map(_nonfinite, value)):
            return [None if _nonfinite(v) else v for v in value], True
    return value, False


def rewind_jsonl(path: str | Path, last_epoch: int) -> int:
    """Rewrite ``path`` without the records of epochs after ``last_epoch``; returns how many."""
    path = Path(path)
    if not path.exists():
        return 0
    repair_truncated_tail(path)
    dropped = 0

    def keep_earlier(dst: IO[str]) -> None:
        nonlocal dropped
        with open(path, encoding="utf-8") as src:
            for line in src:
                try:
                    epoch = json.loads(line).get("epoch")
                except (json.JSONDecodeError, AttributeError):  # not a record
                    dropped += 1
                    continue
                if isinstance(epoch, int) and epoch > last_epoch:
                    dropped += 1
                else:
                    dst.write(line)

    rewrite_atomic(path, keep_earlier)
    return dropped


def rewrite_atomic(
    path: Path, write: Callable[[IO[str]], None], newline: str | None = None
) -> None:
    """Replace ``path`` by what ``write(file)`` writes, streaming: a temporary file beside
    it (``<name>.tmp``), fsynced and renamed over it, so a reader or a crash only ever sees
    a whole file (the temporary file is removed on failure)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline=newline) as dst:
            write(dst)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fsync_dir(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (no-op where directories can't be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
