"""Study views: every run measured beside predicted, scaling curves with Amdahl's fit, memory
breakdown, communication share by axis, and the runs that failed or were refused, with their reasons."""
from __future__ import annotations

from harness.report import charts, figures
from harness.report.blocks import notice, num_span, pair_cell, table
from harness.report.fmt import esc, nbytes, num, pct, rate, seconds
from harness.report.study import Study


def runs_table(study: Study) -> str:
    rows = []
    for r in study.runs:
        d = r.dims
        deg = " ".join(f"{a}{d[a]}" for a in ("dp", "tp", "pp", "vpp", "ep") if (d.get(a) or 1) > 1) or "1"
        rows.append([
            f'<td class="s-{esc(r.status)}">{esc(r.status)}</td>', esc(r.strategy), esc(r.engine), esc(deg),
            str(d.get("world_size", "-")),
            pair_cell(r.m("step_time_s"), r.p("step_time_s"), seconds, f"step-{r.run_id}"),
            pair_cell(r.m("tokens_per_s"), r.p("tokens_per_s"), rate, f"tokens-{r.run_id}"),
            pair_cell(r.m("mfu_pct"), r.p("mfu_pct"), pct, f"mfu-{r.run_id}"),
            pair_cell(r.m("model_states_bytes"), r.p("model_states_bytes"), nbytes, f"states-{r.run_id}"),
            pair_cell(r.m("comm_share_pct"), r.p("comm_share_pct"), pct, f"comm-{r.run_id}"),
            pair_cell(r.m("bubble_pct"), r.p("bubble_pct"), pct, f"bubble-{r.run_id}") if r.uses("pp")
            else "<td>-</td>",
            f'<td class="mono">{esc(r.run_id)}</td>'])
    return (table(["status", "strategy", "engine", "degrees", "world", "step time", "tokens/s", "MFU",
                   "model states/rank", "comm share", "bubble", "run id"], rows, "runs-table", 'id="runs-table"')
            + '<p class="small">Each cell: measured (median of the timed steps; memory: max over ranks), the cost '
              "model's prediction, and measured/predicted coloured: <span class='ratio r-good'>within 10%</span> "
              "<span class='ratio r-fair'>within 50%</span> <span class='ratio r-poor'>further</span>.</p>")


def scaling_view(study: Study, figs) -> tuple[str, dict | None]:
    series = charts.scaling_series(study)
    if not series:
        return notice("Scaling: not measured (needs ok runs at two or more device counts, e.g. single and ddp dp=2)."), None
    tput, eff = figures.scaling(series)
    f = series["fit_all"]
    if f is None:
        fit_txt = "Amdahl fit: needs a run on more than one device."
    elif f > 1:
        fit_txt = (f"Amdahl fit: f = {num_span(f'{f:.3f}', 'amdahl-f')}, above 1: the multi-device runs were slower "
                   "than one device (on a small CPU, ranks beyond the core count time-share), which Amdahl's law "
                   "cannot describe.")
    else:
        fit_txt = (f"Amdahl fit over all strategies: serial fraction f = {num_span(f'{f:.3f}', 'amdahl-f')}, so "
                   f"no number of devices can give more than {num(1 / f) if f > 0 else 'unbounded'}x "
                   f"(S(N) = 1 / (f + (1-f)/N)).")
    per = "; ".join(f"{esc(k)}: f = {v:.3f}" for k, v in series["fits"].items() if v is not None)
    html = ('<div class="grid2">' + figs.div(figures.to_json(tput), "scaling-tput")
            + figs.div(figures.to_json(eff), "scaling-eff") + "</div>"
            + f"<p>{fit_txt}" + (f" Per strategy: {per}." if per else "") + "</p>")
    return html, series


def memory_view(study: Study, figs) -> tuple[str, dict | None]:
    series = charts.memory_series(study)
    if not series:
        return notice("Memory breakdown: not measured."), None
    act = any(v is not None for v in series["measured"]["activations_bytes"])
    note = ("" if act else "<p class='small'>Activations: not measured (CPU runs count exact tensor bytes of model "
            "states only); the hatched bars show the cost model's activations.</p>")
    return figs.div(figures.to_json(figures.memory(series)), "memory") + note, series


def comm_view(study: Study, figs) -> tuple[str, dict | None]:
    series = charts.comm_series(study)
    if not series:
        return notice("Communication share by axis: not measured and not predicted for any run."), None
    measured_any = any(r["measured"] for r in series["rows"])
    note = "" if measured_any else "<p class='small'>Measured share: not measured in this study (predicted only).</p>"
    return figs.div(figures.to_json(figures.comm(series)), "comm") + note, series


def failures(study: Study) -> str:
    bad = study.not_ok
    if not bad:
        return "<p>Every run finished ok.</p>"
    rows = [[f'<td class="s-{esc(r.status)}">{esc(r.status)}</td>', esc(r.label), f'<td class="mono">{esc(r.run_id)}</td>',
             f'<td class="error">{esc(r.r.get("error") or "(no message)")}</td>'] for r in bad]
    return table(["status", "config", "run id", "reason"], rows, "failures-table", 'id="failures-table"')
