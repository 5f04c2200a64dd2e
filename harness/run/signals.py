"""The parent's termination signals (SIGTERM, SIGINT, SIGHUP): noted, not acted on where they land.

A signal that raised wherever the parent happened to be (composing, appending a record) could leave
half a record or orphaned ranks. Instead the handler notes it; the launcher's poll loop sees it within
one poll, ends every process of the run in flight (launch/local.py), the run is recorded as
`interrupted`, and the sweep starts no further run. A second signal of the same kind raises
KeyboardInterrupt at once, for a user who insists (the launcher still ends the ranks on the way out).
"""
from __future__ import annotations

import signal

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
