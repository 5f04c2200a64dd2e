"""A dry run's pipeline step shortened to the micro-batches that decide its peak (launcher=dryrun).

A rank of a pipeline runs an ordered list of actions, F / B / W of one micro-batch on one of its
stages: torch's own `schedule.pipeline_order[rank]` (GPipe, 1F1B, the looped, zero-bubble and V
runtimes alike). For many schedules the list for m micro-batches is the list for fewer, m', with
copies of one block of actions inserted at one place, each copy the one before with its micro-batch
indices moved on by the same number q; the actions after the copies are the same with their indices
moved on by m - m' (a 1F1B rank's steady state is one B and one F a copy, its warm-up before them and
its cool-down after them).

The bytes a step holds at any moment depend on which actions ran before it, not on which come next.
So a copy inserted into the list holds what the copy before it held, plus what each copy leaves
behind for the rest of the step (delta: a loss the last stage keeps, the sends a multi-stage
schedule holds until the step ends); every action after the copies holds what it held in the short
step plus delta for every copy inserted. What a stage makes once per micro-batch of the whole step
when the schedule starts (torch's receive buffers, the step's batch) is made for all m micro-batches
in the shortened step too (harness/strategies/pp_fake.py).

`find_splice` proves the first part from the two action lists alone; the short step then runs with
COPIES copies before the place where the others go, harness/worker/measure.py's LiveTensors marks
every action, and `extrapolate` checks the second part on the last VERIFIED copies (each one's bytes at
its start and at its highest, what was live then by kind and by operator, and where the highest came,
are the copy before's plus the same delta) and gives the full step's peak, its step and phase, from
the short one's: the highest of the short step's own actions, the inserted copies (the last one when
delta is positive) and the actions after them. The first copy may differ from the rest (the step's
first backward makes the gradients), and so may the gap after it, so the last two copies are compared. Where
no such splice exists
(GPipe and looped BFS hold every micro-batch until their backward: their peak grows with m) or the
check fails, every micro-batch runs.
"""
from __future__ import annotations

from dataclasses import dataclass

COPIES = 4  # copies of the repeated block the short step runs before the inserted ones
VERIFIED = 2  # of them, the last ones whose bytes must repeat: the first may hold the step's first backward,
# and so may the gap after it (1F1B keeps the input gradient it sent until the next backward's replaces it: after
# the first backward there is none from before)
KIND = {"F": "F", "B": "B", "I": "B", "W": "W"}  # torch's computation types -> the stage method that runs it

Action = tuple  # (kind "F" | "B" | "W", stage index, micro-batch index)


@dataclass(frozen=True)
class Splice:
    microbatches: int  # m': the micro-batches the short step runs
    at: int  # actions of the short order before the inserted copies
    period: int  # actions per copy
    shift: int  # micro-batches a copy moves on
    copies: int  # copies inserted to make the full order
    order: tuple  # the short step's actions, as this rank must run them

    def as_dict(self) -> dict:
        return {"simulated_microbatches": self.microbatches, "splice_at_action": self.at, "period_actions": self.period,
                "period_microbatches": self.shift, "copies_extrapolated": self.copies}


def local_order(schedule, pp_rank: int, m: int) -> list[Action]:
    """This rank's compute actions in the order torch's schedule for m micro-batches runs them
    (overlapped pairs flattened). torch 2.13's 1F1B `pipeline_order` numbers the last rank's forwards
    1..m, which its step runs as 0..m-1 (every stage runs its forwards in micro-batch order): a kind
    whose numbers reach m is renumbered in the order it runs. What ran is checked against it (extrapolate)."""
    out = []
    for action in schedule.pipeline_order[pp_rank]:
        for sub in (action.sub_actions or (action,)) if action is not None else ():
            kind = KIND.get(sub.computation_type.value)
            if kind is not None:
                out.append((kind, sub.stage_index, sub.microbatch_index))
    off = {(kind, stage) for kind, stage, mb in out if mb >= m}
    seen: dict = {}
    for i, (kind, stage, _) in enumerate(out):
        if (kind, stage) in off:
            seen[kind, stage] = seen.get((kind, stage), -1) + 1
            out[i] = (kind, stage, seen[kind, stage])
    return out


def find_splice(full: list[Action], m: int, order_of, bound: int) -> Splice | None:
    """The splice with the fewest micro-batches: `order_of(m2)` is the rank's order for m2 micro-batches,
    None where torch refuses m2; m2 is tried from 1 up to `bound` (a splice needs few copies, so it is
    found well below a bound of a few rounds of the pipeline, or not at all)."""
    for m2 in range(1, min(m, bound + 1)):
        short = order_of(m2)
        if short is None:
            continue
        found = _splice(full, short, m - m2)
        if found is not None:
            return Splice(m2, *found, tuple(short))
    return None


def _splice(full: list[Action], short: list[Action], d: int) -> tuple[int, int, int, int] | None:
    """(at, period, shift, copies): full = short[:at] + copies + short[at:] moved on by d micro-batches,
    the copies continuing the COPIES copies that end short[:at]; None if no such split exists."""
    extra = len(full) - len(short)
    if extra <= 0:
        return None
    lcp = 0
    while lcp < len(short) and full[lcp] == short[lcp]:
        lcp += 1
    lcs = 0  # the longest tail of short that, moved on by d, ends full
    while lcs < len(short) and _moved(short[-1 - lcs], d) == full[-1 - lcs]:
        lcs += 1
    for at in range(min(lcp, len(short)), len(short) - lcs - 1, -1):
        for period in (b for b in range(1, extra + 1) if extra % b == 0):
            if at < COPIES * period:
                break
            shift = full[at][2] - full[at - period][2]
            if shift <= 0 or shift * (extra // period) != d:
                continue
            if all(_moved(full[n - period], shift) == full[n] for n in range(at - (COPIES - 1) * period, at + extra)):
                return at, period, shift, extra // period
    return None


def _moved(action: Action, d: int) -> Action:
    return action[0], action[1], action[2] + d


def extrapolate(steps: list[list[dict]], splice: Splice) -> dict:
    """The full step's peak from the short step's segments (harness/worker/measure.py LiveTensors.mark),
    per step: [before the first action, action 0, between 0 and 1, action 1, ..., after the last action].
    Raises NotPeriodic when the copies' bytes do not repeat."""
    best = None  # (bytes, step, at, by_kind, by_op)
    for step, segs in enumerate(steps, 1):
        n = (len(segs) - 1) // 2
        if n != len(splice.order) or [s["label"] for s in segs[1::2]] != list(splice.order):
            raise NotPeriodic(f"step {step} ran {[s['label'] for s in segs[1::2]][:12]}..., not torch's order for "
                              f"{splice.microbatches} micro-batches")
        at, b = splice.at, splice.period
        delta = _delta(segs[2 * at], segs[2 * (at - b)])
        for copy in range(VERIFIED - 1):  # each verified copy against the one before it
            hi = 2 * (at - copy * b)
            for u in range(-2 * b, 0):
                _check(segs[hi + u], segs[hi + u - 2 * b], delta, step)
        candidates = [(s, 0) for s in segs[:2 * at]]
        candidates += [(s, j) for j in sorted({1, splice.copies}) for s in segs[2 * (at - b):2 * at]]
        candidates += [(s, splice.copies) for s in segs[2 * at:]]
        for seg, times in candidates:
            peak = seg["max"] + times * delta[0]
            if best is None or peak > best[0]:
                best = (peak, step, seg["at"], times, delta)
    peak, step, at, times, delta = best
    by_kind = _plus(at["live_by_kind"], delta[1], times)
    by_op = _plus(at["live_by_op"], delta[2], times)
    return {"peak_bytes": peak, "peak_step": step, "peak_phase": at["phase"], "peak_op": at["op"],
            "peak_live_by_kind": {k: v for k, v in by_kind.items() if v},
            "peak_live_by_op": dict(sorted(((k, v) for k, v in by_op.items() if v), key=lambda kv: -kv[1])[:TOP_OPS])}


TOP_OPS = 12  # as harness/worker/measure.py keeps


class NotPeriodic(RuntimeError):
    """The short step's copies did not hold the same bytes plus one delta: every micro-batch must run."""


def _delta(later: dict, earlier: dict) -> tuple[int, dict, dict]:
    return (later["start"] - earlier["start"], _minus(later["start_by_kind"], earlier["start_by_kind"]),
            _minus(later["start_by_op"], earlier["start_by_op"]))


def _check(seg: dict, before: dict, delta: tuple, step: int) -> None:
    same = (seg["label"] == before["label"] if seg["label"][0] == "gap" else seg["label"][:2] == before["label"][:2])
    here = _delta(seg, before)
    tops = (seg["max"] - before["max"], _minus(seg["at"]["live_by_kind"], before["at"]["live_by_kind"]),
            _minus(seg["at"]["live_by_op"], before["at"]["live_by_op"]))
    where = (seg["at"]["phase"], seg["at"]["op"]) == (before["at"]["phase"], before["at"]["op"])
    if not (same and here == delta and tops == delta and where):
        raise NotPeriodic(f"step {step}: {seg['label']} held {here[0]:+d} bytes at its start and {tops[0]:+d} at its "
                          f"highest ({seg['at']['phase']}) against the copy before, not the copies' delta {delta[0]:+d}")


def _minus(a: dict, b: dict) -> dict:
    return {k: v for k in a.keys() | b.keys() if (v := a.get(k, 0) - b.get(k, 0))}


def _plus(a: dict, d: dict, times: int) -> dict:
    return {k: a.get(k, 0) + times * d.get(k, 0) for k in a.keys() | d.keys()}


def plan(make, m: int, pp_rank: int, chunks: int, full=None) -> Splice | None:
    """The splice of this rank's order for `m` micro-batches with the fewest micro-batches, or None.
    make(n): the rank's torch schedule for n micro-batches (built, not run); full: make(m), where built already;
    chunks: the stages of the pipeline (pp x stages per rank), which bounds the search (see find_splice)."""
    def order_of(n: int) -> list[Action] | None:
        try:
            return local_order(make(n), pp_rank, n)
        except (ValueError, RuntimeError, AssertionError):  # torch refuses n micro-batches for this schedule
            return None

    return find_splice(local_order(full or make(m), pp_rank, m), m, order_of, (COPIES + 3) * chunks)
