"""The report page: one HTML file with the DP / TP / PP / 3D mode switch on top and the study views
below. Its CSS and script are static files (harness/report/static/) copied inline; plotly.js (~4.7 MB)
is written once per results directory beside the pages (`plotly-<version>.min.js`) and loaded by a
relative path, so each page stays small and the directory opens with no network.

A section that cannot be drawn from the records it got shows its error in a `.report-error` box and
the rest of the page is still written: a report never hides the records behind one bad figure.
"""
from __future__ import annotations

import html
import json
import time
import traceback
from collections import Counter
from pathlib import Path

from harness.labels import esc
from harness.report import dp_mode, mesh_mode, pp_mode, tp_mode, views
from harness.report.blocks import Figures
from harness.report.study import Study, candidates
from harness.rundir import write_atomic

# Imports inside functions: plotly (only for a report).

MODES = (("dp", "DP", "data parallel", dp_mode), ("tp", "TP", "tensor parallel", tp_mode),
         ("pp", "PP", "pipeline parallel", pp_mode), ("mesh", "3D", "device mesh", mesh_mode))
STATIC = Path(__file__).resolve().parent / "static"


def plotly_js(out_dir: Path) -> str:
    """Write plotly.js into out_dir once (per version) and return its file name, for a relative <script src>."""
    import plotly.offline

    name = f"plotly-{plotly.offline.get_plotlyjs_version()}.min.js"
    path = Path(out_dir) / name
    if not path.exists():
        write_atomic(path, plotly.offline.get_plotlyjs())  # two studies ending together never share a file
    return name


def default_mode(study: Study) -> str:
    """The mode the page opens on: the one whose axis most of the study's runs use (first on a tie)."""
    counts = [len(candidates(study, key)) for key, *_ in MODES]
    return MODES[counts.index(max(counts))][0]


def _guard(name: str, fn, *args) -> str:
    """Render one section; on a bug, an error box instead of no report (the traceback says where)."""
    try:
        out = fn(*args)
        return out[0] if isinstance(out, tuple) else out
    except Exception as e:  # noqa: BLE001 - one broken section must not lose the rest of the page
        return (f'<div class="report-error" data-section="{esc(name)}">This section could not be drawn '
                f"({esc(type(e).__name__)}: {esc(e)}).\n{esc(traceback.format_exc(limit=4))}</div>")


def _header(study: Study) -> str:
    counts = Counter(r.status for r in study.runs)
    ex = study.example()
    env = (ex.r.get("env") or {}) if ex else {}
    hw = ex.cfg("hardware", "name", default="?") if ex else "?"
    models = sorted({str(r.cfg("model", "name")) for r in study.runs if r.cfg("model", "name")})
    status = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    return (f'<header><h1>brigade report: study <span id="study-name">{esc(study.name)}</span></h1>'
            f'<p class="meta">{len(study.runs)} configs ({esc(status)}); model {esc(", ".join(models) or "?")}; '
            f"hardware {esc(hw)}; torch {esc(env.get('torch', '?'))}; commit {esc((env.get('git_commit') or '?')[:10])}"
            f"; records: {esc(study.path)}</p></header>")


def build(study: Study, plotly_src: str) -> str:
    """The page; plotly_src is the script path plotly.js is loaded from (relative to the page)."""
    figs = Figures()
    nav = "".join(f'<button type="button" role="tab" data-mode="{key}" aria-selected="false" id="tab-{key}">'
                  f'{label}<span class="sub">{sub}</span></button>' for key, label, sub, _ in MODES)
    sections = "".join(f'<section class="mode-section" role="tabpanel" id="mode-{key}" data-mode="{key}" hidden>'
                       f"<h2>{label}: {sub}</h2>{_guard(key, mod.render, study, figs)}</section>"
                       for key, label, sub, mod in MODES)
    study_views = ('<div id="study-views">'
                   '<h2 id="runs">All runs: measured beside predicted</h2>' + _guard("runs", views.runs_table, study)
                   + '<h2 id="scaling">Scaling</h2>' + _guard("scaling", views.scaling_view, study, figs)
                   + '<h2 id="memory">Memory breakdown per device</h2>' + _guard("memory", views.memory_view, study, figs)
                   + '<h2 id="comm">Communication share by axis</h2>' + _guard("comm", views.comm_view, study, figs)
                   + '<h2 id="compute">Compute by kind of work</h2>' + _guard("compute", views.compute_view, study, figs)
                   + '<h2 id="failures">Failed and invalid runs</h2>' + _guard("failures", views.failures, study)
                   + "</div>")
    figures_json = "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in figs.items.items()) + "}"
    figures_json = figures_json.replace("</", "<\\/")  # never end the script element early
    generated = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>brigade report: {html.escape(study.name)}</title>"
            f"<style>{(STATIC / 'report.css').read_text()}</style>"
            f'<script src="{esc(plotly_src)}"></script></head><body data-default-mode="{default_mode(study)}">'
            + _header(study) + f'<nav class="modes" role="tablist">{nav}</nav><main>{sections}{study_views}</main>'
            f"<footer>Written by <code>python -m harness.report {esc(study.path)}</code> at {esc(generated)}. "
            f"Needs only {esc(plotly_src)} beside it: no network.</footer>"
            f'<script type="application/json" id="report-figures">{figures_json}</script>'
            f"<script>{(STATIC / 'report.js').read_text()}</script></body></html>")
