"""brigade's SLURM launcher for Hydra (`launcher=slurm`; Hydra accepts launcher plugins only from the
hydra_plugins package). The sweep side: one sbatch per config with its own resources, outcomes taken
as each job ends. What runs inside each job (torchrun per node, rendezvous, time limits) is the node
side, launch/slurm.py; the two halves and why are described there and in launch/README.md.

Why a subclass of Hydra's submitit launcher: the stock one submits all jobs of a sweep as one array
with one set of resources, waits for all of them, and raises on the first failed job (losing the
rest of the sweep's results). A study mixes world sizes and node counts, and a job killed by SLURM
must become a record at once.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Sequence

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher

from harness.config import ADHOC_STUDY
from harness.run.claims import SUBMITTED, SUBMITTING, claim_key, held_by
from harness.run.results_file import already_done, read, records_path
from launch.slurm import (
    SlurmJobFailed,
    SlurmJobSignalled,
    _minutes_left,
    attempt_cause,
    job_resources,
    requeued_cause,
    slurm_job_id,
)

# Imports inside functions: Hydra imports every plugin at start-up, so what a sweep or a launch needs loads
# when it runs.

log = logging.getLogger(__name__)


class BrigadeSlurmLauncher(SubmititSlurmLauncher):
    """Hydra's submitit SLURM launcher with per-config resources and failures as JobReturns."""

    poll_s = 3.0  # sacct at most this often (submitit's own back-off reaches 10 min)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int):
        from hydra.core.singleton import Singleton
        from hydra.core.utils import JobReturn, JobStatus, filter_overrides

        assert self.config is not None and self.hydra_context is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        run_ends = self.task_function.run_ends
        returns: list = [None] * len(job_overrides)
        queue: list[tuple[int, str]] = []  # (job index, its resources as a key), in sweep order
        composed: dict[int, Any] = {}
        claimed: dict[int, str] = {}  # job index -> the run_id this process holds until SLURM runs it
        for i, overrides in enumerate(job_overrides):
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            task_cfg = _task_cfg(cfg)
            # Claimed before the resume check, as a local run is, and held for the job until it ends
            # (its task 0 takes it over if this process dies): another invocation of the study
            # neither submits nor runs it meanwhile.
            held, run_id = _claim(run_ends, task_cfg)
            if held:
                from harness.run.terminal import console

                console.print(f"[dim]skip {run_id}: {held}[/]")
                returns[i] = JobReturn(overrides=list(overrides), cfg=task_cfg, status=JobStatus.COMPLETED,
                                       _return_value=None)
                continue
            resources = _resources_or_none(task_cfg)
            if resources is None:  # a skip or an invalid config: recorded here, nothing to submit
                run_ends.claims.release(run_id)  # the task claims it itself
                returns[i] = JobReturn(overrides=list(overrides), cfg=task_cfg, status=JobStatus.COMPLETED,
                                       _return_value=self.task_function(task_cfg))
                continue
            composed[i] = task_cfg
            if run_id:
                claimed[i] = run_id
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
                        run_ends.claims.release(claimed.pop(i, ""))
                        returns[i] = _failed(job_overrides[i], SlurmJobFailed(f"sbatch refused the job: {e}"))
                        continue
                    if i in claimed:
                        run_ends.claims.relabel(claimed[i], f"{SUBMITTED} {job.job_id}")
                    in_flight.append((i, job))
                for i, job in self._finished(in_flight):
                    in_flight.remove((i, job))
                    run_ends.claims.release(claimed.pop(i, ""))
                    returns[i] = self._outcome(job, job_overrides[i], composed[i])
                if in_flight:
                    time.sleep(self.poll_s)
        except BaseException:  # Ctrl-C: do not leave the sweep's jobs running on the cluster
            for _, job in in_flight:
                job.cancel(check=False)
            raise
        finally:
            for run_id in claimed.values():
                run_ends.claims.release(run_id)
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
        """The job's JobReturn; a job that ended without one gets its record here (_record_lost)."""
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
            record = self._record_lost(job.job_id, state, error, timed_out, task_cfg)
        return JobReturn(overrides=list(overrides), cfg=task_cfg, status=_completed(), _return_value=record)

    def _record_lost(self, job_id: str, state: str, error: Exception, timed_out: bool, task_cfg) -> dict:
        """The record of a job that ended without one: `interrupted` when SLURM took it away and did not
        requeue it (its node failed, it was preempted: launch/slurm.py), else by the rule for a job that
        raised (harness/run/cause.py: `failed`, or `timeout` when its time limit ended it)."""
        from harness.run.record import Status
        from harness.run.sweep import launcher_failure, unlaunched

        run_ends = self.task_function.run_ends
        if state.startswith(("NODE_FAIL", "PREEMPTED")):
            return unlaunched(run_ends, task_cfg, Status.INTERRUPTED, attempt_cause(job_id, state, _sacct_nodes(job_id)))
        if isinstance(error, SlurmJobSignalled) and not timed_out:
            return unlaunched(run_ends, task_cfg, Status.INTERRUPTED, f"{requeued_cause(job_id)}: {error}")
        return launcher_failure(run_ends, task_cfg, error, status=Status.TIMEOUT if timed_out else Status.FAILED)

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


def _claim(run_ends, task_cfg) -> tuple[str | None, str]:
    """(who holds it, or None once this process holds it for submission; its run_id, "" if none:
    an ad-hoc run, or a config the task function will refuse)."""
    from harness.config import as_dict, to_run_config
    from harness.run.record import run_id

    try:
        run = to_run_config(task_cfg)
    except Exception:  # noqa: BLE001 - a type error in an override: run_job records it as invalid
        return None, ""
    if run.study == ADHOC_STUDY:
        return None, ""
    rid = claim_key(run_id(as_dict(run)), run.repeat)
    line = run_ends.claims.take(run.results_dir, run.study, rid, SUBMITTING)
    return (held_by(line, run.results_dir, run.study, rid) if line else None), rid


def _resources_or_none(task_cfg) -> dict | None:
    """This config's sbatch resources; None when the job would not run (already done in this study,
    or refused by validation): run_job then writes or returns its record without a SLURM job."""
    from harness.config import as_dict, to_run_config
    from harness.dims import ConfigError
    from harness.validate import validate

    try:
        run = to_run_config(task_cfg)
    except Exception:  # noqa: BLE001 - a type error in an override: run_job records it as invalid
        return None
    if already_done(as_dict(run), run) is not None:
        return None
    try:
        return job_resources(run, validate(run))
    except ConfigError:
        return None


def _sacct_attempts(job_id: str, field: str) -> list[str]:
    """`field` of each attempt of the job, first to last (sacct -D: one row per attempt)."""
    import subprocess

    try:
        return subprocess.run(["sacct", "-n", "-X", "-D", "-P", "-j", job_id, "-o", field], capture_output=True,
                              text=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return []


def _sacct_nodes(job_id: str) -> str:
    """The nodes of the job's last attempt, as sacct lists them (bn[1-2])."""
    return (_sacct_attempts(job_id, "NodeList") or ["?"])[-1]


def _record_of_job(task_cfg, job_id: str) -> dict | None:
    """The record the job's last attempt appended, if any (env.slurm_job and env.slurm_restarts name it; an
    earlier attempt's record, of a requeue, is not this attempt's)."""
    last = max(len(_sacct_attempts(job_id, "State")) - 1, 0)
    path = records_path(task_cfg.get("results_dir", "results"), task_cfg.get("study", ADHOC_STUDY))
    for r in reversed(read(path)):
        env = r.get("env") or {}
        if env.get("slurm_job") == job_id and int(env.get("slurm_restarts") or 0) == last:
            return r
    return None
