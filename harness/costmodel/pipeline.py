"""Pipeline bubble: idle time of a rank per optimizer step, in units of one virtual stage's
forward + backward of one micro-batch (t_c = t_F + t_B + t_W, with t_F : t_B : t_W = 1 : 1 : 1,
i.e. backward twice the forward, split evenly into input- and weight-gradient halves).

    GPipe, 1F1B (Huang et al. 2019; Narayanan et al. 2019)     idle = (p-1) t_c, v = 1
    interleaved 1F1B, looped BFS (Narayanan et al. 2021)       idle = (p-1) t_c with v chunks per rank
    => bubble_pct = 100 * (p-1) / (v*m + p - 1)                (4 stages, 8 micro-batches: 27.27 %)
    ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism") idle = (p-1)(t_F + t_B - t_W) = (p-1) t_c/3
        -> interleaved_zero_bubble
    ZB-H2 / ZB-V (Qi et al. 2023, 2024)                        idle = (p-1)(t_F + t_B - 2 t_W) = 0 once
        m >= 2p fills the schedule; with fewer micro-batches ZB-H1's figure -> zbv_zero_bubble
    DualPipeV (DeepSeek-V3 report, Table 2) (p/2-1)(t_F&B + t_B - 3 t_W) = 0 with these ratios and
        m >= p; ZB-H1's figure below that -> dualpipev
    m < p: the pipeline never fills: UNFILLED_IDLE_UNITS, the schedule's own timeline (schedule.py)

On CPU the stages share the cores: a rank computes slower the more ranks compute at once (time-sharing
beyond the core count, and calibrate's co-running slowdown from two on). While the pipeline fills and
drains, or waits on a slower stage, fewer stages compute, so those actions run faster than the steady
state's. `warped_timeline` takes the schedule's own timeline (schedule.py, each stage at its own cost:
the last one holds the head and the loss) and stretches each instant by the slowdown of the stages busy
then, relative to all busy; every rank busy at that instant is slowed alike, so the stretched timeline
keeps the schedule's order and its dependencies (processor sharing with the schedule's order fixed).
"""
from __future__ import annotations

from functools import lru_cache

from harness import catalog
from harness.costmodel import schedule as sched

# idle units by the catalog's `bubble` kind of a schedule: f(pp, m)
IDLE_UNITS = {
    "textbook": lambda pp, m: float(pp - 1),
    "zb_h1": lambda pp, m: (pp - 1) / 3,
    "zbv": lambda pp, m: 0.0 if m >= 2 * pp else (pp - 1) / 3,
    "dualpipe_v": lambda pp, m: 0.0 if m >= pp else (pp - 1) / 3,
}


def _split_unfilled(pp: int, v: int, m: int) -> float:
    return (pp - 1) / 3 + v / 3 * (pp - max(m, pp / 2)) + (v - 2 / 3) * max(0.0, pp / 2 - m)


# m < pp: f(pp, v chunks per rank, m). Each micro-batch walks its v * pp chunks rank after rank and the
# ranks wait for it. Looped schedules: the first micro-batch's forward and backward take v * pp chunk
# units end to end and each further one adds one, so idle = v pp + m - 1 - v m = (p - 1) + (v - 1)(p - m)
# (v = 1: GPipe and 1F1B's p - 1, whatever m). Split backward (W fills waits): schedule.py's timeline,
# (p-1)/3 at m = p, v/3 more per micro-batch fewer down to p/2, v - 2/3 more per one below that;
# tests/test_report.py checks both against the simulator.
UNFILLED_IDLE_UNITS = {
    "textbook": lambda pp, v, m: (pp - 1) + (v - 1) * (pp - m),
    "zb_h1": _split_unfilled,
    "zbv": _split_unfilled,
    "dualpipe_v": _split_unfilled,
}


def bubble_units(schedule: str, pp: int, vpp: int, m: int) -> float:
    """Idle time per step in units of one virtual stage's t_F + t_B + t_W."""
    if pp <= 1:
        return 0.0
    row = catalog.schedule(schedule)
    if m < pp:  # the formulas above assume the pipeline fills
        return UNFILLED_IDLE_UNITS[row.bubble](pp, catalog.chunks_per_rank(schedule, vpp), m)
    return IDLE_UNITS[row.bubble](pp, m)


def bubble_pct(schedule: str, pp: int, vpp: int, m: int) -> float:
    """100 * idle / (busy + idle) on one rank: busy = v*m units, idle = bubble_units."""
    idle = bubble_units(schedule, pp, vpp, m)
    v = vpp if pp > 1 else 1
    return 100.0 * idle / (v * m + idle) if idle else 0.0


@lru_cache(maxsize=4096)
def warped_timeline(schedule: str, pp: int, vpp: int, m: int, relative: tuple,
                    stage_scale: tuple | None = None) -> tuple[float, tuple[float, ...]]:
    """(makespan, each rank's busy time) of the schedule's timeline (schedule.py; stage_scale: stages of
    unequal cost) with every instant stretched by relative[k], the time of an action while k stages
    compute over its time with all pp computing (relative[pp] = 1; relative[0], no stage busy, is 1); in
    the simulator's units (a plain chunk's forward = 1/v)."""
    events = sched.simulate(schedule, pp, m, vpp, stage_scale).events
    changes: dict[float, int] = {}
    for e in events:
        changes[e["start_s"]] = changes.get(e["start_s"], 0) + 1
        changes[e["end_s"]] = changes.get(e["end_s"], 0) - 1
    stretched_at: dict[float, float] = {0.0: 0.0}  # unstretched instant -> stretched instant
    k, t0, at = 0, 0.0, 0.0
    for t1 in sorted(changes):
        at += (t1 - t0) * relative[k]
        stretched_at[t1] = at
        k, t0 = k + changes[t1], t1
    busy = [0.0] * pp
    for e in events:
        busy[e["rank"]] += stretched_at[e["end_s"]] - stretched_at[e["start_s"]]
    return at, tuple(busy)
