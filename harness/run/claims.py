"""Claims: in a named study, one invocation runs a config (each repeat of it) at a time.

The key is the run_id, and the repeat after the first (claim_key), so two invocations of a study never
run the same repeat twice. A claim is an exclusive, non-blocking flock on
<results_dir>/runs/<study>/.claims/<key>.lock, held from before the resume check until the record is
written. The kernel drops it when its process dies, however it dies, so a claim is never stale; the
files stay (removing a lock file while another process opens it would let two claims coexist). The
holder writes one line into the file, "<pid> <what it does with it>", which a refused invocation prints.

SLURM handover (launcher=slurm): the invocation that submits a job claims the key `SUBMITTING`, then
relabels it `SUBMITTED <job id>` and holds it until the job ends (hydra_plugins/brigade_slurm). Inside
the job, task 0 waits while the line says SUBMITTING (the job id is being written); a claim held as
this job's is its own: it goes on, and takes the claim over should the submitter die (inherit). The
other nodes' tasks only read the line: they go on when the claim is this job's, and stop when another
brigade holds it, as task 0 does.
"""
from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

from harness import rundir

SUBMITTING = "submitting it to SLURM"
SUBMITTED = "submitted it as SLURM job"


def claim_key(run_id: str, repeat: int | None) -> str:
    """What one invocation claims while it runs a config: its run_id, and the repeat after the first."""
    return run_id + (f".r{repeat}" if repeat else "")


def claim_path(results_dir: str, study: str, key: str) -> Path:
    return rundir.runs_dir(results_dir, study) / ".claims" / f"{key}.lock"


class Claims:
    """The claims this process holds: key -> the fd of its lock file (closing it lets go)."""

    def __init__(self):
        self.fds: dict[str, int] = {}

    def take(self, results_dir: str, study: str, key: str, holder: str = "running it",
             wait_while=None, timeout_s: float = 60.0) -> str | None:
        """Claim `key`, saying what this process does with it (`holder`); None when claimed now,
        else the holder's line ("<pid> <what it does with it>"). wait_while(line): keep trying while
        it is true (a SLURM job whose submitter is still writing the job's id), up to timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            fd, line = _lock(results_dir, study, key, holder)
            if fd is not None:
                self.fds[key] = fd
                return None
            if wait_while is None or not wait_while(line) or time.monotonic() > deadline:
                return line
            time.sleep(0.5)

    def inherit(self, results_dir: str, study: str, key: str, holder: str) -> None:
        """Hold `key` as soon as its holder lets go: a SLURM job whose submitting invocation holds the
        claim for it, and would leave it unheld if it died while the job runs."""
        fd = os.open(claim_path(results_dir, study, key), os.O_RDWR | os.O_CREAT, 0o644)
        self.fds[key] = fd

        def wait() -> None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # blocks until the submitter lets go (or dies)
                _write_holder(fd, holder)
            except OSError:
                pass  # released meanwhile: the run ended

        threading.Thread(target=wait, daemon=True, name=f"claim-{key}").start()

    def relabel(self, key: str, holder: str) -> None:
        """Say what this process now does with a claim it holds (e.g. which SLURM job runs it)."""
        fd = self.fds.get(key)
        if fd is not None:
            _write_holder(fd, holder)

    def release(self, key: str) -> None:
        fd = self.fds.pop(key, None)
        if fd is not None:
            os.close(fd)  # closing the last descriptor drops the flock


def claim_for_job(claims: Claims, results_dir: str, study: str, key: str, slurm_job: str | None,
                  task_rank: int = 0) -> str | None:
    """Claim a config for the job about to run it; None when this process may run it, else why not
    (a line to print). `slurm_job`: the SLURM job this process runs in (None outside one), `task_rank`
    its SLURM task (module docstring: the handover)."""
    if not slurm_job:
        line = claims.take(results_dir, study, key)
        return line and held_by(line, results_dir, study, key)
    mine = (f"{SUBMITTED} {slurm_job}", f"in SLURM job {slurm_job}")
    if task_rank == 0:
        line = claims.take(results_dir, study, key, mine[1],
                           wait_while=lambda line: line.endswith(SUBMITTING))  # the job id is being written
        if line and line.endswith(mine[0]):
            claims.inherit(results_dir, study, key, mine[1])
            return None
    else:
        line = _holder_once_settled(claim_path(results_dir, study, key), SUBMITTING)
        line = "" if line.endswith(mine) else line
    return line and held_by(line, results_dir, study, key)


def held_by(line: str, results_dir: str, study: str, key: str) -> str:
    """A claim's holder, said as a line to print."""
    return f"another brigade (pid {line}) holds it ({claim_path(results_dir, study, key)})"


def holder_line(path: Path) -> str:
    """What the last holder of a claim said it does with it (read without the lock)."""
    try:
        return path.read_text(errors="replace").strip() or "?"
    except OSError:
        return "?"


def _lock(results_dir: str, study: str, key: str, holder: str) -> tuple[int | None, str]:
    """(fd holding the claim, ""), or (None, the holder's line: "<pid> <what it does with it>")."""
    path = claim_path(results_dir, study, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        line = holder_line(path)
        os.close(fd)
        return None, line
    try:
        _write_holder(fd, holder)
    except OSError:
        os.close(fd)  # e.g. a full disk: the claim is not kept half-made
        raise
    return fd, ""


def _holder_once_settled(path: Path, unsettled: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    line = holder_line(path)
    while (line == "?" or line.endswith(unsettled)) and time.monotonic() < deadline:
        time.sleep(0.5)
        line = holder_line(path)
    return line


def _write_holder(fd: int, holder: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {holder}\n".encode(), 0)
