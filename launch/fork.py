"""Run a function in a fresh child process and return its result (or raise its error here).

Why a process per simulated rank: torch keeps per-process state keyed on meshes and groups that
compare equal across ranks (FSDP2's sharding specs end up holding the first rank's DeviceMesh when
one process re-initialises the fake process group as another rank: torch 2.13, checked here), so
simulating several ranks one after another in one process gives every rank rank 0's shards.

Why multiprocessing's "forkserver" and not a plain fork: a process that has run a torch op uses
OpenMP's thread pool, and a child forked from it hangs in its first parallel region (seen here: a
forked rank waited on a futex forever). The fork server is a process that has imported torch and
brigade but computed nothing; each child is forked from it (no second `import torch`), so starting
one costs milliseconds. It talks to this process over a Unix-domain socket pair (no network).

Signals: the fork server and its children ignore SIGINT, SIGTERM and SIGHUP, which a terminal or
coreutils `timeout` sends to the whole process group (launch/fork_server.py says why): the parent
notes them and ends its children itself. A child dies with the fork server (PR_SET_PDEATHSIG), and
the fork server with the parent, so no child outlives the process that started it.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import signal
import traceback

_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


def _child(conn, fn, args):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # SIGTERM and SIGHUP: ignored since the fork server
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    try:
        conn.send(("result", fn(*args)))
    except BaseException as e:  # noqa: BLE001 - sent to the parent, which re-raises
        conn.send(("error", (type(e).__name__, str(e), traceback.format_exc())))
    finally:
        conn.close()


class ChildError(RuntimeError):
    """The child raised (kind: its exception's type), or died before answering (kind "ChildDied",
    exitcode: its exit status, -N for signal N)."""

    def __init__(self, kind: str, message: str, tb: str, exitcode: int | None = None):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message, self.child_traceback, self.exitcode = kind, message, tb, exitcode


PRELOAD = ["launch.fork_server", "torch", "torch.distributed.fsdp", "torch.distributed.tensor.parallel", "torch.distributed.pipelining",
           "harness.strategies.base", "models.gpt", "launch.fork"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class Forked:
    """fn(*args) started in a child forked from the fork server; `done()` polls, `result()` collects
    (its return value, or ChildError with the child's traceback). Several may run at once."""

    def __init__(self, fn, *args):
        ctx = _context()
        self._conn, child = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, args=(child, fn, args))
        self._proc.start()
        child.close()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def done(self, timeout_s: float | None = 0.0) -> bool:
        return self._conn.poll(timeout_s)

    def kill(self) -> None:
        self._proc.kill()
        self._proc.join()

    def result(self):
        try:
            status, payload = self._conn.recv()  # before join: a large result would block the child's send
        except EOFError:
            self._proc.join()
            code = self._proc.exitcode
            how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited with code {code}"
            raise ChildError("ChildDied", f"the forked process {how} before answering", "", code) from None
        self._proc.join()
        if status == "error":
            raise ChildError(*payload)
        return payload


def run_forked(fn, *args, timeout_s: float | None = None):
    """fn(*args) (fn importable by name) in a child forked from the fork server; its result, or
    ChildError with the child's traceback. Return plain data (numbers, lists, numpy arrays): torch
    pickles tensors as shared-memory handles that die with the child."""
    child = Forked(fn, *args)
    if not child.done(timeout_s):
        child.kill()
        raise TimeoutError(f"the child did not answer within {timeout_s:.0f} s")
    return child.result()
