"""Attributing gloo collectives to mesh axes through c10d's flight recorder (pure; see the
"Attributing a gloo event" paragraph of trace_analysis.py): each profiler event is matched with the
flight-recorder entry that enqueued it, which names its process group; profiling.py recorded which
mesh axis each group is."""
from __future__ import annotations

from harness.collect.comm_names import P2P, collective_name, dtype_bytes, logical_name, numel


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


def flight_entries(trace: dict, events: list[dict], steps) -> list[dict]:
    """The flight recorder's entries (saved by profiling.py) made inside the profiled steps, each with
    the collective as run (`run`), as asked for (`coll`, from the enclosing c10d operator), its
    process group, group size and element count, in the order they were enqueued."""
    meta = trace.get("brigade", {})
    base_ns = trace.get("baseTimeNanoseconds", 0)
    sizes = {str(k): len(v) for k, v in meta.get("pg_ranks", {}).items()}
    ops = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e["name"].startswith("c10d::"))
    out = []
    for en in meta.get("fr_entries", []):
        t_us = (en.get("time_created_ns", 0) - base_ns) / 1000  # the trace's clock: base + ts microseconds
        if not inside(t_us, steps):
            continue  # enqueued outside the profiled steps (the barrier between them)
        run = collective_name(en.get("profiling_name", ""))
        enclosing = [name for s, e, name in ops if s <= t_us <= e]
        coll = (logical_name(enclosing[-1]) if enclosing else None) or run
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
