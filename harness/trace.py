"""`python -m harness.trace FILE...`: any torch-profiler trace (brigade's `trace_rank<r>.json`, or one from
anyone's run, `.json`, `.json.gz` or `.json.xz`), per rank and per step: compute by kind of work,
communication, its exposed part and overlap, idle time, the top kernels and the collectives by kind, size and
group with their bus bandwidth. The figures and their definitions: harness/collect/trace_analysis.py and
docs/measurement.md ("Any profiler trace"); beside Holistic Trace Analysis's on the same traces:
`python -m lab.trace_vs_hta`."""
from __future__ import annotations

import argparse
import sys

from harness.collect import trace_analysis as ta
from harness.collect.compute_classes import CLASSES

STEP_SOURCE = {ta.STEP_EVENT: f"brigade's `{ta.STEP_EVENT}` annotations",
               "ProfilerStep#N": "torch's ProfilerStep#N annotations",
               ta.WHOLE_TRACE: "no step annotations in the trace: the whole trace is one window"}


def bus_bandwidth_bytes(coll: str, in_bytes: float, out_bytes: float, n: int) -> float:
    """The bytes whose rate is nccl-tests' bus bandwidth (its doc/PERFORMANCE.md): the cost model's bus bytes
    (trace_analysis.bus_bytes: all_reduce 2(n-1)/n S, all_gather and reduce_scatter and all_to_all (n-1)/n S),
    but S itself where nccl-tests' busbw is the algorithm bandwidth: broadcast, reduce, send, recv, send/recv."""
    if coll in ("broadcast", "reduce", "send", "recv", "send_recv"):
        return float(in_bytes)
    return ta.bus_bytes(coll, in_bytes, out_bytes, n)


def busbw_GBps(row: dict) -> float | None:
    """A row of trace_analysis's `collectives`: its bus bandwidth, where its size and group size are known."""
    if not (row["msg_bytes"] and row["time_s"] and (row["group_size"] or row["kind"] in ta.P2P)):
        return None
    per_call = bus_bandwidth_bytes(row["kind"], row["msg_bytes"], row["out_bytes"] or 0.0, row["group_size"] or 2)
    return per_call * row["count"] / row["time_s"] / 1e9


def _bytes(b: float | None) -> str:
    if not b:
        return "?"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b:.0f} B"


def report(path, trace: dict) -> str:
    """The tables of one rank's trace (trace_analysis.analyse), as text."""
    a = ta.analyse(trace)
    info = trace.get("distributedInfo") or {}
    rank = info.get("rank", trace.get("brigade", {}).get("rank", "?"))
    world = info.get("world_size") or "?"
    out = [f"== {path}: rank {rank} of {world}, {a['device']}, {a['profiled_steps']} step(s); steps from "
           f"{STEP_SOURCE[a['step_source']]}"]
    cls = " ".join(f"{c[:5]:>7s}" for c in CLASSES)
    out.append(f"{'step':22s} {'window ms':>10s} {'compute ms':>10s} {cls} {'comm ms':>9s} {'comm %':>7s} "
               f"{'exposed %':>9s} {'overlap %':>9s} {'idle %':>7s}")
    mean = {**a, "step": "mean", "step_time_s": a["profiled_step_time_s"]}
    for s in [*a["steps"], mean] if len(a["steps"]) > 1 else a["steps"]:
        ms = " ".join(f"{1e3 * s[f'compute_{c}_time_s']:7.2f}" for c in CLASSES)
        out.append(f"{str(s['step'])[:22]:22s} {1e3 * s['step_time_s']:10.2f} {1e3 * s['compute_time_s']:10.2f} {ms} "
                   f"{1e3 * s['comm_time_s']:9.2f} {s['comm_share_pct']:7.1f} {s['comm_exposed_pct']:9.1f} "
                   f"{s['comm_overlap_pct']:9.1f} {s['idle_pct']:7.1f}")
    out.append("  (compute classes: attention, gemm, optimizer, elementwise; comm % and exposed % of the window, "
               "overlap % of the communication, idle: nothing running)")
    if a.get("compute_top_kernels"):
        out.append("top kernels, per step:")
        out += [f"  {k['kind']:11s} {1e3 * k['time_s']:9.2f} ms x{k['count']:<6.1f} {k['name'][:100]}"
                for k in a["compute_top_kernels"]]
    if a["collectives"]:
        out.append("collectives, per step:")
        out.append(f"  {'kind':14s} {'axis':7s} {'group':18s} {'n':>9s} {'message':>10s} {'calls':>6s} {'ms':>9s} "
                   f"{'busbw GB/s':>10s}")
        for r in a["collectives"]:
            world = " (world)" if r["group_size_from"] == "world" else ""
            n = f"{r['group_size']}{world}" if r["group_size"] else "?"
            bw = busbw_GBps(r)
            out.append(f"  {r['kind']:14s} {r['axis']:7s} {str(r['group'] or '?')[:18]:18s} {n:>9s} "
                       f"{_bytes(r['msg_bytes']):>10s} {r['count']:6.1f} {1e3 * r['time_s']:9.3f} "
                       f"{'-' if bw is None else f'{bw:.1f}':>10s}")
        if any(r["group_size_from"] == "world" for r in a["collectives"]):
            out.append("  n (world): the trace names no process group, so the bus bandwidth takes the world's size")
    if a["comm_time_by_axis_s"]:
        out.append("communication by axis, per step: " + ", ".join(
            f"{axis} {1e3 * t:.2f} ms ({1e3 * a['comm_exposed_by_axis_s'][axis]:.2f} exposed)"
            for axis, t in sorted(a["comm_time_by_axis_s"].items())))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.trace", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="torch-profiler traces (.json, .json.gz, .json.xz), one per rank")
    args = p.parse_args(argv)
    status = 0
    for path in args.files:
        try:
            print(report(path, ta.load(path)) + "\n")
        except (OSError, ValueError, KeyError) as e:
            print(f"== {path}: cannot analyse it: {type(e).__name__}: {e}", file=sys.stderr)
            status = 2
    return status


if __name__ == "__main__":
    sys.exit(main())
