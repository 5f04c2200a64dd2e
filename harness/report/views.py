"""Study views: every run measured beside predicted, scaling curves with Amdahl's fit, memory
breakdown, communication share by axis, and the runs that failed or were refused, with their reasons."""
from __future__ import annotations

from harness.labels import ci_text, esc, nbytes, num, pct, rate, seconds
from harness.report import charts, figures
from harness.report.blocks import notice, num_span, pair_cell, table
from harness.report.study import Study


def runs_table(study: Study) -> str:
    rows = []
    for r in study.runs:
        d = r.dims
        rows.append([
            f'<td class="s-{esc(r.status)}">{esc(r.status)}</td>', esc(r.strategy), esc(r.engine), esc(r.degrees),
            str(d.get("world_size", "-")),
            pair_cell(r.m("step_time_s"), r.p("step_time_s"), seconds, f"step-{r.run_id}"),
            pair_cell(r.m("tokens_per_s"), r.p("tokens_per_s"), rate, f"tokens-{r.run_id}"),
            f'<td class="num">{esc(ci_text(r.ci("tokens_per_s")))}</td><td class="num">{r.repeats}</td>',
            pair_cell(r.m("mfu_pct"), r.p("mfu_pct"), pct, f"mfu-{r.run_id}", r.measured.get("mfu_warning")),
            pair_cell(r.m("model_states_bytes"), r.p("model_states_bytes"), nbytes, f"states-{r.run_id}"),
            pair_cell(r.m("comm_share_pct"), r.p("comm_share_pct"), pct, f"comm-{r.run_id}"),
            pair_cell(r.m("bubble_pct"), r.p("bubble_pct"), pct, f"bubble-{r.run_id}") if r.uses("pp")
            else "<td>-</td>",
            f'<td class="mono">{esc(r.run_id)}</td>'])
    return (table(["status", "strategy", "engine", "degrees", "world", "step time", "tokens/s", "tokens/s 95% CI",
                   "repeats", "MFU",
                   "model states/rank", "comm share", "bubble", "run id"], rows, "runs-table", 'id="runs-table"')
            + '<p class="small">Each cell: measured (median of the timed steps, pooled over '
              "the config's repeats; memory: max over ranks), the cost model's prediction, and measured/predicted "
              "coloured: <span class='ratio r-good'>within 10%</span> "
              "<span class='ratio r-fair'>within 50%</span> <span class='ratio r-poor'>further</span>. The 95% interval "
              "of tokens/s is a bootstrap of the median over steps (and over repeats, when there are several).</p>")


def scaling_view(study: Study, figs) -> tuple[str, dict | None]:
    series = charts.scaling_series(study)
    if not series:
        return notice("Scaling: not measured (needs ok runs of one series at two or more device counts, e.g. "
                      "single and ddp dp=2)."), None
    tput, eff = figures.scaling(series)
    rows = []
    for s in series["series"]:
        for i, n in enumerate(s["devices"]):
            kf = s["karp_flatt"][i]
            rows.append([esc(s["name"]), esc(s["kind"]), esc(s["labels"][i]), str(n), esc(rate(s["tokens_per_s"][i])),
                         f"{s['speedup'][i]:.2f}x", esc(pct(100 * s["efficiency"][i])),
                         "-" if kf is None else f"{kf:.3f}"])
    html = ('<div class="grid2">' + figs.div(figures.to_json(tput), "scaling-tput")
            + figs.div(figures.to_json(eff), "scaling-eff") + "</div>"
            + table(["series", "kind", "run", "devices", "tokens/s", "speed-up", "efficiency", "Karp-Flatt e"],
                    rows, "scaling-table", 'id="scaling-table"')
            + "<ul>" + "".join(f"<li>{_fit_sentence(s)}</li>" for s in series["series"]) + "</ul>"
            + '<p class="small">Speed-up S = tokens/s over the series\' smallest run\'s tokens/s per device; '
              "efficiency S/N. Strong scaling (same global batch): Amdahl S(N) = 1 / (f + (1-f)/N); the "
              "Karp-Flatt metric e = (1/S - 1/N) / (1 - 1/N) is the serial fraction each point implies (rising "
              "e with N: overhead that grows with N, not a fixed serial part). Weak scaling (same batch per "
              "device): Gustafson S(N) = N - f (N-1). Fits need 3 device counts; the residual is the RMS of "
              "measured minus fitted speed-up.</p>")
    return html, series


def _fit_sentence(s: dict) -> str:
    name = f"<b>{esc(s['name'])}</b> ({esc(s['kind'])} scaling, baseline {esc(s['baseline_label'])})"
    f = s["fit"]
    if s["kind"] == "mixed":
        return f"{name}: neither the global batch nor the batch per device is the same in all its runs; no law fitted."
    if f is None:
        return f"{name}: {len(s['devices'])} device counts; a fit needs 3."
    fv, res = f["serial_fraction"], f["rms_residual"]
    txt = (f"{name}: {f['law']} fit over {f['n_points']} points, serial fraction "
           f"f = {num_span(f'{fv:.3f}', 'fit-' + s['name'])}, residual {res:.3f}x RMS")
    if fv > 1 or fv < 0:
        return txt + (": outside 0-1, the runs did not scale the way the law assumes (slower with more devices: "
                      "on a small CPU, ranks beyond the core count time-share).")
    if f["law"] == "Amdahl":
        return txt + f"; no number of devices can give more than {num(1 / fv) if fv > 0 else 'unbounded'}x."
    return txt + f"; each added device adds {num(1 - fv)} of a device's work."


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


def compute_view(study: Study, figs) -> tuple[str, dict | None]:
    series = charts.compute_series(study)
    if not series:
        return notice("Compute by kind of work: not measured and not predicted for any run."), None
    rows = [[esc(r["label"]), esc(seconds(r["measured_s"])), esc(seconds(r["predicted_s"])),
             *(esc(f"{pct((r['measured'] or {}).get(k))} / {pct((r['predicted'] or {}).get(k))}") for k in series["kinds"])]
            for r in series["rows"]]
    note = ("" if any(r["measured"] for r in series["rows"]) else
            "<p class='small'>Measured split: no profiled run in this study (<code>workload.profile_steps</code> "
            "&gt; 0 records it); predicted only.</p>")
    return (figs.div(figures.to_json(figures.compute(series)), "compute")
            + table(["config", "compute measured", "compute predicted", *(f"{k} % meas / pred" for k in series["kinds"])],
                    rows, "compute-table", 'id="compute-table"')
            + note + '<p class="small">Each side as a share of its own compute: the profiled steps\' kernels '
              "(CPU: operators) sorted into fused attention, GEMMs, the optimizer's step and the rest "
              "(element-wise), beside the cost model's terms for the same config. On a CPU the profiler slows "
              "small operators most, so compare shares there, not seconds.</p>"), series


def failures(study: Study) -> str:
    bad = study.not_ok
    if not bad:
        return "<p>Every run finished ok.</p>"
    rows = [[f'<td class="s-{esc(r.status)}">{esc(r.status)}</td>', esc(r.label), f'<td class="mono">{esc(r.run_id)}</td>',
             f'<td class="error">{esc(r.r.get("error") or "(no message)")}</td>'] for r in bad]
    return table(["status", "config", "run id", "reason"], rows, "failures-table", 'id="failures-table"')
