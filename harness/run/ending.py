"""How a run ends, for the parent process: the one place that ends a run (Ending.end: append its
record, release its claim, note its outcome, print its line), the invocation's exit status, the
claim on a run_id, the parent's termination signals, and the results table.

One Ending per invocation, made by the CLI and handed to the task function (harness.run.job.Task),
through which the sweeper and the launchers reach it: no state between them in module globals or
environment variables. A job called without one (tests, tools) gets its own.

Exit status (so scripts and CI can tell):

    0  every run ok (or skipped as already ok)
    2  some run invalid (refused before launch), none worse
    1  some run failed | timeout | oom | diverged | interrupted, or a record could not be written

`allow_failures=true` (a sweep that expects some runs to fail or be refused, e.g. an OOM frontier)
exits 0 once every run has its record; an interrupted invocation or a lost record still exits 1.

Signals (SIGTERM, SIGINT, SIGHUP) are noted, not acted on where they land. A signal that raised
wherever the parent happened to be (composing, appending a record) could leave half a record or
orphaned ranks. Instead the handler notes it; the launcher's poll loop sees it within one poll, ends
every process of the run in flight (launch/local.py), the run is recorded as `interrupted`, and the
sweep starts no further run. A second signal of the same kind raises KeyboardInterrupt at once, for
a user who insists (the launcher still ends the ranks on the way out).

A claim is an exclusive, non-blocking flock on <results_dir>/runs/<study>/.claims/<run_id>.lock, held
from before the resume check until the record is written, so two invocations of the same named study
never run one config twice. The kernel drops it when its process dies, however it dies, so a claim is
never stale; the files stay (removing a lock file while another process opens it would let two claims
coexist).
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from harness import rundir
from harness.collect.aggregate import MFU_EXCEEDED, config_records
from harness.config import GiB
from harness.labels import ci_text, labels, nbytes
from harness.run import record as rec
from harness.run import results_file
from harness.run.record import FAILURES, Status

# Wide enough for the results table when output goes to a file or CI log (80 columns otherwise).
console = Console(stderr=True, width=None if sys.stderr.isatty() else 140)
UNRECORDED = "unrecorded"  # an outcome, not a status: the record could not be written


class Ending:
    """This invocation's runs as they end, and what its exit status is therefore."""

    def __init__(self):
        self.outcomes: list[tuple[str, bool]] = []  # (status or UNRECORDED, allow_failures)
        self.ended: list[dict] = []  # the records ended here (a SLURM job's come back from elsewhere)
        self.claims: dict[str, int] = {}  # run_id -> fd of its lock file
        self.sweep_total: int | None = None  # set by the sweeper: jobs then print no single-run ending
        self.sweep_done = 0  # runs of the sweep ended before the current one (its progress bar)

    def __getstate__(self):  # pickled into a SLURM job: a claim's fd belongs to this process
        return {**self.__dict__, "claims": {}, "outcomes": [], "ended": []}

    def end(self, record: dict, label: str, results_dir: str) -> dict:
        """The one place a run ends: its record appended (all or nothing), its claim released, its
        outcome noted for the exit status, its line printed. A record that cannot be written is said
        (NOT RECORDED) and makes the invocation exit 1."""
        path = results_file.records_path(results_dir, record["study"])
        try:
            results_file.append(path, record)
        except OSError as e:  # all or nothing: nothing of it is in the file
            self.outcomes.append((UNRECORDED, False))
            console.print(f"[red]NOT RECORDED[/] {escape(label)} {record['run_id']} ({record['status']}): "
                          f"appending to {path} failed: {escape(str(e))}")
        else:
            self.count(record)
            print_summary(record, label)
        finally:
            self.release(rec.claim_key(record["run_id"], record.get("repeat")))
        return record

    def count(self, record: dict) -> None:
        """Note a record's outcome once: ended here, skipped as done, or returned by a SLURM job."""
        if not any(r is record for r in self.ended):
            self.ended.append(record)
            self.outcomes.append((record["status"], relaxed(record)))

    def exit_status(self) -> int:
        if received() or any(s in (Status.INTERRUPTED, UNRECORDED) for s, _ in self.outcomes):
            return 1
        sweep_relaxed = any(r for _, r in self.outcomes)  # allow_failures is one setting per invocation
        if any(s in FAILURES and not (r or sweep_relaxed) for s, r in self.outcomes):
            return 1
        if any(s == Status.INVALID and not (r or sweep_relaxed) for s, r in self.outcomes):
            return 2
        return 0

    def note(self, status: str) -> None:
        """An outcome with no record to count (a results_dir no record can go to)."""
        self.outcomes.append((status, False))

    def interrupted(self) -> bool:
        return any(s == Status.INTERRUPTED for s, _ in self.outcomes)

    def claim(self, results_dir: str, study: str, run_id: str, holder: str = "running it",
              wait_while=None, timeout_s: float = 60.0) -> str | None:
        """Claim run_id, saying what this process does with it (`holder`); None when claimed now,
        else the holder's line ("<pid> <what it does with it>"). wait_while(line): keep trying while
        it is true (a SLURM job whose submitter is still writing the job's id), up to timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            fd, line = take_claim(results_dir, study, run_id, holder)
            if fd is not None:
                self.claims[run_id] = fd
                return None
            if wait_while is None or not wait_while(line) or time.monotonic() > deadline:
                return line
            time.sleep(0.5)

    def inherit(self, results_dir: str, study: str, run_id: str, holder: str) -> None:
        """Hold run_id's claim as soon as its holder lets go: a SLURM job whose submitting invocation
        holds the claim for it, and would leave it unheld if it died while the job runs."""
        fd = os.open(claim_path(results_dir, study, run_id), os.O_RDWR | os.O_CREAT, 0o644)
        self.claims[run_id] = fd

        def wait() -> None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # blocks until the submitter lets go (or dies)
                _write_holder(fd, holder)
            except OSError:
                pass  # released meanwhile: the run ended

        threading.Thread(target=wait, daemon=True, name=f"claim-{run_id}").start()

    def relabel(self, run_id: str, holder: str) -> None:
        """Say what this process now does with a claim it holds (e.g. which SLURM job runs it)."""
        fd = self.claims.get(run_id)
        if fd is not None:
            _write_holder(fd, holder)

    def release(self, run_id: str) -> None:
        fd = self.claims.pop(run_id, None)
        if fd is not None:
            os.close(fd)  # closing the last descriptor drops the flock


def relaxed(record: dict) -> bool:
    """allow_failures, as the record's config says (a composition failure has only its overrides)."""
    cfg = record.get("config") or {}
    return bool(cfg.get("allow_failures")) or "allow_failures=true" in (cfg.get("overrides") or [])


def failure(error: BaseException) -> tuple[Status, str]:
    """The one rule for a job that raised instead of ending (a bug, a full disk, a SLURM job killed
    without a record): `failed`, or `timeout` when its time limit ended it; the error says where."""
    where = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    at = f" (at {where[0].filename}:{where[0].lineno} in {where[0].name})" if where else ""
    status = Status.TIMEOUT if getattr(error, "timed_out", False) else Status.FAILED
    return status, f"{type(error).__name__}: {str(error)[:2000]}{at}"


def claim_path(results_dir: str, study: str, run_id: str) -> Path:
    return rundir.runs_dir(results_dir, study) / ".claims" / f"{run_id}.lock"


def take_claim(results_dir: str, study: str, run_id: str, holder: str) -> tuple[int | None, str]:
    """(fd holding the claim, ""), or (None, the holder's line: "<pid> <what it does with it>")."""
    path = claim_path(results_dir, study, run_id)
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


def held_by(line: str, results_dir: str, study: str, run_id: str) -> str:
    """A claim's holder, said as a line to print."""
    return f"another brigade (pid {line}) holds it ({claim_path(results_dir, study, run_id)})"


def holder_line(path: Path) -> str:
    """What the last holder of a claim said it does with it (read without the lock)."""
    try:
        return path.read_text(errors="replace").strip() or "?"
    except OSError:
        return "?"


def _write_holder(fd: int, holder: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {holder}\n".encode(), 0)


# A signal handler belongs to the process, not to an invocation: the one piece of module state here.
HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_received: list[int] = []


def install_signals() -> None:
    """Called once by the CLI's process (only the main thread may set handlers)."""
    for sig in HANDLED:
        signal.signal(sig, _note)


def _note(signum, frame) -> None:
    if signum in _received:
        raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
    _received.append(signum)


def received() -> str | None:
    """The name of the first termination signal this process got (SIGTERM, ...), or None."""
    return signal.Signals(_received[0]).name if _received else None


def print_summary(record: dict, label: str) -> None:
    """One line per ended run: its status, what it was, and its figures or its error."""
    m = record.get("measured") or {}
    if record["status"] != Status.OK:
        detail = escape(" ".join((record.get("error") or "").split())[:300])
    elif m.get("kind") == "dryrun":  # launcher=dryrun: memory only (harness/collect/dryrun.py)
        p = record.get("predicted") or {}
        detail = (f"dry run of ranks {m['dryrun_ranks']}: model states {m['model_states_bytes'] / GiB:.2f} GiB "
                  f"(predicted {p.get('model_states_bytes', 0) / GiB:.2f}), peak {m.get('peak_mem_bytes', 0) / GiB:.2f} "
                  f"GiB (predicted {p.get('peak_mem_bytes', 0) / GiB:.2f}) per rank")
    else:
        detail = f"step {m['step_time_s']:.3f} s, {m['tokens_per_s']:.0f} tokens/s"
    style = STATUS_STYLE[record["status"]]
    console.print(f"[{style}]{record['status']:>7}[/] {escape(label)} [dim]{record['run_id']}[/] {detail}")


STATUS_STYLE = {Status.OK: "green", Status.INVALID: "yellow", Status.FAILED: "red", Status.TIMEOUT: "red",
                Status.OOM: "magenta", Status.DIVERGED: "red", Status.INTERRUPTED: "red"}


def results_table(records: list[dict], title: str, names: list[str] | None = None) -> Table:
    """names: what to call each run (default: labels that tell the records apart, one row per config). A
    config run several times (repeats=N) is one row: its repeats' pooled median and 95 % interval."""
    if names is None:
        records = config_records(records)
    t = Table(title=title, title_justify="left", header_style="bold")
    for col in ("run", "batch", "step s", "pred s", "tokens/s", "95% CI", "n", "MFU %", "states/rank", "pred",
                "status"):
        t.add_column(col, justify="left" if col in ("run", "status") else "right", no_wrap=col != "status")
    for r, label in zip(records, names or labels(records)):
        m, p = r.get("measured") or {}, r.get("predicted") or {}
        status = r["status"]
        note = "" if status == "ok" else f" {escape((r.get('error') or '')[:90])}"
        batch = (r.get("config") or {}).get("workload", {}).get("global_batch_size")  # tells weak from strong scaling
        t.add_row(escape(label), _fmt(batch, "{}"),
                  _fmt(m.get("step_time_s"), "{:.3f}"), _fmt(p.get("step_time_s"), "{:.3f}"),
                  _fmt(m.get("tokens_per_s"), "{:.0f}"), ci_text(m.get("tokens_per_s_ci95")),
                  str(r.get("repeats", 1)), _mfu(m),
                  nbytes(m.get("model_states_bytes"), "-"), nbytes(p.get("model_states_bytes"), "-"),
                  f"[{STATUS_STYLE[status]}]{status}[/]{note}")
    exceeded = sorted({str(((r.get("config") or {}).get("hardware") or {}).get("name")) for r in records
                       if (r.get("measured") or {}).get("mfu_warning")})
    if exceeded:
        t.caption = (f"MFU % marked !: above 100 %, {MFU_EXCEEDED} (python -m harness.calibrate; the profile: "
                     f"hardware={', '.join(exceeded)})")
        t.caption_justify = "left"
    return t


def _mfu(m: dict) -> str:
    """MFU %, marked when it exceeds the profile's rate (measured.mfu_warning)."""
    return _fmt(m.get("mfu_pct"), "{:.1f}") + (" [yellow]![/]" if m.get("mfu_warning") else "")


def _fmt(x, spec: str) -> str:
    return "-" if x is None else spec.format(x)


def print_table(records: list[dict], title: str, console: Console | None = None, names: list[str] | None = None) -> None:
    (console or Console()).print(results_table(records, title, names))


# -- cause -----------------------------------------------------------------------------------------
# Why a run that did not finish failed: the first rank that died, and how.
#
# Three witnesses, none enough alone:
#   - error_rank<r>.json: a rank that raised (type, message, time to the microsecond). A rank killed
#     by a signal writes none, and its peers then raise "Connection reset by peer": their files are
#     consequences, not the cause.
#   - torchrun's exit summary in workers.log: every failed rank's exit code (-9 = SIGKILL) and the
#     second torchrun saw it die (its monitor polls every 0.1 s).
#   - the kernel's oom_kill counter (/proc/vmstat), read by the launcher before and after the run: a
#     rank killed by SIGKILL while the counter rose was, in all likelihood, the OOM killer's victim.
# A rank that died by SIGTERM is torchrun tearing the others down after the first failure, so it is
# the cause only when nothing else is. A death by another signal is stamped when torchrun's monitor
# saw it, floored to the second, and under load that poll lags (observed: a peer's error 0.08 s before
# the stamped second, at load 21 on 2 cores), so it counts SIGNAL_SLACK_S earlier than its stamp; and
# an error that says a peer went away ("Connection reset by peer", ...) is never preferred to it. Error files written before the parent began to end
# the run (timeout or a signal to the parent) win over `timeout`/`interrupted`: the run had failed.

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
    status: str  # failed | oom
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
            candidates.append(Death(e["rank"], e.get("time", 0), "oom" if e.get("oom") else "failed",
                                    f"rank {e['rank']}: {e['type']}: {e['message']}"))
    torn_down = []  # SIGTERM: torchrun's own teardown, unless nothing else explains the failure
    for rank, (seen, code) in rank_deaths(result.log_path).items():
        if code >= 0 or rank in errors or seen > ended:
            continue
        name = signal_name(code)
        oom = code == -signal.SIGKILL and result.oom_kills > 0
        why = (f"; the kernel OOM-killed {result.oom_kills} process(es) during the run (/proc/vmstat oom_kill): "
               f"host memory ran out" if oom else "")
        death = Death(rank, seen, "oom" if oom else "failed", f"rank {rank}: killed by {name} (exit code {code}){why}")
        (torn_down if code == -signal.SIGTERM else candidates).append(death)
    killed = any(d.rank not in errors for d in candidates)

    def when(d: Death) -> float:
        if d.rank not in errors:  # a signal death, stamped late
            return d.time - SIGNAL_SLACK_S
        return float("inf") if killed and _PEER_LOST.search(d.error) else d.time

    ordered = sorted(candidates or torn_down, key=when)
    return ordered[0] if ordered else None


def launcher_death(result) -> tuple[str, str] | None:
    """torchrun itself killed by a signal (no summary written): (status, error)."""
    code = result.returncode
    if code is None or code >= 0:
        return None
    if code == -signal.SIGKILL and result.oom_kills > 0:
        return "oom", (f"torchrun killed by SIGKILL while the kernel OOM-killed {result.oom_kills} process(es) "
                       f"(/proc/vmstat oom_kill): host memory ran out")
    return "failed", f"torchrun killed by {signal_name(code)} (exit code {code})"


def verdict(run, run_dir: Path, result) -> tuple[str, str] | None:
    """(status, error) of a run that did not finish, or None when its measurement is there to read."""
    death = first_death(run_dir, result)
    if death is not None:
        return death.status, death.error
    if result.timed_out:
        return "timeout", f"run exceeded launcher.timeout_s={run.launcher.timeout_s:.0f} s; every process of the run ended"
    if result.interrupted:
        return "interrupted", (f"brigade received {result.interrupted} while the run was in flight; "
                               f"every process of the run ended")
    if not (Path(run_dir) / rundir.MEASUREMENT).exists():
        return launcher_death(result) or ("failed", f"workers exited with code {result.returncode}: "
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
