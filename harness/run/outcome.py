"""The invocation's exit status, from the runs it ended (so scripts and CI can tell):

    0  every run ok (or skipped as already ok)
    2  some run invalid (refused before launch), none worse
    1  some run failed | timeout | oom | diverged | interrupted, or a record could not be written

`allow_failures=true` (a sweep that expects some runs to fail or be refused, e.g. an OOM frontier)
exits 0 once every run has its record; an interrupted invocation or a lost record still exits 1.
"""
from __future__ import annotations

FAILED = ("failed", "timeout", "oom", "diverged")
_ended: list[tuple[str, bool]] = []  # (status or "unrecorded", allow_failures)


def note(status: str, allow_failures: bool = False) -> None:
    _ended.append((status, allow_failures))


def exit_status() -> int:
    if any(s in ("interrupted", "unrecorded") for s, _ in _ended):
        return 1
    sweep_relaxed = any(relaxed for _, relaxed in _ended)  # allow_failures is one setting per invocation
    if any(s in FAILED and not (relaxed or sweep_relaxed) for s, relaxed in _ended):
        return 1
    if any(s == "invalid" and not (relaxed or sweep_relaxed) for s, relaxed in _ended):
        return 2
    return 0
