"""DP mode: the ring all-reduce of gradients among the dp ranks, the bytes each rank sends per step
(formula, cost model, measured), and what ZeRO-1/2/3 shard, for one data-parallel run of the study.

Bytes per rank per step (nccl-tests bus factors): all-reduce 2(N-1)/N * G; ZeRO-2/3 and FSDP run a
reduce-scatter of gradients and an all-gather of parameters, (N-1)/N * G each, and ZeRO-3/FSDP
gathers parameters again for the backward: 3 (N-1)/N * Psi bytes (Rajbhandari et al. 2020, sec. 7).
"""
from __future__ import annotations

import json

from harness import catalog
from harness.labels import esc, nbytes, pct, rate, seconds
from harness.report import ring as ringmod
from harness.report import svg
from harness.report.blocks import explain, notice, num_span, selector, table
from harness.report.study import Run, Study, candidates, command_for

ZERO_NAMES = {0: "replicated (DDP)", 1: "ZeRO-1: optimizer state", 2: "ZeRO-2: + gradients",
              3: "ZeRO-3 / FSDP: + parameters"}


def zero_stage(run: Run) -> int:
    """What this run shards over dp, as a ZeRO stage (harness/catalog.py)."""
    s = run.cfg("strategy", default={}) or {}
    return catalog.zero_stage(run.strategy, run.engine, int(s.get("zero_stage") or 0),
                              s.get("data_parallel", catalog.DEFAULT_DATA_PARALLEL))


def full_state_bytes(run: Run) -> tuple[dict[str, float], str]:
    """Unsharded params / grads / optimizer bytes per rank (before dp sharding) and where they come from."""
    psi = run.p("params_per_rank")
    fp32 = run.dtype_bytes == 4
    if psi:
        # ZeRO paper's accounting: fp32: 4 + 4 + 8 bytes/param (Adam m, v); mixed: 2 + 2 + 12 (+ fp32 master)
        per = (4, 4, 8) if fp32 else (2, 2, 12)
        return ({"params": per[0] * psi, "grads": per[1] * psi, "optimizer": per[2] * psi},
                f"{psi:,} parameters per rank (cost model) x {'4 + 4 + 8' if fp32 else '2 + 2 + 12'} bytes")
    if zero_stage(run) == 0 and run.m("params_bytes"):
        return ({"params": run.m("params_bytes"), "grads": run.m("grads_bytes") or 0.0,
                 "optimizer": run.m("optimizer_bytes") or 0.0}, "this run's measured bytes (nothing sharded)")
    return {}, ""


def render(study: Study, figs) -> str:
    runs = candidates(study, "dp")
    if not runs:
        return notice("This study ran no data-parallel config (no run with dp > 1).", command_for(study, "dp"))
    panels = [_panel(study, r, f"dp{i}") for i, r in enumerate(runs)]
    return selector("dp", runs, panels)


def _panel(study: Study, run: Run, wid: str) -> str:
    n = run.dims["dp"]
    grads_meas, grads_pred = run.m("grads_bytes"), run.p("grads_bytes")
    stage = zero_stage(run)
    # bytes of the full gradient of this rank's parameters: what the ring all-reduce moves
    full, source = full_state_bytes(run)
    g_full = full.get("grads") or (grads_meas if stage < 2 else None)
    formula = ringmod.allreduce_bytes_per_rank(g_full, n) if g_full else None
    if stage == 3 and g_full:
        formula = 3 * (n - 1) / n * g_full
    meas_bytes, pred_bytes = run.comm_bytes("dp")
    body = [f'<h3>{esc(run.label)} <span class="status s-{esc(run.status)}">{esc(run.status)}</span></h3>',
            explain(_sentences(study, run, n, g_full, formula, meas_bytes, pred_bytes, stage))]
    if n > 1:
        steps = ringmod.steps(min(n, svg.MAX_RING))
        chunk = g_full / n if g_full else None
        cut = f" (first {svg.MAX_RING} of {n} ranks drawn)" if n > svg.MAX_RING else ""
        body.append(
            f'<div class="ring-widget" id="{wid}" data-steps="{esc(json.dumps(steps))}" data-n="{min(n, svg.MAX_RING)}" '
            f'data-chunk="{esc(nbytes(chunk) if chunk else "G/" + str(n))}">'
            f'<div class="ring-controls"><button class="ring-prev" type="button">&#9664; step</button>'
            f'<button class="ring-play" type="button">play</button>'
            f'<button class="ring-next" type="button">step &#9654;</button>'
            f'<span class="ring-caption" aria-live="polite"></span></div>'
            f"{svg.ring(wid, n)}<p class=\"small\">Ring all-reduce of the gradients among the {n} dp ranks{cut}: "
            f"each rank's gradient is cut into {min(n, svg.MAX_RING)} chunks (the small squares, coloured by chunk); "
            f"a square fills as the chunk sums more ranks' gradients and turns solid when it holds the sum of all "
            f"{n}.</p></div>")
    body.append("<h4>Bytes each rank sends per step (dp axis)</h4>")
    # G in the formulas is the full (unsharded) gradient of the rank's parameters; under ZeRO-2/3 a rank
    # holds only a 1/N shard of it, shown apart so the formula's G is never the shard
    rows = [["full gradient bytes per rank (G, unsharded)", num_span(nbytes(g_full, "-"), "dp-grad-full"), "",
             esc(source or "")]]
    if stage >= 2:
        rows.append([f"gradient shard held per rank (G/N, {esc(ZERO_NAMES[stage])})", esc(nbytes(grads_meas)),
                     esc(nbytes(grads_pred, "not predicted")), "what the rank holds after the reduce-scatter"])
    else:
        rows[0][1:3] = [num_span(nbytes(grads_meas if grads_meas is not None else g_full), "dp-grad-full"),
                        esc(nbytes(grads_pred, "not predicted"))]
    rows += [
            [f"ring formula {'3' if stage == 3 else '2'}(N-1)/N x G, N = {n}", num_span(nbytes(formula, "-"), "dp-bytes-formula"),
             "", "G above"],
            ["all dp collectives", num_span(nbytes(meas_bytes), "dp-bytes-measured"),
             num_span(nbytes(pred_bytes, "not predicted"), "dp-bytes-predicted"),
             "measured: flight recorder counts of the profiled steps; predicted: cost model"]]
    colls = run.collectives_of("dp")
    for name, c in sorted(colls.items()):
        rows.append([f"&nbsp;&nbsp;{esc(name)}", esc(nbytes(c.get("bytes"))), "",
                     esc(f"{c.get('count', 0):g} per step, {seconds(c.get('time_s'))}")])
    body.append(table(["", "measured", "predicted", "note"], rows, "bytes-table"))
    body.append(_zero_section(study, run, wid, n, stage, full, source))
    return "".join(body)


def _sentences(study, run, n, g_full, formula, meas_bytes, pred_bytes, stage) -> list[str]:
    out = [f"Data parallel keeps a copy of the model on each of the {n} dp ranks; every rank runs forward and "
           f"backward on its own 1/{n} of the global batch "
           f"({run.cfg('workload', 'global_batch_size')} sequences), then the ranks average their gradients so "
           f"every copy takes the same optimizer step."]
    base = study.baseline(run)
    tps = run.m("tokens_per_s")
    if tps and base and base.run_id != run.run_id:
        s = tps / (base.m("tokens_per_s") / base.world)
        out.append(f"At dp={n} this study measured {num_span(rate(tps), 'dp-tokens')} tokens/s, "
                   f"{num_span(f'{s:.2f}x', 'dp-speedup')} the per-device throughput of {esc(base.label)} "
                   f"(scaling efficiency {num_span(pct(100 * s / run.world), 'dp-efficiency')}).")
    elif not run.ok:
        out.append(f"This run did not finish ({esc(run.status)}): {esc((run.r.get('error') or '')[:200])}")
    if formula:
        bw_link = "inter_node" if run.world > (run.cfg("hardware", "devices_per_node", default=1) or 1) else "intra_node"
        bw = run.cfg("hardware", bw_link, "bus_bw_GBps")
        step = run.m("step_time_s")
        t = formula / (bw * 1e9) if bw else None
        what = ("ZeRO-3/FSDP's all-gather of parameters (forward and backward) and reduce-scatter of gradients "
                "make each rank send 3(N-1)/N" if stage == 3 else "A ring all-reduce (or ZeRO's reduce-scatter plus "
                "all-gather) makes each rank send 2(N-1)/N")
        txt = f"{what} of its gradient bytes: {num_span(nbytes(formula), 'dp-bytes')} per step here"
        if t:
            txt += (f"; at this hardware's {bw:g} GB/s bus bandwidth ({bw_link.replace('_', '-')}) that is about "
                    f"{esc(seconds(t))}")
            if step:
                txt += f", {num_span(pct(100 * t / step), 'dp-comm-estimate')} of the measured {esc(seconds(step))} step"
        out.append(txt + ".")
    share = (run.comm_share_by_axis() or {}).get("dp")
    exposed = (run.comm_exposed_by_axis() or {}).get("dp")
    if share is not None:
        out.append(f"Measured in the profiled steps: the dp axis spent {num_span(pct(share), 'dp-comm-share')} of "
                   f"the step in collectives, {esc(pct(exposed))} not hidden behind compute.")
    else:
        out.append("The measured communication share of the dp axis: not measured for this run.")
    states = run.m("model_states_bytes")
    out.append(f"Choose data parallel when the model, its gradients and optimizer state fit on one device "
               f"(here {esc(nbytes(states))} per rank{', ' + ZERO_NAMES[stage] + ' sharded' if stage else ''}): "
               f"its traffic grows with the model size, not the batch, and overlaps with the backward pass; "
               f"when the model states do not fit, ZeRO shards them over the same ranks.")
    return out


def _zero_section(study: Study, run: Run, wid: str, n: int, stage: int, full: dict, source: str) -> str:
    if not full:
        return "<h4>What ZeRO shards</h4>" + notice("Parameter count not known for this run (no prediction).")
    same = {zero_stage(r): r for r in study.ok_runs
            if r.dims["dp"] == n and not r.uses("tp") and not r.uses("pp")
            and r.cfg("model", "name") == run.cfg("model", "name")}
    rows = []
    for s in range(4):
        shard = svg.ZERO_SHARDS[s]
        parts = {k: v / (n if k in shard else 1) for k, v in full.items()}
        measured = same.get(s)
        meas_txt = (f"{nbytes(measured.m('model_states_bytes'))} ({measured.label})" if measured else "not run")
        cls = ' class="current"' if s == stage else ""
        rows.append([f'<td{cls}>{esc(ZERO_NAMES[s])}</td>', esc(nbytes(parts["params"])), esc(nbytes(parts["grads"])),
                     esc(nbytes(parts["optimizer"])), esc(nbytes(sum(parts.values()))), esc(meas_txt)])
    buttons = "".join(f'<button type="button" class="zero-btn{" active" if s == stage else ""}" data-stage="{s}">'
                      f"ZeRO-{s}</button>" for s in range(4))
    return ("<h4>What ZeRO-1/2/3 shard over the dp ranks</h4>"
            f'<div class="zero-widget" id="{wid}-zero"><div class="zero-buttons">{buttons}</div>'
            f"{svg.zero(wid + '-zero', n, full, stage)}</div>"
            + table(["stage (this run's is highlighted)", "params/rank", "grads/rank", "optimizer/rank", "total/rank",
                     f"measured in this study at dp={n}"], rows, "zero-table")
            + f'<p class="small">Per-rank bytes from {esc(source)}, divided by N = {n} where sharded (the ZeRO '
              "paper's ideal; DeepSpeed also keeps an fp32 master partition, see the runs table).</p>")
