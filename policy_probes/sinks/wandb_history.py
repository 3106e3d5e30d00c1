"""What a W&B run already holds on disk: the last epoch and step in its run files.

Every ``wandb.init`` of a resumed training run writes a new run folder
(``run_dir/wandb/offline-run-<time>-<id>/run-<id>.wandb``, ``run-...`` online) under the
same run id, and W&B counts ``_step`` from 0 in each. So that every epoch is uploaded once
on increasing steps, :class:`~.wandb_sink.WandbSink` reads back the history records of the
earlier folders. A run file is a LevelDB-style log (a 7-byte header, then 32 KiB blocks of
chunks, each with a crc32, a length and a FULL/FIRST/MIDDLE/LAST type) of serialized
``wandb_internal_pb2.Record`` messages; reading stops at the first damaged chunk (what
follows a crash mid-write was never complete, so W&B does not have it either).
"""

from __future__ import annotations

import json
import logging
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("policy_probes.sinks")

_BLOCK, _CHUNK_HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
#: keys of the image-only rows a sink logs when it closes (not records of metrics.jsonl)
_IMAGE_PREFIXES = ("heatmaps/", "layers/")
_ROW_FIELDS = {"epoch", "_step", "_runtime", "_timestamp"}


@dataclass(frozen=True)
class WandbHistoryPosition:
    """Where a W&B run's history stands: the highest ``epoch`` logged (None: none), the
    ``_step`` the next row gets, and ``records``: how many rows hold a record (one per
    emitted record, in the order ``metrics.jsonl`` holds them; the image-only rows a
    closing sink adds are not counted)."""

    last_epoch: int | None = None
    next_step: int = 0
    records: int = 0


def _records(data: bytes) -> list[bytes]:
    """The complete records of a run file (stops at the first damaged chunk)."""
    if len(data) < 7 or data[:4] != b":W&B":
        return []
    pos, pending, out = 7, b"", []
    while pos + _CHUNK_HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER:  # block trailer
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK_HEADER])
        if kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        chunk = data[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length]
        if len(chunk) < length or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            break
        pos += _CHUNK_HEADER + length
        if kind in (_FULL, _FIRST):
            pending = chunk
        else:
            pending += chunk
        if kind in (_FULL, _LAST):
            out.append(pending)
            pending = b""
    return out


def history_position(run_file: Path) -> WandbHistoryPosition:
    """The last ``epoch`` and next ``_step`` of the history rows in one run file."""
    from wandb.proto import wandb_internal_pb2 as pb

    last_epoch: int | None = None
    next_step = records = 0
    for raw in _records(run_file.read_bytes()):
        record = pb.Record()
        try:
            record.ParseFromString(raw)
        except Exception:  # noqa: BLE001 - a record we cannot parse is not history we own
            continue
        if record.WhichOneof("record_type") != "history":
            continue
        next_step = max(next_step, record.history.step.num + 1)
        images_only = True
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            if key not in _ROW_FIELDS and not key.startswith(_IMAGE_PREFIXES):
                images_only = False
            if key == "_step":
                next_step = max(next_step, int(json.loads(item.value_json)) + 1)
            elif key == "epoch":
                epoch = int(json.loads(item.value_json))
                last_epoch = epoch if last_epoch is None else max(last_epoch, epoch)
        records += not images_only
    return WandbHistoryPosition(last_epoch, next_step, records)


def run_history_position(wandb_dir: Path, run_id: str) -> WandbHistoryPosition:
    """:func:`history_position` over every earlier run folder of ``run_id`` in
    ``wandb_dir`` (offline and online ones alike)."""
    last_epoch: int | None = None
    next_step = records = 0
    for run_file in sorted(Path(wandb_dir).glob(f"*run-*-{run_id}/run-{run_id}.wandb")):
        try:
            pos = history_position(run_file)
        except OSError as exc:
            logger.warning("could not read the earlier W&B run file %s: %s", run_file, exc)
            continue
        next_step = max(next_step, pos.next_step)
        records += pos.records
        if pos.last_epoch is not None:
            last_epoch = pos.last_epoch if last_epoch is None else max(last_epoch, pos.last_epoch)
    return WandbHistoryPosition(last_epoch, next_step, records)
