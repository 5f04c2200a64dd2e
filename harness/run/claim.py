"""One claim per run_id in a study: two invocations of the same named study never run one config twice.

The claim is an exclusive, non-blocking flock on <results_dir>/runs/<study>/.claims/<run_id>.lock,
held from before the resume check until the record is written. The kernel drops it when its
process dies, however it dies, so a claim is never stale; the files stay (removing a lock file
while another process opens it would let two claims coexist).
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

_held: dict[str, int] = {}  # run_id -> fd of the lock file


def take(results_dir: str, study: str, run_id: str) -> str | None:
    """Claim run_id; None when claimed now, else who holds it (a line to print)."""
    d = Path(results_dir) / "runs" / study / ".claims"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{run_id}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        return f"another brigade (pid {holder}) is running it ({path})"
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[run_id] = fd
    return None


def release(run_id: str) -> None:
    fd = _held.pop(run_id, None)
    if fd is not None:
        os.close(fd)  # closing the last descriptor drops the flock
