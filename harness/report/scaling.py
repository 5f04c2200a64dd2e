"""Scaling of a study, one series at a time: speed-up, efficiency, the Karp-Flatt metric, and a fit
of Amdahl's (strong) or Gustafson's (weak) law with its residual.

A series is a set of runs meant to be read as one curve. The study says which (`series: strong` in a
run of its `runs:` list, conf/experiment/scaling.yaml); a run without one belongs to its strategy's
series at its global batch, which also holds the study's one-device run of the same model and batch
as its baseline. A series is strong scaling when its global batch is the same at every device count,
weak when the batch per device is; anything else is shown without a fit.

    speed-up     S(N) = tokens/s(N) / (tokens/s(b) / N_b)   against the series' smallest run b
    efficiency   E(N) = S(N) / N                            (weak scaling: tokens/s per device kept)
    Karp-Flatt   e(N) = (1/S - 1/N) / (1 - 1/N)             the serial fraction one point implies
                                                            (Karp & Flatt 1990); strong series only
    Amdahl       S(N) = 1 / (f + (1 - f) / N)               strong: least squares of 1/S - 1/N = f (1 - 1/N)
    Gustafson    S(N) = N - f (N - 1)                       weak: least squares of N - S = f (N - 1)

A fit needs 3 device counts (two points always fit a one-parameter curve exactly, so the residual
would say nothing); the residual is the RMS of measured minus fitted speed-up. f > 1 means the runs
got slower than one device (on a 2-core CPU, ranks beyond 2 time-share the cores): neither law
describes that, and the page says so.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from harness import catalog

MIN_FIT_POINTS = 3


@dataclass
class Point:
    devices: int
    tokens_per_s: float
    speedup: float
    efficiency: float
    karp_flatt: float | None  # None at N = 1 and in weak series
    run_id: str
    label: str


@dataclass
class Fit:
    law: str  # "Amdahl" | "Gustafson"
    serial_fraction: float
    rms_residual: float  # RMS of measured - fitted speed-up, in x
    n_points: int

    def speedup(self, n: float) -> float:
        return amdahl(self.serial_fraction, n) if self.law == "Amdahl" else gustafson(self.serial_fraction, n)


@dataclass
class Series:
    name: str
    kind: str  # "strong" | "weak" | "mixed"
    points: list[Point] = field(default_factory=list)
    fit: Fit | None = None
    baseline_label: str = ""

    @property
    def baseline_tokens_per_s_per_device(self) -> float:
        b = self.points[0]
        return b.tokens_per_s / b.devices


def speedup(tokens_per_s: float, base_tokens_per_s: float, base_world: int = 1) -> float:
    """Speed-up relative to one device, from a baseline that may itself use base_world devices
    (assumed perfectly efficient there, the best one can say without a one-device run)."""
    return tokens_per_s / (base_tokens_per_s / base_world)


def karp_flatt(s: float, n: int) -> float | None:
    return (1 / s - 1 / n) / (1 - 1 / n) if n > 1 and s > 0 else None


def amdahl(f: float, n: float) -> float:
    return 1.0 / (f + (1.0 - f) / n)


def gustafson(f: float, n: float) -> float:
    return n - f * (n - 1)


def fit_serial_fraction(points: list[tuple[int, float]]) -> float | None:
    """Amdahl's f by least squares from (devices, speed-up) points; None without a point N > 1."""
    xs = [(1 - 1 / n, 1 / s - 1 / n) for n, s in points if n > 1 and s > 0]
    den = sum(x * x for x, _ in xs)
    return sum(x * y for x, y in xs) / den if xs and den else None


def fit_gustafson(points: list[tuple[int, float]]) -> float | None:
    """Gustafson's f by least squares from (devices, scaled speed-up) points."""
    xs = [(n - 1, n - s) for n, s in points if n > 1]
    den = sum(x * x for x, _ in xs)
    return sum(x * y for x, y in xs) / den if xs and den else None


def fit(kind: str, points: list[tuple[int, float]]) -> Fit | None:
    """The law of the series' kind fitted over its points, None under MIN_FIT_POINTS device counts."""
    if kind not in ("strong", "weak") or len({n for n, _ in points}) < MIN_FIT_POINTS:
        return None
    law, f = ("Amdahl", fit_serial_fraction(points)) if kind == "strong" else ("Gustafson", fit_gustafson(points))
    if f is None:
        return None
    out = Fit(law, f, 0.0, len(points))
    out.rms_residual = math.sqrt(sum((s - out.speedup(n)) ** 2 for n, s in points) / len(points))
    return out


def _kind(runs) -> str:
    batches = {r.cfg("workload", "global_batch_size") for r in runs}
    if len(batches) == 1:
        return "strong"
    per_device = {r.cfg("workload", "global_batch_size") / r.world for r in runs}
    return "weak" if len(per_device) == 1 else "mixed"


def _groups(study) -> dict[str, list]:
    """Series name -> ok runs with a throughput, first-seen order."""
    ok = [r for r in study.ok_runs if r.m("tokens_per_s")]
    batches: dict[str, set] = {}
    for r in ok:
        batches.setdefault(r.strategy, set()).add(r.cfg("workload", "global_batch_size"))
    groups: dict[str, list] = {}
    for r in ok:
        if r.series:
            name = r.series
        else:
            many = len(batches[r.strategy]) > 1
            name = r.strategy + (f" batch {r.cfg('workload', 'global_batch_size')}" if many else "")
        groups.setdefault(name, []).append(r)
    # an unnamed series without a one-device run starts at the study's one-device run of the same model and batch
    for runs in groups.values():
        if runs[0].series or any(r.world == 1 for r in runs):
            continue
        same = [b for b in ok if b.world == 1 and not b.series
                and b.cfg("model", "name") == runs[0].cfg("model", "name")
                and b.cfg("workload", "global_batch_size") == runs[0].cfg("workload", "global_batch_size")]
        if same:
            # the run with no parallel axis at all (the reference strategy) before a dp strategy at 1
            runs.insert(0, min(same, key=lambda b: (len(getattr(catalog.STRATEGIES.get(b.strategy), "axes", ())),
                                                    b.run_id)))
    # a series that is only some other series' baseline is not a curve of its own
    shown = {id(r) for n, runs in groups.items() for r in runs if len(runs) > 1}
    return {n: runs for n, runs in groups.items() if len(runs) > 1 or id(runs[0]) not in shown}


def series(study) -> list[Series]:
    """Every series of the study with at least two device counts."""
    out = []
    for name, runs in _groups(study).items():
        if len({r.world for r in runs}) < 2:
            continue
        kind = _kind(runs)
        base = min(runs, key=lambda r: (r.world, r.run_id))
        s = Series(name, kind, baseline_label=base.label)
        for r in sorted(runs, key=lambda r: (r.world, r.run_id)):
            sp = speedup(r.m("tokens_per_s"), base.m("tokens_per_s"), base.world)
            s.points.append(Point(r.world, r.m("tokens_per_s"), sp, sp / r.world,
                                  karp_flatt(sp, r.world) if kind == "strong" else None, r.run_id, r.label))
        s.fit = fit(kind, [(p.devices, p.speedup) for p in s.points])
        out.append(s)
    return out
