"""Time of one optimizer step on the slowest rank, and what each axis' communication leaves exposed.

    t_mb     = one micro-batch's compute on the rank (compute.py: GEMMs, attention, element-wise)
    compute  = m * t_mb + optimizer step and gradient accumulation bytes / memory bandwidth
               (+ the optimizer step's DTensor dispatch with tp > 1 on a CPU profile that measured it)
    bubble   = bubble_units * t_mb / v   (harness/costmodel/pipeline.py); on CPU, where stages share the
               cores, the schedule's timeline with each stage's own cost, each instant stretched by the
               stages busy then (pipeline.warped_timeline): its makespan less the slowest rank's busy time
    comm     = Σ α-β times per axis (comm.py, dp_comm.py); tp and pp per call from calibrate's measured time
               per message size where the profile has one (comm.call_s), tp's collectives (all-reduce;
               sequence parallel: all-gather, reduce-scatter) as a step meets them where calibrate
               measured that (comm.IN_STEP: after each rank's own compute); a CPU collective among
               ranks sharing the cores more than when calibrate timed it, that many times longer
               (comm.time_shared)
    host     = a runtime that launches each layer's kernels from Python in host_layer_s (conf/runtime/) bounds a
               micro-batch from below: a rank takes max(its compute, its layers x host_layer_s); a TP collective
               runs while the device waits for the host (estimate.py); where its pipeline's sends cross nodes,
               each layer's TP rings add their steps' floor to that bound (ring_chain_layer_s)
    exposed  = per mechanism (dp_comm.py): gradient buckets hide behind the backward they follow but for
               the last bucket; FSDP / ZeRO-3 gathers are prefetched one unit ahead, exposing the first
               unit and whatever exceeds the compute; the distributed optimizer's gathers hide behind
               the next forward; ZeRO-1's broadcast and DeepSpeed 1/2's gathers after the step are
               exposed; TP collectives are exposed (no comm-overlap option is modelled); PP sends hide in
               the steady state, exposed on the fill/drain chain (2(p-1) sends); EP all-to-alls are
               exposed. On CPU nothing hides (gloo's threads need the cores the compute uses:
               docs/notes.md measured 23 % exposed by A/B where the trace said 8 %), so exposed = comm.
    step     = compute + bubble + exposed + interference (estimate.py: compute overlapped by a collective
               runs compute.overlap_slowdown slower on a GPU)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from harness import catalog
from harness.costmodel import comm, traffic
from harness.costmodel import pipeline as pipe
from harness.costmodel.compute import gemm_time, layer_projections, microbatch_times
from harness.costmodel.layout import cpu_slowdowns, node_crossing_axes


@dataclass(slots=True)
class ComputeTime:
    per_rank_s: dict  # pp rank -> seconds per micro-batch, all stages computing
    microbatch_s: float  # the slowest rank's
    matmul_s: float  # m micro-batches of the slowest rank's GEMMs and attention
    optimizer_s: float
    compute_s: float
    busy_warp: float = 1.0  # CPU pipelines: the slowest rank's busy time / its all-stages-busy value
    pipe_s: float = 0.0  # ... the warped timeline's makespan (pipeline.warped_timeline; 0: the bubble formula's)
    idle_mean_s: float = 0.0  # ... and the ranks' mean idle time in it
    attention_s: float = 0.0  # the attention core's part of matmul_s
    host_s: float = 0.0  # the operators' host work in matmul_s (dispatch, DTensor, FSDP2; CPU profiles)
    accumulate_s: float = 0.0  # gradient accumulation's part of optimizer_s (a trace sees it in the backward)
    host_wait_s: float = 0.0  # the device idle while the host launches the layers (runtime host_layer_s), in compute_s
    layer_times: object = None  # what it was made from (compute_time's `like`): the layer times,
    host_layer_s: float = 0.0  # the per-layer host floor,
    made_of: tuple = ()  # m, the checkpointing and the pipeline ranks (pp rank, layers, last)


@dataclass(slots=True)
class AxisComm:
    bytes: float  # bytes one rank sends per step
    time_s: float
    exposed_s: float


def compute_time(lo, mb: int, m: int, ckpt: str, like: ComputeTime | None = None) -> ComputeTime:
    """like: the compute time of a layout that differs from lo in dp only (the planner's HSDP shard groups): where
    both ran the same layer times (Layout.mb_times) on the same pipeline ranks with the same host floor and no CPU
    pipeline timeline, their micro-batches take the same time and only the optimizer's terms are lo's own."""
    times = microbatch_times(lo, mb)
    host_layer_s = lo.strategy.runtime.host_layer_s + ring_chain_layer_s(lo)
    made_of = (m, ckpt, tuple((r.pp_rank, r.layers, r.last) for r in lo.ranks))
    accumulate_s = (m - 1) * traffic.GRAD_ACCUMULATE_BYTES_PER_ELEM * lo.grad_elems / lo.mem_bw if lo.mem_bw else 0.0
    optimizer_s = (lo.optimizer_traffic_bytes / lo.mem_bw if lo.mem_bw else 0.0) + accumulate_s + lo.optimizer_dispatch_s
    if (like is not None and like.layer_times is times and like.host_layer_s == host_layer_s and not like.pipe_s
            and lo.hw.device != "cpu" and like.made_of == made_of):
        slowest, busy = like.microbatch_s, like.busy_warp
        return ComputeTime(like.per_rank_s, slowest, like.matmul_s, optimizer_s, m * slowest * busy + optimizer_s,
                           busy, like.pipe_s, like.idle_mean_s, like.attention_s, like.host_s, accumulate_s,
                           like.host_wait_s, times, host_layer_s, made_of)
    per_rank, slowest, slowest_matmul, slowest_parts, wait = {}, 0.0, 0.0, (0.0, 0.0), 0.0
    for rank in lo.ranks:
        matmul, elementwise = times.rank_time(rank, ckpt)
        # the host launches a layer's kernels in host_layer_s (runtime profile); the device waits where it is faster
        t = max(matmul + elementwise, rank.layers * host_layer_s)
        per_rank[rank.pp_rank] = t
        if t > slowest:
            slowest, slowest_matmul, slowest_parts = t, matmul, times.rank_parts(rank, ckpt)
            wait = t - matmul - elementwise
    pipe_s, busy_s, idle_mean_s = _cpu_pipeline(lo, m, times, ckpt, slowest_matmul / slowest if slowest else 1.0)
    busy = busy_s / (m * slowest) if pipe_s else 1.0
    return ComputeTime(per_rank, slowest, m * slowest_matmul * busy, optimizer_s, m * slowest * busy + optimizer_s,
                       busy, pipe_s, idle_mean_s, attention_s=m * slowest_parts[0] * busy,
                       host_s=m * (slowest_parts[1] + wait) * busy, accumulate_s=accumulate_s, host_wait_s=m * wait,
                       layer_times=times, host_layer_s=host_layer_s, made_of=made_of)


NANOTRON_RINGS_PER_LAYER = 10  # nanotron_tp: 6 all-gathers and 4 reduce-scatters a layer and micro-batch


def ring_chain_layer_s(lo) -> float:
    """A layer's floor per micro-batch from its TP rings where the runtime's pipeline sends cross nodes (runtime
    tp_ring_step_remote_pp_s, conf/runtime/nanotron.yaml says what was measured): every step of the layer's
    NANOTRON_RINGS_PER_LAYER rings waits that long, one after the other, whatever the micro-batch's size, while
    the device computes what it can; the rank takes the longer of the two (compute_time), as with the host."""
    step, pl = lo.strategy.runtime.tp_ring_step_remote_pp_s, lo.place
    if not step or pl.tp <= 1 or "pp" not in node_crossing_axes(pl):
        return 0.0
    return NANOTRON_RINGS_PER_LAYER * (pl.tp - 1) * step


WARP_MAX_CHUNKS = 1024  # a CPU layout beyond this keeps the all-busy rate (a 2-core VM runs pp <= 4)


def _cpu_pipeline(lo, m: int, times, ckpt: str, gemm_share: float) -> tuple[float, float, float]:
    """(makespan, the slowest rank's busy time, the ranks' mean idle time), seconds, of a pipeline whose
    stages share a CPU's cores; (0, 0, 0) elsewhere. pipeline.warped_timeline runs the schedule with each
    stage's own cost (the last stage's head and loss: on model=small about two blocks' worth, so the other
    ranks wait on it and fewer stages compute at once than with equal stages) and stretches each instant
    with k of p stages busy, k * ranks_per_node / p ranks computing, as layout.cpu_slowdowns says for
    their GEMM and memory-bound shares, relative to all stages busy (the rates per_rank_s holds)."""
    pl = lo.place
    if lo.hw.device != "cpu" or pl.pp <= 1:
        return 0.0, 0.0, 0.0
    if pl.pp * pl.vpp * m > WARP_MAX_CHUNKS:  # the V schedules' simulator is quadratic in its actions
        return 0.0, 0.0, 0.0
    relative = [1.0]
    for k in range(1, pl.pp + 1):
        gemm, memory = cpu_slowdowns(lo.hw, k * pl.ranks_per_node / pl.pp)
        relative.append(round(gemm_share * gemm / pl.slowdown + (1 - gemm_share) * memory / pl.mem_slowdown, 6))
    rank = lo.ranks[0]
    chunk = rank.layers / len(rank.stages) * (times.layer[ckpt] + times.layer_traffic[ckpt])  # one stage, F + B
    head = times.head + times.head_traffic
    n_stages = pl.pp * catalog.chunks_per_rank(lo.strategy.schedule, pl.vpp)
    scale = (1.0,) * (n_stages - 1) + (round(1.0 + head / chunk, 4),) if chunk else None
    span_units, busy_units = pipe.warped_timeline(lo.strategy.schedule, pl.pp, pl.vpp, m, tuple(relative), scale)
    per_unit = chunk * n_stages / pl.pp / 3  # a chunk's F + B is 3 / v units of the simulator
    pipe_s = span_units * per_unit
    return pipe_s, max(busy_units) * per_unit, pipe_s - sum(busy_units) / len(busy_units) * per_unit


def bubble(lo, ct: ComputeTime, m: int) -> tuple[float, float]:
    """(bubble seconds of the slowest rank, bubble_pct as measured: mean over ranks of idle / pipeline time).
    With unequal stages (on model=small the last stage's head makes it 1.6x the first) the slowest rank
    idles while the others fill and drain, bubble_units x the others' mean time, and the faster ranks
    idle longer. lo.ranks holds one pp rank per kind of stage, each standing for `weight` ranks
    (layout.pipeline_ranks: ranks 0, 1, p-1 with equal stages, the middle ones like rank 1). Equal stages:
    idle_mean_s = bubble_s and this is the formula's (p-1)/(v m + p-1)."""
    pl, t_mb = lo.place, ct.microbatch_s
    units = pipe.bubble_units(lo.strategy.schedule, pl.pp, pl.vpp, m)
    if pl.pp <= 1:
        return 0.0, 0.0
    t_sum = sum(ct.per_rank_s[r.pp_rank] * r.weight for r in lo.ranks)  # over all pp ranks
    others = (t_sum - t_mb) / (pl.pp - 1)
    if ct.pipe_s:  # CPU pipelines: the warped timeline of the stages' own costs (compute_time)
        return ct.pipe_s - m * t_mb * ct.busy_warp, 100 * ct.idle_mean_s / ct.pipe_s
    pipe_s = m * t_mb + units * others / pl.vpp
    idle_mean_s = pipe_s - m * t_sum / pl.pp
    return units / pl.vpp * t_mb, 100 * idle_mean_s / pipe_s


def dp_comm(lo, ct: ComputeTime, m: int) -> AxisComm:
    volume = total = exposed = 0.0
    t_mb = ct.microbatch_s
    for c in lo.dp_collectives:
        size = c.op.bytes_once + c.op.bytes_per_microbatch * m
        calls = (max(1, math.ceil(size / c.bucket_bytes)) if c.bucket_bytes
                 else max(1, round(size / max(c.unit_bytes, 1))) * c.units)
        t = (calls * comm.call_s(c.link, c.op.collective, c.group, size / calls) if c.link is not None
             else calls * c.alpha_s + size * c.factor / c.bus_bw_Bps)
        volume += c.factor * size
        total += t
        exposed += _exposed(lo, c, t, calls, t_mb, m, ct.compute_s)
    return AxisComm(volume, total, exposed)


def _exposed(lo, c, t: float, calls: int, t_mb: float, m: int, compute_s: float) -> float:
    """The part of a collective's time t that no compute hides (t_mb: one micro-batch, 1/3 forward)."""
    mechanism = c.op.mechanism
    if not lo.can_overlap or mechanism == "after_step" or not lo.strategy.overlap_comm:
        return t
    if mechanism == "prefetch":  # the first unit waits; what cannot be in flight ahead waits too
        ahead = c.prefetch_fraction * t
        return min(t, (t - ahead) + max(0.0, ahead - compute_s) + t / c.units)
    window = {"backward_last": t_mb * 2 / 3, "backward_each": t_mb * 2 / 3 * m, "next_forward": t_mb / 3}[mechanism]
    return max(0.0, t - window) + t / calls


def tp_comm(lo, mb: int, m: int) -> AxisComm:
    """All-reduces of the activations; with sequence parallel all-gathers and reduce-scatters of them and
    the norm gradients' all-reduces (comm.py). A runtime with its own TP (runtime tp_collectives): nanotron_tp."""
    links, tp = lo.links, lo.place.tp
    if links.tp is None:
        return AxisComm(0.0, 0.0, 0.0)
    if lo.strategy.runtime.tp_collectives == "nanotron_async" and links.tp_gather is not None:
        return nanotron_tp(lo, mb, m)
    calls = m * links.tp_calls_per_microbatch
    one = mb * lo.model.s * lo.model.h * lo.per_token.act_elem_bytes
    if links.tp_gather is None:
        sent = comm.FACTOR["all_reduce"](tp) * calls * one
        t = calls * comm.call_s(links.tp, "all_reduce", tp, one)
    else:
        norms, norm_bytes = m * links.tp_norm_grads_per_microbatch, 4 * lo.model.h  # fp32 parameters' gradients
        sent = (2 * comm.FACTOR["all_gather"](tp) * calls * one
                + comm.FACTOR["all_reduce"](tp) * norms * norm_bytes)
        t = (calls * (comm.call_s(links.tp_gather, "all_gather", tp, one)
                      + comm.call_s(links.tp_scatter, "reduce_scatter", tp, one))
             + norms * comm.call_s(links.tp, "all_reduce", tp, norm_bytes))
    return AxisComm(sent, t, 0.0 if lo.strategy.tp_comm_overlap and lo.can_overlap else t)


def nanotron_tp(lo, mb: int, m: int) -> AxisComm:
    """nanotron's TP in its REDUCE_SCATTER mode with tp_linear_async_communication (the sweep's setting;
    src/nanotron/parallel/tensor_parallel/functional.py), q k v and gate up each one column-parallel linear, o and
    down row-parallel. E = the gathered activation (b s h in the matmul's dtype). Per layer and micro-batch:
        column linear  forward   all-gather E, overlapped with the GEMM of the rank's own rows (1/tp of it)
                       backward  all-gather E again (tp_recompute_allgather) under the input-gradient GEMM,
                                 reduce-scatter of the input gradient under the weight-gradient GEMM
        row linear     forward   reduce-scatter of the output, exposed
                       backward  all-gather of the output gradient, under the GEMM of the rank's own rows
    6 all-gathers and 4 reduce-scatters; each exposes what its overlapping GEMM does not cover. The first stage's
    embedding adds a reduce-scatter forward and an all-gather backward, the head's stage a column linear, both
    exposed; the norm weights' gradients are all-reduced once per step (sync_tied_weights_gradients). Where the
    pipeline's sends cross nodes, the layer's rings also bound its micro-batch from below (ring_chain_layer_s)."""
    key = ("nanotron_tp", mb)
    if key not in lo.gemm_cache:
        md, pl, links = lo.model, lo.place, lo.links
        tokens, e = mb * md.s, lo.per_token.act_elem_bytes
        one = tokens * md.h * e
        ag = comm.call_s(links.tp_gather, "all_gather", pl.tp, one)
        rs = comm.call_s(links.tp_scatter, "reduce_scatter", pl.tp, one)
        curve = lo.hw.gemm.get(lo.dtype)

        def gemm(shapes):  # forward seconds of the projections merged into one linear (one training GEMM's worth)
            if curve is None:
                return sum(2 * m_ * n * k for m_, n, k in shapes) / lo.matmul_rate
            return sum(gemm_time(curve, *g, e, lo.mem_bw, pl.slowdown) for g in shapes)
        proj = layer_projections(md, pl.tp, tokens)
        columns, rows = (proj[0:3], proj[4:-1]), (proj[3:4], proj[-1:])
        exposed = (sum(max(0.0, ag - gemm(c) / pl.tp) + max(0.0, ag - gemm(c)) + max(0.0, rs - gemm(c)) for c in columns)
                   + sum(rs + max(0.0, ag - gemm(r) / pl.tp) for r in rows))
        busiest = max(lo.ranks, key=lambda r: r.layers * exposed + (ag + rs) * (int(r.first) + int(r.last)))
        ends = int(busiest.first) + int(busiest.last)
        per_mb = busiest.layers * exposed + (ag + rs) * ends
        time_mb = busiest.layers * (6 * ag + 4 * rs) + (ag + rs) * ends
        calls_mb = 10 * busiest.layers + 2 * ends
        norms = norm_tensors_of(lo) * (2 * busiest.layers + int(busiest.last))
        norm_s = norms * comm.call_s(links.tp, "all_reduce", pl.tp, 4 * md.h)
        lo.gemm_cache[key] = (per_mb, time_mb, calls_mb * comm.FACTOR["all_gather"](pl.tp) * one, norm_s, norms)
    per_mb, time_mb, sent_mb, norm_s, norms = lo.gemm_cache[key]
    sent = m * sent_mb + comm.FACTOR["all_reduce"](lo.place.tp) * norms * 4 * lo.model.h
    return AxisComm(sent, m * time_mb + norm_s, m * per_mb + norm_s)


def norm_tensors_of(lo) -> int:
    return 2 if lo.model.cfg.norm == "layernorm" else 1


def pp_comm(lo, mb: int, m: int, t_mb: float = 0.0) -> AxisComm:
    """Stage-boundary sends (hidden in the steady state, exposed on the fill/drain chain of 2(p-1) sends), and
    where the runtime puts the fp32 cast and the loss on stages after the head's (nanotron), the logits' hops:
    such a stage does nothing but pass the logits on and their gradient back, so its time per micro-batch is its
    hops': per micro-batch its link carries the logits in and their gradient out, and the next stage's logits out
    and their gradient in, each way at once (full duplex), so it takes the sum of its two hops' times. The first
    micro-batch waits for the hops there and back, and every micro-batch for what that stage's time exceeds the
    slowest compute stage's (t_mb) by."""
    link, pl = lo.links.pp, lo.place
    if link is None:
        return AxisComm(0.0, 0.0, 0.0)
    one = mb * lo.model.s * lo.model.h * lo.per_token.residual_elem_bytes
    sends = lo.links.pp_sends_per_microbatch * m
    t_send = comm.call_s(link, "send_recv", 2, one)
    t = sends * t_send
    exposed = 2 * (pl.pp - 1) * t_send if lo.can_overlap else t
    logits = mb * lo.model.s * lo.model.V / pl.tp
    hops = [comm.call_s(link, "send_recv", 2, logits * e) for e in lo.links.pp_logits_elem_bytes]
    if hops:  # a relay stage: in from the stage before, out to the next
        relay = max(a + b for a, b in zip(hops, hops[1:] + [0.0]))
        t += 2 * m * sum(hops)
        exposed += 2 * sum(hops) + m * max(0.0, relay - t_mb)
    return AxisComm(sends * one + 2 * m * logits * sum(lo.links.pp_logits_elem_bytes), t, exposed)


def ep_comm(lo, mb: int, m: int) -> AxisComm:
    link, md = lo.links.ep, lo.model
    if link is None:
        return AxisComm(0.0, 0.0, 0.0)
    calls = 4 * lo.links.ep_layers * m  # dispatch and combine, forward and backward
    size = calls * mb * md.s * md.k * md.h * 4
    factor = comm.FACTOR["all_to_all"](lo.place.ep)
    t = (calls * comm.call_s(link, "all_to_all", lo.place.ep, size / calls) if link.fabric
         else calls * link.alpha_s + factor * size / link.bw_Bps)
    return AxisComm(factor * size, t, t)
