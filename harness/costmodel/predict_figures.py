"""The figures only `predict` reports beside the planner's: FLOPs, rates, MFU, per-rank lists, Amdahl."""
from __future__ import annotations

from harness.costmodel import pipeline as pipe
from harness.costmodel.flops import hardware_flops_per_step, mfu_peak_tflops, model_flops_per_step
from harness.costmodel.layout import Layout
from harness.costmodel.memory_peak import activations_at_most

MODEL_STATE_KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "master_bytes", "model_states_bytes")


def add_predict_figures(out: dict, lo, mb: int, m: int, ckpt: str) -> dict:
    """out + FLOPs, rates, per-rank lists; each memory figure its own max over ranks, as measured
    (harness/collect/aggregate.py): pipeline stages differ in states and activations."""
    out.update(rates_and_utilisation(out, lo, mb, m, ckpt))
    out.update(per_rank_lists(lo, mb, m, ckpt))
    for k in MODEL_STATE_KEYS:
        out[k] = max(out[f"{k}_per_rank"])
    return out


def rates_and_utilisation(out: dict, lo: Layout, mb: int, m: int, ckpt: str) -> dict:
    """The figures only `predict` reports: FLOPs, rates, MFU, Amdahl, memory verdict."""
    md, hw, pl = lo.model, lo.hw, lo.place
    gbs = mb * m * pl.dp
    flops = model_flops_per_step(md.cfg, gbs)
    hw_flops = hardware_flops_per_step(md.cfg, gbs, ckpt)
    step, world = out["step_time_s"], pl.world
    peak = mfu_peak_tflops(hw.device, hw.peak, hw.rate, lo.dtype)  # FLOP/s
    speedup = hw_flops / (hw.rate.get(lo.dtype) or hw.rate["fp32"]) / step
    return {
        "params_total": md.params_total, "params_per_rank": lo.params_per_rank,
        "model_flops_per_step": flops, "hardware_flops_per_step": hw_flops,
        "tokens_per_step": gbs * md.s, "num_microbatches": m,
        "tflops_per_device": flops / step / world / 1e12,
        "mfu_pct": 100 * flops / step / world / peak if peak else None,
        "hfu_pct": 100 * hw_flops / step / world / peak if peak else None,
        "bubble_pct_schedule": pipe.bubble_pct(lo.strategy.schedule, pl.pp, pl.vpp, m),
        "speedup_vs_one_device": speedup,
        # Karp & Flatt (1990): the serial fraction e = (1/S - 1/N) / (1 - 1/N) that this one speed-up implies
        "karp_flatt_serial_fraction": ((world / speedup - 1) / (world - 1)) if world > 1 else 0.0,
        "ranks_per_node": pl.ranks_per_node, "cpu_time_sharing_factor": pl.slowdown, "cpu_memory_slowdown": pl.mem_slowdown,
        "achievable_flops_per_rank": lo.matmul_rate,
        "state_sharding": lo.strategy.state_sharding,
        "fits_in_memory": out["peak_mem_bytes"] <= hw.memory_bytes,
        "memory_headroom_bytes": hw.memory_bytes - out["peak_mem_bytes"],
        "device_memory_bytes": hw.memory_bytes,
        "peak_mem_kind": "predicted_tensor_peak",  # device tensors: on CUDA comparable with max_allocated
    }


def per_rank_lists(lo: Layout, mb: int, m: int, ckpt: str) -> dict:
    """Per-rank lists in rank order (harness/dims.py's placement; the base layout has cp = 1)."""
    keys = (*MODEL_STATE_KEYS[:4], "model_states_bytes", "activations_bytes")
    lists: dict = {k: [] for k in keys}
    params = []
    pl = lo.place
    for rank in lo.ranks:
        acts = activations_at_most(lo, rank, mb, m, ckpt)
        for p_b, g_b, o_b, x_b in rank.states:
            for _ in range(pl.tp):
                for k, val in zip(keys, (p_b, g_b, o_b, x_b, p_b + g_b + o_b + x_b, acts)):
                    lists[k].append(val)
                params.append(rank.numel)
    out = {f"{k}_per_rank": xs for k, xs in lists.items()}
    out["params_per_rank_list"] = params
    return out


def amdahl_speedup(serial_fraction: float, n: int) -> float:
    """Amdahl (1967): speedup on n devices when a fraction f of the one-device time is serial."""
    return 1.0 / (serial_fraction + (1.0 - serial_fraction) / n)
