"""One benchmark run, from the parent's side: the Hydra task function.

    compose (Hydra) -> RunConfig -> validate -> predict -> write frozen config -> launch ranks
    -> collect measurement.json -> one record appended to <results_dir>/<study>.jsonl -> W&B

Every path through here ends in exactly one record (ok | invalid | failed | timeout | oom | diverged |
interrupted) or says why not (already done, claimed by another invocation, the record could not be
written), and the function never raises for a bad run, so a sweep goes on past it.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from harness import rundir
from harness.rundir import write_atomic
from harness.run import claim, outcome, preflight, signals
from harness.run import record as rec
from harness.config import RunConfig, as_dict, to_run_config
from harness.dims import ConfigError, ParallelDims
from harness.labels import base_label, own_label, slug

# Wide enough for the results table when output goes to a file or CI log (80 columns otherwise).
console = Console(stderr=True, width=None if sys.stderr.isatty() else 140)
GiB = 1024**3


def _fresh_run_dir(results_dir: str, study: str, name: str) -> Path:
    """A new directory per attempt: an earlier attempt's files are never overwritten."""
    base = Path(results_dir) / "runs" / study
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


def _slurm_run_dir(run: RunConfig, name: str, slurm_job: str) -> Path:
    """One dir per SLURM job (a requeued job gets a new one: its restart count is in the name)."""
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    d = Path(run.results_dir) / "runs" / run.study / f"{name}.slurm{slurm_job}{f'.r{restarts}' if restarts else ''}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def run_job(cfg: DictConfig) -> dict:
    """Hydra task function: run one config and return its record."""
    t0 = time.monotonic()
    raw = OmegaConf.to_container(cfg, resolve=False)
    raw.pop("hydra", None)
    unsafe = preflight.results_problem(str(raw.get("results_dir", "results")), str(raw.get("study", "adhoc")))
    if unsafe:  # no record: there is no safe file to put it in
        outcome.note("invalid")
        console.print(f"[yellow]invalid[/] {escape(unsafe)}", highlight=False, soft_wrap=True)
        return None
    try:
        raw = OmegaConf.to_container(cfg, resolve=True)
        raw.pop("hydra", None)
        run = to_run_config(cfg)
        config = as_dict(run)
    except Exception as e:  # noqa: BLE001 - a type error in an override is an invalid config
        record = rec.make_record(raw, None, None, "invalid", f"{type(e).__name__}: {e}")
        return _finish(record, raw.get("results_dir", "results"), None, None)

    # a named study: one invocation runs a config at a time (harness/run/claim.py); not inside a SLURM
    # job, where every node's task runs this function for the same run
    if run.study != "adhoc" and not _slurm_job(run):
        held = claim.take(run.results_dir, run.study, rec.claim_key(rec.run_id(config), run.repeat))
        if held:
            console.print(f"[dim]skip {run.strategy.name} {rec.run_id(config)}: {escape(held)}[/]")
            return None
    done = rec.already_done(config, run)
    if done is not None:
        claim.release(rec.claim_key(done["run_id"], run.repeat))
        outcome.note(done["status"], run.allow_failures)
        console.print(f"[dim]skip {done['strategy']} {done['run_id']}: already {done['status']} "
                      f"in {rec.records_path(run.results_dir, run.study)}[/]")
        return {**done, "skipped": True}

    try:
        dims, predicted = _plan(run)
    except ConfigError as e:
        dims_or_none = _dims_if_valid(run)
        record = rec.make_record(config, run, dims_or_none, "invalid", str(e))
        return _finish(record, run.results_dir, run, None)
    if signals.received():  # the parent was asked to stop: start nothing new (the sweep stops too)
        claim.release(rec.claim_key(rec.run_id(config), run.repeat))
        return None

    label = own_label({"strategy": run.strategy.name, "config": config, "dims": dims.as_dict()}, _task_overrides())
    name = f"{slug(label)[:80]}-{rec.run_id(config)}"  # what the run is, then which exact config
    name += f"-r{run.repeat}" if run.repeat else ""
    slurm_job = _slurm_job(run)
    # launcher=slurm: every node's task runs this function (launch/README.md). They must agree on
    # the run dir without talking, so it is named after the SLURM job, not an attempt counter, and
    # its files are written atomically (all nodes write the same content; workers read them).
    run_dir = _slurm_run_dir(run, name, slurm_job) if slurm_job else _fresh_run_dir(run.results_dir, run.study, name)
    write_atomic(run_dir / rundir.CONFIG, OmegaConf.to_yaml(OmegaConf.create(config)))
    write_atomic(run_dir / rundir.PREDICTION, json.dumps(predicted, indent=1))
    rec.start_git_probe()
    status, error, measured, env = _launch_and_collect(run, dims, run_dir, label)
    if slurm_job:  # names the job in the record (the sweep looks for it when the job was killed)
        env = {**env, "slurm_job": slurm_job}
    record = rec.make_record(config, run, dims, status, error, measured, predicted, env, run_dir, time.monotonic() - t0)
    return _finish(record, run.results_dir, run, run_dir, label)


def _task_overrides() -> list[str]:
    """The overrides this job was given (command line and study run), [] outside a Hydra job."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _plan(run: RunConfig) -> tuple[ParallelDims, dict]:
    """Validate, predict and check the launcher's machine; ConfigError (with the arithmetic) if it cannot run."""
    import importlib

    from harness.costmodel import predict
    from harness.validate import validate

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
    preflight = getattr(importlib.import_module(f"launch.{run.launcher.name}"), "preflight", None)
    if preflight:  # what only the launcher knows: this machine's devices and memory
        preflight(run, dims, predicted)
    return dims, predicted


def _dims_if_valid(run: RunConfig) -> ParallelDims | None:
    try:
        return ParallelDims.from_config(run.parallel, run.launcher)
    except ConfigError:
        return None


def _launch_and_collect(run: RunConfig, dims: ParallelDims, run_dir: Path, label: str):
    import importlib

    launcher = importlib.import_module(f"launch.{run.launcher.name}")
    log_path = run_dir / rundir.WORKERS_LOG
    progress_file = run_dir / rundir.PROGRESS
    with _progress(label) as (bar, task):
        def on_poll():
            try:
                done, total = map(int, progress_file.read_text().split())
                bar.update(task, completed=done, total=total)
            except (OSError, ValueError):
                pass

        result = launcher.execute(run, dims, run_dir, log_path, on_poll)
    return collect(run, dims, run_dir, result)


def collect(run: RunConfig, dims: ParallelDims, run_dir: Path, result) -> tuple[str, str | None, dict, dict]:
    """Turn what the ranks left in run_dir into (status, error, measured, env)."""
    from harness.collect.aggregate import aggregate, environment
    from harness.run import cause

    ended = cause.verdict(run, run_dir, result)
    if ended is not None:
        return (*ended, {}, {})
    measurement = json.loads((run_dir / rundir.MEASUREMENT).read_text())
    try:
        measured = aggregate(run, dims, measurement)
    except Exception as e:  # noqa: BLE001 - a bug in aggregation must still yield a record
        return "failed", f"aggregating measurement.json failed: {type(e).__name__}: {e}\n{traceback.format_exc()}", {}, {}
    if result.returncode != 0:
        # Every rank's figures were gathered and written before the exit (e.g. a gloo teardown
        # race in destroy_process_group under load): the run is measured; say what happened.
        measured["warnings"] = [f"workers exited with code {result.returncode} after writing "
                                f"measurement.json: {cause.log_tail(result.log_path, 5)}"]
    diverged = cause.divergence(measured.get("losses"))
    return ("diverged" if diverged else "ok"), diverged, measured, environment(measurement["ranks"])


def _finish(record: dict, results_dir: str, run: RunConfig | None, run_dir: Path | None, label: str = "") -> dict:
    if run is not None and _slurm_job(run):
        from launch.slurm import task_rank

        if task_rank() != 0:  # launcher=slurm: the other nodes' tasks ran their ranks; task 0 records
            return record
    log_wandb = run is not None and run_dir is not None and record["status"] == "ok" and run.logger.name == "wandb"
    if log_wandb:
        from harness.run.wandb_log import run_identity

        record["wandb"] = run_identity(record, run_dir, run.logger, label)  # known before logging: written with the record
    path = rec.records_path(results_dir, record["study"])
    try:
        rec.append(path, record)  # the record first: W&B can never lose it
    except OSError as e:  # all or nothing: nothing of it is in the file
        claim.release(rec.claim_key(record["run_id"], record.get("repeat")))
        outcome.note("unrecorded")
        console.print(f"[red]NOT RECORDED[/] {record['strategy']} {record['run_id']} ({record['status']}): "
                      f"appending to {path} failed: {escape(str(e))}")
        return record
    claim.release(rec.claim_key(record["run_id"], record.get("repeat")))
    outcome.note(record["status"], run is not None and run.allow_failures)
    if log_wandb:
        from harness.run.wandb_log import log_record

        log_record(record, run_dir, run.logger, job_type=run.launcher.name)
    _print_summary(record, label or base_label(record))
    if "BRIGADE_SWEEP_TOTAL" not in os.environ:  # one run, no sweep: it ends here, so say where things are
        _single_run_ending(record, results_dir, run_dir, label or base_label(record))
    return record


def _print_summary(record: dict, label: str) -> None:
    style = {"ok": "green", "invalid": "yellow"}.get(record["status"], "red")
    m = record.get("measured") or {}
    if record["status"] != "ok":
        detail = escape((record.get("error") or "")[:300])
    elif m.get("kind") == "dryrun":  # launcher=dryrun: memory only (harness/collect/dryrun.py)
        p = record.get("predicted") or {}
        detail = (f"dry run of ranks {m['dryrun_ranks']}: model states {m['model_states_bytes'] / GiB:.2f} GiB "
                  f"(predicted {p.get('model_states_bytes', 0) / GiB:.2f}), peak {m.get('peak_mem_bytes', 0) / GiB:.2f} "
                  f"GiB (predicted {p.get('peak_mem_bytes', 0) / GiB:.2f}) per rank")
    else:
        detail = f"step {m['step_time_s']:.3f} s, {m['tokens_per_s']:.0f} tokens/s"
    console.print(f"[{style}]{record['status']:>7}[/] {escape(label)} [dim]{record['run_id']}[/] {detail}")


def _single_run_ending(record: dict, results_dir: str, run_dir: Path | None, label: str) -> None:
    """The end of a run started without -m: its one-row table, the record, the run dir and W&B run."""
    from harness.run.table import print_table

    print_table([record], f"run {record['run_id']}", console, names=[label])
    path = rec.records_path(results_dir, record["study"])
    lines = [f"record: {path} (run_id {record['run_id']})"] + ([f"run dir: {run_dir}"] if run_dir else [])
    w = record.get("wandb")
    if w:
        lines.append(f"W&B: {w['mode']} run '{w['name']}' (id {w['id']}, group {w['group']}) in {w['dir']}"
                     + (" (upload later with `wandb sync <dir>/offline-run-*`)" if w["mode"] == "offline" else ""))
    lines.append(f"report: none for one run (`python -m harness.report {path}` draws the runs in that file)")
    for line in lines:  # never wrapped: paths and ids stay whole for copying
        console.print(escape(line), soft_wrap=True)


class _progress:
    """Steps of the current run, under the sweep's own bar when a sweep is running."""

    def __init__(self, label: str):
        self.label = label

    def __enter__(self):
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console, transient=True)
        total = int(os.environ.get("BRIGADE_SWEEP_TOTAL", "0"))
        if total:
            num = int(os.environ.get("BRIGADE_SWEEP_DONE", "0"))
            self.bar.add_task("sweep", total=total, completed=num)
        task = self.bar.add_task(f"  {self.label} steps", total=None)
        self.bar.start()
        return self.bar, task

    def __exit__(self, *exc):
        self.bar.stop()
        return False
