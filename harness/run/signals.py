"""The parent's termination signals (SIGTERM, SIGINT, SIGHUP): noted, not acted on where they land.

A signal that raised wherever the parent happened to be (composing, appending a record) could leave
half a record or orphaned ranks. Instead the handler notes it; the launcher's poll loop sees it within
one poll, ends every process of the run in flight (launch/local.py), the run is recorded as
`interrupted`, and the sweep starts no further run. A second signal of the same kind raises
KeyboardInterrupt at once, for a user who insists (the launcher still ends the ranks on the way out).

A signal from coreutils `timeout` is a time limit, not an interruption (`stop_cause`): the run is then
recorded as `timeout`, naming the command.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

from harness.run.record import Status

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
        names.add(signal.Signals(int(sig)).name)
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
