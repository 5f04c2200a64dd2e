"""launcher=slurm: one SLURM job per config, submitted by Hydra's submitit launcher.

Two halves, one on each side of sbatch:

    sweep process (login node)                       SLURM job, one task per node
    --------------------------                       ----------------------------
    BrigadeSlurmLauncher.launch(jobs)                submitit runs harness.job.run_job (Hydra job)
      compose each job -> its own resources            -> launch.slurm.execute on every node:
      (nodes, CPUs = ranks x cpus_per_task, GPUs)         torchrun --nnodes N --node-rank SLURM_NODEID
      skip/invalid jobs: run here, no sbatch              c10d rendezvous on the job's first node
      sbatch per config, <= array_parallelism at once   task 0 writes the record (harness.job)
      poll sacct (via submitit) -> JobReturn per job

Why one task per node running torchrun (not one task per rank): the ranks of a node are then
started, watched and killed exactly as with launcher=local (same argv, same process-group
wall-clock limit, same per-rank error files), torchrun supplies LOCAL_RANK and tears the node's
ranks down when one of them dies, and brigade's parent work (validate, predict, run dir, record)
runs once per node rather than once per rank. See launch/README.md.

Why a launcher subclass: the stock submitit launcher submits all jobs of a sweep as one array with
one set of resources, waits for all of them, and raises on the first failed job (losing the rest of
the sweep's results). A study mixes world sizes and node counts, and a job killed by SLURM must
become a record at once.
"""
from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Sequence

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher

from launch.local import LaunchResult, run_workers, torchrun_argv, worker_env

log = logging.getLogger(__name__)

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


def execute(run, dims, run_dir: Path, log_path: Path, on_poll=None) -> LaunchResult:
    """This node's ranks, under torchrun; called by harness.job.run_job in every task of the job."""
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
    from harness.config import as_dict
    from harness.record import run_id

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


class BrigadeSlurmLauncher(SubmititSlurmLauncher):
    """Hydra's submitit SLURM launcher with per-config resources and failures as JobReturns."""

    poll_s = 3.0  # sacct at most this often (submitit's own back-off reaches 10 min)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int):
        from hydra.core.singleton import Singleton
        from hydra.core.utils import JobReturn, JobStatus, filter_overrides

        assert self.config is not None and self.hydra_context is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        returns: list = [None] * len(job_overrides)
        queue: list[tuple[int, str]] = []  # (job index, its resources as a key), in sweep order
        composed: dict[int, Any] = {}
        for i, overrides in enumerate(job_overrides):
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            task_cfg = _task_cfg(cfg)
            resources = _resources_or_none(task_cfg)
            if resources is None:  # a skip or an invalid config: recorded here, nothing to submit
                from harness.job import run_job

                returns[i] = JobReturn(overrides=list(overrides), cfg=task_cfg, status=JobStatus.COMPLETED,
                                       _return_value=run_job(task_cfg))
                continue
            composed[i] = task_cfg
            queue.append((i, json.dumps(resources, sort_keys=True)))

        # One sbatch per config, at most `array_parallelism` of this sweep's jobs queued or running
        # at once (a sweep-wide limit; SLURM's own %N limit would apply per array, i.e. per resource
        # set). Each job's outcome is taken as soon as it ends, so a killed job's record does not
        # wait for the slowest job of the sweep.
        limit = max(1, int(self.params.get("array_parallelism") or 1))
        executors: dict[str, Any] = {}
        in_flight: list[tuple[int, Any]] = []
        try:
            while queue or in_flight:
                while queue and len(in_flight) < limit:
                    i, key = queue.pop(0)
                    if key not in executors:
                        executors[key] = self._executor(json.loads(key))
                    executor = executors[key]
                    log.info(f"sbatch #{initial_job_idx + i}: {' '.join(filter_overrides(job_overrides[i]))}")
                    try:
                        job = executor.submit(self, list(job_overrides[i]), "hydra.sweep.dir", initial_job_idx + i,
                                              f"job_id_for_{i}", Singleton.get_state())
                    except Exception as e:  # noqa: BLE001 - sbatch refused (too many CPUs, bad partition)
                        returns[i] = _failed(job_overrides[i], SlurmJobFailed(f"sbatch refused the job: {e}"))
                        continue
                    in_flight.append((i, job))
                for i, job in self._finished(in_flight):
                    in_flight.remove((i, job))
                    returns[i] = self._outcome(job, job_overrides[i], composed[i])
                if in_flight:
                    time.sleep(self.poll_s)
        except BaseException:  # Ctrl-C: do not leave the sweep's jobs running on the cluster
            for _, job in in_flight:
                job.cancel(check=False)
            raise
        return returns

    def _executor(self, resources: dict):
        import submitit
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
        from omegaconf import OmegaConf

        # Sweep-wide settings from hydra.launcher (conf/launcher/slurm.yaml), then this config's
        # own resources; names mapped to submitit's as the stock launcher does.
        params = {**self.params, **resources}
        executor = submitit.AutoExecutor(cluster="slurm", folder=params.pop("submitit_folder"),
                                         slurm_max_num_timeout=params.pop("max_num_timeout", 0))
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
        return executor

    @staticmethod
    def _finished(in_flight):
        from submitit.slurm.slurm import SlurmJob

        if not in_flight:
            return []
        SlurmJob.watcher.update()  # one sacct for all jobs; submitit alone backs off to 10 min
        return [(i, job) for i, job in in_flight if job.done()]

    def _outcome(self, job, overrides, task_cfg):
        """The job's JobReturn; a job that ended without one gets its `failed`/`timeout` record here."""
        from hydra.core.utils import JobReturn

        task0 = job.task(0) if job.num_tasks > 1 else job  # only task 0 writes the record
        state = job.state
        if not state.startswith("COMPLETED"):
            # Killed jobs leave no result file: do not wait submitit's 15 s for one (slow shared
            # filesystems matter for jobs that completed, which keep the default).
            task0._results_timeout_s = 3
        try:
            ret = task0.results()[0]
            assert isinstance(ret, JobReturn), ret
            signalled = ret._return_value if isinstance(ret._return_value, SlurmJobSignalled) else None
            if signalled is None:
                return ret  # a record (or the job function's own exception, recorded by the sweeper)
            error, timed_out = signalled, signalled.timed_out
        except Exception as e:  # noqa: BLE001 - killed, timed out, node failure: no result pickle
            error = SlurmJobFailed(f"SLURM job {job.job_id} ended {state} without a record: "
                                   f"{type(e).__name__}: {str(e)[-1500:]}")
            timed_out = state.startswith("TIMEOUT")
        record = _record_of_job(task_cfg, job.job_id)
        if record is None:  # the usual case; else the task wrote it and was killed before returning
            from harness.sweep import launcher_failure

            record = launcher_failure(task_cfg, error, status="timeout" if timed_out else "failed")
        return JobReturn(overrides=list(overrides), cfg=task_cfg, status=_completed(), _return_value=record)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Called by submitit in the job when SLURM's warning signal arrives (signal_delay_s before
        the time limit, or on preemption). Hydra's launcher would requeue the job; brigade never
        requeues a benchmark: the run ends here (its ranks are killed on the way out) as a record."""
        left = _minutes_left()
        timed_out = left is not None and left * 60 <= self.params.get("signal_delay_s", 30) + 60
        why = (f"its time limit is {left * 60:.0f} s away (launcher.time_min)" if timed_out
               else "preempted" if left is not None else "time limit near or preempted")
        raise SlurmJobSignalled(f"SLURM job {slurm_job_id()} signalled: {why}; brigade does not requeue runs",
                                timed_out)


def _completed():
    from hydra.core.utils import JobStatus

    return JobStatus.COMPLETED


def _failed(overrides, error: Exception):
    from hydra.core.utils import JobReturn, JobStatus

    return JobReturn(overrides=list(overrides), status=JobStatus.FAILED, _return_value=error)


def _task_cfg(cfg):
    from omegaconf import OmegaConf

    return OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])


def _resources_or_none(task_cfg) -> dict | None:
    """This config's sbatch resources; None when the job would not run (already done in this study,
    or refused by validation): run_job then writes or returns its record without a SLURM job."""
    from harness.config import as_dict, to_run_config
    from harness.dims import ConfigError
    from harness.job import _skip_existing
    from harness.validate import validate

    try:
        run = to_run_config(task_cfg)
    except Exception:  # noqa: BLE001 - a type error in an override: run_job records it as invalid
        return None
    if _skip_existing(as_dict(run), run) is not None:
        return None
    try:
        return job_resources(run, validate(run))
    except ConfigError:
        return None


def _record_of_job(task_cfg, job_id: str) -> dict | None:
    """The record a SLURM job's task appended, if any (env.slurm_job names the job)."""
    from harness import record as rec

    path = rec.records_path(task_cfg.get("results_dir", "results"), task_cfg.get("study", "adhoc"))
    for r in reversed(rec.read(path)):
        if (r.get("env") or {}).get("slurm_job") == job_id:
            return r
    return None


def time_limit_min(run) -> int:
    """SLURM time limit in minutes: launcher.time_min, raised to at least launcher.timeout_s + 1 min
    so that brigade's own wall-clock limit fires first and the record says `timeout` with its reason."""
    return max(run.launcher.time_min, math.ceil(run.launcher.timeout_s / 60) + 1)
