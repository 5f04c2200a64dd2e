"""Step-time statistics: pure Python, so the parent process aggregates without importing torch."""
from __future__ import annotations

import statistics


def percentile(xs: list[float], q: float) -> float:
    """Linearly interpolated percentile, q in [0, 100] (numpy's default method)."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def step_stats(step_times: list[float]) -> dict[str, float]:
    return {"step_time_s": statistics.median(step_times),
            "step_time_s_p10": percentile(step_times, 10),
            "step_time_s_p90": percentile(step_times, 90),
            "step_time_s_mean": statistics.fmean(step_times),
            "step_time_s_std": statistics.pstdev(step_times)}
