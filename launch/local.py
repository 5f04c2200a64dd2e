"""Start the ranks of one run with torchrun, watch them, and end every one of them.

The command is an argv list (never a shell string built from config values). The parent polls it,
reports progress from the file rank 0 writes, and ends the run on expiry of the wall-clock limit or
when the parent itself is asked to stop (SIGTERM/SIGINT/SIGHUP, noted by harness/run/signals.py).

Which processes belong to a run: torchrun starts every rank in a session of its own, so torchrun's
process group is not the run, and a rank whose torchrun died is reparented to PID 1. Instead every
process of the run carries a token in its environment (RUN_TOKEN_VAR, inherited by the ranks and
anything they start, across setsid and reparenting), and ending the run means: SIGCONT + SIGTERM to
every process whose /proc/<pid>/environ holds the token, GRACE_S to exit, then SIGKILL to those left.
This also runs after a normal exit, so a straggler never outlives its run. torchrun itself gets
SIGTERM if the parent dies without a chance to act (PR_SET_PDEATHSIG), and forwards it to the ranks.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from harness.config import GiB
from harness.dims import ConfigError
from harness.run import signals

RUN_TOKEN_VAR = "BRIGADE_RUN_TOKEN"
GRACE_S = 5.0  # SIGTERM -> SIGKILL; with the 0.2 s poll and the SIGKILL wait, a run is gone within ~10 s
POLL_S = 0.2


@dataclass
class LaunchResult:
    returncode: int | None
    timed_out: bool
    wall_s: float
    log_path: Path
    interrupted: str | None = None  # the signal that made the parent end the run (SIGTERM, ...)
    taken_away: str | None = None  # why the scheduler ended the run ("preempted/requeued by SLURM (job J)")
    ended_at: float | None = None  # time.time() when the parent began ending the run (timeout/signal)
    oom_kills: int = 0  # rise of the kernel's oom_kill counter during the run (/proc/vmstat)
    leftovers: list[int] = field(default_factory=list)  # pids still there after SIGKILL (should be none)


def torchrun_argv(run_dir: Path, nproc_per_node: int, nnodes: int = 1, node_rank: int = 0,
                  rdzv_endpoint: str | None = None, rdzv_id: str = "brigade", master_port: int = 0) -> list[str]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc_per_node),
            "--max-restarts", "0"]
    if nnodes == 1 and rdzv_endpoint is None and master_port:
        # static rendezvous: rank 0's store listens on exactly this port (a clash fails the run, loudly)
        argv += ["--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(master_port)]
    elif nnodes == 1 and rdzv_endpoint is None:
        argv += ["--standalone"]  # c10d rendezvous on a free local port: consecutive jobs never clash
    else:
        argv += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id]
    return argv + ["-m", "harness.worker", str(run_dir)]


def worker_env(nproc_per_node: int, device: str) -> dict[str, str]:
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # On CPU a "device" is one core: one thread per rank, whatever the world size, so single
        # vs ddp(2) compares one core with two (as one GPU with two). Beyond the core count, ranks
        # time-share the cores, and the record says so (env.cpu_count, measured.num_threads_per_rank).
        env["OMP_NUM_THREADS"] = "1"
    env.setdefault("DS_ACCELERATOR", "cpu" if device == "cpu" else "cuda")
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    return env


def run_workers(argv: list[str], env: dict, log_path: Path, timeout_s: float, on_poll=None) -> LaunchResult:
    t0 = time.monotonic()
    token = uuid.uuid4().hex
    oom0 = oom_kill_count()
    timed_out, signalled = False, None  # why the parent ends the run: its time limit, or a signal (its name)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**env, RUN_TOKEN_VAR: token}, start_new_session=True,
                                preexec_fn=_die_with_parent)
        try:
            while proc.poll() is None:
                timed_out = time.monotonic() - t0 > timeout_s
                signalled = None if timed_out else signals.received()
                if timed_out or signalled:
                    break
                if on_poll:
                    on_poll()
                try:  # returns as soon as torchrun exits (a sleep would add half a poll to every run)
                    proc.wait(timeout=POLL_S)
                except subprocess.TimeoutExpired:
                    pass
        except BaseException:  # a second Ctrl-C, or a bug in on_poll: take the ranks down with us
            end_run(proc, token)
            raise
        ended_at = time.time() if timed_out or signalled else None
        leftovers = end_run(proc, token)  # after a normal exit too: no straggler outlives its run
    return LaunchResult(None if ended_at else proc.returncode, timed_out, time.monotonic() - t0, log_path,
                        interrupted=signalled, ended_at=ended_at,
                        oom_kills=max(0, oom_kill_count() - oom0), leftovers=leftovers)


def run_members(token: str) -> list[int]:
    """Pids of the live processes that carry this run's token (zombies have no environ: not listed)."""
    needle = f"{RUN_TOKEN_VAR}={token}".encode()
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


def end_run(proc: subprocess.Popen, token: str) -> list[int]:
    """End every process of the run; return the pids still alive after SIGKILL (none, normally)."""
    if not os.path.isdir("/proc"):  # no /proc to find the ranks: torchrun's group is the best we have
        return _kill_group(proc)
    members = run_members(token)
    for sig in (signal.SIGCONT, signal.SIGTERM):  # SIGCONT: a stopped process cannot act on SIGTERM
        _signal_all(members, sig)
    for sig, wait_s in ((None, GRACE_S), (signal.SIGKILL, 3.0)):
        if sig is not None:
            _signal_all(members, sig)
        deadline = time.monotonic() + wait_s
        while members and time.monotonic() < deadline:
            _reap(proc)
            time.sleep(0.05)
            members = run_members(token)
    _reap(proc)
    return members


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _reap(proc: subprocess.Popen) -> None:
    try:
        proc.wait(0)
    except subprocess.TimeoutExpired:
        pass


def _kill_group(proc: subprocess.Popen) -> list[int]:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(GRACE_S)
            return []
        except ProcessLookupError:
            return []
        except subprocess.TimeoutExpired:
            continue
    return [proc.pid]


def oom_kill_count() -> int:
    """The kernel's count of OOM kills since boot (all cgroups); 0 where it is not exposed."""
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork: the child only calls it
except (OSError, AttributeError):
    _prctl = None


def _die_with_parent() -> None:
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


HOST_MEMORY_SHARE = 0.9  # of MemAvailable: the parent, the page cache and other users keep the rest


def preflight(run, dims, predicted: dict) -> None:
    """Refuse, before launch, what this machine cannot run: CUDA ranks without CUDA devices, and on
    CPU, where every rank shares the host's memory, a sum of per-rank predictions over the host's."""
    nproc = dims.world_size // max(1, run.launcher.nodes)
    if run.hardware.device == "cuda":
        have, where = visible_gpus()
        if have < nproc:
            raise ConfigError(f"hardware {run.hardware.name} runs one CUDA device per rank: {nproc} rank(s) need "
                              f"{nproc} device(s), this machine has {have} ({where}); use hardware=cpu here")
    per_rank = predicted.get("peak_mem_bytes") or 0
    avail = host_available_bytes()
    if run.hardware.device == "cpu" and avail and not run.allow_oversubscribe_memory:
        budget = HOST_MEMORY_SHARE * avail
        if nproc * per_rank > budget:
            raise ConfigError(f"on CPU the {nproc} ranks share this host's memory: {nproc} ranks x "
                              f"{per_rank / GiB:.2f} GiB predicted peak = {nproc * per_rank / GiB:.1f} GiB > "
                              f"{HOST_MEMORY_SHARE:.0%} of the {avail / GiB:.1f} GiB available (/proc/meminfo "
                              f"MemAvailable) = {budget / GiB:.1f} GiB (allow_oversubscribe_memory=true runs it anyway)")


def visible_gpus() -> tuple[int, str]:
    """NVIDIA devices this process may use, from the driver's /proc listing and CUDA_VISIBLE_DEVICES
    (no torch in the parent)."""
    d = Path("/proc/driver/nvidia/gpus")
    n = len(list(d.iterdir())) if d.is_dir() else 0
    where = f"{n} in /proc/driver/nvidia/gpus"
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        n = min(n, len([v for v in vis.split(",") if v.strip() and not v.strip().startswith("-")]))
        where += f", CUDA_VISIBLE_DEVICES={vis!r}"
    return n, where


def host_available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def execute(run, dims, run_dir: Path, log_path: Path, on_poll=None) -> LaunchResult:
    """Run every rank of this config on this machine."""
    nproc = dims.world_size // run.launcher.nodes
    argv = torchrun_argv(run_dir, nproc, master_port=run.launcher.master_port)
    return run_workers(argv, worker_env(nproc, run.hardware.device), log_path, run.launcher.timeout_s, on_poll)
