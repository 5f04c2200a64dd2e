"""Predicted vs measured: every record's `fidelity` object.

    fidelity[k]              = measured[k] / predicted[k]      for each k in KEYS both sides have
    fidelity[k_diff_points]  = measured[k] - predicted[k]      for the percentages in POINTS

A ratio of 1 is a perfect prediction; > 1 means the model under-predicts. Where the model predicts 0
and the run measured more, the ratio is None (no finite ratio: a missed term, shown as such).
Peak memory is compared only where the measurement is tensor memory (CUDA max_allocated, or a
tensor peak a strategy reports): the CPU fallback is process RSS (~220 MB of torch, allocator
caching), which a tensor-memory model cannot and should not predict.
The table of a study's ratios: `python -m harness.fidelity results/<study>.jsonl` (harness/fidelity.py).
"""
from __future__ import annotations

KEYS = ("step_time_s", "tokens_per_s", "model_states_bytes", "params_bytes", "grads_bytes", "optimizer_bytes",
        "peak_mem_bytes", "comm_share_pct", "comm_exposed_pct", "bubble_pct",
        "comm_dp_bytes", "comm_tp_bytes", "comm_pp_bytes", "comm_ep_bytes",
        # a profiled step's compute by kind of work (harness/collect/compute_classes.py)
        "compute_time_s", "compute_gemm_time_s", "compute_attention_time_s", "compute_elementwise_time_s",
        "compute_optimizer_time_s")
POINTS = ("comm_share_pct", "comm_exposed_pct", "bubble_pct")
# The goal on a 2-core CPU at world <= 2, after calibration: |ratio - 1| (or points) within these.
GOALS = {"step_time_s": 0.20, "model_states_bytes": 0.01, "comm_dp_bytes": 0.05, "comm_tp_bytes": 0.05,
         "comm_pp_bytes": 0.05, "comm_ep_bytes": 0.05, "bubble_pct_diff_points": 5.0}
RSS_KINDS = ("cpu_peak_rss",)


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def ratios(measured: dict, predicted: dict) -> dict:
    """measured/predicted for every metric both have (see the module docstring)."""
    out: dict = {}
    for k in KEYS:
        m, p = measured.get(k), predicted.get(k)
        if not (_num(m) and _num(p)):
            continue
        if k == "peak_mem_bytes" and measured.get("peak_mem_kind") in RSS_KINDS:
            continue
        if p:
            out[k] = m / p
        elif m:
            out[k] = None
        if k in POINTS:
            out[f"{k}_diff_points"] = m - p
    return out


def within_goal(fid: dict) -> dict[str, bool]:
    """Which of the study's goals this record meets (metrics it has only)."""
    out = {}
    for k, tol in GOALS.items():
        v = fid.get(k)
        if v is None:
            continue
        out[k] = abs(v) <= tol if k.endswith("_points") else abs(v - 1) <= tol
    return out
