"""A pure-Python pipeline schedule simulator: the Gantt chart a schedule predicts, with unit durations.

Each rank runs an ordered list of actions (F: forward of one micro-batch on one stage, B: its backward,
W: the weight-gradient half of a zero-bubble split backward). An action starts when its rank is free
and its inputs exist:

    F(s, mb) needs F(s-1, mb)          activations from the previous stage
    B(s, mb) needs B(s+1, mb), F(s, mb) gradients from the next stage (the last stage: its own F)
    W(s, mb) needs B(s, mb)            the input-gradient half ran first

Durations, per stage chunk of a rank holding `v` chunks: F = 1/v, B = 2/v (a backward is about twice
a forward); a zero-bubble split backward is B (input grads) = 1/v plus W (weight grads) = 1/v.
Communication is free here: the chart shows the schedule's own bubble, the idle time it leaves.

Orders, stage placement and warm-up counts follow torch.distributed.pipelining (the schedules brigade
runs): GPipe (all F then all B), 1F1B (warm-up p-1-r forwards, then one F one B), interleaved 1F1B
(Narayanan et al. 2021; rank r holds stages r, r+p, ..., warm-up (v-1)*m_round + 2(p-1-r)), looped BFS
(each local stage runs every micro-batch, breadth first), interleaved zero bubble (the interleaved
order with B split in B + W and each W run when the rank would otherwise wait, ZB-H1 of Qi et al.
2023), and the V-shaped schedules (zbv_zero_bubble, dualpipev: rank r holds stages r and 2p-1-r),
drawn by a greedy list scheduler with the same B-first, W-as-filler rules: an approximation of those
two, said so in `approximate`.

Bubble of a rank = 1 - busy / makespan; for GPipe and 1F1B it equals (p-1)/(m+p-1), for interleaved
1F1B (p-1)/(v*m+p-1) (the formula `formula_bubble_pct` returns).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from harness import catalog


@dataclass
class Simulation:
    schedule: str
    pp: int
    vpp: int
    num_microbatches: int
    events: list[dict] = field(default_factory=list)  # {"rank", "stage", "mb", "action", "start_s", "end_s"}
    makespan: float = 0.0
    approximate: bool = False

    def bubble_pct_per_rank(self) -> list[float]:
        busy = [0.0] * self.pp
        for e in self.events:
            busy[e["rank"]] += e["end_s"] - e["start_s"]
        return [100.0 * (1.0 - b / self.makespan) for b in busy]

    @property
    def bubble_pct(self) -> float:
        per_rank = self.bubble_pct_per_rank()
        return sum(per_rank) / len(per_rank)


def formula_bubble_pct(pp: int, num_microbatches: int, vpp: int = 1) -> float:
    """Textbook bubble fraction of a step: (p-1) / (v*m + p-1) (GPipe/1F1B: v = 1; Narayanan et al. 2021)."""
    return 100.0 * (pp - 1) / (vpp * num_microbatches + pp - 1)


def _orders(schedule: str, p: int, v: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    """Per rank, the ordered (action, stage, mb) list of a non-V schedule (W not included)."""
    out = {}
    for r in range(p):
        order = catalog.schedule(schedule).order
        if order == "all_forward_first":
            out[r] = [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)]
        elif order == "one_f_one_b":
            warm = min(p - 1 - r, m)
            ops = [("F", r, i) for i in range(warm)]
            for i in range(m - warm):
                ops += [("F", r, warm + i), ("B", r, i)]
            ops += [("B", r, i) for i in range(m - warm, m)]
            out[r] = ops
        elif order == "breadth_first":
            stages = catalog.stages_of_rank(schedule, r, p, v)
            out[r] = ([("F", s, i) for s in stages for i in range(m)]
                      + [("B", s, i) for s in reversed(stages) for i in range(m)])
        elif order == "interleaved":
            out[r] = _interleaved(p, v, m, r)
        else:
            raise ValueError(f"no explicit order for schedule {schedule}")
    return out


def _interleaved(p: int, v: int, m: int, r: int) -> list[tuple[str, int, int]]:
    # torch's ScheduleInterleaved1F1B: micro-batches go in rounds of m_round; within a round every
    # local stage (chunk) takes the round's micro-batches in turn; backward visits the chunks in reverse.
    rounds = max(1, m // p)
    if m % rounds:
        raise ValueError(f"interleaved schedule: num_microbatches {m} not divisible by rounds {rounds}")
    per_round = m // rounds
    total = m * v

    def op(k: int, backward: bool) -> tuple[str, int, int]:
        rnd, within = divmod(k, per_round * v)
        chunk, j = divmod(within, per_round)
        if backward:
            chunk = v - 1 - chunk
        return ("B" if backward else "F", r + chunk * p, rnd * per_round + j)

    warm = min(total, (v - 1) * per_round + 2 * (p - 1 - r))
    ops = [op(k, False) for k in range(warm)]
    for k in range(total - warm):
        ops += [op(warm + k, False), op(k, True)]
    ops += [op(k, True) for k in range(total - warm, total)]
    return ops


def simulate(schedule: str, pp: int, num_microbatches: int, vpp: int = 1, stage_scale: tuple | None = None) -> Simulation:
    """The predicted timeline of one step of `schedule` with unit durations (see the module docstring), or
    with stage_scale[s] times them on stage s (stages of unequal cost: the last one holds the head and loss)."""
    if schedule not in catalog.SCHEDULES:
        raise ValueError(f"unknown schedule '{schedule}'; known: {', '.join(catalog.SCHEDULES)}")
    row = catalog.schedule(schedule)
    p, m = pp, num_microbatches
    v = catalog.chunks_per_rank(schedule, vpp)
    assert p >= 1 and m >= 1 and v >= 1, (p, m, v)
    split = row.split_backward
    unit = {"F": 1.0 / v, "B": (1.0 if split else 2.0) / v, "W": 1.0 / v}
    scale = stage_scale or (1.0,) * (p * v)
    dur = {(a, st): d * scale[st] for a, d in unit.items() for st in range(p * v)}
    sim = Simulation(schedule, p, v, m, approximate=row.order == "greedy")
    if row.order == "greedy":
        sim.events = _greedy(schedule, p, v, m, dur)
    else:
        sim.events = _run_orders(schedule, p, m, _orders(schedule, p, v, m), dur, split)
    sim.makespan = max(e["end_s"] for e in sim.events)
    return sim


def _ready_time(done: dict, action: str, stage: int, mb: int, last_stage: int) -> float | None:
    """When the inputs of an action exist (None: not yet produced)."""
    if action == "F":
        return 0.0 if stage == 0 else done.get(("F", stage - 1, mb))
    if action == "B":
        own = done.get(("F", stage, mb))
        nxt = own if stage == last_stage else done.get(("B", stage + 1, mb))
        return None if own is None or nxt is None else max(own, nxt)
    return done.get(("B", stage, mb))


def _run_orders(schedule, p, m, orders, dur, split) -> list[dict]:
    """Execute fixed per-rank orders; with `split`, a rank runs a pending W whenever its next F/B
    would have to wait (and all leftover Ws at the end)."""
    last_stage = max(s for ops in orders.values() for _, s, _ in ops)
    done: dict = {}
    free = [0.0] * p
    pos = [0] * p
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    events: list[dict] = []

    def emit(r, a, s, mb, start):
        end = start + dur[(a, s)]
        done[(a, s, mb)] = end
        free[r] = end
        events.append({"rank": r, "stage": s, "mb": mb, "action": a, "start_s": start, "end_s": end})

    total_ops = sum(len(o) for o in orders.values())
    while sum(pos) < total_ops or any(pending_w):
        progressed = False
        # pick, among ranks, the action that can start earliest (event order keeps W fillers honest)
        best = None
        for r in range(p):
            if pos[r] < len(orders[r]):
                a, s, mb = orders[r][pos[r]]
                t = _ready_time(done, a, s, mb, last_stage)
                if t is not None:
                    start = max(free[r], t)
                    if best is None or start < best[0]:
                        best = (start, r, a, s, mb)
        if best is not None:
            start, r, a, s, mb = best
            # fill the wait with a weight-grad action if one fits before the inputs arrive
            if split and pending_w[r] and free[r] + dur[("W", pending_w[r][0][0])] <= start:
                ws, wmb = pending_w[r].pop(0)
                emit(r, "W", ws, wmb, free[r])
                continue
            emit(r, a, s, mb, start)
            pos[r] += 1
            if split and a == "B":
                pending_w[r].append((s, mb))
            progressed = True
        if not progressed:
            # every rank's next F/B waits on something not yet run: run the earliest-free rank's W
            cands = [r for r in range(p) if pending_w[r]]
            assert cands, f"schedule {schedule} deadlocked in the simulator"
            r = min(cands, key=lambda i: free[i])
            ws, wmb = pending_w[r].pop(0)
            emit(r, "W", ws, wmb, free[r])
    return events


def _greedy(schedule, p, v, m, dur) -> list[dict]:
    """V-shaped schedules by list scheduling: each free rank takes its ready action with priority
    B (deepest stage first) > F (within an in-flight limit, deepest stage first) > W (filler)."""
    n_stages = p * v
    last_stage = n_stages - 1
    done: dict = {}
    free = [0.0] * p
    todo = {r: [(a, s, mb) for s in catalog.stages_of_rank(schedule, r, p, v) for a in ("F", "B", "W") for mb in range(m)]
            for r in range(p)}
    in_flight = [0] * p
    limit = [2 * p] * p  # ZB-V: every rank holds at most ~2p chunk activations (1F1B rank 0 memory)
    events: list[dict] = []
    while any(todo.values()):
        best = None
        for r in range(p):
            cands = []
            for a, s, mb in todo[r]:
                t = _ready_time(done, a, s, mb, last_stage)
                if t is None:
                    continue
                if a == "F" and in_flight[r] >= limit[r]:
                    continue
                prio = {"B": 0, "F": 1, "W": 2}[a]
                cands.append((max(free[r], t), prio, -s, mb, a, s))
            if cands:
                c = min(cands)
                if best is None or (c[0], c[1]) < (best[1][0], best[1][1]):
                    best = (r, c)
        if best is None:  # only in-flight-limited forwards are left: lift the limit
            limit = [x + 1 for x in limit]
            continue
        r, (start, _, _, mb, a, s) = best
        end = start + dur[(a, s)]
        done[(a, s, mb)] = end
        free[r] = end
        todo[r].remove((a, s, mb))
        in_flight[r] += 1 if a == "F" else (-1 if a == "B" else 0)
        events.append({"rank": r, "stage": s, "mb": mb, "action": a, "start_s": start, "end_s": end})
    return events


def idle_intervals(events: list[dict], ranks: int, end: float, start: float = 0.0) -> list[dict]:
    """The gaps of each rank between `start` and `end` (the bubbles), as {"rank", "start_s", "end_s"}."""
    out = []
    for r in range(ranks):
        t = start
        for e in sorted((e for e in events if e["rank"] == r), key=lambda e: e["start_s"]):
            if e["start_s"] > t + 1e-12:
                out.append({"rank": r, "start_s": t, "end_s": e["start_s"]})
            t = max(t, e["end_s"])
        if end > t + 1e-12:
            out.append({"rank": r, "start_s": t, "end_s": end})
    return out
