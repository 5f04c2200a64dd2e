"""PP mode: the schedule as a Gantt chart, predicted (harness.costmodel.schedule, unit durations) beside
the measured timeline of the run (timeline_rank<r>.json), bubbles shaded, and the bubble % three ways:
the textbook formula (p-1)/(v*m+p-1), the cost model, and measured (1 - busy / pipeline time per rank).
"""
from __future__ import annotations

from harness import catalog
from harness.costmodel.schedule import formula_bubble_pct, simulate
from harness.labels import esc, pct
from harness.report import charts, figures
from harness.report.blocks import explain, notice, num_span, selector, table
from harness.report.study import Run, Study, candidates, command_for

# Drawn when the study ran no pipeline: every schedule the simulator orders exactly (not the greedy
# V-shaped approximations), the default first, in the textbook case of 4 stages and 8 micro-batches.
ILLUSTRATION = tuple((name, 4, 1 if row.placement == "one" else 2, 8) for name, row in
                     sorted(catalog.SCHEDULES.items(), key=lambda kv: kv[0] != catalog.DEFAULT_SCHEDULE)
                     if row.order != "greedy")


def predicted_series(schedule: str, pp: int, vpp: int, m: int):
    sim = simulate(schedule, pp, m, vpp)
    labels = [f"pp rank {r} (stage {', '.join(map(str, catalog.stages_of_rank(schedule, r, pp, sim.vpp)))})" for r in range(pp)]
    series = charts.gantt_series(sim.events, pp, sim.makespan, labels=labels)
    return sim, series


def formula(schedule: str, pp: int, vpp: int, m: int) -> float | None:
    if catalog.schedule(schedule).split_backward:
        return None  # zero-bubble schedules: no closed form of this kind (Qi et al. 2023: ~0 when m >= 2p)
    v = catalog.chunks_per_rank(schedule, vpp)
    return formula_bubble_pct(pp, m, v)


def render(study: Study, figs) -> str:
    runs = candidates(study, "pp")
    if runs:
        return selector("pp", runs, [_panel(study, r, figs) for r in runs])
    head = notice("This study ran no pipeline-parallel config (no run with pp > 1). Below: the schedules "
                  "the simulator predicts for the textbook case of 4 stages and 8 micro-batches (nothing "
                  "measured).", command_for(study, "pp"))
    opts, panels = [], []
    for i, (sched, p, v, m) in enumerate(ILLUSTRATION):
        sim, series = predicted_series(sched, p, v, m)
        f = formula(sched, p, v, m)
        opts.append(f'<option value="{i}">{sched} (p={p}, v={v}, m={m})</option>')
        title = f"{sched}: p={p}, v={v}, m={m}; simulated bubble {sim.bubble_pct:.1f}%"
        panels.append(f'<div class="run-panel" data-mode="pp-demo" data-index="{i}"{" hidden" if i else ""}>'
                      + figs.div(figures.to_json(figures.gantt(series, title, "time (F = 1 unit)")), "pp-demo")
                      + explain([f"Bubble: formula (p-1)/(v*m+p-1) = {num_span(pct(f, 'no closed form'), 'pp-demo-formula')}, "
                                 f"simulated {num_span(pct(sim.bubble_pct), 'pp-demo-sim')}."]) + "</div>")
    return (head + f'<label class="picker">schedule: <select class="run-select" data-mode="pp-demo">{"".join(opts)}'
            f"</select></label>" + "".join(panels))


def _panel(study: Study, run: Run, figs) -> str:
    d = run.dims
    p, v = d["pp"], d.get("vpp", 1)
    m = run.num_microbatches or 1
    sched = run.cfg("strategy", "schedule", default=catalog.DEFAULT_SCHEDULE)
    body = [f'<h3>{esc(run.label)} <span class="status s-{esc(run.status)}">{esc(run.status)}</span></h3>']
    try:
        sim, pred = predicted_series(sched, p, v, m)
    except (ValueError, AssertionError) as e:
        sim, pred = None, None
        body.append(notice(f"The simulator cannot draw {sched} at p={p}, v={v}, m={m}: {e}"))
    timelines = run.timelines()
    meas = charts.measured_gantt(timelines) if timelines else None
    f = formula(sched, p, v, m)
    measured_bubble = run.m("bubble_pct")
    body.append(explain(_sentences(run, sched, p, v, m, f, sim, measured_bubble, meas)))
    grid = []
    if pred:
        grid.append(figs.div(figures.to_json(figures.gantt(
            pred, f"Predicted: {sched}, {p * v} stages on {p} ranks x {m} micro-batches (F = 1, B = 2 units)"
            if v > 1 else f"Predicted: {sched}, {p} stages x {m} micro-batches (F = 1, B = 2 units)", "time (F = 1 unit)")),
            "pp-pred"))
    if meas:
        grid.append(figs.div(figures.to_json(figures.gantt(
            meas, f"Measured: one timed step (step {timelines[0].get('step', '?')})", "ms")), "pp-meas"))
    else:
        grid.append(notice("Measured timeline: not measured (no timeline_rank*.json in the run directory"
                           + (f" {run.run_dir}" if run.run_dir else "") + ")."))
    body.append('<div class="gantt-grid">' + "".join(grid) + "</div>")
    per_rank = run.measured.get("bubble_pct_per_rank") or (meas or {}).get("bubble_pct_per_rank") or []
    rows = [["formula (p-1)/(v*m+p-1)", num_span(pct(f, "no closed form"), "pp-bubble-formula"), "textbook, uniform stages"],
            ["simulated schedule (unit F/B/W)", num_span(pct(sim.bubble_pct if sim else None, "-"), "pp-bubble-sim"),
             "the predicted chart" + (" (approximate for V schedules)" if sim and sim.approximate else "")],
            ["cost model", num_span(pct(run.p("bubble_pct"), "not predicted"), "pp-bubble-predicted"),
             "predicted.bubble_pct"],
            ["measured", num_span(pct(measured_bubble), "pp-bubble-measured"),
             "mean over ranks of 1 - busy / pipeline time; per rank: "
             + (", ".join(esc(pct(x)) for x in per_rank) if per_rank else "not measured")]]
    body.append(table(["bubble %", "value", "how"], rows, "bytes-table"))
    return "".join(body)


def _sentences(run, sched, p, v, m, f, sim, measured_bubble, meas) -> list[str]:
    layers = run.cfg("model", "n_layers", default=0)
    out = [f"Pipeline parallel cuts the {layers} layers into {p * v} stages ({layers // max(p * v, 1)} layers each"
           + (f", {v} per rank, interleaved" if v > 1 else "") + f") on {p} ranks; the {m} micro-batches of each "
           f"step flow through them like trays on a line, forward then backward, and only the activations at the "
           f"stage boundaries travel between neighbours."]
    if f is not None:
        out.append(f"With {sched}, the first and last stages wait while the pipe fills and drains: (p-1)/(v*m+p-1) = "
                   f"({p}-1)/({v}*{m}+{p}-1) = {num_span(pct(f), 'pp-formula')} of the step is bubble in theory.")
    else:
        out.append(f"{sched} splits each backward into an input-gradient part B and a weight-gradient part W and "
                   f"moves W into the gaps, so its bubble is smaller than 1F1B's; the simulator predicts "
                   f"{esc(pct(sim.bubble_pct if sim else None))}.")
    if measured_bubble is not None:
        gap = measured_bubble - (f if f is not None else (sim.bubble_pct if sim else 0))
        out.append(f"Measured: {num_span(pct(measured_bubble), 'pp-measured')} idle on average over the ranks"
                   + (f", {abs(gap):.1f} points {'above' if gap > 0 else 'below'} the schedule's own bubble: the "
                      f"difference is waiting for point-to-point transfers and uneven stages (the first holds the "
                      f"embeddings, the last the head and loss)." if abs(gap) >= 1 else ", as the schedule predicts."))
    else:
        out.append("Measured bubble: not measured for this run.")
    if meas is None and run.ok:
        out.append("This run left no timeline files, so only the predicted chart is drawn.")
    f2 = formula_bubble_pct(p, 4 * m, v)
    out.append(f"Choose pipeline parallel when the model does not fit even with ZeRO, or to cross nodes over slow "
               f"links: it sends only boundary activations. Keep the micro-batches many: with {4 * m} instead of "
               f"{m} the formula's bubble falls to {esc(pct(f2))}.")
    if not run.ok:
        out.append(f"This run did not finish ({esc(run.status)}): {esc((run.r.get('error') or '')[:200])}")
    return out

