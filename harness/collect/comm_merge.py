"""Every rank's profiled-window figures (harness/worker/profiling.py) -> the record's measured keys.

Pure Python (no torch), so the parent process aggregates a run without importing torch.
"""
from __future__ import annotations

import statistics

from harness.collect import trace_analysis


def ab_exposed(rank_abs: list[dict]) -> dict:
    """Per-rank A/B timings -> measured keys. A step ends when its slowest rank is done (max over
    ranks), then the median over pairs, as in the timed loop."""
    abs_ = [a for a in rank_abs if a]
    if not abs_ or not all(a.get("applicable") for a in abs_):
        return {"comm_exposed_ab_pct": None, "comm_ab_note": "no sync_disabled() for this strategy"} if abs_ else {}
    sync = statistics.median(max(ts) for ts in zip(*(a["sync_s"] for a in abs_)))
    nosync = statistics.median(max(ts) for ts in zip(*(a["nosync_s"] for a in abs_)))
    out = {"comm_ab_step_sync_s": sync, "comm_ab_step_nosync_s": nosync,
           "comm_ab_collectives_sync": max(a["sync_collectives"] for a in abs_),
           "comm_ab_collectives_nosync": max(a["nosync_collectives"] for a in abs_)}
    if out["comm_ab_collectives_sync"] and out["comm_ab_collectives_nosync"] >= out["comm_ab_collectives_sync"]:
        # The flight recorder saw as many collectives without sync: the switch did not take effect.
        return {**out, "comm_exposed_ab_pct": None, "comm_ab_note": "sync_disabled() did not remove collectives"}
    out["comm_exposed_ab_pct"] = 100 * (sync - nosync) / sync
    return out


def merge(ranks: list[dict]) -> dict:
    """Every rank's window figures -> the record's measured keys (harness/collect/aggregate.py)."""
    profiles = [r.get("comm_profile") for r in ranks if r.get("comm_profile")]
    if not profiles:
        return {}
    errors = [p["error"] for p in profiles if "error" in p]
    out = trace_analysis.merge_ranks([p for p in profiles if "error" not in p]) if not errors else {}
    if errors:
        out["comm_profile_error"] = errors[0]
    out.update(ab_exposed([r.get("comm_ab") for r in ranks if r.get("comm_ab")]))
    out["profile_traces"] = sorted(f"trace_rank{r['rank']}.json" for r in ranks if r.get("comm_profile"))
    return out
