"""The device mesh of one run, for the 3D mode: which ranks form each group along every axis, which
node each rank sits on, which groups cross nodes, and which collective each axis runs.

Placement comes from harness.dims.ParallelDims (tp innermost, then cp, then dp, then pp). Nodes are consecutive
blocks of `hardware.devices_per_node` ranks (or launcher.nproc_per_node on a multi-node launch),
the same assumption the cost model makes when it picks intra- or inter-node bandwidth.
"""
from __future__ import annotations

from harness import catalog
from harness.costmodel.params import tp_block_collectives
from harness.dims import COMM_AXES, DEGREES, ConfigError, ParallelDims


def ranks_per_node(run) -> int:
    nodes = run.cfg("launcher", "nodes", default=1) or 1
    nproc = run.cfg("launcher", "nproc_per_node", default=0) or 0
    if nodes > 1 and nproc > 0:
        return int(nproc)
    return max(1, int(run.cfg("hardware", "devices_per_node", default=1) or 1))


def collectives(run, axis: str) -> str:
    """What runs along an axis for this run's strategy, in words."""
    s = run.cfg("strategy", default={}) or {}
    zero = catalog.zero_stage(run.strategy, run.engine, int(s.get("zero_stage") or 0),
                              s.get("data_parallel", catalog.DEFAULT_DATA_PARALLEL))
    if axis == "dp":
        if zero == 3:
            return "all-gather of parameters (forward and backward) + reduce-scatter of gradients"
        if zero == 2 or (zero == 1 and run.engine == "deepspeed"):
            return "reduce-scatter of gradients + all-gather of updated parameters"
        if zero == 1:
            return "all-reduce of gradients + broadcast of each rank's updated parameter shard"
        return "all-reduce of gradients (ring: reduce-scatter then all-gather)"
    if axis == "tp":
        c = tp_block_collectives(run.cfg("model", "mlp", default="gelu"), bool(s.get("sequence_parallel")))
        if s.get("sequence_parallel"):
            return "all-gather + reduce-scatter of activations, 2 of each per layer forward and backward"
        return f"all-reduce of activations, {c['fwd']} per layer forward and {c['bwd']} backward"
    if axis == "dp_replicate":
        return "all-reduce of the gradient shards among the replicas of each shard (HSDP)"
    if axis == "cp":
        return "all-gather of K and V before each attention (forward), reduce-scatter of their gradients (backward)"
    if axis == "pp":
        return "send/recv of activations (forward) and their gradients (backward) between neighbour stages"
    if axis == "ep":
        return "all-to-all of routed tokens, 2 per MoE layer forward and 2 backward"
    raise ValueError(axis)


def describe(run) -> dict | None:
    """The mesh as plain data for the page: ranks with coords and node, and per axis its groups."""
    d = run.dims
    try:
        dims = ParallelDims(**{a: d.get(a, 1) for a in DEGREES}, world_size=d["world_size"])
    except ConfigError:
        return None
    per_node = ranks_per_node(run)
    ranks = [{"rank": r, "node": r // per_node, "grid": dims.grid(r), **dims.coords(r)} for r in range(dims.world_size)]
    axes = []
    for axis in sorted(COMM_AXES, key=lambda a: a != "tp"):  # tp first: the chattiest axis
        size = getattr(dims, axis)
        if size <= 1:
            continue
        groups = dims.groups(axis)
        crossing = [g for g in groups if len({r // per_node for r in g}) > 1]
        link = "inter_node" if crossing else "intra_node"
        axes.append({"axis": axis, "size": size, "groups": groups, "crossing": len(crossing),
                     "collective": collectives(run, axis), "link": link,
                     "bus_bw_GBps": run.cfg("hardware", link, "bus_bw_GBps")})
    return {"dims": dims.as_dict(), "grid_shape": dims.grid_shape(), "ranks_per_node": per_node,
            "nodes": (dims.world_size + per_node - 1) // per_node, "ranks": ranks, "axes": axes}
