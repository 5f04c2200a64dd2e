r"""Communication share from one rank's profiler trace: total, overlapped and exposed, by axis.

Pure Python (no torch): it reads the Chrome trace that harness/worker/measure.py saved, so stored traces
can be analysed anywhere (tests/fixtures/traces/).

What counts as what, per rank, inside the profiled steps (the `brigade/step` annotations):

    steps    S = union of the step annotations (main thread)
    comm     C = union of collective intervals, clipped to S
                 CPU/gloo: `gloo:*` events; collectives run on the process group's worker threads,
                 send/recv show on the main thread as the blocking wait for the transfer
                 CUDA/NCCL: the NCCL kernels on their stream
    compute  K = union of compute intervals, clipped to S
                 CPU: main-thread operators (cpu_op), less the time inside communication operators
                 or waits on them (a DTensor wait_tensor runs inside the aten op that needed it)
                 CUDA: every non-NCCL kernel
    overlapped = |C ∩ K|,  exposed = |C \ K| = |C| - |C ∩ K|
    comm_share_pct = 100 |C| / |S|,   comm_exposed_pct = 100 |C \ K| / |S|

A union, not a sum, so two collectives in flight at once (two buckets, two axes) count once; per
axis and per collective the same union is taken over that axis' (collective's) events alone, so the
breakdown can add up to more than the total when axes overlap each other.

Attributing a gloo event to an axis: gloo events carry no process group (torch 2.13's gloo backend
emits no `record_param_comms` events, which on NCCL name the group), so each is matched with the
c10d flight-recorder entry that enqueued it (same collective, same element count, created before the
event started, earliest first: a process group runs its queue in order). The profiled steps' entries
are known by record id (measure.py reads the next id before and after each step), not by creation
time: the recorder's clock and the profiler's differ by microseconds. The entry names the
process group; profiling.py recorded which mesh axis each group is. Point-to-point ops are not in
gloo's flight recorder: they are the pipeline's (pp) when pp > 1. An event that cannot be matched
takes the axis of other events on the same worker thread (each process group has its own threads),
else "unknown": never dropped.

Why not Holistic Trace Analysis: HTA reads GPU kernels (its comm/compute overlap is NCCL kernels
against compute kernels per rank), so it has nothing to say about gloo's CPU threads and nothing per
axis; the interval algebra here is the same on both devices, so CPU and CUDA figures mean the same.

Caveats, with figures in results/README.md: on 2 CPU cores the gloo threads compete with compute, so
"overlapped" time is not free (the A/B figure `comm_exposed_ab_pct` is the honest exposed cost); a
collective's interval includes the wait for the slowest peer to arrive; a pipeline recv's wait
includes the time the previous stage spends computing (part of the bubble).
"""
from __future__ import annotations

import bisect
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

from harness.collect import compute_classes
from harness.collect.compute_classes import intersect, length, subtract, union
from harness.dims import COMM_AXES

STEP_EVENT = "brigade/step"
# Main-thread operators that are communication or a wait for it, never compute.
_NOT_COMPUTE = re.compile(r"^(c10d::|gloo:|nccl:|_c10d_functional::|c10d_functional::|record_param_comms)|wait",
                          re.IGNORECASE)
_NCCL_KERNEL = re.compile(r"nccl", re.IGNORECASE)


# -- loading ------------------------------------------------------------------------------------
def load(path) -> dict:
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt") as f:
        return json.load(f)


# -- the analysis -------------------------------------------------------------------------------
def analyse(trace: dict) -> dict:
    """Per-rank communication figures of one trace, per profiled step (see the module docstring)."""
    meta = trace.get("brigade", {})
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps_ev = [e for e in events if e.get("name") == STEP_EVENT and e.get("cat") != "gpu_user_annotation"]
    if not steps_ev:
        raise ValueError(f"no '{STEP_EVENT}' events in the trace: not a brigade profiled window")
    main = (steps_ev[0]["pid"], steps_ev[0]["tid"])
    steps = union((e["ts"], e["ts"] + e["dur"]) for e in steps_ev)
    n_steps = len(steps_ev)
    cuda = any(e.get("cat") == "kernel" for e in events)

    if cuda:
        comm_ev = [e for e in events if e.get("cat") == "kernel" and _NCCL_KERNEL.search(e["name"])]
        compute_ev = [e for e in events if e.get("cat") == "kernel" and not _NCCL_KERNEL.search(e["name"])]
    else:
        comm_ev = [e for e in events if e["name"].startswith("gloo:")]
        on_main = [e for e in events if (e["pid"], e["tid"]) == main and e.get("cat") == "cpu_op"]
        compute_ev = [e for e in on_main if not _NOT_COMPUTE.search(e["name"])]
        blocked_ev = [e for e in on_main if _NOT_COMPUTE.search(e["name"])]
    span = lambda evs: union((e["ts"], e["ts"] + e["dur"]) for e in evs)  # noqa: E731
    compute = intersect(span(compute_ev), steps)
    if not cuda:  # a wait inside an operator (DTensor waits inside aten::add) is not compute
        compute = subtract(compute, span(blocked_ev))
    comm = intersect(span(comm_ev), steps)
    overlapped = intersect(comm, compute)

    step_s = length(steps) / n_steps / 1e6  # trace times are microseconds
    comm_s = length(comm) / n_steps / 1e6
    overlap_s = length(overlapped) / n_steps / 1e6
    out = {"profiled_steps": n_steps, "profiled_step_time_s": step_s, "comm_time_s": comm_s,
           "comm_overlapped_time_s": overlap_s, "comm_exposed_time_s": comm_s - overlap_s,
           "compute_time_s": length(compute) / n_steps / 1e6,
           "comm_share_pct": 100 * comm_s / step_s if step_s else 0.0,
           "comm_exposed_pct": 100 * (comm_s - overlap_s) / step_s if step_s else 0.0,
           "device": "cuda" if cuda else "cpu"}
    for name, us in compute_classes.split(compute, compute_ev, events, cuda).items():
        out[f"compute_{name}_time_s"] = us / n_steps / 1e6
    if cuda:
        out["compute_top_kernels"] = compute_classes.top_kernels(compute_ev, steps, n_steps)

    entries = flight_entries(trace, events)
    label = attribute(comm_ev, entries, meta, cuda)
    by_axis: dict = defaultdict(dict)
    groups: dict = defaultdict(list)
    for e in comm_ev:
        groups[label[id(e)]].append(e)
    for (axis, coll), evs in sorted(groups.items()):
        in_window = [e for e in evs if inside(e["ts"], steps)]
        if not in_window:
            continue  # e.g. the barrier between profiled steps
        ivs = intersect(span(evs), steps)
        t = length(ivs) / n_steps / 1e6
        by_axis[axis][coll] = {"time_s": t, "exposed_s": t - length(intersect(ivs, compute)) / n_steps / 1e6,
                               "count": len(in_window) / n_steps}
    axis_totals = {}
    for axis in by_axis:
        ivs = intersect(span([e for (a, _), evs in groups.items() if a == axis for e in evs]), steps)
        axis_totals[axis] = {"time_s": length(ivs) / n_steps / 1e6,
                             "exposed_s": (length(ivs) - length(intersect(ivs, compute))) / n_steps / 1e6}
    # Bytes: the flight recorder's entries of the profiled steps (each names its group and sizes),
    # plus point-to-point from the trace where the recorder has none (gloo does not log send/recv).
    for (axis, coll), b in count_bytes(trace, entries, meta, steps, n_steps).items():
        slot = by_axis[axis].setdefault(coll, {"time_s": 0.0, "exposed_s": 0.0, "count": 0.0})
        slot.update(b)
    out["comm_by_axis"] = {a: dict(v) for a, v in by_axis.items()}
    out["comm_time_by_axis_s"] = {a: v["time_s"] for a, v in axis_totals.items()}
    out["comm_exposed_by_axis_s"] = {a: v["exposed_s"] for a, v in axis_totals.items()}
    out["comm_bytes_by_axis"] = {a: sum(c.get("bytes", 0.0) for c in v.values()) for a, v in by_axis.items()}
    out["comm_bytes_as_run_by_axis"] = {a: sum(c.get("bytes_as_run", c.get("bytes", 0.0)) for c in v.values())
                                        for a, v in by_axis.items()}
    return out


def count_bytes(trace: dict, entries: list[dict], meta: dict, steps, n_steps: int) -> dict:
    """(axis, collective) -> {bytes, msg_bytes, calls} per step. `bytes`: what this rank sends for the
    collective asked for (bus_bytes); `bytes_as_run` where the backend ran another one (gloo runs a
    reduce-scatter as an all-reduce of the whole input); `msg_bytes`: the input as the caller gave it."""
    acc: dict = defaultdict(lambda: {"bytes": 0.0, "bytes_as_run": 0.0, "msg_bytes": 0.0, "calls": 0})
    for en in entries:
        if en["n"] <= 1 and not en["p2p"]:
            continue
        slot = acc[(pg_axis(meta, en["pg"], en["coll"]), en["coll"])]
        slot["bytes"] += bus_bytes(en["coll"], en["in_bytes"], en["out_bytes"], en["n"])
        slot["bytes_as_run"] += bus_bytes(en["run"], en["in_bytes"], en["out_bytes"], en["n"])
        slot["msg_bytes"] += en["in_bytes"]
        slot["calls"] += 1
    if not any(en["p2p"] for en in entries):
        # gloo: send/recv from the trace (shapes recorded), inside the profiled steps
        for e in trace["traceEvents"]:
            if e.get("ph") != "X" or e.get("name") not in ("gloo:send", "gloo:recv") or not inside(e["ts"], steps):
                continue
            args = e.get("args", {})
            dims = args.get("Input Dims") or [[]]
            b = sum(numel(d) for d in dims if isinstance(d, list)) * dtype_bytes((args.get("Input type") or ["float"])[0])
            coll = collective_name(e["name"])
            slot = acc[(meta.get("p2p_axis", "unknown"), coll)]
            slot["bytes"] += bus_bytes(coll, b, b, 2)
            slot["bytes_as_run"] += bus_bytes(coll, b, b, 2)
            slot["msg_bytes"] += b
            slot["calls"] += 1
    out = {}
    for k, v in acc.items():
        row = {"bytes": v["bytes"] / n_steps, "msg_bytes": v["msg_bytes"] / n_steps, "calls": v["calls"] / n_steps}
        if abs(v["bytes_as_run"] - v["bytes"]) > 1e-6 * max(1.0, v["bytes"]):
            row["bytes_as_run"] = v["bytes_as_run"] / n_steps
        out[k] = row
    return out


# -- across ranks (parent side) -----------------------------------------------------------------
def merge_ranks(per_rank: list[dict]) -> dict:
    """Per-rank figures -> the record's measured keys. Shares and times: mean over ranks (the typical
    rank; every rank's own figure is kept in *_per_rank). Bytes: max over ranks (the busiest rank,
    what bounds the step), per-rank lists beside."""
    per_rank = [r for r in per_rank if r]
    if not per_rank:
        return {}
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    out: dict = {}
    for k in ("comm_share_pct", "comm_exposed_pct", "comm_time_s", "comm_exposed_time_s", "comm_overlapped_time_s",
              "profiled_step_time_s", "compute_time_s", *compute_classes.KEYS):
        if not all(k in r for r in per_rank):
            continue  # a profile from before the compute split (stored records)
        vals = [r[k] for r in per_rank]
        out[k] = mean(vals)
        if k.endswith("_pct"):
            out[f"{k}_per_rank"] = vals
    tops = [r["compute_top_kernels"] for r in per_rank if r.get("compute_top_kernels")]
    if tops:  # every rank runs the same kernels; the first rank's list
        out["compute_top_kernels"] = tops[0]
    axes = sorted({a for r in per_rank for a in r["comm_by_axis"]})
    by_axis: dict = {}
    for a in axes:
        colls = sorted({c for r in per_rank for c in r["comm_by_axis"].get(a, {})})
        by_axis[a] = {}
        for c in colls:
            rows = [r["comm_by_axis"].get(a, {}).get(c, {}) for r in per_rank]
            by_axis[a][c] = {"time_s": mean([x.get("time_s", 0.0) for x in rows]),
                             "exposed_s": mean([x.get("exposed_s", 0.0) for x in rows]),
                             "count": max(x.get("count", 0.0) for x in rows),
                             "bytes": max(x.get("bytes", 0.0) for x in rows),
                             "msg_bytes": max(x.get("msg_bytes", 0.0) for x in rows)}
            if any("bytes_as_run" in x for x in rows):
                by_axis[a][c]["bytes_as_run"] = max(x.get("bytes_as_run", x.get("bytes", 0.0)) for x in rows)
    out["comm_by_axis"] = by_axis
    out["comm_share_by_axis_pct"] = {a: mean([100 * r.get("comm_time_by_axis_s", {}).get(a, 0.0)
                                              / r["profiled_step_time_s"] for r in per_rank]) for a in axes}
    out["comm_exposed_by_axis_pct"] = {a: mean([100 * r.get("comm_exposed_by_axis_s", {}).get(a, 0.0)
                                                / r["profiled_step_time_s"] for r in per_rank]) for a in axes}
    out["comm_bytes_by_axis"] = {a: max(r["comm_bytes_by_axis"].get(a, 0.0) for r in per_rank) for a in axes}
    out["comm_bytes_by_axis_per_rank"] = {a: [r["comm_bytes_by_axis"].get(a, 0.0) for r in per_rank] for a in axes}
    for a in COMM_AXES:  # the measured twins of the cost model's comm_<axis>_bytes (the collective asked for) ...
        out[f"comm_{a}_bytes"] = out["comm_bytes_by_axis"].get(a, 0.0)
        # ... and what the backend ran (gloo: a reduce-scatter as an all-reduce of the whole input)
        out[f"comm_{a}_bytes_as_run"] = max((r.get("comm_bytes_as_run_by_axis", {}).get(a, 0.0) for r in per_rank),
                                            default=0.0)
    return out


# -- comm names ------------------------------------------------------------------------------------
# Collective names, element sizes and bus bytes as the profiler, gloo, NCCL and c10d's flight
# recorder spell them (pure). Used by the analysis below and by the flight recorder section.

P2P = ("send", "recv")
_NCCL_NAMES = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
               "broadcast": "broadcast", "reduce": "reduce", "sendrecv": "send_recv", "alltoall": "all_to_all"}
# Element sizes by the dtype names the flight recorder (c10 ScalarType) and the profiler (C++ type) use.
DTYPE_BYTES = {"float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "c10::half": 2, "bfloat16": 2,
               "c10::bfloat16": 2, "long": 8, "long int": 8, "int64": 8, "int": 4, "int32": 4, "short": 2,
               "byte": 1, "unsigned char": 1, "char": 1, "signed char": 1, "bool": 1, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "c10::float8_e4m3fn": 1, "c10::float8_e5m2": 1}


def collective_name(event_name: str) -> str:
    """gloo:all_reduce -> all_reduce; nccl:send 0->1 -> send; ncclDevKernel_AllGather_RING_LL -> all_gather."""
    if ":" in event_name and not event_name.startswith("ncclDevKernel") and not event_name.startswith("ncclKernel"):
        return event_name.split(":", 1)[1].split()[0]
    m = re.match(r"nccl(?:Dev)?Kernel_([A-Za-z]+)", event_name)
    if m:
        return _NCCL_NAMES.get(m.group(1).lower(), m.group(1).lower())
    return event_name


def dtype_bytes(name: str) -> int:
    return DTYPE_BYTES.get(str(name).lower(), 4)


def numel(dims) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def bus_bytes(coll: str, in_bytes: float, out_bytes: float, n: int) -> float:
    """Bytes this rank sends for one collective, the cost model's convention (harness/costmodel/comm.py:
    nccl-tests bus factors): all_reduce 2(n-1)/n * S; all_gather (n-1)/n * S_out; reduce_scatter and
    all_to_all (n-1)/n * S_in; broadcast (n-1)/n * S (a ring broadcast, averaged over the ranks);
    send S; recv 0 (the peer's send counts it)."""
    if n <= 1 and coll != "send":
        return 0.0
    if coll == "all_reduce":
        return 2 * (n - 1) / n * in_bytes
    if coll == "all_gather":
        return (n - 1) / n * max(out_bytes, in_bytes * n)
    if coll in ("reduce_scatter", "all_to_all", "broadcast"):
        return (n - 1) / n * in_bytes
    if coll == "send":
        return float(in_bytes)
    return 0.0


def logical_name(c10d_op: str) -> str | None:
    """The collective the caller asked for, from the c10d operator that enqueued it
    (c10d::_reduce_scatter_base_ -> reduce_scatter even where gloo runs it as an all-reduce)."""
    n = c10d_op.split("::", 1)[-1].lower()
    for key, name in (("reduce_scatter", "reduce_scatter"), ("allgather", "all_gather"), ("allreduce", "all_reduce"),
                      ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("barrier", "barrier"),
                      ("send", "send"), ("recv", "recv"), ("reduce", "reduce"), ("gather", "gather"),
                      ("scatter", "scatter")):
        if key in n:
            return name
    return None


# -- flight recorder -------------------------------------------------------------------------------
# Attributing gloo collectives to mesh axes through c10d's flight recorder (pure; see the
# "Attributing a gloo event" paragraph of trace_analysis.py): each profiler event is matched with the
# flight-recorder entry that enqueued it, which names its process group; profiling.py recorded which
# mesh axis each group is.

def pg_axis(meta: dict, pg_name: str, coll: str) -> str:
    """Axis of a process group: profiling.py lists candidates per group (a group can be both the ep and
    the dp group when ep == dp); an all-to-all is expert traffic, anything else data-parallel."""
    axes = meta.get("pg_axes", {}).get(str(pg_name))
    if not axes:
        return "unknown"
    if len(axes) > 1 and "ep" in axes:
        return "ep" if coll.startswith("all_to_all") else [a for a in axes if a != "ep"][0]
    return axes[0]


def entry_numel(entry: dict) -> int:
    return sum(numel(s) for s in entry.get("input_sizes") or [])


def inside(ts: float, steps) -> bool:
    return any(s <= ts < e for s, e in steps)


def flight_entries(trace: dict, events: list[dict]) -> list[dict]:
    """The flight recorder's entries of the profiled steps (profiling.py saved them with each step's
    record-id range), each with the collective as run (`run`), as asked for (`coll`, from the c10d
    operator that enqueued it), its process group, group size and element count, in enqueue order."""
    meta = trace.get("brigade", {})
    base_ns = trace.get("baseTimeNanoseconds", 0)
    sizes = {str(k): len(v) for k, v in meta.get("pg_ranks", {}).items()}
    ops = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e["name"].startswith("c10d::"))
    starts = [o[0] for o in ops]
    ranges = meta.get("fr_steps", [])
    out = []
    for en in sorted(meta.get("fr_entries", []), key=lambda en: en["record_id"]):
        if not any(a <= en["record_id"] < b for a, b in ranges):
            continue  # outside the recorded steps (the barrier between them)
        # The operator that enqueued it: the c10d operator nearest its creation time. The recorder's
        # clock and the profiler's differ by microseconds, so nearest, not containing.
        # Candidates: the few operators that started last before it and the next one (enqueueing is
        # short; a nest of operators is a few deep); the innermost of equals wins.
        t_us = (en.get("time_created_ns", 0) - base_ns) / 1000
        i = bisect.bisect_right(starts, t_us)
        near = min(ops[max(0, i - 8):i + 1], key=lambda o: (max(o[0] - t_us, t_us - o[1], 0.0), -o[0]), default=None)
        run = collective_name(en.get("profiling_name", ""))
        coll = (logical_name(near[2]) if near else None) or run
        pg = str((en.get("process_group") or ["?"])[0])
        in_b = entry_numel(en) * dtype_bytes((en.get("input_dtypes") or ["float"])[0])
        out_b = sum(numel(x) for x in en.get("output_sizes") or []) * dtype_bytes(
            (en.get("output_dtypes") or en.get("input_dtypes") or ["float"])[0])
        out.append({"run": run, "coll": coll, "pg": pg, "n": sizes.get(pg, 1), "numel": entry_numel(en),
                    "created_us": t_us, "in_bytes": in_b, "out_bytes": out_b, "p2p": bool(en.get("is_p2p"))})
    return out


def attribute(comm_ev: list[dict], entries: list[dict], meta: dict, cuda: bool) -> dict[int, tuple[str, str]]:
    """id(event) -> (axis, collective), matching each event with the flight-recorder entry that enqueued
    it: same collective as run, same element count (gloo events record their shapes), created before
    the event started, earliest first (see the module docstring)."""
    used = [False] * len(entries)
    out: dict[int, tuple[str, str]] = {}
    tid_axis: dict = {}
    p2p_axis = meta.get("p2p_axis", "unknown")
    for ev in sorted(comm_ev, key=lambda e: e["ts"]):
        run = collective_name(ev["name"])
        args = ev.get("args", {})
        if args.get("Process Group Name") is not None:  # NCCL kernels may carry their group directly
            out[id(ev)] = (pg_axis(meta, args["Process Group Name"], run), run)
            continue
        if run in P2P or run == "send_recv":
            out[id(ev)] = (p2p_axis, run)
            continue
        dims = args.get("Input Dims")
        elems = numel(dims[0]) if dims and isinstance(dims[0], list) and not cuda else None
        best = None
        for i, en in enumerate(entries):
            if used[i] or en["p2p"] or en["run"] != run:
                continue
            if en["created_us"] > ev["ts"] + 2000:  # enqueued after this event began (2 ms clock slack)
                break
            if elems is None or en["numel"] == elems:
                best = i
                break
        if best is not None:
            used[best] = True
            en = entries[best]
            label = (pg_axis(meta, en["pg"], en["coll"]), en["coll"])
            tid_axis[(ev["pid"], ev["tid"])] = label[0]
        else:
            label = (tid_axis.get((ev["pid"], ev["tid"]), "unknown"), run)
        out[id(ev)] = label
    return out
