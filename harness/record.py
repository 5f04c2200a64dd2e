"""Records: every run ends in exactly one JSON line in <results_dir>/<study>.jsonl.

Appends are atomic: one write(2) of one line under an exclusive flock, with O_APPEND, so concurrent
jobs (SLURM arrays) never interleave and a crash never leaves half a record in the middle of the
file. Records are never rewritten; a reader skips a torn last line.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
from pathlib import Path

SCHEMA_VERSION = 1
STATUSES = ("ok", "invalid", "failed", "timeout", "oom")


def run_id(config: dict) -> str:
    """Hash of the resolved config, less the fields that do not change what is measured and less
    the values equal to the schema's defaults, so that adding a field with a default to the schema
    keeps every existing run_id (a resumed study still finds its done runs)."""
    from harness.config import NON_SEMANTIC_KEYS

    defaults = _schema_defaults()
    semantic = {k: v for k, v in _flatten(config).items()
                if k.split(".")[0] not in NON_SEMANTIC_KEYS and defaults.get(k, _ABSENT) != v}
    return hashlib.sha256(json.dumps(semantic, sort_keys=True, default=str).encode()).hexdigest()[:12]


_ABSENT = object()


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@functools.lru_cache(maxsize=1)
def _schema_defaults() -> dict:
    from omegaconf import OmegaConf

    from harness.config import RunConfig

    return _flatten(OmegaConf.to_container(OmegaConf.structured(RunConfig), throw_on_missing=False))


def records_path(results_dir: str | Path, study: str) -> Path:
    return Path(results_dir) / f"{study}.jsonl"


def append(path: Path, record: dict) -> None:
    assert record["status"] in STATUSES, record["status"]
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, sort_keys=False, default=str) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        # A previous writer killed mid-line would leave no newline: start ours on a fresh line.
        if os.fstat(fd).st_size and os.pread(fd, 1, os.fstat(fd).st_size - 1) != b"\n":
            line = b"\n" + line
        os.write(fd, line)
        os.fsync(fd)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def read(path: Path) -> list[dict]:
    if not Path(path).exists():
        return []
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn line from a writer that was killed: skipped, never repaired in place
    return out


def latest_by_run_id(records: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in records:
        out[r["run_id"]] = r
    return out
