"""Reads an offline W&B run file back, with the protobuf classes that ship with wandb."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2 as pb

# The run file is a LevelDB-style log (https://github.com/google/leveldb/blob/main/doc/log_format.md):
# a 7-byte header (":W&B", magic 0xBEE1, version), then 32 KiB blocks of chunks, each with a
# 7-byte header (crc32 of type+data, length, type FULL/FIRST/MIDDLE/LAST). Each record is a
# serialized wandb_internal_pb2.Record. wandb 0.31 ships no Python reader, so this is one.
BLOCK, CHUNK_HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(run_file: Path) -> list[pb.Record]:
    data = run_file.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    pos, pending, out = 7, b"", []
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # block trailer
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        if kind == 0:
            pos += left
            continue
        chunk = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, "corrupt chunk"
        pos += CHUNK_HEADER + length
        if kind == FULL:
            pending = chunk
        elif kind == FIRST:
            pending = chunk
            continue
        elif kind == MIDDLE:
            pending += chunk
            continue
        else:
            assert kind == LAST
            pending += chunk
        record = pb.Record()
        record.ParseFromString(pending)
        out.append(record)
    return out


def history_rows(records: list[pb.Record]) -> list[dict[str, Any]]:
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows.append(
                {
                    (i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                    for i in r.history.item
                }
            )
    return rows


def run_file(run_dir: Path) -> Path:
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    return files[0]
