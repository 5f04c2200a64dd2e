"""The report page: one self-contained HTML file (plotly.js, CSS and the page's script inline; it opens
with no network), with the DP / TP / PP / 3D mode switch on top and the study views below.

A section that cannot be drawn from the records it got shows its error in a `.report-error` box and
the rest of the page is still written: a report never hides the records behind one bad figure.
"""
from __future__ import annotations

import html
import json
import time
import traceback
from collections import Counter

from harness.report import dp_mode, mesh_mode, pp_mode, tp_mode, views
from harness.report.blocks import Figures
from harness.report.fmt import esc
from harness.report.study import Study

MODES = (("dp", "DP", "data parallel", dp_mode), ("tp", "TP", "tensor parallel", tp_mode),
         ("pp", "PP", "pipeline parallel", pp_mode), ("mesh", "3D", "device mesh", mesh_mode))

CSS = """
:root { --fg:#1d232b; --muted:#5b6470; --line:#dde2e8; --bg:#f7f8fa; --accent:#2f6db5; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif; color:var(--fg); background:var(--bg); }
header { padding:18px 28px 8px; background:#fff; border-bottom:1px solid var(--line); }
header h1 { margin:0 0 4px; font-size:22px; }
header .meta { color:var(--muted); margin:0; }
main { padding:10px 28px 40px; max-width:1500px; }
h2 { margin:28px 0 8px; font-size:19px; border-bottom:2px solid var(--line); padding-bottom:4px; scroll-margin-top:64px; }
h3 { margin:16px 0 6px; font-size:16px; } h4 { margin:18px 0 6px; font-size:14px; }
nav.modes { position:sticky; top:0; z-index:10; display:flex; gap:6px; padding:10px 28px; background:#fff;
  border-bottom:1px solid var(--line); }
nav.modes button { font:inherit; font-weight:600; padding:7px 16px; border:1px solid var(--line); border-radius:18px;
  background:#fff; cursor:pointer; }
nav.modes button[aria-selected="true"] { background:var(--accent); color:#fff; border-color:var(--accent); }
nav.modes .sub { font-weight:400; opacity:.8; margin-left:4px; }
.mode-section { background:#fff; border:1px solid var(--line); border-radius:8px; padding:4px 18px 16px; margin-top:14px; }
.mode-section[hidden] { display:none; }
.explain { background:#f1f6fc; border-left:4px solid var(--accent); padding:4px 14px; margin:8px 0 12px; max-width:1100px; }
.explain p { margin:6px 0; }
.notice { background:#fff8e6; border:1px solid #f0d48a; border-radius:6px; padding:6px 14px; margin:10px 0; }
.notice p { margin:6px 0; }
pre.cmd { background:#1d232b; color:#e8eef5; padding:8px 12px; border-radius:6px; overflow-x:auto; }
.report-error { background:#fdecea; border:1px solid #e15759; border-radius:6px; padding:8px 14px; white-space:pre-wrap; }
table { border-collapse:collapse; margin:8px 0; background:#fff; }
th, td { border:1px solid var(--line); padding:4px 8px; text-align:left; vertical-align:top; }
th { background:#eef1f5; font-weight:600; }
td.pair { white-space:nowrap; }
td.pair .meas { font-weight:600; display:block; }
td.pair .pred { color:var(--muted); font-size:12px; display:block; }
.ratio { display:inline-block; font-size:11px; padding:0 5px; border-radius:8px; margin-top:2px; }
.r-good { background:#d9f2dc; color:#1f6b2a; } .r-fair { background:#fcefc7; color:#7a5b00; }
.r-poor { background:#fbd9d7; color:#9a1c14; } .r-none { color:var(--muted); }
.s-ok { color:#1f6b2a; font-weight:600; } .s-invalid { color:#7a5b00; font-weight:600; }
.s-failed, .s-timeout, .s-oom { color:#9a1c14; font-weight:600; }
.status { font-size:12px; font-weight:600; margin-left:6px; }
td.error { font-family:ui-monospace,Menlo,monospace; font-size:12px; max-width:900px; white-space:pre-wrap; word-break:break-word; }
.mono { font-family:ui-monospace,Menlo,monospace; font-size:12px; }
.small { color:var(--muted); font-size:12px; }
.num { color:#12355b; }
.grid2, .gantt-grid { display:grid; grid-template-columns:repeat(auto-fit, minmax(520px, 1fr)); gap:12px; }
.plot { min-height:260px; background:#fff; }
.scroll { overflow-x:auto; }
svg.tp-block, svg.mesh, svg.zero, svg.ring { max-width:100%; height:auto; }
.ring-widget, .zero-widget, .mesh-widget { margin:10px 0; }
.ring-controls, .zero-buttons, .mesh-buttons { display:flex; gap:6px; align-items:center; margin:6px 0; flex-wrap:wrap; }
.ring-controls button, .zero-buttons button, .mesh-buttons button { font:inherit; padding:3px 10px; border:1px solid var(--line);
  border-radius:4px; background:#fff; cursor:pointer; }
.zero-buttons button.active, .mesh-buttons button.active { background:var(--accent); color:#fff; border-color:var(--accent); }
.ring-caption { margin-left:10px; color:var(--fg); }
.zero-table td.current { font-weight:700; background:#eef5ff; }
.picker { display:inline-block; margin:10px 0 0; font-weight:600; }
.picker select { font:inherit; margin-left:6px; }
dl.kv { display:grid; grid-template-columns:max-content auto; gap:2px 14px; }
dl.kv dt { color:var(--muted); } dl.kv dd { margin:0; }
footer { color:var(--muted); font-size:12px; padding:10px 28px 30px; }
"""

SCRIPT = r"""
(function () {
  "use strict";
  var FIGS = JSON.parse(document.getElementById("report-figures").textContent);
  var PALETTE = ["#4e79a7","#f28e2b","#59a14f","#e15759","#76b7b2","#edc948","#b07aa1","#ff9da7","#9c755f","#bab0ac"];

  function visible(el) { return !!(el.offsetWidth || el.offsetHeight || el.getClientRects().length); }
  function renderPlots(root) {
    (root || document).querySelectorAll(".plot[data-fig]").forEach(function (el) {
      if (el.dataset.rendered || !visible(el)) return;
      var fig = FIGS[el.dataset.fig];
      if (!fig) return;
      el.dataset.rendered = "1";
      Plotly.newPlot(el, fig.data, fig.layout, {displaylogo: false, responsive: true});
    });
  }

  // -- the mode switch ----------------------------------------------------------------------------------
  var tabs = document.querySelectorAll("nav.modes button[data-mode]");
  function showMode(mode) {
    tabs.forEach(function (t) { t.setAttribute("aria-selected", t.dataset.mode === mode ? "true" : "false"); });
    document.querySelectorAll(".mode-section").forEach(function (s) { s.hidden = s.dataset.mode !== mode; });
    renderPlots(document.getElementById("mode-" + mode));
    if (history.replaceState) history.replaceState(null, "", "#" + mode);
  }
  tabs.forEach(function (t) { t.addEventListener("click", function () { showMode(t.dataset.mode); }); });

  // -- run pickers (a mode with several candidate configs) ------------------------------------------------
  document.querySelectorAll("select.run-select").forEach(function (sel) {
    sel.addEventListener("change", function () {
      var scope = sel.closest(".mode-section") || document;
      scope.querySelectorAll('.run-panel[data-mode="' + sel.dataset.mode + '"]').forEach(function (p) {
        p.hidden = p.dataset.index !== sel.value;
      });
      renderPlots(scope);
    });
  });

  // -- ring all-reduce step-through -----------------------------------------------------------------------
  document.querySelectorAll(".ring-widget").forEach(function (w) {
    var steps = JSON.parse(w.dataset.steps), n = parseInt(w.dataset.n, 10), id = w.id, k = 0, timer = null;
    var caption = w.querySelector(".ring-caption");
    function draw() {
      var st = steps[k];
      for (var i = 0; i < n; i++) for (var c = 0; c < n; c++) {
        var cell = document.getElementById(id + "-cell-" + i + "-" + c);
        var v = st.state[i][c];
        cell.setAttribute("fill-opacity", n > 1 ? (0.15 + 0.85 * (v - 1) / (n - 1)).toFixed(3) : "1");
        cell.setAttribute("stroke-width", v === n ? "1.6" : "0.4");
      }
      for (var e = 0; e < n; e++) {
        var edge = document.getElementById(id + "-edge-" + e), label = document.getElementById(id + "-edge-label-" + e);
        if (!edge) continue;
        edge.setAttribute("stroke", "#bbb"); edge.setAttribute("stroke-width", "2"); label.textContent = "";
      }
      st.sends.forEach(function (s) {
        var edge = document.getElementById(id + "-edge-" + s[0]), label = document.getElementById(id + "-edge-label-" + s[0]);
        if (!edge) return;
        edge.setAttribute("stroke", PALETTE[s[2] % 10]); edge.setAttribute("stroke-width", "4");
        label.textContent = "chunk " + s[2];
      });
      var total = n - 1, text;
      if (st.phase === "start") text = "start: every rank holds its own gradient, cut into " + n + " chunks of " + w.dataset.chunk + ".";
      else if (st.phase === "reduce-scatter") text = "reduce-scatter step " + (st.k + 1) + " of " + total +
        ": each rank sends one chunk (" + w.dataset.chunk + ") to its right neighbour, which adds it to its own.";
      else text = "all-gather step " + (st.k + 1) + " of " + total +
        ": each rank forwards a fully summed chunk (" + w.dataset.chunk + "); the receiver overwrites its copy.";
      if (k === steps.length - 1 && n > 1) text += " Done: every rank holds the sum of all " + n + " gradients.";
      caption.textContent = "[" + k + "/" + (steps.length - 1) + "] " + text;
      w.dataset.step = String(k);
    }
    function stop() { if (timer) { clearInterval(timer); timer = null; w.querySelector(".ring-play").textContent = "play"; } }
    w.querySelector(".ring-next").addEventListener("click", function () { stop(); k = Math.min(k + 1, steps.length - 1); draw(); });
    w.querySelector(".ring-prev").addEventListener("click", function () { stop(); k = Math.max(k - 1, 0); draw(); });
    w.querySelector(".ring-play").addEventListener("click", function () {
      if (timer) { stop(); return; }
      if (k === steps.length - 1) k = 0;
      this.textContent = "pause";
      timer = setInterval(function () { if (k >= steps.length - 1) { stop(); return; } k++; draw(); }, 900);
      draw();
    });
    draw();
  });

  // -- what ZeRO shards ---------------------------------------------------------------------------------
  document.querySelectorAll(".zero-widget").forEach(function (w) {
    w.querySelectorAll(".zero-btn").forEach(function (b) {
      b.addEventListener("click", function () {
        w.querySelectorAll(".zero-btn").forEach(function (x) { x.classList.toggle("active", x === b); });
        w.querySelectorAll(".zero-stage").forEach(function (g) { g.style.display = g.dataset.stage === b.dataset.stage ? "" : "none"; });
      });
    });
  });

  // -- device mesh: colour ranks by node or by their group on one axis ----------------------------------------
  document.querySelectorAll(".mesh-widget").forEach(function (w) {
    function colour(axis) {
      w.querySelectorAll(".mesh-rank").forEach(function (g) {
        var rect = g.querySelector("rect");
        var key = axis === "node" ? g.dataset.node : g.getAttribute("data-group-" + axis);
        if (axis === "node") rect.setAttribute("fill", parseInt(key, 10) % 2 ? "#e3e9f2" : "#f4f4f4");
        else rect.setAttribute("fill", key === null ? "#fff" : PALETTE[parseInt(key, 10) % 10]);
        rect.setAttribute("fill-opacity", axis === "node" ? "1" : "0.55");
      });
      w.dataset.axis = axis;
    }
    w.querySelectorAll(".mesh-btn").forEach(function (b) {
      b.addEventListener("click", function () {
        w.querySelectorAll(".mesh-btn").forEach(function (x) { x.classList.toggle("active", x === b); });
        colour(b.dataset.axis);
      });
    });
  });

  var first = (location.hash || "").replace("#", "");
  showMode(["dp", "tp", "pp", "mesh"].indexOf(first) >= 0 ? first : "dp");
  renderPlots(document.getElementById("study-views"));
  document.body.dataset.ready = "1";
})();
"""


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


def build(study: Study) -> str:
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
                   + '<h2 id="failures">Failed and invalid runs</h2>' + _guard("failures", views.failures, study)
                   + "</div>")
    figures_json = "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in figs.items.items()) + "}"
    figures_json = figures_json.replace("</", "<\\/")  # never end the script element early
    import plotly.offline

    generated = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>brigade report: {html.escape(study.name)}</title><style>{CSS}</style>"
            f"<script>{plotly.offline.get_plotlyjs()}</script></head><body>"
            + _header(study) + f'<nav class="modes" role="tablist">{nav}</nav><main>{sections}{study_views}</main>'
            f"<footer>Written by <code>python -m harness.report {esc(study.path)}</code> at {esc(generated)}. "
            "Self-contained: no network needed.</footer>"
            f'<script type="application/json" id="report-figures">{figures_json}</script>'
            f"<script>{SCRIPT}</script></body></html>")
