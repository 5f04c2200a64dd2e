"""Collective names, element sizes and bus bytes as the profiler, gloo, NCCL and c10d's flight
recorder spell them (pure). Used by trace_analysis.py and flight_recorder.py."""
from __future__ import annotations

import re

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
