"""The figures only `predict` reports beside the planner's: FLOPs, rates, MFU, per-rank lists, Amdahl."""
from __future__ import annotations

from harness.costmodel import activations as act
from harness.costmodel import pipeline as pipe
from harness.catalog import PEAK_KEY


def details(out: dict, lo, mb: int, m: int, ckpt: str) -> dict:
    """The figures only `predict` reports: FLOPs, rates, per-rank lists, Amdahl."""
    from harness.costmodel.flops import hardware_flops_per_step, model_flops_per_step

    md, hw, st = lo.md, lo.hw, lo.st
    dp, tp, world = lo.dp, lo.tp, lo.world
    gbs = mb * m * dp
    flops = model_flops_per_step(md.cfg, gbs)
    hw_flops = hardware_flops_per_step(md.cfg, gbs, ckpt)
    step = out["step_time_s"]
    pkey = PEAK_KEY[lo.precision]
    peak = hw.peak.get(pkey)
    one_device_s = hw_flops / (hw.rate.get(pkey) or hw.rate["fp32"])
    speedup = one_device_s / step
    out.update({
        "params_total": md.params_total,
        "params_per_rank": lo.psi_rank,
        "model_flops_per_step": flops,
        "hardware_flops_per_step": hw_flops,
        "tokens_per_step": gbs * md.s,
        "num_microbatches": m,
        "tflops_per_device": flops / step / world / 1e12,
        "mfu_pct": 100 * flops / step / world / peak if peak else None,
        "hfu_pct": 100 * hw_flops / step / world / peak if peak else None,
        "bubble_pct_schedule": pipe.bubble_pct(st.schedule, lo.pp, lo.v, m),
        "speedup_vs_one_device": speedup,
        "amdahl_serial_fraction": ((world / speedup - 1) / (world - 1)) if world > 1 else 0.0,
        "ranks_per_node": lo.rpn,
        "cpu_time_sharing_factor": lo.slowdown,
        "achievable_flops_per_rank": lo.rate_eff,
        "memory_family": st.fam,
        "fits_in_memory": out["peak_mem_bytes"] <= hw.memory_bytes,
        "memory_headroom_bytes": hw.memory_bytes - out["peak_mem_bytes"],
        "device_memory_bytes": hw.memory_bytes,
        "peak_mem_kind": "predicted_tensor_peak",  # device tensors: on CUDA comparable with max_allocated
    })
    # per-rank lists in rank order: rank = pp_rank*(dp*tp) + dp_rank*tp + tp_rank
    lists: dict = {k: [] for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "master_bytes",
                                   "model_states_bytes", "activations_bytes")}
    params_list = []
    layer_act = lo.act_seq[ckpt] * mb
    for ri in lo.ranks:
        acts = act.in_flight(st.schedule, lo.pp, lo.v, m, ri.r) * (
            ri.layers * layer_act + (lo.head_seq * mb if ri.last else 0))
        for d in range(dp):
            p_b, g_b, o_b, x_b = ri.states[d]
            for _ in range(tp):
                for k, val in (("params_bytes", p_b), ("grads_bytes", g_b), ("optimizer_bytes", o_b),
                               ("master_bytes", x_b), ("model_states_bytes", p_b + g_b + o_b + x_b),
                               ("activations_bytes", acts)):
                    lists[k].append(val)
                params_list.append(ri.numel)
    for k, xs in lists.items():
        out[f"{k}_per_rank"] = xs
    # The measured convention (harness/collect/aggregate.py): each memory figure is its own max over ranks,
    # not the figures of the rank with the highest peak (pipeline stages differ in states and activations).
    for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "master_bytes", "model_states_bytes"):
        out[k] = max(lists[k])
    out["params_per_rank_list"] = params_list
    return out


def amdahl_speedup(serial_fraction: float, n: int) -> float:
    """Amdahl (1967): speedup on n devices when a fraction f of the one-device time is serial."""
    return 1.0 / (serial_fraction + (1.0 - serial_fraction) / n)
