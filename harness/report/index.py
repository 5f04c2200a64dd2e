"""The index across studies: `python -m harness.report --index [results_dir]` -> <results_dir>/index.html.

Every study in the directory (each <study>.jsonl), in time order, on one page:

    studies     date, commit, environment fingerprint, status counts, a link to the study's own report
    scaling     one chart per model x series, one line per study (tokens/s against devices, 95 % bars):
                commit against commit, cluster against cluster on one chart
    history     each config's tokens/s across the studies that ran it, in time order, with 95 % bars;
                a regression between two consecutive studies is flagged as `harness.compare` flags it

Configs are matched across studies by run_id and summarised from their repeats, as everywhere
(harness/collect/aggregate.py). The page uses the study reports' stylesheet, script and plotly.js file
beside it (no network); it is rewritten at the end of every study (harness/run/sweep.py).
"""
from __future__ import annotations

import html
import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import plotly.graph_objects as go

from harness.collect import aggregate
from harness.compare import DEFAULT_THRESHOLD_PCT, compare_configs
from harness.labels import base_label, ci_text, esc, labels, rate
from harness.report import figures
from harness.report.blocks import Figures, table
from harness.report.charts import STRATEGY_COLOURS
from harness.report.page import STATIC, plotly_js
from harness.run import results_file
from harness.run.record import Status
from harness.rundir import write_atomic

INDEX = "index.html"


@dataclass
class StudyEntry:
    name: str
    path: Path
    records: list[dict]  # the latest record of each (run_id, repeat)
    by_config: dict[str, list[dict]]  # run_id -> its repeats
    configs: dict[str, dict]  # run_id -> the config's record (repeats pooled)

    @property
    def started(self) -> str:
        return min((r.get("created_at") or "" for r in self.records), default="")

    @property
    def env(self) -> dict:
        ok = [r for r in self.records if r.get("status") == Status.OK] or self.records
        return ok[-1].get("env") or {}

    def report(self) -> str | None:
        """The study's own report, relative to the index, when it exists."""
        page = self.path.with_suffix(".html")
        return page.name if page.exists() else None


def load_studies(results_dir: Path) -> list[StudyEntry]:
    """Every <study>.jsonl of results_dir with at least one record, oldest first."""
    out = []
    for path in sorted(Path(results_dir).glob("*.jsonl")):
        records = aggregate.latest(results_file.read(path))
        if records:
            by = aggregate.by_config(records)
            out.append(StudyEntry(path.stem, path, records, by, {k: aggregate.config_record(v) for k, v in by.items()}))
    return sorted(out, key=lambda s: (s.started, s.name))


def _env_text(env: dict) -> str:
    gpus = env.get("gpus") or {}
    devices = ", ".join(f"{v.get('gpu_count')}x {v.get('gpu_name')}" for v in gpus.values() if v.get("gpu_name"))
    parts = [f"torch {env.get('torch')}", f"CUDA {env.get('cuda')}" if env.get("cuda") else "no CUDA",
             f"NCCL {env.get('nccl')}" if env.get("nccl") else "", f"driver {env.get('driver')}" if env.get("driver") else "",
             devices or (env.get("device_name") or ""), f"{env.get('num_nodes') or 1} node(s)",
             f"cluster {env.get('cluster')}" if env.get("cluster") else ""]
    return "; ".join(p for p in parts if p)


def studies_table(studies: list[StudyEntry]) -> str:
    rows = []
    for s in studies:
        env = s.env
        counts = Counter(r.get("status") for r in s.records)
        link = s.report()
        name = f'<a href="{esc(link)}">{esc(s.name)}</a>' if link else esc(s.name)
        reps = max((len(v) for v in s.by_config.values()), default=1)
        commit = (env.get("git_commit") or "?")[:10] + (" (dirty)" if env.get("git_dirty") else "")
        rows.append([name, esc(s.started[:16].replace("T", " ")), f'<span class="mono">{esc(commit)}</span>',
                     esc(_env_text(env)), esc(", ".join(f"{v} {k}" for k, v in sorted(counts.items()))),
                     str(len(s.configs)), str(reps)])
    return table(["study", "started", "commit", "environment", "records", "configs", "repeats"], rows,
                 "runs-table", 'id="studies-table"')


def _tput(r: dict) -> tuple[float, float, float] | None:
    """(tokens/s, 95 % lo, hi) of an ok config record, None otherwise (an interval-less record: its figure)."""
    m = r.get("measured") or {}
    if r.get("status") != Status.OK or not m.get("tokens_per_s"):
        return None
    lo, hi = m.get("tokens_per_s_ci95") or (m["tokens_per_s"], m["tokens_per_s"])
    return m["tokens_per_s"], lo, hi


def _bars(points: list[tuple[float, float, float]]) -> dict:
    return dict(type="data", symmetric=False, array=[round(h - y, 1) for y, _, h in points],
                arrayminus=[round(y - lo, 1) for y, lo, _ in points], thickness=1)


def scaling_charts(studies: list[StudyEntry], figs: Figures) -> str:
    """One chart per model x series; one line per study: at each device count its fastest config."""
    groups: dict[tuple[str, str], dict[str, dict[int, tuple]]] = {}
    for s in studies:
        for r in s.configs.values():
            t, world = _tput(r), (r.get("dims") or {}).get("world_size")
            if t is None or not world:
                continue
            cfg = r.get("config") or {}
            key = (str((cfg.get("model") or {}).get("name")), str(cfg.get("series") or ""))
            line = groups.setdefault(key, {}).setdefault(s.name, {})
            if world not in line or t[0] > line[world][0][0]:
                line[world] = (t, base_label(r))
    out = []
    for (model, series), lines in sorted(groups.items()):
        fig = go.Figure()
        for i, (study, pts) in enumerate(lines.items()):
            xs = sorted(pts)
            vals = [pts[n][0] for n in xs]
            fig.add_trace(go.Scatter(x=xs, y=[round(v[0], 1) for v in vals], mode="lines+markers", name=study,
                                     error_y=_bars(vals), text=[pts[n][1] for n in xs],
                                     line=dict(color=STRATEGY_COLOURS[i % len(STRATEGY_COLOURS)]),
                                     hovertemplate=f"{esc(study)}: %{{text}}<br>%{{y:.0f}} tokens/s<extra></extra>"))
        fig.update_layout(**figures.LAYOUT, title=f"{model}, series {series or '(none)'}: tokens/s vs devices",
                          xaxis_title="devices (world size)", yaxis_title="tokens/s (95% interval)")
        fig.update_xaxes(dtick=1)
        out.append(figs.div(figures.to_json(fig), "index-scaling"))
    return "".join(out) or '<p class="notice">No ok run yet.</p>'


@dataclass
class Regression:
    label: str
    run_id: str
    before: str  # study names
    after: str
    ratio: tuple[float, float, float]


def history(studies: list[StudyEntry], figs: Figures, threshold_pct: float) -> tuple[str, list[Regression]]:
    """Each config's tokens/s across the studies that ran it (time order), one chart per model; each
    consecutive pair compared as `harness.compare` compares them, slower ones flagged."""
    order = [s.name for s in studies]
    # a config across studies: matched as `harness.compare` matches it, a run slowed on purpose with the
    # clean config it slows (aggregate.compared_id); in each study, that config's run_id
    per_config: dict[str, list[StudyEntry]] = {}
    in_study: dict[tuple[str, str], str] = {}
    for s in studies:
        for rid, r in s.configs.items():
            key = aggregate.compared_id(r)
            if (s.name, key) not in in_study or rid == key:  # a study that ran both: its clean config
                in_study[s.name, key] = rid
        for key in dict.fromkeys(aggregate.compared_id(r) for r in s.configs.values()):
            per_config.setdefault(key, []).append(s)
    regressions: list[Regression] = []
    by_model: dict[str, go.Figure] = {}
    # configs named by what sets them apart across every study (harness/labels.py)
    names = dict(zip(per_config, labels([seen[-1].configs[in_study[seen[-1].name, key]]
                                         for key, seen in per_config.items()])))
    for i, (key, seen) in enumerate(per_config.items()):
        pts = [(s, _tput(s.configs[in_study[s.name, key]])) for s in seen]
        pts = [(s, t) for s, t in pts if t is not None]
        if not pts:
            continue
        r = pts[-1][0].configs[in_study[pts[-1][0].name, key]]
        label = names[key]
        model = str(((r.get("config") or {}).get("model") or {}).get("name"))
        fig = by_model.setdefault(model, go.Figure())
        colour = STRATEGY_COLOURS[i % len(STRATEGY_COLOURS)]
        fig.add_trace(go.Scatter(x=[s.name for s, _ in pts], y=[round(t[0], 1) for _, t in pts],
                                 mode="lines+markers", name=label, error_y=_bars([t for _, t in pts]),
                                 line=dict(color=colour), legendgroup=key,
                                 hovertemplate=f"{esc(label)}<br>%{{x}}: %{{y:.0f}} tokens/s<extra></extra>"))
        flagged = []
        for (a, _), (b, tb) in zip(pts, pts[1:]):
            ia, ib = in_study[a.name, key], in_study[b.name, key]
            row = compare_configs({ia: a.by_config[ia]}, {ib: b.by_config[ib]}, threshold_pct)[0]
            if row.verdict == "slower":
                regressions.append(Regression(label, ib, a.name, b.name, row.ratio))
                flagged.append((b.name, tb[0]))
        if flagged:
            fig.add_trace(go.Scatter(x=[x for x, _ in flagged], y=[round(y, 1) for _, y in flagged], mode="markers",
                                     name=f"regression: {label}", legendgroup=key,
                                     marker=dict(symbol="x", size=16, color="#d62728", line=dict(width=2)),
                                     hovertemplate="regression (slower beyond the threshold)<extra></extra>"))
    out = []
    for model, fig in sorted(by_model.items()):
        fig.update_layout(**figures.LAYOUT, title=f"{model}: each config's tokens/s across studies (time order)",
                          xaxis_title="study", yaxis_title="tokens/s (95% interval)")
        fig.update_xaxes(categoryorder="array", categoryarray=order, type="category")
        out.append(figs.div(figures.to_json(fig), "index-history"))
    rows = [[esc(g.label), f'<span class="mono">{esc(g.run_id)}</span>', esc(g.before), esc(g.after),
             f"{g.ratio[0]:.3f}", f"{g.ratio[1]:.3f}-{g.ratio[2]:.3f}"] for g in regressions]
    flags = (table(["config", "run id", "before", "after", "tokens/s after/before", "95% interval"], rows,
                   "runs-table", 'id="regressions"') if rows else
             '<p id="regressions" class="notice">No regression between consecutive studies.</p>')
    return "".join(out) + f"<h3>Regressions (threshold {threshold_pct:g} %)</h3>" + flags, regressions


def latest_table(studies: list[StudyEntry]) -> str:
    """Each config's figure in each study, as numbers (what the history chart draws)."""
    rows = []
    for s in studies:
        for rid, r in s.configs.items():
            t = _tput(r)
            rows.append([esc(s.name), esc(base_label(r)), f'<span class="mono">{esc(rid)}</span>', esc(r.get("status")),
                         esc(rate(t[0]) if t else "-"), esc(ci_text(t[1:] if t else None)), str(r.get("repeats", 1))])
    return table(["study", "config", "run id", "status", "tokens/s", "95% interval", "repeats"], rows, "runs-table",
                 'id="configs-table"')


def build(studies: list[StudyEntry], plotly_src: str, results_dir: Path,
          threshold_pct: float = DEFAULT_THRESHOLD_PCT) -> str:
    figs = Figures()
    hist, regressions = history(studies, figs, threshold_pct)
    body = ("<h2 id='studies'>Studies</h2>" + studies_table(studies)
            + "<h2 id='scaling'>Scaling across studies</h2>" + scaling_charts(studies, figs)
            + "<h2 id='history'>Each config across studies</h2>" + hist
            + "<h2 id='configs'>Every config in every study</h2>" + latest_table(studies))
    figures_json = "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in figs.items.items()) + "}"
    figures_json = figures_json.replace("</", "<\\/")
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>brigade index: {html.escape(str(results_dir))}</title>"
            f"<style>{(STATIC / 'report.css').read_text()}</style>"
            f'<script src="{esc(plotly_src)}"></script></head><body>'
            f'<header><h1>brigade index: {len(studies)} studies in {esc(results_dir)}</h1>'
            f'<p class="meta" id="regression-count">{len(regressions)} regression(s) flagged</p></header>'
            f'<main><div id="study-views">{body}</div></main>'
            f"<footer>Written by <code>python -m harness.report --index {esc(results_dir)}</code> at "
            f"{esc(time.strftime('%Y-%m-%d %H:%M:%S %Z'))}. Needs only {esc(plotly_src)} beside it: no network.</footer>"
            f'<script type="application/json" id="report-figures">{figures_json}</script>'
            f"<script>{(STATIC / 'report.js').read_text()}</script></body></html>")


def write_index(results_dir: str | Path) -> Path:
    results_dir = Path(results_dir)
    path = results_dir / INDEX
    write_atomic(path, build(load_studies(results_dir), plotly_js(results_dir), results_dir))
    return path
