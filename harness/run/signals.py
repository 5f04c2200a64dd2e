"""The parent's termination signals (SIGTERM, SIGINT, SIGHUP): noted, not acted on where they land.

A signal that raised wherever the parent happened to be (composing, appending a record) could leave
half a record or orphaned ranks. Instead the handler notes it; the launcher's poll loop sees it within
one poll, ends every process of the run in flight (launch/local.py), the run is recorded as
`interrupted`, and the sweep starts no further run. A second signal of the same kind raises
KeyboardInterrupt at once, for a user who insists (the launcher still ends the ranks on the way out); one
within ECHO_S of the first is the same signal delivered twice, as coreutils `timeout` does (to the command,
then to its group).

A signal from coreutils `timeout` is a time limit, not an interruption (harness/run/cause.py `stop_cause`):
the run is then recorded as `timeout`, naming the command.
"""
from __future__ import annotations

import signal
import time

# A signal handler belongs to the process, not to an invocation: the one piece of module state here.
HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_received: list[tuple[int, float]] = []  # (signal, time.monotonic() when noted)
# coreutils `timeout` sends its signal to the command, then to the command's whole process group, which
# holds the command: one event, two deliveries, a moment apart. A repeat within this window is that echo,
# not a user insisting.
ECHO_S = 1.0


def install_signals() -> None:
    """Called once by the CLI's process (only the main thread may set handlers)."""
    for sig in HANDLED:
        signal.signal(sig, _note)


def _note(signum, frame) -> None:
    now = time.monotonic()
    if any(s == signum and now - at > ECHO_S for s, at in _received):
        raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
    _received.append((signum, now))


def received() -> str | None:
    """The name of the first termination signal this process got (SIGTERM, ...), or None."""
    return signal.Signals(_received[0][0]).name if _received else None
