"""The cost model's core: one config (already reduced to plain numbers) -> the predicted figures.

    predict(run, dims)  -> Model.of / Hardware.of / Strategy.of + evaluate(..., detail=True)
    harness.tools.plan        -> the same objects built once, evaluate(..., detail=False) in its loop

Time (per optimizer step, on the slowest rank):
    t_mb     = hardware FLOPs of one micro-batch on the rank / achievable FLOP/s   (forward+backward)
               + its element-wise bytes / memory bandwidth (traffic.py; when the hardware gives one)
    compute  = m * t_mb + optimizer step and gradient accumulation bytes / memory bandwidth
    bubble   = bubble_units * t_mb / v   (harness/costmodel/pipeline.py)
    comm     = Σ α-β times per axis (harness/costmodel/comm.py)
    exposed  = the part of comm that cannot hide behind compute:
               DDP / ZeRO grads: all but the last bucket hide behind the last micro-batch's backward;
               FSDP all-gathers: prefetched behind compute, except the first block of each pass;
               ZeRO-1 parameter sync, TP all-reduces, EP all-to-alls: not overlapped;
               PP sends: hidden in the steady state, exposed on the fill/drain chain (2(p-1) sends);
               on CPU nothing hides (gloo's threads need the cores the compute uses: docs/notes.md#cpu-overlap
               measured 23 % exposed by A/B where the trace said 8 %), so exposed = comm there.
    step     = compute + bubble + exposed;  efficiency η = compute / step
On CPU one device is one core (launch/local.py: one thread per rank); when a node runs more ranks
than it has cores they time-share, so each rank's FLOP/s and bandwidth divide by ranks_per_node / cores.
"""
from __future__ import annotations

import math

from harness.costmodel import activations as act
from harness.costmodel import comm
from harness.costmodel import memory as mem
from harness.costmodel import pipeline as pipe
from harness.costmodel import traffic
from harness import catalog
from harness.costmodel.details import details
from harness.costmodel.inputs import Hardware, Model, Strategy, ideal_stage, ranks_per_node
from harness.costmodel.params import rank_inventory, numel, block_tensors

MEM_KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes")


def _grad_comm_bytes(st: Strategy, groups, dp: int, ep: int, grad_elem_bytes: int) -> tuple[float, float]:
    """(dense, expert) gradient bytes a dp all-reduce / reduce-scatter moves, after any comm hook."""
    dense = sum(c * d0 * r for c, d0, r, k in groups if k == "dense")
    expert = sum(c * d0 * r for c, d0, r, k in groups if k == "expert")
    if st.comm_hook == "fp16":
        return 2 * dense, 2 * expert
    if st.comm_hook == "powersgd":  # Vogels et al. 2019: a rank-r P (n x r) and Q (m x r) per matrix
        def compressed(kind):
            return sum(c * (st.powersgd_rank * (d0 + r) if r > 1 else d0) for c, d0, r, k in groups if k == kind)
        return 4 * compressed("dense"), 4 * compressed("expert")
    return grad_elem_bytes * dense, grad_elem_bytes * expert


class Layout:
    """Everything about a config that does not depend on micro-batching or checkpointing: placement,
    model states, per-token FLOPs, the links each axis uses. The planner builds one per layout and
    finishes it for every (micro-batch size, micro-batch count, checkpointing) cheaply."""
    __slots__ = ("md", "hw", "st", "dp", "tp", "pp", "v", "ep", "precision", "world", "e", "e_res", "n_stages",
                 "rpn", "slowdown", "rate_eff", "can_overlap", "ranks", "psi_rank", "act_seq", "head_seq",
                 "logits_seq", "fsdp_block", "layer_fl", "head_fl", "dp_ops", "tp_link", "tp_calls_mb",
                 "pp_link", "pp_sends_mb", "ep_link", "ep_layers", "unsharded_e", "ideal_bytes", "bw_eff",
                 "layer_mem", "head_mem", "opt_bytes", "grad_elems")


class RankInfo:
    """One pipeline rank's share: parameter groups, model states (worst dp rank), layers, ends."""
    __slots__ = ("r", "groups", "numel", "states", "p", "g", "o", "x", "total", "layers", "first", "last", "stages")


def layout(md: Model, hw: Hardware, st: Strategy, dp: int, tp: int, pp: int, vpp: int, ep: int, precision: str,
           nodes: int = 1, detail: bool = False, weight_decay: float = 0.0) -> Layout:
    lo = Layout()
    lo.md, lo.hw, lo.st, lo.dp, lo.tp, lo.pp, lo.ep, lo.precision = md, hw, st, dp, tp, pp, ep, precision
    v = lo.v = vpp if pp > 1 else 1
    lo.n_stages = n_stages = pp * v
    lo.world = world = dp * tp * pp
    e = lo.e = catalog.PRECISION_BYTES[precision]
    lo.e_res = 4 if st.autocast else e  # the residual stream: fp32 under autocast
    lo.rpn = ranks_per_node(hw, world, nodes)
    lo.slowdown = max(1.0, lo.rpn / hw.devices_per_node) if hw.device == "cpu" else 1.0
    lo.rate_eff = (hw.rate.get(catalog.PEAK_KEY[precision]) or hw.rate["fp32"]) / lo.slowdown
    lo.can_overlap = hw.device != "cpu"
    fam = st.fam
    per_stage_layers = md.L // n_stages
    head_div = tp  # vocab-parallel head and loss (models/tp_plan.py)

    # Without detail only pp ranks 0, 1 and p-1: the middle ranks hold the same parameters and rank 1
    # has the most micro-batches in flight among them, so every maximum is among these three.
    lo.ranks = []
    for r in (range(pp) if detail else sorted({0, min(1, pp - 1), pp - 1})):
        ri = RankInfo()
        ri.r = r
        ri.stages = catalog.stages_of_rank(st.schedule, r, pp, v)
        ri.groups = rank_inventory(md.shape, tp, pp, v, ep, st.schedule, r)
        ri.numel = numel(ri.groups)
        ri.states = mem.model_states(fam, ri.groups, dp, ep, precision, st.ds_knobs, detail)
        ri.p, ri.g, ri.o, ri.x = max(ri.states, key=sum)
        ri.total = ri.p + ri.g + ri.o + ri.x
        ri.layers = per_stage_layers * len(ri.stages)
        ri.first, ri.last = 0 in ri.stages, n_stages - 1 in ri.stages
        lo.ranks.append(ri)
    lo.psi_rank = max(ri.numel for ri in lo.ranks)
    lo.ideal_bytes = mem.ideal_model_states(lo.psi_rank, dp, ideal_stage(st), precision)

    # activation bytes per sequence (every term is linear in the micro-batch size)
    cfg = md.cfg
    lo.act_seq = {c: act.layer_bytes(cfg, 1, tp, st.sp, precision, c, st.autocast) for c in ("none", "selective", "full")}
    lo.head_seq = act.head_bytes(md.s, 1, md.h, md.V, tp, True)
    lo.logits_seq = 8 * md.s * md.V / head_div  # logits + their gradient, at the end of forward / start of backward
    lo.unsharded_e = e if fam == "sharded" else 4  # FSDP2 gathers params in param_dtype
    lo.fsdp_block = lo.unsharded_e * (4 * md.h * md.h + 2 * md.h * md.d_ff) / tp
    # forward+backward FLOPs per token of one layer (x3; full recompute x4; selective + the core)
    lo.layer_fl = {"none": 3 * md.layer_flops / tp, "selective": (3 * md.layer_flops + md.core_flops) / tp,
                   "full": 4 * md.layer_flops / tp}
    lo.head_fl = 3 * md.head_flops / head_div
    # memory-bound work (traffic.py): per token per layer / head, and the optimizer step of the rank
    # with the most optimizer state (AdamW state is 8 B per element it updates)
    lo.bw_eff = hw.mem_bw / lo.slowdown if hw.mem_bw else 0.0
    lo.layer_mem = {c: traffic.layer_bytes_per_token(cfg, tp, st.sp, e, lo.e_res, c) for c in ("none", "selective", "full")}
    lo.head_mem = traffic.head_bytes_per_token(cfg, head_div)
    lo.opt_bytes = traffic.optimizer_bytes(max(ri.o for ri in lo.ranks) / 8, weight_decay)
    lo.grad_elems = max(ri.numel for ri in lo.ranks)

    # dp collectives of the pp rank with the most parameters: (coll, n, base bytes, scaling with m, when, link)
    def link(coll, n, stride):
        return comm.collective_link(hw, coll, n, stride * n <= lo.rpn)

    busiest = max(lo.ranks, key=lambda ri: ri.numel)
    grad_elem = 4 if (fam != "deepspeed" or precision == "fp32") else e
    param_elem = e if fam in ("sharded", "deepspeed") else 4
    dense_g, expert_g = _grad_comm_bytes(st, busiest.groups, dp, ep, grad_elem)
    dense_p = param_elem * sum(c * d0 * r for c, d0, r, k in busiest.groups if k == "dense")
    expert_p = param_elem * sum(c * d0 * r for c, d0, r, k in busiest.groups if k == "expert")
    n_units = busiest.layers + 1  # FSDP units / DeepSpeed gather groups: one per block + the root
    # dense params inside the blocks (FSDP re-gathers only those per micro-batch; see comm.dp_ops_scaling)
    block_p = param_elem * busiest.layers * sum(c * d0 * r for c, d0, r, k in block_tensors(md.h, md.d_ff, md.E, tp, ep)
                                                if k == "dense")
    lo.dp_ops = []
    for n, pb, gb, blk in ((dp, dense_p, dense_g, block_p), (dp // ep, expert_p, expert_g, expert_p)):
        if n <= 1 or (pb == 0 and gb == 0):
            continue
        for coll, size1, size_m, when in comm.dp_ops_scaling(fam, st.zero_stage, n, pb, gb, st.reshard_after_forward,
                                                             blk):
            lk = link(coll, n, tp)
            bucket = (st.ds_buckets[0] * grad_elem if st.ds_buckets else st.bucket_bytes)
            lo.dp_ops.append((coll, n, size1, size_m, when, lk.alpha_s, lk.bw_Bps / comm.FACTOR[coll](n),
                              comm.FACTOR[coll](n), bucket if when == "grad" else 0, pb, n_units))
    lo.tp_link = link("all_reduce", tp, 1) if tp > 1 else None
    # Per layer 2 all-reduces forward (after o, fc2) and, backward, one per column-parallel projection
    # fed by a replicated input: q, k, v and fc1 each reduce their input gradient separately (models/
    # tp_plan.py wraps them one by one; the profiled window counted 6 per layer on model=tiny): 6.
    # With sequence parallel the attention and MLP inputs are gathered once (PrepareModuleInput), so
    # the gradient is reduce-scattered once per input: 4 all-reduce equivalents (Megatron's count).
    lo.tp_calls_mb = max((4 if st.sp else 6) * ri.layers + int(ri.first) + int(ri.last) for ri in lo.ranks)
    lo.pp_link = link("send_recv", 2, dp * tp) if pp > 1 else None
    lo.pp_sends_mb = max(comm.pp_sends(ri.stages, n_stages) for ri in lo.ranks)
    lo.ep_link = link("all_to_all", ep, tp) if ep > 1 and md.E else None
    lo.ep_layers = max(ri.layers for ri in lo.ranks)
    return lo


def finish(lo: Layout, mb: int, m: int, ckpt: str) -> dict:
    """The prediction of a layout for micro-batch size mb, m micro-batches per step and a checkpointing mode."""
    md, st = lo.md, lo.st
    dp, tp, pp, v, fam = lo.dp, lo.tp, lo.pp, lo.v, st.fam
    tokens_mb = mb * md.s
    layer_act = lo.act_seq[ckpt] * mb
    layer_fl = lo.layer_fl[ckpt]

    # -- memory: the worst rank --------------------------------------------------------------------
    layer_mem = lo.layer_mem[ckpt]
    worst, worst_total, worst_acts, flops_mb, t_mb = None, -1.0, 0.0, 0.0, 0.0
    t_rank = {}  # pp rank -> its time per micro-batch (stages differ: embeddings first, head last)
    for ri in lo.ranks:
        acts = (ri.layers * layer_act + (lo.head_seq * mb if ri.last else 0)) * (
            act.in_flight(st.schedule, pp, v, m, ri.r) if pp > 1 else 1.0)
        if ri.total + acts > worst_total:
            worst, worst_total, worst_acts = ri, ri.total + acts, acts
        f = tokens_mb * (ri.layers * layer_fl + (lo.head_fl if ri.last else 0))
        t = f / lo.rate_eff
        if lo.bw_eff:
            t += tokens_mb * (ri.layers * layer_mem + (lo.head_mem if ri.last else 0)) / lo.bw_eff
        t_rank[ri.r] = t
        if t > t_mb:
            flops_mb, t_mb = f, t
    buffers = (mem.comm_buffer_bytes(fam, st.zero_stage, worst.g, 0, st.ds_buckets)
               if dp > 1 and (st.uses_ddp or fam == "deepspeed") else 0)
    held = 0.0  # unsharded FSDP state held across forward and backward
    transient = lo.logits_seq * mb if worst.last else 0.0
    if fam == "sharded" and dp > 1:
        full = lo.unsharded_e * worst.numel
        transient = max(transient, 3 * lo.fsdp_block)  # this unit's and the prefetched unit's params + its grads
        if not st.reshard_after_forward:
            held += full - worst.p  # zero2: every block's full params from its forward to its backward
        if m > 1:  # accumulation keeps grads unsharded (and params gathered) between micro-batches
            held += (full - worst.g) + ((full - worst.p) if st.reshard_after_forward else 0)
    if ckpt == "full":
        transient = max(transient, lo.act_seq["none"] * mb)  # one block's activations while it is recomputed
    peak_b = worst.total + buffers + held + worst_acts + transient

    # -- time --------------------------------------------------------------------------------------
    matmul_s = m * flops_mb / lo.rate_eff
    optimizer_s = ((lo.opt_bytes + (m - 1) * traffic.GRAD_ACCUMULATE_BYTES_PER_ELEM * lo.grad_elems) / lo.bw_eff
                   if lo.bw_eff else 0.0)
    compute_s = m * t_mb + optimizer_s
    bubble_s = pipe.bubble_units(st.schedule, pp, v, m) * t_mb / v
    # bubble_pct as measured (pipeline_timeline.py: the mean over ranks of idle / pipeline time), with
    # unequal stages (issue 6 fidelity: on model=small the last stage's head makes it 1.6x the first):
    # the slowest rank idles while the others fill and drain, bubble_units x the others' mean time,
    # and the faster ranks idle longer. lo.ranks holds pp ranks 0, 1, p-1 (middle ranks equal rank 1).
    # Equal stages: idle_mean_s = bubble_s and this is the formula's (p-1)/(v m + p-1).
    t_all = [t_rank[0], *[t_rank[min(1, pp - 1)]] * (pp - 2), t_rank[pp - 1]] if pp > 1 else [t_mb]
    others = (sum(t_all) - t_mb) / (pp - 1) if pp > 1 else 0.0
    pipe_s = m * t_mb + pipe.bubble_units(st.schedule, pp, v, m) * others / v
    idle_mean_s = pipe_s - m * sum(t_all) / len(t_all)
    overlap = lo.can_overlap
    v_dp = t_dp = exposed = 0.0
    for coll, n, size1, size_m, when, alpha, bw_eff, factor, bucket, pb, n_units in lo.dp_ops:
        size = size1 + size_m * m
        calls = max(1, math.ceil(size / bucket)) if bucket else max(1, round(size / max(pb, 1))) * n_units
        t = calls * alpha + size / bw_eff
        v_dp += factor * size
        t_dp += t
        if not overlap or when == "step" or not st.overlap_comm:
            exposed += t
        elif when == "grad":  # hides behind the backward that produces it, but for the last bucket
            window = t_mb * 2 / 3 * (m if size_m else 1)
            exposed += max(0.0, t - window) + t / calls
        else:  # FSDP / ZeRO-3 all-gathers, prefetched behind compute but for the first unit
            exposed += max(0.0, t - compute_s) + t / n_units
    v_tp = t_tp = v_pp = t_pp = v_ep = t_ep = 0.0
    if lo.tp_link is not None:
        calls = m * lo.tp_calls_mb
        size = calls * tokens_mb * md.h * lo.e
        t_tp = calls * lo.tp_link.alpha_s + comm.FACTOR["all_reduce"](tp) * size / lo.tp_link.bw_Bps
        v_tp = comm.FACTOR["all_reduce"](tp) * size
        exposed += t_tp
    if lo.pp_link is not None:
        one = tokens_mb * md.h * lo.e_res
        sends = lo.pp_sends_mb * m
        t_pp = sends * (lo.pp_link.alpha_s + one / lo.pp_link.bw_Bps)
        v_pp = sends * one
        exposed += 2 * (pp - 1) * (lo.pp_link.alpha_s + one / lo.pp_link.bw_Bps) if overlap else t_pp
    if lo.ep_link is not None:
        calls = 4 * lo.ep_layers * m
        size = calls * tokens_mb * md.k * md.h * 4
        t_ep = calls * lo.ep_link.alpha_s + comm.FACTOR["all_to_all"](lo.ep) * size / lo.ep_link.bw_Bps
        v_ep = comm.FACTOR["all_to_all"](lo.ep) * size
        exposed += t_ep

    comm_s = t_dp + t_tp + t_pp + t_ep
    step_s = compute_s + bubble_s + exposed
    tokens = tokens_mb * m * dp
    return {
        "step_time_s": step_s,
        "tokens_per_s": tokens / step_s,
        "tokens_per_s_per_device": tokens / step_s / lo.world,
        "params_bytes": worst.p, "grads_bytes": worst.g, "optimizer_bytes": worst.o, "master_bytes": worst.x,
        "model_states_bytes": worst.total,
        "model_states_bytes_ideal": lo.ideal_bytes,
        "activations_bytes": worst_acts,
        "comm_buffer_bytes": buffers,
        "fsdp_unsharded_bytes": held,
        "transient_bytes": transient,
        "peak_mem_bytes": peak_b,
        "compute_time_s": compute_s,
        "matmul_time_s": matmul_s,
        "memory_bound_time_s": compute_s - matmul_s,
        "optimizer_time_s": optimizer_s,
        "bubble_time_s": bubble_s,
        "bubble_pct": 100 * idle_mean_s / pipe_s if pp > 1 else 0.0,
        "comm_time_s": comm_s,
        "comm_exposed_time_s": exposed,
        "comm_share_pct": 100 * min(comm_s, step_s) / step_s,
        "comm_exposed_pct": 100 * exposed / step_s,
        "efficiency": compute_s / step_s,
        "comm_dp_bytes": v_dp, "comm_tp_bytes": v_tp, "comm_pp_bytes": v_pp, "comm_ep_bytes": v_ep,
        "comm_dp_time_s": t_dp, "comm_tp_time_s": t_tp, "comm_pp_time_s": t_pp, "comm_ep_time_s": t_ep,
    }


def evaluate(md: Model, hw: Hardware, st: Strategy, dp: int, tp: int, pp: int, vpp: int, ep: int, mb: int,
             m: int, precision: str, ckpt: str, nodes: int = 1, detail: bool = True, weight_decay: float = 0.0) -> dict:
    """One config's prediction; detail adds FLOPs, rates, per-rank lists and Amdahl (harness.tools.predict)."""
    lo = layout(md, hw, st, dp, tp, pp, vpp, ep, precision, nodes, detail, weight_decay)
    out = finish(lo, mb, m, ckpt)
    return details(out, lo, mb, m, ckpt) if detail else out
