"""The cost model's core: one config (already reduced to plain numbers) -> the predicted figures.

    predict(run, dims)  -> Model.of / Hardware.of / Strategy.of + evaluate(..., detail=True)
    harness.plan        -> the same objects built once, evaluate(..., detail=False) in its loop

Time (per optimizer step, on the slowest rank):
    t_mb     = hardware FLOPs of one micro-batch on the rank / achievable FLOP/s   (forward+backward)
    compute  = m * t_mb;   bubble = bubble_units * t_mb / v   (harness/costmodel/pipeline.py)
    comm     = Σ α-β times per axis (harness/costmodel/comm.py)
    exposed  = the part of comm that cannot hide behind compute:
               DDP / ZeRO grads: all but the last bucket hide behind the last micro-batch's backward;
               FSDP all-gathers: prefetched behind compute, except the first block of each pass;
               ZeRO-1 parameter sync, TP all-reduces, EP all-to-alls: not overlapped;
               PP sends: hidden in the steady state, exposed on the fill/drain chain (2(p-1) sends);
               on CPU nothing hides (gloo's threads need the cores the compute uses: shared/STACK.md
               measured 23 % exposed by A/B where the trace said 8 %), so exposed = comm there.
    step     = compute + bubble + exposed;  efficiency η = compute / step
On CPU one device is one core (launch/local.py: one thread per rank); when a node runs more ranks
than it has cores they time-share, so each rank's FLOP/s divides by ranks_per_node / cores.
"""
from __future__ import annotations

import math

from harness.costmodel import activations as act
from harness.costmodel import comm
from harness.costmodel import memory as mem
from harness.costmodel import pipeline as pipe
from harness.costmodel.flops import (attention_core_flops_per_token, head_forward_flops_per_token,
                                     layer_forward_flops_per_token)
from harness.costmodel.params import params_total, rank_inventory, stages_of_rank, numel

PRECISION_KEY = {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}
MEM_KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes")


class Model:
    """A model config reduced to numbers, with per-token FLOPs precomputed."""
    __slots__ = ("cfg", "shape", "L", "h", "a", "d_ff", "V", "s", "E", "k", "params_total",
                 "layer_flops", "core_flops", "head_flops")

    @classmethod
    def of(cls, m) -> "Model":
        self = cls()
        self.cfg = m
        self.L, self.h, self.a, self.d_ff, self.V, self.s = (m.n_layers, m.d_model, m.n_heads, m.d_ff,
                                                             m.vocab_size, m.seq_len)
        self.E, self.k = m.n_experts, m.top_k
        self.shape = (self.L, self.h, self.a, self.d_ff, self.V, self.s, self.E, self.k)
        self.params_total = params_total(m)
        self.layer_flops = layer_forward_flops_per_token(m)
        self.core_flops = attention_core_flops_per_token(m)
        self.head_flops = head_forward_flops_per_token(m)
        return self


class Hardware:
    """A hardware profile in SI units: FLOP/s, bytes, seconds, bytes/s."""
    __slots__ = ("name", "device", "devices_per_node", "memory_bytes", "rate", "peak", "intra", "inter",
                 "collectives")

    @classmethod
    def of(cls, hw) -> "Hardware":
        self = cls()
        self.name, self.device, self.devices_per_node = hw.name, hw.device, hw.devices_per_node
        self.memory_bytes = hw.memory_GiB * 1024**3
        self.peak = {k: v * 1e12 for k, v in dict(hw.peak_tflops).items()}
        self.rate = {**self.peak, **{k: v * 1e12 for k, v in dict(hw.achievable_tflops).items()}}
        self.intra = comm.Link(hw.intra_node.latency_us * 1e-6, hw.intra_node.bus_bw_GBps * 1e9)
        self.inter = comm.Link(hw.inter_node.latency_us * 1e-6, hw.inter_node.bus_bw_GBps * 1e9)
        self.collectives = {}
        for name, by_n in dict(hw.collectives or {}).items():
            if not isinstance(by_n, dict) and not hasattr(by_n, "items"):
                continue
            table = {}
            for n, fig in dict(by_n).items():
                if str(n).isdigit() and fig.get("bus_bw_GBps"):
                    table[int(n)] = comm.Link(fig["latency_us"] * 1e-6, fig["bus_bw_GBps"] * 1e9)
            if table:
                self.collectives[name] = table
        return self


class Strategy:
    """The strategy knobs the cost model reads."""
    __slots__ = ("name", "engine", "fam", "zero_stage", "schedule", "sp", "reshard_after_forward", "bucket_bytes",
                 "comm_hook", "powersgd_rank", "overlap_comm", "ds_knobs", "ds_buckets", "uses_ddp")

    @classmethod
    def of(cls, s) -> "Strategy":
        self = cls()
        self.name, self.engine, self.zero_stage = s.name, s.engine, s.zero_stage
        self.fam = mem.family(s)
        self.schedule = s.schedule
        self.sp = bool(s.sequence_parallel)
        self.reshard_after_forward = bool(s.reshard_after_forward)
        self.bucket_bytes = s.bucket_cap_mb * 1024**2
        self.comm_hook, self.powersgd_rank = s.comm_hook, s.powersgd_rank
        self.overlap_comm = bool(s.ds.overlap_comm) if s.engine == "deepspeed" else True
        self.ds_knobs = (s.zero_stage, s.ds.stage3_param_persistence_threshold) if s.engine == "deepspeed" else ()
        self.ds_buckets = ((s.ds.reduce_bucket_size, s.ds.stage3_prefetch_bucket_size, s.ds.stage3_max_live_parameters)
                           if s.engine == "deepspeed" else None)
        # DDP wraps the model (reducer buckets, no_sync) for ddp, zero1 and 3d with dp_shard=ddp
        self.uses_ddp = self.fam in ("replicate", "zero1_torch") and s.engine == "torch"
        return self


def ranks_per_node(hw: Hardware, world: int, nodes: int) -> int:
    """Ranks sharing a node. CPU ranks time-share a node's cores; a GPU node holds at most
    devices_per_node ranks, so a larger world spans at least world / devices_per_node nodes."""
    nodes = max(1, nodes)
    if hw.device != "cpu":
        nodes = max(nodes, -(-world // hw.devices_per_node))
    return max(1, -(-world // nodes))


def ideal_stage(st: "Strategy") -> int:
    """The ZeRO stage whose ideal memory this engine approximates."""
    if st.fam == "replicate":
        return 0
    if st.fam == "zero1_torch":
        return 1
    if st.fam == "fsdp":
        return st.zero_stage if st.zero_stage >= 2 else 3
    return st.zero_stage


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


def evaluate(md: Model, hw: Hardware, st: Strategy, dp: int, tp: int, pp: int, vpp: int, ep: int, mb: int,
             m: int, precision: str, ckpt: str, nodes: int = 1, detail: bool = True) -> dict:
    world = dp * tp * pp
    v = vpp if pp > 1 else 1
    n_stages = pp * v
    e = mem.ACT_BYTES[precision]
    pkey = PRECISION_KEY[precision]
    rpn = ranks_per_node(hw, world, nodes)
    slowdown = max(1.0, rpn / hw.devices_per_node) if hw.device == "cpu" else 1.0
    rate = hw.rate.get(pkey) or hw.rate.get("fp32")
    rate_eff = rate / slowdown
    tokens_mb = mb * md.s
    layer_act = act.layer_bytes(md.cfg, mb, tp, st.sp, precision, ckpt)
    head_sharded = tp > 1
    per_stage_layers = md.L // n_stages
    layer_fl = md.layer_flops / tp * (4 if ckpt == "full" else 3) + (md.core_flops / tp if ckpt == "selective" else 0)
    head_fl = 3 * md.head_flops / (tp if head_sharded else 1)
    fam = st.fam
    dp_ranks_all = detail

    per_pp = []  # per pipeline rank: (states per dp rank, activations, flops per micro-batch, stages, groups)
    for r in range(pp):
        stages = stages_of_rank(r, pp, v, st.schedule)
        groups = rank_inventory(md.shape, tp, pp, v, ep, st.schedule, r)
        states = mem.model_states(fam, groups, dp, ep, precision, st.ds_knobs, dp_ranks_all)
        layers = per_stage_layers * len(stages)
        first, last = 0 in stages, n_stages - 1 in stages
        flops_mb = tokens_mb * (layers * layer_fl + (head_fl if last else 0))
        acts = act.in_flight(st.schedule, pp, v, m, r) * (
            layers * layer_act + (act.head_bytes(md.s, mb, md.h, md.V, tp, head_sharded) if last else 0))
        per_pp.append((states, acts, flops_mb, stages, groups, layers, first, last))

    # -- memory (max over ranks) -------------------------------------------------------------
    def totals(states):
        return [p + g + o for p, g, o, _ in states]

    worst = max(range(pp), key=lambda r: max(totals(per_pp[r][0])) + per_pp[r][1])
    states, acts, _, _, groups, layers, _, last = per_pp[worst]
    i_max = max(range(len(states)), key=lambda i: totals(states)[i])
    p_b, g_b, o_b, master_b = states[i_max]
    psi_rank = max(numel(x[4]) for x in per_pp)
    model_states_b = p_b + g_b + o_b
    unsharded_param_b = 4 * numel(groups)
    buffers = (mem.comm_buffer_bytes(fam, st.zero_stage, g_b, st.bucket_bytes / 1024**2, st.ds_buckets)
               if dp > 1 and (st.uses_ddp or fam == "deepspeed") else 0)
    held = 0.0  # unsharded FSDP state held across forward/backward
    transient = [8 * mb * md.s * md.V / (tp if head_sharded else 1) if last else 0.0]  # logits + their grad
    if fam == "fsdp" and dp > 1:
        block = 4 * (4 * md.h * md.h + 2 * md.h * md.d_ff) / tp
        transient.append(3 * block)  # this block's and the prefetched block's params + its grads
        if not st.reshard_after_forward:
            held += unsharded_param_b - p_b  # zero2: every block's full params from forward to backward
        if m > 1:
            held += unsharded_param_b - g_b  # accumulation without sync keeps unsharded grads
    if ckpt == "full":
        transient.append(act.layer_bytes(md.cfg, mb, tp, st.sp, precision, "none"))
    peak_b = model_states_b + buffers + held + acts + max(transient)

    # -- compute -----------------------------------------------------------------------------------
    t_mb = max(x[2] for x in per_pp) / rate_eff
    compute_s = m * t_mb
    bubble_s = pipe.bubble_units(st.schedule, pp, v, m) * t_mb / v
    can_overlap = hw.device != "cpu"

    # -- communication -----------------------------------------------------------------------------
    def link(coll, n, stride):
        return comm.collective_link(hw, coll, n, stride * n <= rpn)

    vol = {"dp": 0.0, "tp": 0.0, "pp": 0.0, "ep": 0.0}
    t_axis = {"dp": 0.0, "tp": 0.0, "pp": 0.0, "ep": 0.0}
    exposed = x_max = 0.0
    grad_elem = 4 if (fam != "deepspeed" or precision == "fp32") else e
    param_elem = 4 if fam != "deepspeed" else e
    n_blocks = per_stage_layers * len(per_pp[0][3]) + 1
    for r_pp in range(pp):  # the dp traffic of the busiest pipeline rank counts
        _, _, _, _, grp, _, _, _ = per_pp[r_pp]
        dense_g, expert_g = _grad_comm_bytes(st, grp, dp, ep, grad_elem)
        dense_p = param_elem * sum(c * d0 * r for c, d0, r, k in grp if k == "dense")
        expert_p = param_elem * sum(c * d0 * r for c, d0, r, k in grp if k == "expert")
        v_dp = t_dp = x_dp = 0.0
        for n, pb, gb in ((dp, dense_p, dense_g), (dp // ep, expert_p, expert_g)):
            if n <= 1 or (pb == 0 and gb == 0):
                continue
            for coll, size, when in comm.dp_ops(fam, st.zero_stage, n, m, pb, gb, st.reshard_after_forward):
                lk = link(coll, n, tp)
                if coll in ("all_reduce", "reduce_scatter") and when == "grad":
                    bucket = st.ds_buckets[0] * grad_elem if st.ds_buckets else st.bucket_bytes
                    calls = max(1, math.ceil(size / bucket))
                else:
                    calls = max(1, round(size / max(pb, 1)) * n_blocks)
                t = comm.time_s(lk, coll, n, size, calls)
                v_dp += comm.volume(coll, n, size)
                t_dp += t
                if not can_overlap or when == "step" or not st.overlap_comm:
                    x_dp += t
                elif when == "grad":
                    window = t_mb * 2 / 3 * (m if fam == "deepspeed" and st.zero_stage >= 2 else 1)
                    x_dp += max(0.0, t - window) + t / calls
                else:  # FSDP all-gathers, prefetched
                    x_dp += max(0.0, t - compute_s) + t / n_blocks
        if t_dp >= t_axis["dp"]:
            vol["dp"], t_axis["dp"], x_max = v_dp, t_dp, x_dp
    exposed += x_max if t_axis["dp"] else 0.0

    if tp > 1:  # per rank: 4 all-reduces per layer per micro-batch, +1 with the embedding, +1 with the head
        calls = m * max(4 * x[5] + int(x[6]) + int(x[7]) for x in per_pp)
        size = calls * mb * md.s * md.h * e
        t = comm.time_s(link("all_reduce", tp, 1), "all_reduce", tp, size, calls)
        vol["tp"], t_axis["tp"] = comm.volume("all_reduce", tp, size), t
        exposed += t
    if pp > 1:
        sends = max(comm.pp_sends(x[3], n_stages) for x in per_pp)
        one = mb * md.s * md.h * 4  # fp32 residual stream (autocast leaves it fp32)
        lk = link("send_recv", 2, dp * tp)
        t = comm.time_s(lk, "send_recv", 2, sends * m * one, sends * m)
        vol["pp"], t_axis["pp"] = sends * m * one, t
        exposed += comm.time_s(lk, "send_recv", 2, 2 * (pp - 1) * one, 2 * (pp - 1)) if can_overlap else t
    if ep > 1 and md.E:
        layers_r = max(x[5] for x in per_pp)
        size = 4 * layers_r * m * mb * md.s * md.k * md.h * 4
        t = comm.time_s(link("all_to_all", ep, tp), "all_to_all", ep, size, 4 * layers_r * m)
        vol["ep"], t_axis["ep"] = comm.volume("all_to_all", ep, size), t
        exposed += t

    comm_s = sum(t_axis.values())
    step_s = compute_s + bubble_s + exposed
    tokens = mb * m * dp * md.s
    out = {
        "step_time_s": step_s,
        "tokens_per_s": tokens / step_s,
        "tokens_per_s_per_device": tokens / step_s / world,
        "params_bytes": p_b, "grads_bytes": g_b, "optimizer_bytes": o_b, "master_bytes": master_b,
        "model_states_bytes": model_states_b,
        "model_states_bytes_ideal": mem.ideal_model_states(psi_rank, dp, ideal_stage(st), precision),
        "activations_bytes": acts,
        "comm_buffer_bytes": buffers,
        "peak_mem_bytes": peak_b,
        "compute_time_s": compute_s,
        "bubble_time_s": bubble_s,
        "bubble_pct": 100 * bubble_s / step_s if pp > 1 else 0.0,
        "bubble_pct_schedule": pipe.bubble_pct(st.schedule, pp, v, m),
        "comm_time_s": comm_s,
        "comm_exposed_time_s": exposed,
        "comm_share_pct": 100 * min(comm_s, step_s) / step_s,
        "comm_exposed_pct": 100 * exposed / step_s,
        "efficiency": compute_s / step_s,
        "comm_dp_bytes": vol["dp"], "comm_tp_bytes": vol["tp"], "comm_pp_bytes": vol["pp"], "comm_ep_bytes": vol["ep"],
    }
    if not detail:
        return out
    return _details(out, md, hw, st, dims=(dp, tp, pp, v, ep), per_pp=per_pp, m=m, mb=mb, precision=precision,
                    ckpt=ckpt, world=world, rpn=rpn, slowdown=slowdown, rate_eff=rate_eff, t_axis=t_axis,
                    psi_rank=psi_rank)


def _details(out, md, hw, st, dims, per_pp, m, mb, precision, ckpt, world, rpn, slowdown, rate_eff, t_axis,
             psi_rank) -> dict:
    """The figures only `predict` reports: FLOPs, rates, per-rank lists, Amdahl."""
    from harness.costmodel.flops import hardware_flops_per_step, model_flops_per_step

    dp, tp, pp, v, ep = dims
    gbs = mb * m * dp
    flops = model_flops_per_step(md.cfg, gbs)
    hw_flops = hardware_flops_per_step(md.cfg, gbs, ckpt)
    step = out["step_time_s"]
    peak = hw.peak.get(PRECISION_KEY[precision])
    one_device_s = hw_flops / (hw.rate.get(PRECISION_KEY[precision]) or hw.rate["fp32"])
    speedup = one_device_s / step
    out.update({
        "params_total": md.params_total,
        "params_per_rank": max(numel(x[4]) for x in per_pp),
        "model_flops_per_step": flops,
        "hardware_flops_per_step": hw_flops,
        "tokens_per_step": gbs * md.s,
        "num_microbatches": m,
        "tflops_per_device": flops / step / world / 1e12,
        "mfu_pct": 100 * flops / step / world / peak if peak else None,
        "hfu_pct": 100 * hw_flops / step / world / peak if peak else None,
        "comm_dp_time_s": t_axis["dp"], "comm_tp_time_s": t_axis["tp"], "comm_pp_time_s": t_axis["pp"],
        "comm_ep_time_s": t_axis["ep"],
        "speedup_vs_one_device": speedup,
        "amdahl_serial_fraction": ((world / speedup - 1) / (world - 1)) if world > 1 else 0.0,
        "ranks_per_node": rpn,
        "cpu_time_sharing_factor": slowdown,
        "achievable_flops_per_rank": rate_eff,
        "memory_family": st.fam,
        "fits_in_memory": out["peak_mem_bytes"] <= hw.memory_bytes,
        "memory_headroom_bytes": hw.memory_bytes - out["peak_mem_bytes"],
        "device_memory_bytes": hw.memory_bytes,
    })
    # per-rank lists in rank order: rank = pp_rank*(dp*tp) + dp_rank*tp + tp_rank
    lists = {k: [] for k in (*MEM_KEYS, "model_states_bytes", "activations_bytes", "params_per_rank")}
    for r_pp, (states, acts, _, _, groups, _, _, _) in enumerate(per_pp):
        for d in range(dp):
            p_b, g_b, o_b, _ = states[d]
            for _ in range(tp):
                lists["params_bytes"].append(p_b)
                lists["grads_bytes"].append(g_b)
                lists["optimizer_bytes"].append(o_b)
                lists["model_states_bytes"].append(p_b + g_b + o_b)
                lists["activations_bytes"].append(acts)
                lists["params_per_rank"].append(numel(groups))
    for k, xs in lists.items():
        out[f"{k}_per_rank" if not k.endswith("_per_rank") else "params_per_rank_list"] = xs
    out["peak_mem_kind"] = "predicted_tensor_peak"  # device tensors (on CUDA comparable with max_allocated)
    return out


def amdahl_speedup(serial_fraction: float, n: int) -> float:
    """Amdahl (1967): speedup on n devices when a fraction f of the one-device time is serial."""
    return 1.0 / (serial_fraction + (1.0 - serial_fraction) / n)
