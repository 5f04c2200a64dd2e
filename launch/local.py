"""Start the ranks of one run with torchrun, as a subprocess in its own process group.

The command is an argv list (never a shell string built from config values). The parent polls it,
reports progress from the file rank 0 writes, and on expiry of the wall-clock limit kills the whole
process group (torchrun and every rank), so a hung collective can never hang a sweep.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class LaunchResult:
    returncode: int | None
    timed_out: bool
    wall_s: float
    log_path: Path


def torchrun_argv(run_dir: Path, nproc_per_node: int, nnodes: int = 1, node_rank: int = 0,
                  rdzv_endpoint: str | None = None, rdzv_id: str = "brigade") -> list[str]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc_per_node),
            "--max-restarts", "0"]
    if nnodes == 1 and rdzv_endpoint is None:
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
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        try:
            while proc.poll() is None:
                if time.monotonic() - t0 > timeout_s:
                    _kill_group(proc)
                    return LaunchResult(None, True, time.monotonic() - t0, log_path)
                if on_poll:
                    on_poll()
                time.sleep(0.2)
        except BaseException:  # Ctrl-C or a job cancelled by SLURM: take the ranks down with us
            _kill_group(proc)
            raise
    return LaunchResult(proc.returncode, False, time.monotonic() - t0, log_path)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def execute(run, dims, run_dir: Path, log_path: Path, on_poll=None) -> LaunchResult:
    """Run every rank of this config on this machine."""
    nproc = dims.world_size // run.launcher.nodes
    argv = torchrun_argv(run_dir, nproc)
    return run_workers(argv, worker_env(nproc, run.hardware.device), log_path, run.launcher.timeout_s, on_poll)
