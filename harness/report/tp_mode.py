"""TP mode: one block's weight matrices split over the tp ranks (Megatron: q/k/v and fc1 by columns,
o and fc2 by rows), where the collectives run, and the bytes per layer, for one tensor-parallel run.

Collectives per block per micro-batch (Shoeybi et al. 2019; Korthikanti et al. 2022 for SP), each
moving one (b, s, h) activation of A = b*s*h*dtype bytes, counted from models/tp_plan.py's PLAN:

    no SP  forward: an all-reduce after each row-parallel layer (o, fc2): 2
           backward: an all-reduce of the input gradient of each column-parallel layer; brigade's
           model keeps q, k, v as separate layers, so q, k, v and fc1 each reduce theirs: 4
           (Megatron fuses qkv: 2). 6 all-reduces, 6 * 2(t-1)/t * A bytes sent per rank.
    SP     the input of attention and of the MLP is all-gathered once (forward) and its gradient
           reduce-scattered once (backward); each row-parallel output is reduce-scattered (forward)
           and its gradient all-gathered (backward): 8 halves = 4 all-reduce equivalents.

The embedding (vocab-parallel) and the loss add a little more; the cost model counts those too.
"""
from __future__ import annotations

from harness.costmodel.params import tp_block_collectives
from harness.labels import esc, nbytes, pct, seconds
from harness.report import svg
from harness.report.blocks import explain, notice, num_span, selector, table
from harness.report.study import Run, Study, candidates, command_for


def per_block_bytes(run: Run, t: int) -> tuple[float, float, dict]:
    """(activation message A, bytes one rank sends per block per micro-batch, the collective counts)."""
    b = run.cfg("workload", "micro_batch_size", default=1)
    s = run.cfg("model", "seq_len", default=1)
    h = run.cfg("model", "d_model", default=1)
    counts = dict(tp_block_collectives(run.cfg("model", "mlp", default="gelu"), bool(run.cfg("strategy", "sequence_parallel"))))
    msg = b * s * h * run.dtype_bytes
    return msg, counts["allreduce_equiv"] * 2 * (t - 1) / t * msg, counts


def render(study: Study, figs) -> str:
    runs = candidates(study, "tp")
    if runs:
        return selector("tp", runs, [_panel(study, r) for r in runs])
    ex = study.example()
    head = notice("This study ran no tensor-parallel config (no run with tp > 1). Below: what tp = 2 would "
                  "split for this study's model (an illustration, nothing measured).", command_for(study, "tp"))
    if ex is None or not ex.cfg("model", "d_model"):
        return head
    return head + _schematic(ex, 2)


def _schematic(run: Run, t: int) -> str:
    m = run.cfg("model", default={})
    msg, _, counts = per_block_bytes(run, t)
    sp = bool(run.cfg("strategy", "sequence_parallel"))
    return (f'<div class="scroll">{svg.tp_block(t, m["d_model"], m["d_ff"], m["n_heads"], sp, msg, counts)}'
            "</div>")


def _panel(study: Study, run: Run) -> str:
    t = run.dims["tp"]
    m = run.cfg("model", default={})
    layers = m.get("n_layers", 0)
    mb = run.num_microbatches or 1
    pp = run.dims["pp"]
    msg, per_block, counts = per_block_bytes(run, t)
    per_step = per_block * layers / pp * mb
    meas_bytes, pred_bytes = run.comm_bytes("tp")
    sp = bool(run.cfg("strategy", "sequence_parallel"))
    body = [f'<h3>{esc(run.label)}{" + sequence parallel" if sp else ""} '
            f'<span class="status s-{esc(run.status)}">{esc(run.status)}</span></h3>',
            explain(_sentences(study, run, t, msg, per_block, counts, sp)),
            _schematic(run, t), "<h4>Bytes per layer and per step (tp axis, per rank)</h4>"]
    rows = [["one activation (b, s, h)", esc(nbytes(msg)), "", esc(f"b={run.cfg('workload', 'micro_batch_size')}, "
                                                                  f"s={m.get('seq_len')}, h={m.get('d_model')}, "
                                                                  f"{run.dtype_bytes} bytes/element")],
            [f"per block per micro-batch: {counts['allreduce_equiv']} x 2(t-1)/t x A",
             num_span(nbytes(per_block), "tp-bytes-block"), "",
             ("2 all-gathers + 2 reduce-scatters forward, the same backward (4 all-reduce equivalents); "
              "DTensor also all-reduces each norm parameter's gradient (h elements) every micro-batch" if sp else
              f"{counts['fwd']} all-reduces forward (after o, fc2) + {counts['bwd']} backward (input gradients of "
              "q, k, v, fc1: separate layers here; Megatron fuses qkv)")],
            [f"blocks only, per step: x {layers // pp} blocks/rank x {mb} micro-batches",
             num_span(nbytes(per_step), "tp-bytes-blocks-step"), "", "formula"],
            ["all tp collectives per step", num_span(nbytes(meas_bytes), "tp-bytes-measured"),
             num_span(nbytes(pred_bytes, "not predicted"), "tp-bytes-predicted"),
             "measured: flight recorder; predicted: cost model (adds embedding and loss"
             + (", and the norm gradients)" if sp else ")")]]
    for name, c in sorted(run.collectives_of("tp").items()):
        rows.append([f"&nbsp;&nbsp;{esc(name)}", esc(nbytes(c.get("bytes"))), "",
                     esc(f"{c.get('count', 0):g} per step, {seconds(c.get('time_s'))}")])
    body.append(table(["", "measured", "predicted", "note"], rows, "bytes-table"))
    return "".join(body)


def _sentences(study, run, t, msg, per_block, counts, sp) -> list[str]:
    m = run.cfg("model", default={})
    out = [f"Tensor parallel splits every block's weight matrices over the {t} tp ranks: W_qkv and W_fc1 by "
           f"columns (each rank runs {m.get('n_heads', 0) // t} of the {m.get('n_heads')} attention heads and "
           f"{m.get('d_ff', 0) // t} of the {m.get('d_ff')} MLP units), W_o and W_fc2 by rows, so each rank "
           f"holds 1/{t} of the linear weights"
           + (f" ({esc(nbytes(run.m('params_bytes')))} of parameters per rank measured)." if run.m("params_bytes")
              else ".")]
    share = (run.comm_share_by_axis() or {}).get("tp")
    link = "intra_node" if t <= (run.cfg("hardware", "devices_per_node", default=1) or 1) else "inter_node"
    bw = run.cfg("hardware", link, "bus_bw_GBps")
    if share is not None:
        out.append(f"TP spent {num_span(pct(share), 'tp-comm-share')} of its step in communication at tp={t} on "
                   f"this interconnect ({esc(run.cfg('hardware', 'name'))}, {bw:g} GB/s {link.replace('_', '-')} "
                   f"bus bandwidth); none of it overlaps compute, because every matmul waits for its input.")
    else:
        pred = (run.predicted_comm_share_by_axis() or {}).get("tp")
        out.append("The measured communication share of the tp axis: not measured for this run"
                   + (f"; the cost model predicts {num_span(pct(pred), 'tp-comm-share-pred')} of the step at "
                      f"tp={t} on {esc(run.cfg('hardware', 'name'))}." if pred is not None else "."))
    how = ("2 all-gathers and 2 reduce-scatters forward and the same backward (and a small all-reduce of "
           "each norm parameter's gradient, since the norms see a sequence-sharded input)" if sp else
           f"{counts['fwd']} all-reduces forward and {counts['bwd']} backward")
    out.append(f"The price: every block moves (b, s, h) activations ({esc(nbytes(msg))} each) through {how}, "
               f"{num_span(nbytes(per_block), 'tp-bytes')} sent per rank per block per micro-batch.")
    out.append("Choose tensor parallel when one layer's weights or activations are too big for one device, and keep "
               "it inside a node: its traffic grows with batch x sequence x hidden size, happens in every layer and "
               "cannot hide behind compute, so it needs the fastest links (NVLink), not the network.")
    if not run.ok:
        out.append(f"This run did not finish ({esc(run.status)}): {esc((run.r.get('error') or '')[:200])}")
    return out
