"""How a run ends, for the parent process: the one place that ends a run (Ending.end: append its
record, release its claim, note its outcome, print its line), and the invocation's exit status.
Beside it, by concern: the claims (harness/run/claims.py), the parent's signals (signals.py), why a
run failed (cause.py) and what is printed (terminal.py).

One Ending per invocation, made by the CLI and handed to the task function (harness.run.job.Task),
through which the sweeper and the launchers reach it: no state between them in module globals or
environment variables. A job called without one (tests, tools) gets its own.

Exit status (so scripts and CI can tell):

    0  every run ok (or skipped as already ok)
    2  some run invalid (refused before launch), none worse
    1  some run failed | timeout | oom | diverged | interrupted, or a record could not be written

`allow_failures=true` (a sweep that expects some runs to fail or be refused, e.g. an OOM frontier)
exits 0 once every run has its record; an interrupted invocation or a lost record still exits 1.
"""
from __future__ import annotations

from rich.markup import escape

from harness.run import results_file
from harness.run.claims import Claims, claim_key
from harness.run.record import FAILURES, Status
from harness.run.signals import received
from harness.run.terminal import console, print_summary

UNRECORDED = "unrecorded"  # an outcome, not a status: the record could not be written


class Ending:
    """This invocation's runs as they end, and what its exit status is therefore."""

    def __init__(self):
        self.outcomes: list[tuple[str, bool]] = []  # (status or UNRECORDED, allow_failures)
        self.ended: list[dict] = []  # the records ended here (a SLURM job's come back from elsewhere)
        self.claims = Claims()  # the configs this invocation runs or has submitted (harness/run/claims.py)
        self.sweep_total: int | None = None  # set by the sweeper: jobs then print no single-run ending
        self.sweep_done = 0  # runs of the sweep ended before the current one (its progress bar)

    def __getstate__(self):  # pickled into a SLURM job: a claim's fd belongs to this process
        return {**self.__dict__, "claims": Claims(), "outcomes": [], "ended": []}

    def end(self, record: dict, label: str, results_dir: str, release_claim: bool = True) -> dict:
        """The one place a run ends: its record appended (all or nothing), its claim released, its
        outcome noted for the exit status, its line printed. A record that cannot be written is said
        (NOT RECORDED) and makes the invocation exit 1. release_claim=False: an earlier attempt of a
        SLURM job recorded by the attempt that now runs the config (harness/run/job.py)."""
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
            if release_claim:
                self.claims.release(claim_key(record["run_id"], record.get("repeat")))
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


def relaxed(record: dict) -> bool:
    """allow_failures, as the record's config says (a composition failure has only its overrides)."""
    cfg = record.get("config") or {}
    return bool(cfg.get("allow_failures")) or "allow_failures=true" in (cfg.get("overrides") or [])
