"""The parts of a sweep that the Hydra sweeper delegates to brigade: records for jobs that never
ran their task function, and the end-of-study table (and report)."""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf
from rich.markup import escape

from harness.config import ADHOC_STUDY, as_dict, to_run_config
from harness.run import record as rec
from harness.run import results_file
from harness.run.cause import failure
from harness.run.ending import Ending
from harness.run.record import Status
from harness.run.signals import received
from harness.run.terminal import console, print_table
from harness.run.wandb_log import group
from harness.validate import validate

# Imports inside functions: harness.report, harness.report.index, harness.report.wandb_summary, which would
# make an import cycle at the top.


def _base(config: DictConfig) -> tuple[str, str]:
    return str(config.get("results_dir", "results")), str(config.get("study", ADHOC_STUDY))


def composition_failure(run_ends: Ending, config: DictConfig, overrides: list[str], error: Exception) -> dict:
    """A job Hydra cannot compose (unknown option, bad type): an invalid record with Hydra's message."""
    results_dir, study = _base(config)
    strategy = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == "strategy"), None)
    cfg = {"study": study, "overrides": list(overrides), "strategy": {"name": strategy}}
    return run_ends.end(rec.make_record(cfg, None, None, Status.INVALID, f"{type(error).__name__}: {error}"),
                      " ".join(overrides), results_dir)


def unlaunched(run_ends: Ending, job_cfg: DictConfig, status: Status, error: str) -> dict:
    """A job that ended without writing its record: killed by SLURM (`failed`/`timeout`), or not
    launched because brigade was signalled (`interrupted`). Its config is composed here as in the
    job, so the record has the run_id a resumed study looks for."""
    run = to_run_config(OmegaConf.masked_copy(job_cfg, [k for k in job_cfg if k != "hydra"]))
    config = as_dict(run)
    try:
        dims = validate(run)
    except Exception:  # noqa: BLE001
        dims = None
    return run_ends.end(rec.make_record(config, run, dims, status, error), run.strategy.name, run.results_dir)


def launcher_failure(run_ends: Ending, job_cfg: DictConfig, error: BaseException, status: Status | None = None) -> dict:
    """A job the launcher reports failed before it wrote a record, by the rule every job that raised
    follows (harness/run/cause.py: failure); `status` when the launcher knows better (SLURM's job state)."""
    rule_status, text = failure(error)
    return unlaunched(run_ends, job_cfg, status or rule_status, text)


def finish_study(config: DictConfig, records: list[dict]) -> None:
    results_dir, study = _base(config)
    print_table(records, f"study {study}: {len(records)} runs", console)
    console.print(f"records: {results_file.records_path(results_dir, study)}")
    logged = [r["wandb"] for r in records if r.get("wandb")]
    if logged:
        console.print(f"W&B: {len(logged)} {logged[0]['mode']} runs in group '{logged[0]['group']}' under "
                      f"{results_dir}/runs/{study}/*/wandb (upload later with `wandb sync <dir>/offline-run-*`)")
    if config.get("report", True) and not received():  # interrupted: the user wants out now
        write_report(config, results_dir, study, records)


def write_report(config: DictConfig, results_dir: str, study: str, records: list[dict]) -> None:
    """The study's HTML report (harness.report) and its W&B summary run; the path is printed last.
    Ad-hoc runs (no study named) get a report of this invocation's runs only, `adhoc-<invocation>.html`.
    A failure here is printed and swallowed: the records are already written and the sweep is done."""
    path = results_file.records_path(results_dir, study)
    run_ids, name = (({r["run_id"] for r in records if "run_id" in r}, group(study)) if study == ADHOC_STUDY else (None, None))
    try:
        from harness.report import write_report as write_html

        html = write_html(path, path.with_name(f"{name}.html") if name else None, run_ids=run_ids, name=name)
    except Exception as e:  # noqa: BLE001 - a report bug must never fail the sweep or touch the records
        console.print(f"[red]report failed[/] ({escape(type(e).__name__)}: {escape(str(e))}); "
                      f"the records in {path} are unaffected; retry with `python -m harness.report {path}`")
        return
    logger = config.get("logger") or {}
    if logger.get("name") == "wandb":
        try:
            from harness.report.wandb_summary import log_summary

            where = log_summary(path, html, mode=str(logger.get("mode", "offline")),
                                project=str(logger.get("project", "brigade")), entity=logger.get("entity"),
                                run_ids=run_ids, name=name)
            if where:
                console.print(f"W&B study summary: {where}")
        except Exception as e:  # noqa: BLE001 - same rule as the report
            console.print(f"[red]W&B study summary failed[/] ({escape(type(e).__name__)}: {escape(str(e))})")
    try:
        from harness.report.index import write_index

        console.print(f"index: {write_index(results_dir)}")
    except Exception as e:  # noqa: BLE001 - same rule as the report
        console.print(f"[red]index failed[/] ({escape(type(e).__name__)}: {escape(str(e))}); "
                      f"retry with `python -m harness.report --index {results_dir}`")
    console.file.flush()
    print(f"report: {html}", flush=True)
