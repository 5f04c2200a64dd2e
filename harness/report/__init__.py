"""The study report: an HTML visual explainer of the configs a study ran, plus PNGs.

    python -m harness.report results/<study>.jsonl      -> results/<study>.html (+ results/<study>_*.png)

The page (harness/report/page.py) has a mode switch, each mode drawn for a run of the study that
uses it, with a plain-language explanation computed from that run's numbers:

    DP   ring all-reduce step by step (ring.py), bytes per rank per step, what ZeRO-1/2/3 shard
    TP   one block's matrices split by columns / rows over tp ranks, where the collectives run
    PP   Gantt chart predicted by a schedule simulator (schedule.py) beside the measured timeline
    3D   the device mesh (ParallelDims placement), groups per axis, which cross nodes

and the study views: every run measured beside predicted (ratio coloured), scaling with an Amdahl fit
(scaling.py), memory breakdown, communication share by axis, failed runs with their reasons.
Records come from several producers (cost model, strategies, measurement); any figure a record lacks
reads "not measured" / "not predicted", never an error. The same summary can go to W&B
(wandb_summary.py). Charts: plotly (page), matplotlib (PNGs); only the schematics are hand-drawn SVG.
"""
from __future__ import annotations

from pathlib import Path

from harness import catalog
from harness.rundir import write_atomic

# Imports inside functions: harness.report, harness.report.study, which would make an import cycle at the top.


def png_paths(html_path: Path) -> dict[str, Path]:
    stem = html_path.with_suffix("")
    return {k: Path(f"{stem}_{k}.png") for k in ("scaling", "memory", "comm", "pipeline")}


def write_pngs(study, html_path: Path) -> dict[str, Path]:
    """The key charts as PNG next to the HTML; only those the study has data for."""
    from harness.report import charts, png, pp_mode
    from harness.report.study import candidates

    paths = png_paths(html_path)
    out = {}
    for key, fn, series in (("scaling", png.scaling, charts.scaling_series(study)),
                            ("memory", png.memory, charts.memory_series(study)),
                            ("comm", png.comm, charts.comm_series(study))):
        if fn(series, paths[key]):
            out[key] = paths[key]
    pp_runs = candidates(study, "pp")
    if pp_runs:
        run = pp_runs[0]
        d = run.dims
        sched = run.cfg("strategy", "schedule", default=catalog.DEFAULT_SCHEDULE)
        try:
            _, pred = pp_mode.predicted_series(sched, d["pp"], d.get("vpp", 1), run.num_microbatches or 1)
        except (ValueError, AssertionError):
            pred = None
        timelines = run.timelines()
        meas = charts.measured_gantt(timelines) if timelines else None
        titles = (f"predicted {sched}, {run.label}", f"measured {run.label}")
    else:
        sched, p, v, m = pp_mode.ILLUSTRATION[0]
        _, pred = pp_mode.predicted_series(sched, p, v, m)
        meas, titles = None, (f"predicted {sched}, p={p}, m={m} (illustration: no pipeline run in the study)", "")
    if png.pipeline(pred, meas, titles, paths["pipeline"]):
        out["pipeline"] = paths["pipeline"]
    for key, path in paths.items():  # a chart this study has no data for: no stale file from an earlier run
        if key not in out:
            path.unlink(missing_ok=True)
    return out


def write_report(records_path: str | Path, out_path: str | Path | None = None, pngs: bool = True,
                 run_ids: set[str] | None = None, name: str | None = None) -> Path:
    """Read a study's records and write its HTML report (and PNGs); returns the HTML path.
    run_ids / name: only those runs, titled `name` (one invocation's ad-hoc runs: harness/run/sweep.py)."""
    from harness.report import page
    from harness.report.study import load

    records_path = Path(records_path)
    study = load(records_path, run_ids, name)
    html_path = Path(out_path) if out_path else records_path.with_suffix(".html")
    html_path.parent.mkdir(parents=True, exist_ok=True)
    # a reader never sees half a page, and two writers (SLURM array jobs ending together) never share a file
    write_atomic(html_path, page.build(study, page.plotly_js(html_path.parent)))
    if pngs:
        write_pngs(study, html_path)
    return html_path
