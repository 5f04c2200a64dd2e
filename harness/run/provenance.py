"""Where a record came from (its `env`, the parent's side): the code's commit and whether it was
dirty, the packages' versions, the host and its fingerprint (harness/collect/aggregate.py)."""
from __future__ import annotations

import platform
import socket
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from harness.collect.aggregate import host_fingerprint

REPO = Path(__file__).resolve().parents[2]

_GIT = (["rev-parse", "HEAD"], ["status", "--porcelain", "--untracked-files=no"])
_git_probe: list = []


def start_git_probe() -> None:
    """Ask git for the commit and dirty state now (as the ranks start: the code that runs), so that
    the record after the run does not wait for it (git status: ~0.1 s of a run's fixed cost)."""
    try:
        _git_probe[:] = [subprocess.Popen(["git", "-C", str(REPO), *a], stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True) for a in _GIT]
    except OSError:
        _git_probe.clear()


def _git_state() -> tuple[str | None, bool | None]:
    """The probe's answers (started now if no run started one); None, None without git."""
    if not _git_probe:
        start_git_probe()
    procs, _git_probe[:] = list(_git_probe), []
    try:
        commit, status = (p.communicate(timeout=5)[0] for p in procs)
    except (ValueError, subprocess.SubprocessError):  # ValueError: no probe (git missing)
        for p in procs:
            p.kill()
        return None, None
    return commit.strip() or None, bool(status.strip())


def parent_env() -> dict:
    def v(pkg):
        try:
            return version(pkg)
        except PackageNotFoundError:
            return None

    commit, dirty = _git_state()
    return {"python": platform.python_version(), "torch": v("torch"), "deepspeed": v("deepspeed"),
            "hostname": socket.gethostname(), "platform": platform.platform(), "git_commit": commit,
            "git_dirty": dirty, "brigade": v("brigade"), **host_fingerprint()}
