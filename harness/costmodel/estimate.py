"""The cost model's core: one config (already reduced to plain numbers) -> the predicted figures.

    predict(run, dims)  -> Model.of / Hardware.of / StrategyKnobs.of (inputs.py) + evaluate(..., detail=True)
    harness.plan  -> the same objects built once; layout() per parallel layout, finish() in its loop

    layout.py       placement, per-rank model states, per-token costs, links, dp collectives
    compute.py      one micro-batch's time: GEMMs by shape, attention, element-wise work
    step_time.py    compute, bubble, comm per axis and what of it is exposed
    memory_peak.py  the worst rank's peak memory
    predict_figures.py  the figures only predict adds (FLOPs, MFU, per-rank lists)
On CPU one device is one core (launch/local.py: one thread per rank); when a node runs more ranks
than it has cores they time-share, so each rank's FLOP/s and bandwidth divide by ranks_per_node / cores.
"""
from __future__ import annotations

from dataclasses import dataclass

from harness.costmodel.inputs import Hardware, Model, StrategyKnobs
from harness.costmodel.layout import Layout, layout
from harness.costmodel.memory_peak import TRANSIENT_TERMS, MemoryPeak, memory_peak
from harness.costmodel.predict_figures import add_predict_figures
from harness.costmodel.step_time import AxisComm, ComputeTime, bubble, compute_time, dp_comm, ep_comm, pp_comm, tp_comm


@dataclass(slots=True)
class StepTiming:
    """What a prediction's time needs (finish): nothing in it depends on the memory peak, so the planner
    computes it once for the layouts that differ only in their peak (HSDP's replica counts)."""
    ct: ComputeTime
    bubble_s: float
    bubble_pct: float
    dp: AxisComm
    tp: AxisComm
    pp: AxisComm
    ep: AxisComm
    comm_s: float
    exposed_s: float
    interference_s: float
    step_s: float


def step_timing(lo: Layout, mb: int, m: int, ckpt: str, like: StepTiming | None = None) -> StepTiming:
    """like: the timing of a layout that differs from lo in dp only (step_time.compute_time's `like`)."""
    ct = compute_time(lo, mb, m, ckpt, like.ct if like is not None else None)
    bubble_s, bubble_pct = bubble(lo, ct, m)
    key = ("tp_ep", mb, m)  # no checkpointing in them: once per micro-batching of the layout
    if key not in lo.gemm_cache:
        lo.gemm_cache[key] = (tp_comm(lo, mb, m), ep_comm(lo, mb, m))
    (tp, ep), dp, pp = lo.gemm_cache[key], dp_comm(lo, ct, m), pp_comm(lo, mb, m, ct.microbatch_s)
    if ct.host_wait_s and tp.exposed_s:  # a TP collective queued behind the kernels runs while the device waits for the host
        tp = AxisComm(tp.bytes, tp.time_s, max(0.0, tp.exposed_s - ct.host_wait_s))
    comm_s = dp.time_s + tp.time_s + pp.time_s + ep.time_s
    exposed = dp.exposed_s + tp.exposed_s + pp.exposed_s + ep.exposed_s
    interference = overlap_interference_s(lo.hw, comm_s - exposed, ct.compute_s)
    step_s = ct.compute_s + bubble_s + exposed + interference
    return StepTiming(ct, bubble_s, bubble_pct, dp, tp, pp, ep, comm_s, exposed, interference, step_s)


def finish(lo: Layout, mb: int, m: int, ckpt: str, peak: MemoryPeak | None = None,
           timing: StepTiming | None = None) -> dict:
    """The prediction of a layout for micro-batch size mb, m micro-batches per step and a checkpointing
    mode (peak: memory_peak(lo, mb, m, ckpt) and timing: step_timing(lo, mb, m, ckpt) when the caller has
    them already, as the planner does)."""
    peak = peak or memory_peak(lo, mb, m, ckpt)
    t = timing or step_timing(lo, mb, m, ckpt)
    ct, dp, tp, pp, ep = t.ct, t.dp, t.tp, t.pp, t.ep
    step_s, comm_s, exposed, interference = t.step_s, t.comm_s, t.exposed_s, t.interference_s
    bubble_s, bubble_pct = t.bubble_s, t.bubble_pct
    tokens = mb * lo.model.s * m * lo.place.dp
    w, terms = peak.rank, peak.terms
    out = {
        "step_time_s": step_s,
        "tokens_per_s": tokens / step_s,
        "tokens_per_s_per_device": tokens / step_s / lo.place.world,
        "params_bytes": w.params_bytes, "grads_bytes": w.grads_bytes, "optimizer_bytes": w.optimizer_bytes,
        "master_bytes": w.master_bytes, "model_states_bytes": w.model_states_bytes,
        "model_states_bytes_ideal": lo.ideal_model_states_bytes,
        # the most any rank's activations reach (its loss phase), whatever the peak's phase
        "activations_bytes": peak.activations_most,
        # the peak: the worst rank at its worst phase, as terms that add up to it (memory_peak.TERMS)
        "peak_mem_bytes": peak.peak_bytes,
        "peak_mem_terms": dict(peak.terms),
        "peak_mem_phase": peak.phase,  # loss | end of backward (memory_peak.py)
        "peak_mem_pp_rank": peak.rank.pp_rank,
        "grads_at_peak_bytes": peak.grads_bytes,
        "comm_buffer_bytes": terms.get("comm_buffers", 0),
        "fsdp_unsharded_bytes": terms.get("fsdp_held", 0),
        "transient_bytes": peak.bytes_of(TRANSIENT_TERMS),
        "allocator_bytes": terms.get("allocator", 0),
        # the pp rank with the most gradient bytes, whose reductions the step waits for (hsdp_cp's HSDP
        # replica all-reduce); not necessarily the rank with the highest memory peak
        "grads_bytes_most": max(r.grads_bytes for r in lo.ranks),
        "compute_time_s": ct.compute_s,
        "matmul_time_s": ct.matmul_s,
        "memory_bound_time_s": ct.compute_s - ct.matmul_s,
        "optimizer_time_s": ct.optimizer_s,
        # the same compute by kind of work, as a profiled step splits it (harness/collect/compute_classes.py)
        # (the operators' host work, CPU profiles' dispatch, goes with the element-wise operators it mostly rides on)
        "compute_gemm_time_s": ct.matmul_s - ct.attention_s - ct.host_s,
        "compute_attention_time_s": ct.attention_s,
        "compute_elementwise_time_s": ct.compute_s - ct.matmul_s - ct.optimizer_s + ct.accumulate_s + ct.host_s,
        "compute_optimizer_time_s": ct.optimizer_s - ct.accumulate_s,
        "bubble_time_s": bubble_s,
        "bubble_pct": bubble_pct,
        "comm_time_s": comm_s,
        "comm_exposed_time_s": exposed,
        "comm_interference_time_s": interference,
        "comm_share_pct": 100 * min(comm_s, step_s) / step_s,
        "comm_exposed_pct": 100 * exposed / step_s,
        "efficiency": ct.compute_s / step_s,
        "comm_dp_bytes": dp.bytes, "comm_tp_bytes": tp.bytes, "comm_pp_bytes": pp.bytes, "comm_ep_bytes": ep.bytes,
        "comm_dp_time_s": dp.time_s, "comm_tp_time_s": tp.time_s, "comm_pp_time_s": pp.time_s,
        "comm_ep_time_s": ep.time_s,
        "comm_dp_exposed_time_s": dp.exposed_s, "comm_tp_exposed_time_s": tp.exposed_s,
        "comm_pp_exposed_time_s": pp.exposed_s, "comm_ep_exposed_time_s": ep.exposed_s,
    }
    return out


def overlap_interference_s(hw, overlapped_s: float, compute_s: float) -> float:
    """What a collective running under compute costs that compute: on a GPU the two share the SMs and
    the memory (NCCL's kernels take SMs from the GEMMs), so compute overlapped by a collective runs
    `compute.overlap_slowdown` slower (a cited measurement, conf/hardware/*.yaml). During the overlapped
    seconds the compute does 1 / (1 + s) of its work; the rest, overlapped x s / (1 + s), is added. A
    profile without the figure (the CPU profiles: nothing overlaps there, step_time.py) adds nothing."""
    s = hw.overlap_slowdown
    return max(0.0, min(overlapped_s, compute_s)) * s / (1 + s) if s else 0.0


def evaluate(md: Model, hw: Hardware, st: StrategyKnobs, dp: int, tp: int, pp: int, vpp: int, ep: int, mb: int,
             m: int, precision: str, ckpt: str, nodes: int = 1, detail: bool = True, weight_decay: float = 0.0) -> dict:
    """One config's prediction; detail adds FLOPs, rates, per-rank lists and Amdahl (harness.predict)."""
    lo = layout(md, hw, st, dp, tp, pp, vpp, ep, precision, nodes, detail, weight_decay)
    out = finish(lo, mb, m, ckpt)
    return add_predict_figures(out, lo, mb, m, ckpt) if detail else out
