"""The run directory: where one run's files live and what each is called, read by the parent and by
every rank alike (the ground floor: it imports nothing of brigade's).

    <results_dir>/runs/<study>/<strategy>-<degrees>-<run_id>[.<attempt>]/
        config.yaml          the frozen, resolved config the workers read (never re-enter Hydra)
        prediction.json      the cost model's prediction, as written into the record
        workers.log          torchrun's and every rank's stdout/stderr
        progress             "<done> <total>" steps, rewritten by rank 0
        error_rank<r>.json   a rank's exception (type, message, traceback, time), written before it exits
        measurement.json     every rank's figures, gathered and written by rank 0 at the end
        trace_rank<r>.json   the profiled window's Chrome trace (torch.profiler)
        timeline_rank<r>.json  a pipeline rank's per-action timeline
        grads_rank<r>.pt     step 0's full gradients, only with BRIGADE_GRAD_DUMP=1 (the parity tests)

The parent writes the frozen config and the prediction, the ranks write their progress, error files,
traces, timelines and the measurement, the parent reads them back (harness/run/job.py) and the report
reads what the record points to. Every file the parent or a rank writes whole is written by
write_atomic: whole or not at all, and synced, so a reader never sees half a file and a crash never
leaves a torn one (workers.log is a stream, appended).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path


def runs_dir(results_dir: str | Path, study: str) -> Path:
    """<results_dir>/runs/<study>/: the study's run directories (and its claims, harness/run/claims.py)."""
    return Path(results_dir) / "runs" / study


CONFIG = "config.yaml"
PREDICTION = "prediction.json"
WORKERS_LOG = "workers.log"
PROGRESS = "progress"
MEASUREMENT = "measurement.json"
ERROR_GLOB = "error_rank*.json"


def error_file(rank: int) -> str:
    return f"error_rank{rank}.json"


def trace_file(rank: int) -> str:
    return f"trace_rank{rank}.json"


def timeline_file(rank: int) -> str:
    return f"timeline_rank{rank}.json"


TIMELINE_GLOB = "timeline_rank*.json"


def grads_file(rank: int) -> str:
    return f"grads_rank{rank}.pt"


GRADS_GLOB = "grads_rank*.pt"


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write `data` whole and durably: into a temporary file beside `path`, synced, renamed over
    `path` (atomic on POSIX), then the directory synced so the rename itself survives a crash. A
    reader sees the old file or the new one, never half; a failed write (disk full) leaves no trace."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    view = memoryview(data.encode() if isinstance(data, str) else data)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while view:  # write(2) may write less than asked
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
