r"""Compute, communication and idle time from one rank's profiler trace, per step: any torch-profiler trace.

Pure Python (no torch): brigade's traces (harness/worker/measure.py) and anyone's (`python -m harness.trace
FILE...`). docs/measurement.md ("Any profiler trace") gives the definitions; in short, inside a step's window W:

    comm C (gloo:* events; NCCL kernels)   compute K (main-thread operators less waits; other kernels)
    busy B (everything the device ran)     overlapped |C ∩ K|, exposed |C \ K|, idle |W \ B|
    comm_share_pct = 100 |C| / |W|,  comm_exposed_pct = 100 |C \ K| / |W|,  comm_overlap_pct = 100 |C ∩ K| / |C|

Unions, not sums, so two collectives in flight at once count once. Steps: `brigade/step`, else
`ProfilerStep#N`, else the whole trace. On a GPU a ProfilerStep's window is the device's: from the first
device operation launched inside it to the next step's first (brigade's steps synchronise the device
inside their annotation, so the annotation is the window).

Which collective an NCCL kernel is, its size and group: the host operator that launched it says
(describe_calls). A gloo event carries no process group, so it is matched with the c10d flight-recorder
entry that enqueued it (same collective, same element count, earliest first: a group runs its queue in
order; the steps' entries are known by record id, since the recorder's clock and the profiler's differ);
the entry names the group, profiling.py recorded its mesh axis. Send/recv are the pipeline's (pp). An
event that cannot be matched takes its worker thread's axis, else "unknown": never dropped.
"""
from __future__ import annotations

import bisect
import gzip
import json
import lzma
import math
import re
from collections import defaultdict
from pathlib import Path

from harness.collect import compute_classes
from harness.collect.compute_classes import intersect, length, span, subtract, union
from harness.dims import COMM_AXES

STEP_EVENT = "brigade/step"
WHOLE_TRACE = "whole trace"
_PROFILER_STEP = re.compile(r"^ProfilerStep\s*#\s*\d+$")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")  # what a GPU runs (annotations are not work)
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
# Main-thread operators that are communication or a wait for it, never compute.
_NOT_COMPUTE = re.compile(r"^(c10d::|gloo:|nccl:|_c10d_functional::|c10d_functional::|record_param_comms)|wait",
                          re.IGNORECASE)
_NCCL_KERNEL = re.compile(r"^nccl.*Kernel")  # ncclKernel_AllReduce_RING_LL_Sum_float, ncclDevKernel_SendRecv
_COMM_OP = re.compile(r"^(nccl:|c10d::|record_param_comms)")


# -- loading ------------------------------------------------------------------------------------
def load(path) -> dict:
    p = Path(path)
    opener = {".gz": gzip.open, ".xz": lzma.open}.get(p.suffix, open)
    with opener(p, "rt") as f:
        return json.load(f)


# -- steps --------------------------------------------------------------------------------------
def find_steps(events: list[dict]) -> tuple[str, list[tuple[str, float, float]], tuple]:
    """(where the steps come from, the steps' host intervals [(name, start, end)], the main thread)."""
    marks = [e for e in events if e["name"] == STEP_EVENT and e.get("cat") != "gpu_user_annotation"]
    source = STEP_EVENT
    if not marks:
        marks = [e for e in events if _PROFILER_STEP.match(e["name"]) and e.get("cat") != "gpu_user_annotation"]
        source = "ProfilerStep#N"
    if marks:
        marks.sort(key=lambda e: e["ts"])
        names = [f"step {i}" if source == STEP_EVENT else e["name"] for i, e in enumerate(marks)]
        return source, [(n, e["ts"], e["ts"] + e["dur"]) for n, e in zip(names, marks)], (marks[0]["pid"],
                                                                                          marks[0]["tid"])
    host: dict = defaultdict(float)  # no annotations: the main thread is the one whose operators took longest
    for e in (e for e in events if e.get("cat") == "cpu_op"):
        host[(e["pid"], e["tid"])] += e["dur"]
    if not host:
        raise ValueError("no CPU operators in the trace: not a torch.profiler trace")
    main = max(host, key=host.get)
    mine = [e for e in events if (e["pid"], e["tid"]) == main]
    return WHOLE_TRACE, [(WHOLE_TRACE, min(e["ts"] for e in mine), max(e["ts"] + e["dur"] for e in mine))], main


def device_windows(steps, device_ev: list[dict], launches: dict) -> list[tuple[str, float, float]]:
    """Each host step's window on the device (module docstring): from its first device operation to the next
    step's first; the last step to the end of its last operation. The whole trace: the device's whole span."""
    if len(steps) == 1 and steps[0][0] == WHOLE_TRACE:
        return [(WHOLE_TRACE, min(e["ts"] for e in device_ev), max(e["ts"] + e["dur"] for e in device_ev))]
    starts = [s for _, s, _ in steps]
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for e in device_ev:
        launch = launches.get(e.get("args", {}).get("correlation"))
        i = bisect.bisect_right(starts, launch["ts"]) - 1 if launch else -1
        if i < 0 or launch["ts"] >= steps[i][2]:
            continue  # launched outside every step (before the first, between two)
        first[i] = min(first.get(i, e["ts"]), e["ts"])
        last[i] = max(last.get(i, 0.0), e["ts"] + e["dur"])
    ids = sorted(first)
    out = []
    for j, i in enumerate(ids):
        end = first[ids[j + 1]] if j + 1 < len(ids) else last[i]
        out.append((steps[i][0], first[i], max(first[i], end)))
    return out


# -- the analysis -------------------------------------------------------------------------------
def analyse(trace: dict) -> dict:
    """Per-rank figures of one trace: the mean over its steps, each step's own (`steps`), the collectives
    (`collectives`) and the communication by axis (see the module docstring)."""
    meta = trace.get("brigade", {})
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e and "name" in e]
    source, host_steps, main = find_steps(events)
    cuda = any(e.get("cat") == "kernel" for e in events)
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {})}
    if cuda:
        device_ev = [e for e in events if e.get("cat") in DEVICE_CATS]
        comm_ev = [e for e in device_ev if e.get("cat") == "kernel" and _NCCL_KERNEL.match(e["name"])]
        compute_ev = [e for e in device_ev if e.get("cat") == "kernel" and not _NCCL_KERNEL.match(e["name"])]
        windows = host_steps if source == STEP_EVENT else device_windows(host_steps, device_ev, launches)
        compute = span(compute_ev)
        busy = span(device_ev)
    else:
        comm_ev = [e for e in events if e["name"].startswith("gloo:")]
        on_main = [e for e in events if (e["pid"], e["tid"]) == main and e.get("cat") == "cpu_op"]
        compute_ev = [e for e in on_main if not _NOT_COMPUTE.search(e["name"])]
        # a wait inside an operator (DTensor waits inside aten::add) is not compute
        compute = subtract(span(compute_ev), span([e for e in on_main if _NOT_COMPUTE.search(e["name"])]))
        windows = host_steps
        busy = union([*compute, *span(comm_ev)])
    if not windows:
        raise ValueError(f"no device work inside any of the {len(host_steps)} steps ({source})")
    comm_all = span(comm_ev)
    per_step = [_step_figures(name, [(s, e)], compute, comm_all, busy, compute_ev, events, cuda)
                for name, s, e in windows]
    steps = union((s, e) for _, s, e in windows)
    n_steps = len(windows)
    out: dict = {"profiled_steps": n_steps, "step_source": source, "device": "cuda" if cuda else "cpu"}
    for k in per_step[0]:
        if k.endswith("_s"):
            out[k] = sum(p[k] for p in per_step) / n_steps
    out["profiled_step_time_s"] = out.pop("step_time_s")
    out.update(_shares(out, out["profiled_step_time_s"]), steps=per_step)
    if cuda:
        out["compute_top_kernels"] = compute_classes.top_kernels(compute_ev, steps, n_steps)
    calls = describe_calls(comm_ev, events, launches, cuda, trace.get("distributedInfo", {}))
    entries = flight_entries(trace, events)
    label = attribute(comm_ev, calls, entries, meta)
    out["collectives"] = collective_rows(comm_ev, calls, label, steps, n_steps)
    out.update(by_axis(comm_ev, calls, label, entries, meta, steps, n_steps, intersect(compute, steps)))
    return out


def _step_figures(name, w, compute, comm_all, busy, compute_ev, events, cuda) -> dict:
    """One step's seconds: its window, compute (and by class), communication, overlap, idle."""
    k, c = intersect(compute, w), intersect(comm_all, w)
    step_us, comm_us, overlap_us = length(w), length(c), length(intersect(c, k))
    out = {"step": name, "step_time_s": step_us / 1e6, "compute_time_s": length(k) / 1e6, "comm_time_s": comm_us / 1e6,
           "comm_overlapped_time_s": overlap_us / 1e6, "comm_exposed_time_s": (comm_us - overlap_us) / 1e6,
           "busy_time_s": length(intersect(busy, w)) / 1e6, "idle_time_s": (step_us - length(intersect(busy, w))) / 1e6}
    for cls, us in compute_classes.split(k, compute_ev, events, cuda).items():
        out[f"compute_{cls}_time_s"] = us / 1e6
    out.update(_shares(out, out["step_time_s"]))
    return out


def _shares(fig: dict, step_s: float) -> dict:
    """Percentages of a step: of its window (comm, exposed, compute, idle) and of its communication (overlap)."""
    pct = lambda x, of: 100 * x / of if of else 0.0  # noqa: E731
    parts = (("comm_share", "comm"), ("comm_exposed", "comm_exposed"), ("compute_share", "compute"), ("idle", "idle"))
    return {**{f"{k}_pct": pct(fig[f"{t}_time_s"], step_s) for k, t in parts},
            "comm_overlap_pct": pct(fig["comm_overlapped_time_s"], fig["comm_time_s"])}


def by_axis(comm_ev, calls, label, entries, meta, steps, n_steps: int, compute) -> dict:
    """Communication per (axis, collective): time and exposed time per step (unions over its events), calls,
    and bytes from the flight recorder (count_bytes)."""
    out: dict = defaultdict(dict)
    groups: dict = defaultdict(list)
    for e in comm_ev:
        groups[label[id(e)]].append(e)
    for (axis, coll), evs in sorted(groups.items()):
        in_window = [e for e in evs if inside(e["ts"], steps)]
        if not in_window:
            continue  # e.g. the barrier between profiled steps
        ivs = intersect(span(evs), steps)
        t = length(ivs) / n_steps / 1e6
        out[axis][coll] = {"time_s": t, "exposed_s": t - length(intersect(ivs, compute)) / n_steps / 1e6,
                           "count": len(in_window) / n_steps}
    totals = {}
    for axis in out:
        ivs = intersect(span([e for (a, _), evs in groups.items() if a == axis for e in evs]), steps)
        totals[axis] = {"time_s": length(ivs) / n_steps / 1e6,
                        "exposed_s": (length(ivs) - length(intersect(ivs, compute))) / n_steps / 1e6}
    # Bytes: the flight recorder's entries of the profiled steps (each names its group and sizes),
    # plus point-to-point from the trace where the recorder has none (gloo does not log send/recv).
    p2p = [(*label[id(e)], calls[id(e)]["in_bytes"]) for e in comm_ev
           if calls[id(e)]["kind"] in P2P and calls[id(e)]["in_bytes"] and inside(e["ts"], steps)]
    for (axis, coll), b in count_bytes(entries, meta, p2p, n_steps).items():
        slot = out[axis].setdefault(coll, {"time_s": 0.0, "exposed_s": 0.0, "count": 0.0})
        slot.update(b)
    return {"comm_by_axis": {a: dict(v) for a, v in out.items()},
            "comm_time_by_axis_s": {a: v["time_s"] for a, v in totals.items()},
            "comm_exposed_by_axis_s": {a: v["exposed_s"] for a, v in totals.items()},
            "comm_bytes_by_axis": {a: sum(c.get("bytes", 0.0) for c in v.values()) for a, v in out.items()},
            "comm_bytes_as_run_by_axis": {a: sum(c.get("bytes_as_run", c.get("bytes", 0.0)) for c in v.values())
                                          for a, v in out.items()}}


# -- what each collective is ------------------------------------------------------------------------
def describe_calls(comm_ev: list[dict], events: list[dict], launches: dict, cuda: bool, dist_info: dict) -> dict:
    """id(event) -> {kind, in_bytes, out_bytes, group, group_size, group_size_from} for each communication
    event: CUDA from the kernel's arguments and the host operators around its launch (module docstring);
    gloo from the event's own arguments. Sizes and groups the trace does not carry are None."""
    ops: dict = defaultdict(list)  # per thread, the communication operators by start time
    for e in sorted(events, key=lambda e: e["ts"]) if cuda else []:
        if e.get("cat") in ("cpu_op", "user_annotation") and _COMM_OP.match(e["name"]):
            ops[(e["pid"], e["tid"])].append(e)
    starts = {k: [e["ts"] for e in v] for k, v in ops.items()}
    pg_sizes = {str(g.get("pg_name")): g.get("pg_size") for g in dist_info.get("pg_config") or []}
    out = {}
    for ev in comm_ev:
        around = []  # innermost first
        launch = launches.get(ev.get("args", {}).get("correlation")) if cuda else None
        if launch is not None:
            key = (launch["pid"], launch["tid"])
            i = bisect.bisect_right(starts.get(key, []), launch["ts"])
            around = [o for o in reversed(ops.get(key, [])[max(0, i - 16):i]) if o["ts"] + o["dur"] >= launch["ts"]]
        sources = [ev.get("args", {})] + [o.get("args", {}) for o in around]
        kinds = ([collective_name(o["name"]) for o in around if o["name"].startswith("nccl:")]
                 + [collective_name(a["Collective name"]) for a in sources if a.get("Collective name")]
                 + [collective_name(o["name"]) for o in around if o["name"].startswith("c10d::")]
                 + [collective_name(ev["name"])])
        kind = next((k for k in kinds if k in COLLECTIVES), kinds[-1])
        in_b, out_b = message_bytes(sources)
        group = next((str(a["Process Group Name"]) for a in sources if a.get("Process Group Name") is not None), None)
        desc = next((a["Process Group Description"] for a in sources if a.get("Process Group Description")), None)
        n = next((int(a["Group size"]) for a in sources if a.get("Group size")), None) or pg_sizes.get(group)
        n_from = "group" if n else None
        if not n and dist_info.get("world_size"):
            n, n_from = int(dist_info["world_size"]), "world"  # the trace names no group: the world's size
        out[id(ev)] = {"kind": kind, "in_bytes": in_b, "out_bytes": out_b,
                       "group": f"{group} ({desc})" if group and desc else group, "pg": group,
                       "group_size": n, "group_size_from": n_from}
    return out


def message_bytes(sources: list[dict]) -> tuple[float | None, float | None]:
    """(input bytes, output bytes) of a collective from the first argument set that sizes it: torch's
    `In msg nelems` / `Out msg nelems` with `dtype`, else the operator's `Input Dims` with `Input type`."""
    for a in sources:
        if a.get("In msg nelems") and str(a.get("dtype", "")).lower() in DTYPE_BYTES:
            size = DTYPE_BYTES[str(a["dtype"]).lower()]
            return a["In msg nelems"] * size, (a.get("Out msg nelems") or 0) * size or None
    for a in sources:
        dims, types = a.get("Input Dims") or [], a.get("Input type") or []
        b = sum(numel(d) * DTYPE_BYTES[str(t).lower()] for d, t in zip(dims, types)
                if isinstance(d, list) and str(t).lower() in DTYPE_BYTES)
        if b:
            return float(b), None
    return None, None


def collective_rows(comm_ev, calls: dict, label: dict, steps, n_steps: int) -> list[dict]:
    """The collectives of the steps by (kind, axis, group, message size), per step: calls and time (the sum
    of their kernels' or events' durations), longest first."""
    rows: dict = {}
    for ev in comm_ev:
        c = calls[id(ev)]
        if inside(ev["ts"], steps):
            key = (c["kind"], label[id(ev)][0], c["group"], c["group_size"], c["in_bytes"])
            r = rows.setdefault(key, {"kind": c["kind"], "axis": key[1], "group": c["group"], "group_size": key[3],
                                      "group_size_from": c["group_size_from"], "msg_bytes": c["in_bytes"],
                                      "out_bytes": c["out_bytes"], "count": 0.0, "time_s": 0.0})
            r["count"] += 1 / n_steps
            r["time_s"] += ev["dur"] / 1e6 / n_steps
    return sorted(rows.values(), key=lambda r: -r["time_s"])


def count_bytes(entries: list[dict], meta: dict, p2p: list, n_steps: int) -> dict:
    """(axis, collective) -> {bytes, msg_bytes, calls} per step. `bytes`: what this rank sends for the
    collective asked for (bus_bytes); `bytes_as_run` where the backend ran another one (gloo runs a
    reduce-scatter as an all-reduce of the whole input); `msg_bytes`: the input as the caller gave it.
    `p2p`: [(axis, send or recv, bytes)] of the steps' point-to-point events."""
    acc: dict = defaultdict(lambda: {"bytes": 0.0, "bytes_as_run": 0.0, "msg_bytes": 0.0, "calls": 0})
    for en in entries:
        if en["n"] <= 1 and not en["p2p"]:
            continue
        slot = acc[(pg_axis(meta, en["pg"], en["coll"]), en["coll"])]
        slot["bytes"] += bus_bytes(en["coll"], en["in_bytes"], en["out_bytes"], en["n"])
        slot["bytes_as_run"] += bus_bytes(en["run"], en["in_bytes"], en["out_bytes"], en["n"])
        slot["msg_bytes"] += en["in_bytes"]
        slot["calls"] += 1
    if not any(en["p2p"] for en in entries):  # gloo logs no send/recv: their sizes from the trace
        for axis, coll, b in p2p:
            slot = acc[(axis, coll)]
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
    per_rank, out = [r for r in per_rank if r], {}
    if not per_rank:
        return {}
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
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
    by_axis: dict = {a: {} for a in axes}
    for a in axes:
        for c in sorted({c for r in per_rank for c in r["comm_by_axis"].get(a, {})}):
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
# recorder spell them (pure). Used by the analysis above and by the flight recorder section.

P2P = ("send", "recv")
# The words each spelling of a collective contains, lower-cased without underscores (gloo:all_reduce,
# nccl:_all_gather_base, c10d::_reduce_scatter_base_, `Collective name` allreduce, ncclKernel_SendRecv_...,
# ncclDevKernel_ReduceScatter_Sum_f32_RING_LL), in the order they must be tried (reducescatter before reduce).
_KINDS = (("reducescatter", "reduce_scatter"), ("allgather", "all_gather"), ("allreduce", "all_reduce"),
          ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("barrier", "barrier"), ("sendrecv", "send_recv"),
          ("send", "send"), ("recv", "recv"), ("reduce", "reduce"), ("gather", "gather"), ("scatter", "scatter"))
COLLECTIVES = frozenset(name for _, name in _KINDS)
_PREFIX = re.compile(r"^(nccl(Dev)?Kernel_|nccl:|gloo:|_?c10d(_functional)?::)", re.IGNORECASE)
# Element sizes by the dtype names the flight recorder (c10 ScalarType) and the profiler (C++ type) use.
DTYPE_BYTES = {"float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "c10::half": 2, "bfloat16": 2,
               "c10::bfloat16": 2, "long": 8, "long int": 8, "int64": 8, "int": 4, "int32": 4, "short": 2,
               "byte": 1, "unsigned char": 1, "char": 1, "signed char": 1, "bool": 1, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "c10::float8_e4m3fn": 1, "c10::float8_e5m2": 1}


def collective_name(event_name: str) -> str:
    """gloo:all_reduce -> all_reduce; nccl:send 0->1 -> send; ncclDevKernel_AllGather_RING_LL -> all_gather;
    c10d::_reduce_scatter_base_ -> reduce_scatter; anything else as it came (its first word)."""
    bare = re.split(r"[\s(]", _PREFIX.sub("", event_name.strip()), maxsplit=1)[0]
    key = bare.lower().replace("_", "")
    return next((name for word, name in _KINDS if word in key), bare)


def logical_name(c10d_op: str) -> str | None:
    """The collective the caller asked for, from the c10d operator that enqueued it
    (c10d::_reduce_scatter_base_ -> reduce_scatter even where gloo runs it as an all-reduce)."""
    name = collective_name(c10d_op)
    return name if name in COLLECTIVES else None


def dtype_bytes(name: str) -> int:
    return DTYPE_BYTES.get(str(name).lower(), 4)


def numel(dims) -> int:
    return math.prod(int(d) for d in dims)


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


# -- flight recorder -------------------------------------------------------------------------------
def pg_axis(meta: dict, pg_name: str, coll: str) -> str:
    """Axis of a process group: profiling.py lists candidates per group (a group can be both the ep and
    the dp group when ep == dp); an all-to-all is expert traffic, anything else data-parallel."""
    axes = meta.get("pg_axes", {}).get(str(pg_name))
    if not axes:
        return "unknown"
    if len(axes) > 1 and "ep" in axes:
        return "ep" if coll.startswith("all_to_all") else [a for a in axes if a != "ep"][0]
    return axes[0]


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
        elems = sum(numel(s) for s in en.get("input_sizes") or [])
        in_b = elems * dtype_bytes((en.get("input_dtypes") or ["float"])[0])
        out_b = sum(numel(x) for x in en.get("output_sizes") or []) * dtype_bytes(
            (en.get("output_dtypes") or en.get("input_dtypes") or ["float"])[0])
        out.append({"run": run, "coll": coll, "pg": pg, "n": sizes.get(pg, 1), "numel": elems,
                    "created_us": t_us, "in_bytes": in_b, "out_bytes": out_b, "p2p": bool(en.get("is_p2p"))})
    return out


def attribute(comm_ev: list[dict], calls: dict, entries: list[dict], meta: dict) -> dict[int, tuple[str, str]]:
    """id(event) -> (axis, collective). An event whose group the trace names takes that group's axis;
    send/recv are the pipeline's; the rest are matched with the flight-recorder entry that enqueued them:
    same collective as run, same element count (gloo events record their shapes), created before the
    event started, earliest first (see the module docstring)."""
    used = [False] * len(entries)
    out: dict[int, tuple[str, str]] = {}
    tid_axis: dict = {}
    p2p_axis = meta.get("p2p_axis", "pp")
    for ev in sorted(comm_ev, key=lambda e: e["ts"]):
        run = calls[id(ev)]["kind"]
        if calls[id(ev)]["pg"] is not None:
            out[id(ev)] = (pg_axis(meta, calls[id(ev)]["pg"], run), run)
            continue
        if run in P2P or (run == "send_recv" and meta):  # a SendRecv kernel no operator names: brigade's pp
            out[id(ev)] = (p2p_axis, run)
            continue
        dims = ev.get("args", {}).get("Input Dims")
        elems = numel(dims[0]) if dims and isinstance(dims[0], list) and ev.get("cat") != "kernel" else None
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
