"""The results file, <results_dir>/<study>.jsonl: one record per line, appended whole, read back
whole, and how a resumed study finds what is already done (already_done).

Appends are all or nothing: one line under an exclusive flock, with O_APPEND, so concurrent jobs
(SLURM arrays) never interleave; a short write (disk full, file size limit) is continued, and on an
error the file is truncated back to where it was, under the lock, and the error raised (the caller
reports the run as not recorded). Readers take the same flock shared (locked_bytes), so a reader
polling a live study never sees half of an append in progress: the kernel grows the file page by page
during one write(2), and a lockless read of a ~20 KB record mid-write saw a torn last line (the fault
test's poll, at load 2-4). Records are never rewritten; a reader skips a torn line (a writer
killed mid-line) with a warning. Lines are strict JSON: a non-finite number is written as null.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import tempfile
import warnings
from pathlib import Path

from harness.collect.aggregate import key
from harness.config import ADHOC_STUDY
from harness.run.record import UNFINISHED, Status, run_id


def records_path(results_dir: str | Path, study: str) -> Path:
    return Path(results_dir) / f"{study}.jsonl"


# Letters, digits, _ . - and no leading dot: a study names <results_dir>/<study>.jsonl and
# <results_dir>/runs/<study>/, so it must stay one plain entry inside results_dir.
_SAFE_STUDY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")


def study_problem(study: str) -> str | None:
    if _SAFE_STUDY.fullmatch(study):
        return None
    return (f"study {study!r} is not a safe name: letters, digits, '_', '.', '-' (1-128, no leading dot); "
            f"it names <results_dir>/<study>.jsonl")


def results_problem(results_dir: str, study: str) -> str | None:
    """One line saying why records cannot go to <results_dir>/<study>.jsonl, or None."""
    problem = study_problem(study)
    if problem or not results_dir:
        return problem or "results_dir is empty: give a directory for the records"
    try:
        Path(results_dir).mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".brigade-probe-", dir=results_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"results_dir {results_dir!r} is not a writable directory: {e.strerror or e} ({e.filename or results_dir})"
    return None


def append(path: Path, record: dict) -> None:
    """Append one record as one line, all or nothing (raises OSError when it could not be written)."""
    assert record["status"] in set(Status), record["status"]
    line = (json.dumps(finite(record), default=str, allow_nan=False) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        # A previous writer killed mid-line would leave no newline: start ours on a fresh line.
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line
        try:
            done = 0
            while done < len(line):  # write(2) may write less than asked (disk full, RLIMIT_FSIZE)
                n = os.write(fd, line[done:])
                if n == 0:
                    raise OSError(errno.ENOSPC, f"wrote 0 of {len(line) - done} bytes", str(path))
                done += n
            os.fsync(fd)
        except BaseException:
            os.ftruncate(fd, size)  # nothing of ours stays behind; the lock keeps others out meanwhile
            raise
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def finite(obj):
    """obj with every NaN/Inf float replaced by None (strict JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def locked_bytes(path: Path) -> bytes:
    """The file's bytes under a shared flock: whole appends only (append holds it exclusive)."""
    with open(path, "rb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_SH)
        try:
            return f.read()
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def read(path: Path) -> list[dict]:
    if not Path(path).exists():
        return []
    out = []
    for i, line in enumerate(locked_bytes(Path(path)).splitlines(), 1):
        try:
            out.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError):
            # a torn line from a writer that was killed: skipped, never repaired in place
            warnings.warn(f"{path}:{i}: skipped a torn record ({len(line)} bytes, not valid JSON)", stacklevel=2)
    return out


def latest_by_run_id(records: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in records:
        out[r["run_id"]] = r
    return out


def already_done(config: dict, run) -> dict | None:
    """Resume: in a named study, a config that already has a finished record is not run again
    (rerun=failed re-runs failed/timeout/oom/diverged ones, rerun=all everything). An invalid or
    interrupted run never finished, so it is always run again. Each repeat is its own run."""
    if run.study == ADHOC_STUDY or run.rerun == "all":
        return None
    mine = (run_id(config), int(config.get("repeat") or 0))
    done = next((r for r in reversed(read(records_path(run.results_dir, run.study))) if key(r) == mine), None)
    if done is None or done["status"] in UNFINISHED:
        return None
    if run.rerun == "failed" and done["status"] != Status.OK:
        return None
    return done
