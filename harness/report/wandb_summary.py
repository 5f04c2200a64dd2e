"""The study summary as one W&B run in the study's group (job_type "summary"), beside the per-run runs:
the runs table (measured, predicted, ratio), scaling / memory / comm tables with W&B plots on them,
the failed runs, the PNG charts, and each scaling series' fit in the run summary.

Same discipline as harness/run/wandb_log.py: offline unless told otherwise (WANDB_MODE wins), every file
under <results_dir>/runs/<study>/_summary/, and a W&B failure is printed and swallowed (the HTML
report and the records never depend on it). Each call is a new W&B run (id <study>-summary-<time>):
a resumed study logs a fresh summary, the newest is the study's state.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

from harness.dims import COMM_AXES
from harness.report import charts, png_paths, scaling
from harness.report.study import load
from harness.run.record import Status
from harness.run.wandb_log import wandb_env

# Imports inside functions: wandb (only when a run logs to W&B).


def summary_dir(records_path: Path, study: str) -> Path:
    return Path(records_path).parent / "runs" / study / "_summary"


def tables(study) -> dict[str, tuple[list[str], list[list]]]:
    """Plain (columns, rows) for each W&B table, so they can be checked without W&B."""
    runs_cols = ["run_id", "run", "strategy", "engine", "status", "degrees", "world_size"]
    metrics = ("step_time_s", "tokens_per_s", "mfu_pct", "model_states_bytes", "comm_share_pct", "bubble_pct")
    for k in metrics:
        runs_cols += [f"measured_{k}", f"predicted_{k}", f"ratio_{k}"]
    runs_cols += ["measured_tokens_per_s_ci95_lo", "measured_tokens_per_s_ci95_hi", "repeats", "error"]
    runs_rows = []
    for r in study.runs:
        row = [r.run_id, r.label, r.strategy, r.engine, r.status, r.degrees, r.world]
        for k in metrics:
            m, p = r.m(k), r.p(k)
            row += [m, p, (m / p) if m is not None and p else None]
        row += [*(r.ci("tokens_per_s") or (None, None)), r.repeats, r.r.get("error")]
        runs_rows.append(row)
    out = {"runs": (runs_cols, runs_rows)}
    out["scaling"] = (["series", "kind", "run", "devices", "tokens_per_s", "speedup", "efficiency", "karp_flatt",
                       "run_id"],
                      [[s.name, s.kind, p.label, p.devices, p.tokens_per_s, p.speedup, p.efficiency, p.karp_flatt,
                        p.run_id] for s in scaling.series(study) for p in s.points])
    mem = charts.memory_series(study)
    mem_rows = []
    if mem:
        for i, label in enumerate(mem["labels"]):
            for side in ("measured", "predicted"):
                parts = {k: mem[side][k][i] for k in mem[side]}
                mem_rows.append([label, side, *parts.values(), sum(v for v in parts.values() if v)])
    out["memory"] = (["run", "side", "params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                      "total_bytes"], mem_rows)
    comm_rows = []
    for r in study.ok_runs:
        meas, pred = r.comm_share_by_axis() or {}, r.predicted_comm_share_by_axis() or {}
        for axis in COMM_AXES:
            mb, pb = r.comm_bytes(axis)
            if axis in meas or axis in pred or mb or pb:
                comm_rows.append([r.label, axis, meas.get(axis), pred.get(axis), mb, pb])
    out["comm"] = (["run", "axis", "measured_share_pct", "predicted_share_pct", "measured_bytes", "predicted_bytes"],
                   comm_rows)
    out["not_ok"] = (["status", "run", "run_id", "error"],
                     [[r.status, r.label, r.run_id, r.r.get("error")] for r in study.not_ok])
    return out


def log_summary(records_path: str | Path, html_path: str | Path | None = None, mode: str = "offline",
                project: str = "brigade", entity: str | None = None, run_ids: set[str] | None = None,
                name: str | None = None) -> str | None:
    """Log the study summary; returns the W&B run directory, or None if logging failed or is disabled.
    run_ids / name: only those runs, as group `name` (one invocation's ad-hoc runs)."""
    records_path = Path(records_path)
    study = load(records_path, run_ids, name)
    wdir = summary_dir(records_path, study.name)
    wdir.mkdir(parents=True, exist_ok=True)
    os.environ.update(wandb_env(wdir, mode))
    try:
        import wandb

        run_id = re.sub(r"[^A-Za-z0-9_-]", "-", f"{study.name}-summary-{time.strftime('%Y%m%d-%H%M%S')}")[-64:]
        run = wandb.init(project=project, entity=entity, group=study.name, job_type="summary",
                         name=f"{study.name}-summary", id=run_id, dir=str(wdir), reinit="finish_previous",
                         config={"study": study.name, "records": str(records_path), "n_runs": len(study.runs)},
                         settings=wandb.Settings(console="off", x_disable_stats=True))
        logged = {}
        for name, (cols, rows) in tables(study).items():
            logged[f"{name}_table"] = wandb.Table(columns=cols, data=rows)
        t = logged["scaling_table"]
        if t.data:
            logged["scaling_tokens_per_s"] = wandb.plot.line(t, "devices", "tokens_per_s", stroke="series",
                                                             title="tokens/s vs devices")
            logged["scaling_efficiency"] = wandb.plot.line(t, "devices", "efficiency", stroke="series",
                                                           title="scaling efficiency vs devices")
        ok = wandb.Table(columns=["run", "measured_model_states_MiB", "measured_step_time_s"],
                         data=[[r.label, (r.m("model_states_bytes") or 0) / 2**20, r.m("step_time_s")]
                               for r in study.ok_runs])
        if ok.data:
            logged["model_states_MiB"] = wandb.plot.bar(ok, "run", "measured_model_states_MiB",
                                                        title="model states per device (measured)")
            logged["step_time_s"] = wandb.plot.bar(ok, "run", "measured_step_time_s", title="step time (measured)")
        if html_path is not None:
            for key, path in png_paths(Path(html_path)).items():
                if path.exists():
                    logged[f"chart_{key}"] = wandb.Image(str(path))
        run.log(logged)
        fits = {f"fit/{s.name}/{k}": v for s in scaling.series(study) if s.fit
                for k, v in (("law", s.fit.law), ("serial_fraction", s.fit.serial_fraction),
                             ("rms_residual", s.fit.rms_residual))}
        counts = {s: sum(r.status == s for r in study.runs) for s in Status}
        run.summary.update({**fits, "n_runs": len(study.runs),
                            **{f"n_{k}": v for k, v in counts.items()},
                            "report_html": str(html_path) if html_path else None})
        where = str(Path(run.dir).parent)
        run.finish()
        # finish() can return before the W&B service has written the run file to disk (seen offline:
        # the file still 7 bytes long); teardown waits for the service, so the run is complete when
        # this returns and nothing is lost if the process exits next (the end of a sweep).
        wandb.teardown()
        return where
    except Exception as e:  # noqa: BLE001 - W&B must never fail a study or its report
        print(f"W&B summary logging failed ({type(e).__name__}: {e}); the records and the report are unaffected")
        return None
