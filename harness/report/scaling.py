"""Scaling of a study: speed-up and efficiency against a baseline, and Amdahl's serial fraction.

The study's runs share a global batch, so scaling is strong scaling and Amdahl's law applies:

    S(N) = 1 / (f + (1 - f) / N)           speed-up on N devices with serial fraction f

Fit: 1/S - 1/N = f (1 - 1/N) is linear in f, so least squares over the points (N > 1) gives
f = sum(x y) / sum(x^2) with x = 1 - 1/N, y = 1/S - 1/N. f > 1 means the runs got slower than one
device (on a 2-core CPU, ranks beyond 2 time-share cores): Amdahl's law cannot describe that and the
page says so.
"""
from __future__ import annotations


def speedup(tokens_per_s: float, base_tokens_per_s: float, base_world: int = 1) -> float:
    """Speed-up relative to one device, from a baseline that may itself use base_world devices
    (assumed perfectly efficient there, the best one can say without a one-device run)."""
    return tokens_per_s / (base_tokens_per_s / base_world)


def efficiency(speed_up: float, devices: int) -> float:
    return speed_up / devices


def amdahl(f: float, n: float) -> float:
    return 1.0 / (f + (1.0 - f) / n)


def fit_serial_fraction(points: list[tuple[int, float]]) -> float | None:
    """Least-squares serial fraction f from (devices, speed-up) points; None without a point N > 1."""
    xs = [(1 - 1 / n, 1 / s - 1 / n) for n, s in points if n > 1 and s > 0]
    den = sum(x * x for x, _ in xs)
    if not xs or den == 0:
        return None
    return sum(x * y for x, y in xs) / den


def curves(study) -> dict:
    """Per strategy: [(devices, tokens/s, speed-up, efficiency, run_id)], and the fitted f per strategy
    and for the whole study. The baseline point (world 1) is included in every strategy's curve."""
    by_strategy: dict[str, list] = {}
    for run in study.ok_runs:
        tps = run.m("tokens_per_s")
        base = study.baseline(run)
        if not tps or base is None:
            continue
        s = speedup(tps, base.m("tokens_per_s"), base.world)
        by_strategy.setdefault(run.strategy, []).append((run.world, tps, s, efficiency(s, run.world), run.run_id))
    base_all = min((study.baseline(r) for r in study.ok_runs if study.baseline(r)), key=lambda r: r.world, default=None)
    for name, pts in by_strategy.items():
        # every curve starts at the baseline, so a strategy's line shows its own scaling from there
        if base_all is not None and base_all.strategy != name and all(p[4] != base_all.run_id for p in pts):
            pts.append((base_all.world, base_all.m("tokens_per_s"), float(base_all.world), 1.0, base_all.run_id))
        pts.sort()
    fits = {name: fit_serial_fraction([(n, s) for n, _, s, _, _ in pts]) for name, pts in by_strategy.items()}
    everything = {(n, s, rid) for pts in by_strategy.values() for n, _, s, _, rid in pts}
    return {"by_strategy": by_strategy, "fits": fits, "fit_all": fit_serial_fraction([(n, s) for n, s, _ in everything]),
            "baseline": base_all}
