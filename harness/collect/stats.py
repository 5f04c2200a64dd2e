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


# -- noise: bootstrap confidence intervals (the model for a comparison is pyperf's and asv's) --------
# Resamples per interval. A fixed seed makes every interval a pure function of its samples: the same
# records always give the same table, report and `harness.compare` verdict.
BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 95.0
_SEED = 0x5EED


def _medians(groups: list[list[float]], rng, resamples: int) -> list[float]:
    """Two-level bootstrap of the pooled median: draw the groups (repeats) with replacement, then each
    drawn group's samples (steps) with replacement. Between-repeat drift (another job on the machine,
    a clock change between repeats) widens the interval, not only the scatter within one run."""
    out = []
    for _ in range(resamples):
        pool: list[float] = []
        for g in (groups[rng.randrange(len(groups))] for _ in groups):
            pool.extend(g[rng.randrange(len(g))] for _ in g)
        out.append(statistics.median(pool))
    return out


def median_ci(groups: list[list[float]], resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float, float]:
    """(median, lo, hi): the median of every sample pooled and its bootstrap 95 % interval.
    groups: one list of step times per repeat (one group: a run's own interval, over its steps)."""
    import random

    groups = [list(g) for g in groups if g]
    if not groups:
        raise ValueError("median_ci needs at least one sample")
    draws = _medians(groups, random.Random(_SEED), resamples)
    tail = (100 - CONFIDENCE) / 2
    return statistics.median([x for g in groups for x in g]), percentile(draws, tail), percentile(draws, 100 - tail)


def ratio_ci(a: list[list[float]], b: list[list[float]],
             resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float, float]:
    """(ratio, lo, hi): median(b) / median(a) and its bootstrap 95 % interval, a and b resampled
    independently (two studies are two independent sets of repeats)."""
    import random

    rng = random.Random(_SEED)
    da, db = _medians(a, rng, resamples), _medians(b, rng, resamples)
    ratios = [y / x for x, y in zip(da, db)]
    tail = (100 - CONFIDENCE) / 2
    point = statistics.median([x for g in b for x in g]) / statistics.median([x for g in a for x in g])
    return point, percentile(ratios, tail), percentile(ratios, 100 - tail)


def throughput_ci(groups_or_steps: list, tokens_per_step: float) -> dict:
    """The 95 % intervals of the median step time and of tokens/s (tokens per step / step time, so
    its bounds are the step interval's, swapped). Takes a run's step times or a list of repeats'."""
    groups = groups_or_steps if groups_or_steps and isinstance(groups_or_steps[0], list) else [groups_or_steps]
    _, lo, hi = median_ci(groups)
    return {"step_time_s_ci95": [lo, hi], "tokens_per_s_ci95": [tokens_per_step / hi, tokens_per_step / lo]}
