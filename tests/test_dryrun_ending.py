"""How a dry run ends when it does not finish (launch/dryrun.py): stopped by coreutils `timeout` it
records `timeout`, its own launcher.timeout_s too; a simulated rank killed from outside records
`interrupted` with that rank and the signal; the forked children's host memory stays within the
budget, fewer running at once when it is small, and one child alone over it ends the run as `oom`.
No process of the run is left behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, records, run

pytestmark = pytest.mark.slow
# one rank (single), two thousand micro-batches of two sequences a step: minutes of simulation
LONG = ["launcher=dryrun", "model=llama_tiny", "strategy=single", "workload.global_batch_size=4096",
        "workload.micro_batch_size=2", "logger=none"]
SHORT = ["launcher=dryrun", "model=llama_tiny", "strategy=ddp", "parallel.dp=2", "launcher.ranks=[0,1]",
         "workload.global_batch_size=8", "workload.micro_batch_size=2", "logger=none"]


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (the fork server and the simulated ranks)."""
    parent = {}
    for entry in os.scandir("/proc"):
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                parent[int(entry.name)] = int(fields[1])
        except (OSError, ValueError, IndexError):
            continue
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        frontier += kids
    return out


def simulated_ranks(pid: int, timeout: float = 180) -> list[int]:
    """The forked children of brigade `pid`'s fork server, once there are some."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [c for c in descendants(pid) if _parent(c) != pid]  # below the fork server, not the server itself
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"no simulated rank within {timeout} s")


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def gone(pids: list[int], limit: float = 15) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if not [p for p in pids if Path(f"/proc/{p}").exists() and _state(p) != "Z"]:
            return True
        time.sleep(0.1)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def test_a_dry_run_stopped_by_coreutils_timeout_records_timeout(tmp_path):
    p = subprocess.Popen(["timeout", "25", sys.executable, "-m", "harness", *LONG, f"results_dir={tmp_path}"],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = p.communicate(timeout=180)
    assert p.returncode == 124, out[-2000:]  # timeout's own status: its limit ran out
    (r,) = records(tmp_path)
    assert r["status"] == "timeout", r["error"]
    assert "(coreutils timeout) when its limit of 25 s ran out" in r["error"], r["error"]
    assert "ChildDied" not in r["error"]


def test_a_dry_run_past_launcher_timeout_s_records_timeout(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "harness", *LONG, "launcher.timeout_s=5", f"results_dir={tmp_path}"],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ranks = simulated_ranks(p.pid)
    out, _ = p.communicate(timeout=180)
    (r,) = records(tmp_path)
    assert r["status"] == "timeout" and "launcher.timeout_s=5" in r["error"], r["error"]
    assert gone(ranks) and p.returncode == 1, out[-2000:]


def test_a_simulated_rank_killed_from_outside_records_interrupted_with_its_rank(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "harness", *LONG, f"results_dir={tmp_path}"],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (child,) = simulated_ranks(p.pid)
    server = descendants(p.pid)
    os.kill(child, signal.SIGKILL)
    out, _ = p.communicate(timeout=120)
    (r,) = records(tmp_path)
    assert r["status"] == "interrupted", r["error"]
    assert r["error"].startswith("rank 0: Killed: its process was killed by SIGKILL (exit code -9) from outside"), r["error"]
    assert gone(server) and p.returncode == 1, out[-2000:]


def test_the_children_stay_within_the_memory_budget_fewer_at_once_when_it_is_small(tmp_path):
    wide = run([*SHORT, "study=wide"], tmp_path)
    assert wide["status"] == "ok", wide["error"]
    m = wide["measured"]
    child = max(m["dryrun_rank_host_peak_pss_bytes"])
    assert m["dryrun_children_most_at_once"] == 2 and m["dryrun_restarted_ranks"] == []
    assert m["dryrun_children_peak_pss_bytes"] <= m["dryrun_memory_budget_bytes"]
    # room for one child, not two: the second waits, or is stopped and started again alone
    budget = 1.4 * child
    narrow = run([*SHORT, "study=narrow", f"launcher.memory_GiB={budget / 2**30:.6f}"], tmp_path)
    assert narrow["status"] == "ok", narrow["error"]
    n = narrow["measured"]
    assert n["dryrun_memory_budget_bytes"] == pytest.approx(budget, rel=1e-5)
    assert n["dryrun_children_most_at_once"] == 1 or n["dryrun_restarted_ranks"] == [1], n
    assert all(peak <= budget for peak in n["dryrun_rank_host_peak_pss_bytes"])
    assert n["peak_mem_bytes_per_rank"] == m["peak_mem_bytes_per_rank"]
    # room for less than one child: the run ends as oom, saying which rank held how much
    tight = run([*SHORT, "study=tight", f"launcher.memory_GiB={0.5 * child / 2**30:.6f}"], tmp_path)
    assert tight["status"] == "oom", tight["error"]
    assert "of host memory (PSS) > the dry run's budget" in tight["error"], tight["error"]


def test_plan_dryrun_top_stopped_by_sigterm_ends_its_dry_run_as_interrupted_and_starts_no_other(tmp_path):
    """`python -m harness.plan --dryrun-top` runs its dry runs in its own process: a SIGTERM there ends the one
    running as `interrupted` (children and fork server gone) and no later layout starts."""
    p = subprocess.Popen([sys.executable, "-m", "harness.plan", "model=llama_tiny", "plan.gpus=2",
                          "workload.global_batch_size=4096", "logger=none", f"results_dir={tmp_path}", "study=stop",
                          "--dryrun-top", "2"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ranks = simulated_ranks(p.pid)
    below = descendants(p.pid)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=180)
    assert p.returncode == 1, out[-3000:]
    rs = records(tmp_path, "stop")
    assert [r["status"] for r in rs][-1] == "interrupted", [(r["status"], r["error"]) for r in rs]
    assert "SIGTERM" in rs[-1]["error"], rs[-1]["error"]
    assert "not run: SIGTERM" in out, out[-3000:]
    assert gone(ranks) and gone(below)
