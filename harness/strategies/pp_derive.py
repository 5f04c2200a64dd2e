"""A dry run's middle pipeline ranks derived from the two simulated at their ends (launcher=dryrun).

A pp rank whose stages are all middle stages (no embeddings, no head, no loss) runs the same modules as
every other such rank with the same layers per stage and the same shards: the same actions on tensors of
the same shapes. What sets their steps apart is how many forwards each holds at once before backward
frees them, `in_flight`: the most forwards not yet matched by their backward anywhere in the rank's
action list (torch's own `pipeline_order`, harness/strategies/pp_shorten.py `local_order`). In 1F1B pp
rank r holds min(m, pp - r); in GPipe every rank holds all m; in the looped schedules it falls by two
chunks a rank. Each of those forwards leaves the same bytes for its backward (its saved activations,
and in a schedule that keeps its sends until the step ends, the send), so a middle rank's peak is

    peak(r) = peak(a) + (in_flight(r) - in_flight(a)) x forward_bytes

with the same step, phase (forward, backward, optimizer) and operator, where a is another rank of its group.
In 1F1B forward_bytes is what each forward of the warm-up (the forwards before the first backward) leaves
for its backward; in the looped schedules it also holds what the step keeps of the backwards that ran
before the peak, which change with the warm-up too. The dry run simulates the lowest and the highest pp
rank of each group of at least DERIVE_MIN and derives those between (`derive`) once the two it ran prove
the rule:
- the same state bytes, the same in_flight list for every pp rank (torch's order), the peak in the same
  step, phase and operator;
- their peaks, in all and kind by kind, differ by a whole number of bytes a forward in flight (`_line`);
- that number is what one warm-up forward left (`warmup_bytes`, measured on the simulated rank's own
  step), or a third rank simulated between them (`NeedWitness`: the one whose in_flight is nearest the
  middle of the ends') lies on their line to the byte, kind by kind.
A rank is derived only where its in_flight lies between the ends' (interpolation, never extrapolation).
Where a check fails every rank of the group is simulated (`measured.dryrun_not_derived` says why). The
rule holds, by test, for the schedules whose `derive_middle` is set in harness/catalog.py
(tests/test_dryrun_derive.py: every rank's peak, step and operator of a derived dry run equal the ones of
the dry run that simulates every rank); the V-shaped schedules, whose middle ranks hold a stage of each
arm of the V, peak apart from any such line and simulate every rank.

Nothing here imports torch: the launcher's parent, which never loads it, plans and derives.
"""
from __future__ import annotations

from harness import catalog
from harness.collect.dryrun import KEYS
from models.pipeline_split import stage_layer_counts

DERIVE_MIN = 3  # a group of fewer ranks has no rank between its two ends: every one is simulated
STATES = tuple(k for k in KEYS if k != "peak_mem_bytes")  # what every rank of a group holds alike


class NotDerived(ValueError):
    """The two simulated ends of a group do not follow the rule: the ranks between them are simulated."""


def in_flight(order) -> int:
    """The most forwards of `order` (pp_shorten.Action tuples) not yet matched by their backward."""
    held = most = 0
    for kind, _stage, _mb in order:
        held += {"F": 1, "B": -1}.get(kind, 0)
        most = max(most, held)
    return most


def warmup_bytes(segments: list[dict]) -> int | None:
    """What each warm-up forward left for the rest of the step, from one step's segments (harness/worker/
    measure.py LiveTensors.mark: a gap, an action, a gap, ...): the bytes at the start of each forward before
    the first backward, minus the forward before's. The first forward is left out (it may make what the step
    makes once); None where fewer than two remain or they differ."""
    starts = []
    for seg in segments[1::2]:
        if seg["label"][0] != "F":
            break
        starts.append(seg["start"])
    steps = {b - a for a, b in zip(starts[1:], starts[2:])}
    return steps.pop() if len(steps) == 1 else None


def groups(run, dims, role_key, stands_for: dict[int, int]) -> list[list[int]]:
    """The simulated ranks (keys of `stands_for`) whose middle ranks may be derived, each group in pp order:
    ranks whose stages are all middle stages, with the same role but for the pp coordinate (`role_key(rank)`:
    launch/dryrun.py) and the same layers per stage; groups of at least DERIVE_MIN."""
    s = run.strategy
    if (not run.launcher.derive or run.launcher.ranks or dims.pp < DERIVE_MIN + 2 or s.engine != "torch"
            or not catalog.schedule(s.schedule).derive_middle):
        return []
    layers = stage_layer_counts(run.model.n_layers, dims.num_stages, tuple(s.stage_layers))
    out: dict[tuple, list[int]] = {}
    for rank in stands_for:
        stages = catalog.stages_of_rank(s.schedule, dims.coords(rank)["pp"], dims.pp, dims.vpp)
        if 0 in stages or dims.num_stages - 1 in stages:
            continue
        out.setdefault((role_key(rank)[1:], tuple(layers[i] for i in stages)), []).append(rank)
    return [sorted(g, key=lambda r: dims.coords(r)["pp"]) for g in out.values() if len(g) >= DERIVE_MIN]


class NeedWitness(Exception):
    """The two ends alone do not prove the slope: simulate `rank` (between them) and derive again."""

    def __init__(self, rank: int):
        super().__init__(rank)
        self.rank = rank


def derive(group: list[int], results: dict[int, dict], dims) -> dict[int, dict]:
    """The results of the group's ranks that were not simulated, from those that were (`results` holds the
    two ends, and any rank between them simulated as a witness): see the module docstring. Raises
    NeedWitness when the ends' slope is not what one warm-up forward left and no rank between them was
    simulated, NotDerived saying which check failed."""
    lo, hi = group[0], group[-1]
    ran = [r for r in group if r in results]
    failed = [r for r in ran if "peak_mem_bytes" not in results[r]["memory"]]
    if failed:
        raise NotDerived(f"ranks {failed} have no peak: their step did not run on fake tensors")
    a, b = results[lo], results[hi]
    ma, mb = a["memory"], b["memory"]
    flights = a.get("in_flight")
    if not flights or any(results[r].get("in_flight") != flights for r in ran):
        raise NotDerived(f"ranks {ran} report different in-flight forwards: "
                         f"{[results[r].get('in_flight') for r in ran]}")
    n = {r: flights[dims.coords(r)["pp"]] for r in group}
    for r in ran:
        m = results[r]["memory"]
        for key in STATES:
            if m.get(key) != ma.get(key):
                raise NotDerived(f"ranks {lo} and {r} hold different {key}: {ma.get(key)} and {m.get(key)}")
        here = _where(m)
        if here != _where(ma):
            raise NotDerived(f"ranks {lo} and {r} peak at different places: {_where(ma)} and {here}")
    dn = n[lo] - n[hi]
    line = _line(ma, mb, dn, f"ranks {lo} and {hi}")
    if any(not min(n[lo], n[hi]) <= n[r] <= max(n[lo], n[hi]) for r in group):
        raise NotDerived(f"in-flight forwards {[n[r] for r in group]}: not all between the ends' {n[hi]} and {n[lo]}")
    witnesses = [r for r in ran if r not in (lo, hi)]
    for r in witnesses:  # a simulated rank between the ends lies on their line, kind by kind
        got = results[r]["memory"]
        want = _at(line, mb, n[r] - n[hi])
        if (got["peak_mem_bytes"], _kinds(got)) != (want["peak_mem_bytes"], want["peak_live_by_kind"]):
            raise NotDerived(f"rank {r} (in flight {n[r]}) peaks at {got['peak_mem_bytes']} bytes, not at the "
                             f"{want['peak_mem_bytes']} of the line through ranks {lo} and {hi}")
    # a witness tests the line where it holds a number of forwards between the ends'; where no rank of the group
    # does, every rank is derived at an end's number, which a witness at one tests
    between = [r for r in group if min(n[lo], n[hi]) < n[r] < max(n[lo], n[hi])]
    proven = dn == 0 or line[0] in {results[r].get("warmup_bytes") for r in (lo, hi)} or any(
        r in between or not between for r in witnesses)
    if not proven:
        if witnesses:  # chosen between the ends where a rank is: only if launcher.ranks chose otherwise
            raise NotDerived(f"ranks {witnesses} hold an end's number of forwards in flight: the line is not tested")
        middle = (n[lo] + n[hi]) / 2
        raise NeedWitness(min(between, key=lambda r: abs(n[r] - middle)) if between else group[len(group) // 2])
    out = {}
    for r in group:
        if r in results:
            continue
        memory = {key: mb[key] for key in STATES if key in mb}
        memory.update(_at(line, mb, n[r] - n[hi]))
        out[r] = {"rank": r, "coords": dims.coords(r), "env": a.get("env"), "num_threads": a.get("num_threads"),
                  "memory": memory, "wall_s": None, "in_flight": flights,
                  "derived": {"from_ranks": ran, "in_flight": n[r], "bytes_per_forward_in_flight": line[0]}}
    return out


def _where(m: dict) -> tuple:
    """The step, phase (forward, backward, optimizer: the module names differ from stage to stage) and
    operator of a peak."""
    return m.get("peak_step"), (m.get("peak_phase") or "").split(" ")[0], m.get("peak_op")


def _kinds(m: dict) -> dict:
    return {k: v for k, v in m.get("peak_live_by_kind", {}).items() if v}


def _line(ma: dict, mb: dict, dn: int, who: str) -> tuple[int, dict]:
    """(bytes, bytes by kind) a forward in flight adds, from two ranks dn forwards apart; equal peaks if dn=0."""
    diff = {k: _kinds(ma).get(k, 0) - _kinds(mb).get(k, 0) for k in _kinds(ma).keys() | _kinds(mb).keys()}
    total = ma["peak_mem_bytes"] - mb["peak_mem_bytes"]
    if dn == 0:
        if total or any(diff.values()):
            raise NotDerived(f"{who} hold as many forwards in flight but peak {total:+d} bytes apart")
        return 0, {}
    if total % dn or any(v % dn for v in diff.values()):
        raise NotDerived(f"{who} peak {total:+d} bytes apart ({diff} by kind) for {dn:+d} forwards in flight: "
                         f"not a whole number of bytes a forward")
    return total // dn, {k: v // dn for k, v in diff.items()}


def _at(line: tuple[int, dict], mb: dict, k: int) -> dict:
    """The peak k forwards in flight more than the rank whose memory is `mb`."""
    kinds = _kinds(mb)
    return {"peak_mem_bytes": mb["peak_mem_bytes"] + k * line[0], "peak_mem_kind": mb.get("peak_mem_kind"),
            "peak_step": mb.get("peak_step"), "peak_op": mb.get("peak_op"),
            "peak_live_by_kind": {kind: v for kind in kinds.keys() | line[1].keys()
                                  if (v := kinds.get(kind, 0) + k * line[1].get(kind, 0))}}
