"""launcher=slurm, the node side: what runs inside each SLURM job. The sweep side (one sbatch per
config, submitted by brigade's subclass of Hydra's submitit launcher) is hydra_plugins/brigade_slurm.

Two halves, one on each side of sbatch:

    sweep process (login node)                       SLURM job, one task per node
    --------------------------                       ----------------------------
    BrigadeSlurmLauncher.launch(jobs)                submitit runs harness.run.job.run_job (Hydra job)
      compose each job -> its own resources            -> launch.slurm.execute on every node:
      (nodes, CPUs = ranks x cpus_per_task, GPUs)         torchrun --nnodes N --node-rank SLURM_NODEID
      skip/invalid jobs: run here, no sbatch              c10d rendezvous on the job's first node
      sbatch per config, <= array_parallelism at once   task 0 writes the record (harness.run.job)
      poll sacct (via submitit) -> JobReturn per job

Why one task per node running torchrun (not one task per rank): the ranks of a node are then
started, watched and killed exactly as with launcher=local (same argv, same process-group
wall-clock limit, same per-rank error files), torchrun supplies LOCAL_RANK and tears the node's
ranks down when one of them dies, and brigade's parent work (validate, predict, run dir, record)
runs once per node rather than once per rank. See launch/README.md.
"""
from __future__ import annotations

import math
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from harness.config import as_dict
from harness.run.record import run_id
from launch.local import LaunchResult, run_workers, torchrun_argv, worker_env

# -- inside the SLURM job (every node) ------------------------------------------------------------


def slurm_job_id() -> str | None:
    """This job's id as submitit and sacct name it: <array job>_<index> for an array task."""
    array, index = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and index:
        return f"{array}_{index}"
    return os.environ.get("SLURM_JOB_ID")


def in_slurm_job() -> bool:
    return "SLURM_JOB_ID" in os.environ


def task_rank() -> int:
    """The SLURM task of this process: one task per node, so task rank == node rank."""
    return int(os.environ.get("SLURM_PROCID", "0"))


def first_node() -> str:
    """The first node of this job: where the c10d rendezvous store lives."""
    nodelist = os.environ["SLURM_JOB_NODELIST"]
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    names = out.stdout.split()
    assert out.returncode == 0 and names, f"scontrol show hostnames {nodelist}: {out.stderr}"
    return names[0]


def rendezvous_port(run) -> int:
    """Every node must pick the same port without talking: derived from the job id (distinct for
    jobs running at the same time), or launcher.master_port when set."""
    if run.launcher.master_port:
        return run.launcher.master_port
    return 20000 + int(os.environ["SLURM_JOB_ID"]) % 10000


def _job_state() -> str:
    """What SLURM says of this job now (CANCELLED, TIMEOUT, ...); '' if it cannot tell."""
    job = os.environ.get("SLURM_JOB_ID", "")
    # sacct says CANCELLED/TIMEOUT where squeue says only COMPLETING while the job is torn down.
    for argv in (["sacct", "-n", "-X", "-P", "-j", job, "-o", "State"], ["squeue", "-h", "-j", job, "-o", "%T"]):
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue
        if out:
            return out.splitlines()[0]
    return ""


# -- an attempt that SLURM ended ----------------------------------------------------------------------
# A requeue (`scontrol requeue`, or preemption in REQUEUE mode) signals every process of the job and
# queues it again under the same id; SLURM_RESTART_COUNT tells the attempts apart, and each attempt has its
# own run dir (harness/run/job.py) and record (env.slurm_job, env.slurm_restarts). A node that stops
# answering for SlurmdTimeout is marked down and its jobs end NODE_FAIL, then are requeued too (JobRequeue=1,
# SLURM's default). Neither is the run's fault: both are `interrupted`, and a resumed study runs them.
# Who records it: the attempt itself when it can (a requeued attempt has KillWait after its SIGTERM);
# else the next attempt, when it starts (lost_attempts); else, for a job SLURM did not requeue, the sweep
# (hydra_plugins/brigade_slurm).

def requeued_cause(job: str) -> str:
    return f"preempted/requeued by SLURM (job {job})"


def node_failed_cause(nodes: str, state: str) -> str:
    return f"node {nodes} failed (SLURM state {state})"


def _run_text(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def restart_count() -> int:
    """Which attempt of its SLURM job this is: 0, then 1 after the first requeue, ..."""
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def taken_away(state: str) -> str | None:
    """Inside a job whose ranks just ended: the cause when SLURM is taking this attempt away (its job
    requeued or preempted), else None. SLURM counts the requeue (scontrol's Restarts) before it signals
    the job, and sacct says REQUEUED or PREEMPTED while scontrol still says COMPLETING."""
    job = slurm_job_id()
    fields = dict(f.split("=", 1) for f in _run_text(["scontrol", "-o", "show", "job", job]).split() if "=" in f)
    if state.startswith(("REQUEUED", "PREEMPTED")) or int(fields.get("Restarts") or 0) > restart_count():
        return requeued_cause(job)
    return None


def outlast_attempt() -> None:
    """When SLURM is ending this attempt (its job requeued or preempted), wait for its SIGKILL instead of
    returning: submitit would save a returned result, and the sweep would take the job as done while
    SLURM runs it again. The wait is bounded by the cluster's KillWait (the SIGTERM-to-SIGKILL delay),
    twice over; after that the record already written is the job's."""
    if taken_away(_job_state()) is None:
        return
    conf = {k.strip(): v.strip() for k, v in (line.split("=", 1) for line in
                                              _run_text(["scontrol", "show", "config"]).splitlines() if "=" in line)}
    time.sleep(2 * float((conf.get("KillWait") or "30 sec").split()[0]))  # "5 sec"; SLURM's default is 30


def attempt_cause(job: str, state: str, nodelist: str) -> str:
    """Why an attempt of `job` that SLURM ended in `state` on `nodelist` ended, in the record's words."""
    if state.startswith("NODE_FAIL"):
        return node_failed_cause(failed_nodes(nodelist), state.split()[0])
    return requeued_cause(job)


def failed_nodes(nodelist: str) -> str:
    """The nodes of an allocation that SLURM holds down or not responding now; the whole list when none
    is (the node came back)."""
    names = _run_text(["scontrol", "show", "hostnames", nodelist]).split()
    rows = [line.split() for line in _run_text(["sinfo", "-h", "-N", "-n", nodelist, "-o", "%N %t"]).splitlines()]
    down = sorted({n for n, t in (r for r in rows if len(r) == 2) if n in names and
                   (t.endswith("*") or t.startswith(("down", "drain", "fail")))})
    return ",".join(down) or nodelist


def lost_attempts(records: list[dict]) -> list[tuple[int, str]]:
    """In a restarted job: (attempt, cause) of each earlier attempt of this job that left no record
    (records: the study's), its cause from sacct's row for that attempt (-D: one row per attempt)."""
    restarts = restart_count()
    if not restarts:
        return []
    job = slurm_job_id()
    have = {int(r["env"].get("slurm_restarts") or 0) for r in records if (r.get("env") or {}).get("slurm_job") == job}
    missing = [k for k in range(restarts) if k not in have]
    if not missing:
        return []
    rows = [line.split("|") for line in _run_text(["sacct", "-n", "-X", "-D", "-P", "-j", job, "-o",
                                                   "State,NodeList"]).splitlines()]
    return [(k, attempt_cause(job, *rows[k]) if k < len(rows) and len(rows[k]) == 2 else requeued_cause(job))
            for k in missing]


def execute(run, dims, run_dir: Path, log_path: Path, on_poll=None) -> LaunchResult:
    """This node's ranks, under torchrun; called by harness.run.job.run_job in every task of the job."""
    if not in_slurm_job():
        raise RuntimeError("launcher=slurm runs inside a SLURM job: submit with `brigade -m launcher=slurm ...` "
                           "(conf/launcher/slurm.yaml sets hydra/launcher=submitit_slurm)")
    nnodes = int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
    assert nnodes == run.launcher.nodes, f"SLURM gave {nnodes} nodes, launcher.nodes={run.launcher.nodes}"
    nproc = dims.world_size // nnodes
    node_rank = task_rank()
    if nnodes == 1:
        argv = torchrun_argv(run_dir, nproc)
    else:
        argv = torchrun_argv(run_dir, nproc, nnodes, node_rank, f"{first_node()}:{rendezvous_port(run)}",
                             rdzv_id=f"brigade-{os.environ['SLURM_JOB_ID']}")
        # Say which agent hosts the rendezvous store: on one machine every node name resolves to a
        # local address, and torchrun's guess would make every node try to host it.
        i = argv.index("-m", 3)
        argv[i:i] = ["--rdzv-conf", f"is_host={int(node_rank == 0)}"]
        # Each node's torchrun writes its own log (they run at the same time).
        log_path = run_dir / f"workers.{os.environ.get('SLURMD_NODENAME', node_rank)}.log"
    result = run_workers(argv, worker_env(nproc, run.hardware.device), log_path, run.launcher.timeout_s, on_poll)
    if result.returncode not in (0, None):
        state = _job_state()
        if state:  # e.g. CANCELLED by scancel: say so in the log tail the record quotes
            with open(log_path, "a") as f:
                f.write(f"\nbrigade: SLURM job {slurm_job_id()} is {state}\n")
        if state.startswith("TIMEOUT"):
            result.timed_out = True
        result.taken_away = taken_away(state)
    return result


# -- the sweep side: Hydra launcher -------------------------------------------------------------

class SlurmJobFailed(RuntimeError):
    """A SLURM job that ended without a record from its task (killed, failed to start, ...)."""


class SlurmJobSignalled(RuntimeError):
    """SLURM's warning signal reached the job (its time limit is near, or it is being preempted)."""

    def __init__(self, message: str, timed_out: bool):
        super().__init__(message, timed_out)  # both in args: the exception is pickled back to the sweep

    @property
    def timed_out(self) -> bool:
        return self.args[1]

    def __str__(self) -> str:
        return self.args[0]


def _minutes_left() -> float | None:
    """Time left before this job's limit (squeue %L: [D-]H:MM:SS or M:SS), None if unknown."""
    try:
        left = subprocess.run(["squeue", "-h", "-j", os.environ["SLURM_JOB_ID"], "-o", "%L"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        days, _, hms = left.rpartition("-")
        parts = [int(x) for x in hms.split(":")]
    except (OSError, subprocess.SubprocessError, KeyError, ValueError):
        return None
    while len(parts) < 3:
        parts.insert(0, 0)
    return (int(days or 0) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]) / 60


def job_resources(run, dims) -> dict[str, Any]:
    """sbatch resources of one config, in the submitit launcher's parameter names."""
    nodes = run.launcher.nodes
    nproc = dims.world_size // nodes
    gpus = run.launcher.gpus_per_node or (nproc if run.hardware.device == "cuda" else 0)
    return {
        "nodes": nodes,
        "tasks_per_node": 1,  # one torchrun per node
        "cpus_per_task": nproc * run.launcher.cpus_per_task,  # launcher.cpus_per_task is per rank
        "gpus_per_node": gpus or None,
        "timeout_min": time_limit_min(run),
        "partition": run.launcher.partition,
        "additional_parameters": dict(run.launcher.additional_parameters),
        # squeue shows what runs: study, strategy, degrees and the run_id its record will carry.
        "name": f"brigade-{run.study}-{run.strategy.name}-{dims.label()}-{run_id(as_dict(run))}",
    }


def time_limit_min(run) -> int:
    """SLURM time limit in minutes: launcher.time_min, raised to at least launcher.timeout_s + 1 min
    so that brigade's own wall-clock limit fires first and the record says `timeout` with its reason."""
    return max(run.launcher.time_min, math.ceil(run.launcher.timeout_s / 60) + 1)
