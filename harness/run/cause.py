"""Why a run that did not finish failed: the first rank that died, and how.

Three witnesses, none enough alone:
  - error_rank<r>.json: a rank that raised (type, message, time to the microsecond). A rank killed
    by a signal writes none, and its peers then raise "Connection reset by peer": their files are
    consequences, not the cause.
  - torchrun's exit summary in workers.log: every failed rank's exit code (-9 = SIGKILL) and the
    second torchrun saw it die (its monitor polls every 0.1 s).
  - the kernel's oom_kill counter (/proc/vmstat), read by the launcher before and after the run: a
    rank killed by SIGKILL while the counter rose was, in all likelihood, the OOM killer's victim.
A rank that died by SIGTERM is torchrun tearing the others down after the first failure, so it is
the cause only when nothing else is. A death by another signal is stamped when torchrun's monitor
saw it, floored to the second, and under load that poll lags (observed: a peer's error 0.08 s before
the stamped second, at load 21 on 2 cores), so it counts SIGNAL_SLACK_S earlier than its stamp; and
an error that says a peer went away ("Connection reset by peer", ...) is never preferred to it. Error files written before the parent began to end
the run (timeout or a signal to the parent) win over `timeout`/`interrupted`: the run had failed.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from harness import rundir
from harness.run.record import Status

# One entry of torchrun's ChildFailedError summary (torch/distributed/elastic/multiprocessing/errors).
_SUMMARY_ENTRY = re.compile(r"time\s*:\s*(\S+)\s*\n\s*host\s*:.*\n\s*rank\s*:\s*(\d+).*\n\s*exitcode\s*:\s*(-?\d+)")


SIGNAL_SLACK_S = 3.0
# What a rank raises when a peer vanished: a consequence of another rank's death, not a cause.
_PEER_LOST = re.compile(r"Connection (reset|closed) by peer|Broken pipe|remote process exited|"
                        r"communicator was aborted", re.IGNORECASE)


@dataclass
class Death:
    rank: int
    time: float  # seconds since the epoch
    status: Status  # FAILED | OOM
    error: str


def rank_deaths(log_path: Path) -> dict[int, tuple[float, int]]:
    """rank -> (time torchrun saw it die, exit code) from torchrun's last summary in the log."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return {}
    out = {}
    for stamp, rank, code in _SUMMARY_ENTRY.findall(text[text.rfind("FAILED"):] if "FAILED" in text else ""):
        try:
            seen = time.mktime(time.strptime(stamp, "%Y-%m-%d_%H:%M:%S"))
        except ValueError:
            seen = float("inf")
        out[int(rank)] = (seen, int(code))
    return out


def signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def error_files(run_dir: Path) -> list[dict]:
    out = []
    for path in sorted(Path(run_dir).glob(rundir.ERROR_GLOB)):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue  # written atomically, so only a file from a foreign writer could be torn
    return out


def first_death(run_dir: Path, result) -> Death | None:
    """The first rank that died before the parent began to end the run, or None."""
    ended = result.ended_at if result.ended_at is not None else float("inf")
    candidates = []
    errors = {}
    for e in error_files(run_dir):
        if e.get("time", 0) <= ended:
            errors[e["rank"]] = e
            status = Status(e["status"]) if e.get("status") else Status.OOM if e.get("out_of_memory") else Status.FAILED
            candidates.append(Death(e["rank"], e.get("time", 0), status,
                                    f"rank {e['rank']}: {e['type']}: {e['message']}"))
    torn_down = []  # SIGTERM: torchrun's own teardown, unless nothing else explains the failure
    for rank, (seen, code) in rank_deaths(result.log_path).items():
        if code >= 0 or rank in errors or seen > ended:
            continue
        name = signal_name(code)
        oom = code == -signal.SIGKILL and result.oom_kills > 0
        why = (f"; the kernel OOM-killed {result.oom_kills} process(es) during the run (/proc/vmstat oom_kill): "
               f"host memory ran out" if oom else "")
        death = Death(rank, seen, Status.OOM if oom else Status.FAILED, f"rank {rank}: killed by {name} (exit code {code}){why}")
        (torn_down if code == -signal.SIGTERM else candidates).append(death)
    killed = any(d.rank not in errors for d in candidates)

    def when(d: Death) -> float:
        if d.rank not in errors:  # a signal death, stamped late
            return d.time - SIGNAL_SLACK_S
        return float("inf") if killed and _PEER_LOST.search(d.error) else d.time

    ordered = sorted(candidates or torn_down, key=when)
    return ordered[0] if ordered else None


def launcher_death(result) -> tuple[Status, str] | None:
    """torchrun itself killed by a signal (no summary written): (status, error)."""
    code = result.returncode
    if code is None or code >= 0:
        return None
    if code == -signal.SIGKILL and result.oom_kills > 0:
        return Status.OOM, (f"torchrun killed by SIGKILL while the kernel OOM-killed {result.oom_kills} process(es) "
                       f"(/proc/vmstat oom_kill): host memory ran out")
    return Status.FAILED, f"torchrun killed by {signal_name(code)} (exit code {code})"


def verdict(run, run_dir: Path, result) -> tuple[Status, str] | None:
    """(status, error) of a run that did not finish, or None when its measurement is there to read."""
    if result.taken_away:  # the scheduler signalled every process: their deaths are its doing (launch/slurm.py)
        return Status.INTERRUPTED, f"{result.taken_away}; every process of the run ended"
    death = first_death(run_dir, result)
    if death is not None:
        return death.status, death.error
    if result.timed_out:
        return Status.TIMEOUT, f"run exceeded launcher.timeout_s={run.launcher.timeout_s:.0f} s; every process of the run ended"
    if result.interrupted:
        status, cause = stop_cause(result.interrupted)
        return status, f"{cause} while the run was in flight; every process of the run ended"
    if not (Path(run_dir) / rundir.MEASUREMENT).exists():
        return launcher_death(result) or (Status.FAILED, f"workers exited with code {result.returncode}: "
                                                    f"{last_exception(result.log_path) or log_tail(result.log_path)}")
    return None


def divergence(losses: list) -> str | None:
    """The first non-finite loss, said with its step, or None when every loss is finite."""
    for step, loss in enumerate(losses or []):
        if loss is None or loss != loss or loss in (float("inf"), float("-inf")):
            shown = ", ".join("nan" if v is None or v != v else f"{v:.4g}" for v in losses[:step + 2])
            return f"loss is {loss} at step {step} (of {len(losses)}, warm-up included): [{shown}, ...]"
    return None


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*", re.MULTILINE)


def last_exception(path: Path) -> str | None:
    """The last exception line in the log ("torch.distributed.DistNetworkError: ... port: 29123 ..."),
    when torchrun itself failed before any rank ran (a clash on launcher.master_port, say)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    found = [m.group(0) for m in _EXCEPTION_LINE.finditer(text) if "ChildFailedError" not in m.group(0)]
    return found[-1][:2000] if found else None


def log_tail(path: Path, n: int = 15) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(l for l in lines[-n:] if l.strip())[-2000:]


def failure(error: BaseException) -> tuple[Status, str]:
    """The one rule for a job that raised instead of ending (a bug, a full disk, a SLURM job killed
    without a record): `failed`, or `timeout` when its time limit ended it; the error says where."""
    where = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    at = f" (at {where[0].filename}:{where[0].lineno} in {where[0].name})" if where else ""
    status = Status.TIMEOUT if getattr(error, "timed_out", False) else Status.FAILED
    return status, f"{type(error).__name__}: {str(error)[:2000]}{at}"


def stop_cause(signame: str) -> tuple[Status, str]:
    """Why brigade was told to stop by `signame`: `timeout` when it came from coreutils `timeout` as its
    limit ran out (this process's parent is `timeout`, which sends that signal, and its duration has
    passed since it started), `interrupted` otherwise (a person, a scheduler); with the sentence to record."""
    limit = _timeout_parent(signame)
    if limit is None:
        return Status.INTERRUPTED, f"brigade received {signame}"
    argv, duration = limit
    return Status.TIMEOUT, (f"brigade received {signame} from its parent `{argv}` (coreutils timeout) when its limit "
                            f"of {duration:g} s ran out")


def _timeout_parent(signame: str) -> tuple[str, float] | None:
    """(its command line, its duration in s) when this process's parent is coreutils `timeout`, sends
    `signame` and has run at least its duration; else None."""
    ppid = os.getppid()
    try:
        args = [a.decode(errors="replace") for a in Path(f"/proc/{ppid}/cmdline").read_bytes().split(b"\0")[:-1]]
        started = int(Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, in ticks
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if not args or Path(args[0]).name != "timeout":
        return None
    sig, duration, i = "TERM", None, 1
    while i < len(args) and duration is None:  # timeout [-s SIG] [-k DURATION] [--foreground ...] DURATION COMMAND
        a = args[i]
        if a in ("-s", "--signal", "-k", "--kill-after"):
            sig = args[i + 1] if a in ("-s", "--signal") and i + 1 < len(args) else sig
            i += 2
            continue
        if a.startswith(("--signal=", "-s")):
            sig = a.split("=", 1)[1] if a.startswith("--") else a[2:]
        elif not a.startswith("-"):
            duration = _duration_s(a)
            if duration is None:
                return None
        i += 1
    names = {sig.upper(), f"SIG{sig.upper()}"}
    if sig.isdigit() and int(sig) in signal.valid_signals():
        names.add(signal_name(-int(sig)))
    elapsed = uptime - started / os.sysconf("SC_CLK_TCK")
    if not duration or signame not in names or elapsed < duration - 0.05:
        return None
    return " ".join(args)[:160], duration


def _duration_s(text: str) -> float | None:
    """coreutils timeout's DURATION: a number with an optional unit s, m, h or d."""
    unit = {"s": 1, "m": 60, "h": 3600, "d": 86400}.get(text[-1:], None)
    try:
        return float(text[:-1]) * unit if unit else float(text)
    except ValueError:
        return None
