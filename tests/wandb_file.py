"""Read a W&B offline run file (run-<id>.wandb), so tests can check what was really logged.

The file is W&B's LevelDB-style log: a 7-byte header (":W&B", version), then 32 KiB blocks of
chunks, each with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last); every
assembled payload is a `wandb_internal_pb2.Record` protobuf.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, buf = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        payload = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 2):
            buf = payload
        else:
            buf += payload
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec
            buf = b""


def summary_and_history(path: Path) -> tuple[dict, list[dict]]:
    summary, history = {}, []
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "summary":
            for item in rec.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in rec.history.item})
    return summary, history
