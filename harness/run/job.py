"""One benchmark run, from the parent's side: the Hydra task function.

    compose (Hydra) -> RunConfig -> validate -> predict -> write frozen config -> launch ranks
    -> collect measurement.json -> one record appended to <results_dir>/<study>.jsonl -> W&B

Every path through here ends in exactly one record (ok | invalid | failed | timeout | oom | diverged |
interrupted) or says why not (already done, claimed by another invocation, the record could not be
written), and the function never raises for a bad run, so a sweep goes on past it.
"""
from __future__ import annotations

import importlib
import json
import os
import time
import traceback
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from harness import catalog, rundir
from harness.collect.aggregate import aggregate
from harness.collect.environment import run_environment, start_git_probe
from harness.config import ADHOC_STUDY, GiB, RunConfig, as_dict, to_run_config
from harness.costmodel import predict
from harness.dims import ConfigError, ParallelDims
from harness.labels import base_label, own_label, slug
from harness.run import cause, results_file
from harness.run import record as rec
from harness.run.cause import failure
from harness.run.claims import claim_for_job, claim_key
from harness.run.ending import Ending
from harness.run.record import Status
from harness.run.results_file import results_problem
from harness.run.signals import received
from harness.run.terminal import console, print_table
from harness.run.wandb_log import log_record, run_identity
from harness.rundir import write_atomic
from harness.validate import validate

# Imports inside functions: Hydra (only the parent composes configs); launch.slurm, which only a SLURM job needs.


def _fresh_run_dir(results_dir: str, study: str, name: str) -> Path:
    """A new directory per attempt: an earlier attempt's files are never overwritten."""
    base = rundir.runs_dir(results_dir, study)
    for attempt in range(1000):
        d = base / (name if attempt == 0 else f"{name}.{attempt}")
        try:
            d.mkdir(parents=True)
            return d
        except FileExistsError:
            continue
    raise RuntimeError(f"too many attempts of {name} in {base}")


def _slurm_job(run: RunConfig) -> str | None:
    """The SLURM job id when this is a launcher=slurm job's task, else None."""
    if run.launcher.name != "slurm" or "SLURM_JOB_ID" not in os.environ:
        return None
    from launch.slurm import slurm_job_id

    return slurm_job_id()


def _slurm_run_dir(run: RunConfig, name: str, slurm_job: str, attempt: int) -> Path:
    """One dir per attempt of a SLURM job (a requeued job gets a new one: its restart count is in the name)."""
    return rundir.runs_dir(run.results_dir, run.study) / f"{name}.slurm{slurm_job}{f'.r{attempt}' if attempt else ''}"


def _record_lost_attempts(run: RunConfig, config: dict, dims: ParallelDims, predicted: dict, name: str,
                          slurm_job: str, label: str, run_ends: Ending) -> None:
    """A restarted SLURM job's earlier attempts that left no record (their node died, or SLURM's SIGKILL
    came before the record was written) each get their `interrupted` record now, before this attempt
    runs (launch/slurm.py says who records what)."""
    from launch.slurm import lost_attempts, task_rank

    if task_rank() != 0:
        return
    for attempt, why in lost_attempts(results_file.read(results_file.records_path(run.results_dir, run.study))):
        d = _slurm_run_dir(run, name, slurm_job, attempt)
        record = rec.make_record(config, run, dims, Status.INTERRUPTED, f"{why}; recorded when the job restarted",
                                 predicted=predicted, env={"slurm_job": slurm_job, "slurm_restarts": attempt},
                                 run_dir=d if d.is_dir() else None)
        run_ends.end(record, label, run.results_dir, release_claim=False)  # this attempt runs the config now


class Task:
    """The Hydra task function, bound to the invocation's Ending: the sweeper and the launchers reach
    it here (Hydra hands them the task function), so nothing passes between them through globals."""

    def __init__(self, run_ends: Ending | None = None):
        self.run_ends = run_ends or Ending()

    def __call__(self, cfg: DictConfig) -> dict | None:
        return run_job(cfg, self.run_ends)


def run_job(cfg: DictConfig, run_ends: Ending | None = None) -> dict | None:
    """Run one config and return its record (None when another invocation holds it, or no record
    can go anywhere). A task that raises (a bug, a disk that is full) ends as a `failed` record."""
    run_ends = run_ends or Ending()
    t0 = time.monotonic()
    raw = OmegaConf.to_container(cfg, resolve=False)
    raw.pop("hydra", None)
    unsafe = results_problem(str(raw.get("results_dir", "results")), str(raw.get("study", ADHOC_STUDY)))
    if unsafe:  # no record: there is no safe file to put it in
        run_ends.note(Status.INVALID)
        console.print(f"[yellow]invalid[/] {escape(unsafe)}", highlight=False, soft_wrap=True)
        return None
    known = _KnownSoFar(raw)
    try:
        return _run(cfg, run_ends, known, t0)
    except Exception as e:  # noqa: BLE001 - the one rule for a task that raised (harness/run/cause.py)
        if known.ended:
            raise  # its record is written: never a second one
        status, error = failure(e)
        record = rec.make_record(known.config, known.run, known.dims, status, error, predicted=known.predicted,
                                 run_dir=known.run_dir, wall_s=time.monotonic() - t0)
        return _finish(record, known.run, None, known.label, run_ends, known)


class _KnownSoFar:
    """What a job knows so far (its config, dims, prediction, run dir, label), so that a task that raised
    still ends in a record with what is known."""

    def __init__(self, raw: dict):
        self.config, self.run, self.dims, self.predicted, self.run_dir = raw, None, None, None, None
        self.label, self.ended = "", False


def _run(cfg: DictConfig, run_ends: Ending, known: _KnownSoFar, t0: float) -> dict | None:
    try:
        raw = OmegaConf.to_container(cfg, resolve=True)
        raw.pop("hydra", None)
        known.config = raw
        run = to_run_config(cfg)
        config = as_dict(run)
    except Exception as e:  # noqa: BLE001 - a type error in an override is an invalid config
        record = rec.make_record(known.config, None, None, Status.INVALID, f"{type(e).__name__}: {e}")
        return _finish(record, None, None, "", run_ends, known)
    known.config, known.run = config, run

    # a named study: one invocation runs a config (each repeat of it) at a time (harness/run/claims.py)
    key = claim_key(rec.run_id(config), run.repeat)
    if run.study != ADHOC_STUDY:
        held = _claim(run, key, run_ends)
        if held:
            console.print(f"[dim]skip {run.strategy.name} {rec.run_id(config)}: {escape(held)}[/]")
            return None
    done = results_file.already_done(config, run)
    if done is not None:
        run_ends.claims.release(key)
        done = {**done, "skipped": True}
        run_ends.count(done)
        console.print(f"[dim]skip {done['strategy']} {done['run_id']}: already {done['status']} "
                      f"in {results_file.records_path(run.results_dir, run.study)}[/]")
        return done

    try:
        dims, predicted = _validate_and_predict(run)
    except ConfigError as e:
        record = rec.make_record(config, run, _dims_if_valid(run), Status.INVALID, str(e))
        return _finish(record, run, None, "", run_ends, known)
    known.dims, known.predicted = dims, predicted
    label = own_label({"strategy": run.strategy.name, "config": config, "dims": dims.as_dict()}, _task_overrides())
    known.label = label
    if received():  # the parent was asked to stop before this run was launched: it ends here
        status, why = cause.stop_cause(received())
        record = rec.make_record(config, run, dims, status, f"{why} before the run was launched; nothing was started",
                                 predicted=predicted, wall_s=time.monotonic() - t0)
        return _finish(record, run, None, label, run_ends, known)

    name = f"{slug(label)[:80]}-{rec.run_id(config)}"  # what the run is, then which exact config
    name += f"-r{run.repeat}" if run.repeat else ""
    slurm_job = _slurm_job(run)
    if slurm_job:
        from launch.slurm import restart_count

        attempt = restart_count()
        _record_lost_attempts(run, config, dims, predicted, name, slurm_job, label, run_ends)
        # launcher=slurm: every node's task runs this function (launch/README.md). They must agree on
        # the run dir without talking, so it is named after the SLURM job and attempt, not a counter, and
        # its files are written atomically (all nodes write the same content; workers read them).
        run_dir = _slurm_run_dir(run, name, slurm_job, attempt)
        run_dir.mkdir(parents=True, exist_ok=True)
    else:
        run_dir = _fresh_run_dir(run.results_dir, run.study, name)
    known.run_dir = run_dir
    write_atomic(run_dir / rundir.CONFIG, OmegaConf.to_yaml(OmegaConf.create(config)))
    write_atomic(run_dir / rundir.PREDICTION, json.dumps(predicted, indent=1))
    start_git_probe()
    status, error, measured, env = _launch_and_collect(run, dims, run_dir, label, run_ends)
    if slurm_job:  # names the job and attempt in the record (the sweep and a restarted job look for them)
        env = {**env, "slurm_job": slurm_job, "slurm_restarts": attempt}
    record = rec.make_record(config, run, dims, status, error, measured, predicted, env, run_dir, time.monotonic() - t0)
    record = _finish(record, run, run_dir, label, run_ends, known)
    if slurm_job and status == Status.INTERRUPTED:
        from launch.slurm import outlast_attempt

        outlast_attempt()  # SLURM requeued the job: its next attempt, not this one, answers the sweep
    return record


def _claim(run: RunConfig, key: str, run_ends: Ending) -> str | None:
    """Claim the config for this job (harness/run/claims.py, the SLURM handover included); None when
    this process may run it, else why not."""
    job = _slurm_job(run)
    rank = 0
    if job:
        from launch.slurm import task_rank

        rank = task_rank()
    return claim_for_job(run_ends.claims, run.results_dir, run.study, key, job, rank)


def _task_overrides() -> list[str]:
    """The overrides this job was given (command line and study run), [] outside a Hydra job."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _validate_and_predict(run: RunConfig) -> tuple[ParallelDims, dict]:
    """Validate, predict and check the launcher's machine; ConfigError (with the arithmetic) if it cannot run."""
    dims = validate(run)
    try:
        predicted = predict(run, dims)
    except Exception as e:  # noqa: BLE001 - a gap in validation must still end in a record, naming the bug
        raise ConfigError(f"the cost model cannot evaluate this config ({type(e).__name__}: {e}); "
                          f"validation should have refused it: a brigade bug, please report") from e
    need, have = predicted.get("peak_mem_bytes"), run.hardware.memory_GiB * GiB
    # a dry run allocates nothing: it is how one checks a layout that would not fit
    if need and need > have and not run.allow_oversubscribe_memory and run.launcher.name != "dryrun":
        raise ConfigError(f"predicted peak memory {need / GiB:.2f} GiB per device > {run.hardware.name} "
                          f"memory {run.hardware.memory_GiB:.2f} GiB (allow_oversubscribe_memory=true runs it anyway)")
    preflight = getattr(importlib.import_module(catalog.LAUNCHERS[run.launcher.name]), "preflight", None)
    if preflight:  # what only the launcher knows: this machine's devices and memory
        preflight(run, dims, predicted)
    return dims, predicted


def _dims_if_valid(run: RunConfig) -> ParallelDims | None:
    try:
        return ParallelDims.from_config(run.parallel, run.launcher)
    except ConfigError:
        return None


def _launch_and_collect(run: RunConfig, dims: ParallelDims, run_dir: Path, label: str, run_ends: Ending):
    launcher = importlib.import_module(catalog.LAUNCHERS[run.launcher.name])
    log_path = run_dir / rundir.WORKERS_LOG
    progress_file = run_dir / rundir.PROGRESS
    with _progress(label, run_ends) as (bar, task):
        def on_poll():
            try:
                done, total = map(int, progress_file.read_text().split())
                bar.update(task, completed=done, total=total)
            except (OSError, ValueError):
                pass

        result = launcher.execute(run, dims, run_dir, log_path, on_poll)
    return collect(run, dims, run_dir, result)


def collect(run: RunConfig, dims: ParallelDims, run_dir: Path, result) -> tuple[Status, str | None, dict, dict]:
    """Turn what the ranks left in run_dir into (status, error, measured, env)."""
    ended = cause.verdict(run, run_dir, result)
    if ended is not None:
        return (*ended, {}, {})
    measurement = json.loads((run_dir / rundir.MEASUREMENT).read_text())
    try:
        measured = aggregate(run, dims, measurement)
    except Exception as e:  # noqa: BLE001 - a bug in aggregation must still yield a record
        return Status.FAILED, f"aggregating measurement.json failed: {type(e).__name__}: {e}\n{traceback.format_exc()}", {}, {}
    if result.returncode != 0:
        # Every rank's figures were gathered and written before the exit (e.g. a gloo teardown
        # race in destroy_process_group under load): the run is measured; say what happened.
        measured["warnings"] = [f"workers exited with code {result.returncode} after writing "
                                f"measurement.json: {cause.log_tail(result.log_path, 5)}"]
    diverged = cause.divergence(measured.get("losses"))
    return (Status.DIVERGED if diverged else Status.OK), diverged, measured, run_environment(measurement["ranks"])


def _finish(record: dict, run: RunConfig | None, run_dir: Path | None, label: str, run_ends: Ending,
            known: _KnownSoFar) -> dict:
    if run is not None and _slurm_job(run):
        from launch.slurm import task_rank

        if task_rank() != 0:  # launcher=slurm: the other nodes' tasks ran their ranks; task 0 records
            return record
    label = label or base_label(record)
    known.ended = True
    if run is not None and run_dir is not None and record["status"] == Status.OK and run.logger.name == "wandb":
        _log_wandb(record, run, run_dir, label, run_ends)
    else:
        run_ends.end(record, label, _results_dir(record))
    if run_ends.sweep_total is None:  # one run, no sweep: it ends here, so say where things are
        _single_run_ending(record, run_dir, label)
    return record


def _log_wandb(record: dict, run: RunConfig, run_dir: Path, label: str, run_ends: Ending) -> None:
    """W&B first, then the record: it names the W&B run only once that run exists, and says why not
    when logging failed. Interrupted while logging (a second Ctrl-C), the record is still written."""
    ident = run_identity(record, run_dir, run.logger, label)
    try:
        error = log_record(record, ident, run_dir, run.logger, job_type=run.launcher.name)
    except BaseException as e:
        record["wandb_error"] = f"W&B logging interrupted ({type(e).__name__})"
        run_ends.end(record, label, _results_dir(record))
        raise
    if error is None:
        record["wandb"] = ident
    else:
        record["wandb_error"] = error
    run_ends.end(record, label, _results_dir(record))


def _results_dir(record: dict) -> str:
    return str((record.get("config") or {}).get("results_dir", "results"))


def _single_run_ending(record: dict, run_dir: Path | None, label: str) -> None:
    """The end of a run started without -m: its one-row table, the record, the run dir and W&B run."""
    print_table([record], f"run {record['run_id']}", console, names=[label])
    path = results_file.records_path(_results_dir(record), record["study"])
    lines = [f"record: {path} (run_id {record['run_id']})"] + ([f"run dir: {run_dir}"] if run_dir else [])
    w = record.get("wandb")
    if record.get("wandb_error"):
        lines.append(f"W&B: not logged ({record['wandb_error']})")
    if w:
        lines.append(f"W&B: {w['mode']} run '{w['name']}' (id {w['id']}, group {w['group']}) in {w['dir']}"
                     + (" (upload later with `wandb sync <dir>/offline-run-*`)" if w["mode"] == "offline" else ""))
    lines.append(f"report: none for one run (`python -m harness.report {path}` draws the runs in that file)")
    for line in lines:  # never wrapped: paths and ids stay whole for copying
        console.print(escape(line), soft_wrap=True)


class _progress:
    """Steps of the current run, under the sweep's own bar when a sweep is running."""

    def __init__(self, label: str, run_ends: Ending):
        self.label, self.run_ends = label, run_ends

    def __enter__(self):
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console, transient=True)
        if self.run_ends.sweep_total:
            self.bar.add_task("sweep", total=self.run_ends.sweep_total, completed=self.run_ends.sweep_done)
        task = self.bar.add_task(f"  {self.label} steps", total=None)
        self.bar.start()
        return self.bar, task

    def __exit__(self, *exc):
        self.bar.stop()
        return False
