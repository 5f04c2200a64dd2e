"""The network between nodes: a fabric profile (conf/hardware/fabric/*.yaml) and what a collective that
crosses it costs.

A fabric carries its NICs (rails) per node, each rail's line rate, the transport, whether collectives
are offloaded in the network, and nccl-tests measurements: for a collective, per (nodes, GPUs per node)
of the measured run, the time per call at each message size (time = factor(n) x size / busbw, nccl-tests
doc/PERFORMANCE.md). The measured run used NCCL's own algorithm choice, so where NCCL goes hierarchical
(a tree or NVLS tree reduces inside the node first and only a node's share crosses the network) the
curve already says so.

A brigade group is rarely the measured one: a dp group with tp 8 has one rank per node, and 1024 ranks
span more nodes than anyone measured. What decides a ring's bandwidth is the chunk each rank passes per
step, S / n, and the NICs it passes them through: NCCL spreads its channels over the min(g, NICs) NICs
the g ranks of a node drive (src/graph/tuning.cc, ring bandwidth = channels x per-channel speed). In
efa_p5's curves busbw at one chunk hardly moves with the node count: at 2 MiB a rank, 147, 152, 156,
148, 157 GB/s on 2, 4, 8, 16, 32 nodes (32 MiB ... 512 MiB all-reduces); at 8 MiB, 305 then 269-273.
So a group of n ranks, g per node, on N nodes, moving S, is priced on the curve of the nearest measured
node count (n_meas ranks, g_meas a node) at the same bytes per rank and NIC:

    k    = min(g_meas, NICs) / min(g, NICs)
    S_eq = S x n_meas / n x k                   (log-log interpolation between measured sizes)
    t    = latency + (t_meas(S_eq) - latency_meas) x factor(n) S k / (factor(n_meas) S_eq)

i.e. the measured bus bandwidth at that chunk, over this group's NICs; and, when the group has fewer ranks per node than the measured run (it cannot reduce inside the node
first as the measured run may have), at least the wire time at the rails' line rate:
factor(n) x S / (min(g, NICs) x rail rate). Below the smallest measured size the time runs on a line
from the fabric's latency to the smallest point (latency-bound), above the largest at the largest
point's bandwidth; beyond the measured node counts the nearest measured one (each profile says how far
its curves reach). The latency is the fabric's measured small-message time plus NCCL's latency per
ring step or tree level the group passes beyond that measurement's (comm.hop_latency_s, the node
profile's hop latencies: a ring over 1536 ranks passes 1535 steps). Where the profile gives a ring step
latency (`ring_step_latency_us`), a ring-only collective (all-gather, reduce-scatter, broadcast: NCCL has no
tree for them) that spans nodes pays it at each of its n - 1 steps instead: a ring's step is a synchronous
exchange between neighbours, so every step waits for the slowest link's per-message latency (Thakur,
Rabenseifner and Gropp 2005, ring all-gather T = (p - 1) alpha + (p - 1)/p n beta). A collective without a curve of
its own uses the all-reduce's bus bandwidth (a ring all-reduce is a reduce-scatter and an all-gather at
the same busbw, the definition nccl-tests gives busbw for), send/recv one rail's line rate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from harness.costmodel import comm

# collectives NCCL runs as a ring only (no tree): where the fabric has a ring step latency, each step pays it
RING_ONLY = ("all_gather", "reduce_scatter", "broadcast")
# the curve a collective without one of its own is priced on (module docstring)
FALLBACK = {"all_gather": "all_reduce", "reduce_scatter": "all_reduce", "broadcast": "all_reduce",
            "all_to_all": None, "send_recv": None, "all_reduce": None}


@dataclass(frozen=True, slots=True)
class Curve:
    """One measured nccl-tests run: time per call at each size ((log bytes, seconds) ascending)."""
    collective: str
    nodes: int
    gpus_per_node: int
    points: tuple
    source: str

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node


class Fabric:
    """A fabric profile in SI units."""
    __slots__ = ("name", "transport", "in_network", "nics_per_node", "rail_Bps", "latency_s", "latency_at", "hops",
                 "curves", "_cache", "ring_step_s")

    @classmethod
    def of(cls, cfg, hops: comm.Hops | None = None) -> "Fabric | None":
        """cfg: hardware.fabric; hops: NCCL's per-step latencies of the node profile (comm.Hops)."""
        if not cfg or not cfg.get("name"):
            return None
        self = cls()
        self.hops = hops if hops is not None else comm.Hops()
        # the measured small-message latency's placement: (nodes, GPUs per node)
        self.latency_at = (int(cfg.get("latency_nodes", 2)), int(cfg.get("latency_gpus_per_node", 8)))
        self.name, self.transport = cfg["name"], cfg.get("transport", "")
        self.in_network = bool(cfg.get("in_network", False))
        self.nics_per_node = int(cfg["nics_per_node"])
        self.rail_Bps = float(cfg["rail_Gbps"]) / 8 * 1e9
        self.latency_s = float(cfg["latency_us"]) * 1e-6
        # a ring-only collective's latency per step where the ring crosses this fabric (module docstring); 0: NCCL's
        # per-hop latencies of the node profile
        self.ring_step_s = float(cfg.get("ring_step_latency_us", 0.0)) * 1e-6
        self.curves = {}
        for coll, runs in dict(cfg.get("curves") or {}).items():
            for run in runs:
                n = int(run["nodes"]) * int(run["gpus_per_node"])
                pts = tuple(sorted((math.log(float(b)), comm.FACTOR[coll](n) * float(b) / (float(bw) * 1e9))
                                   for b, bw in run["busbw_GBps"]))
                self.curves.setdefault(coll, []).append(
                    Curve(coll, int(run["nodes"]), int(run["gpus_per_node"]), pts, run.get("source", "")))
        self._cache = {}
        return self

    def curve(self, collective: str, nodes: int, g: int) -> Curve | None:
        """The measured run nearest this placement: node count in log space, then GPUs per node."""
        runs = self.curves.get(collective) or self.curves.get(FALLBACK.get(collective) or "")
        if not runs:
            return None
        return min(runs, key=lambda c: (abs(math.log(c.nodes / nodes)), abs(c.gpus_per_node - g), -c.nodes))

    def call_s(self, collective: str, n: int, g: int, msg_bytes: float) -> float:
        """Seconds of one collective over n ranks, g of them on each node, moving msg_bytes (nccl-tests
        sizes), across the fabric (module docstring)."""
        key = (collective, n, g, msg_bytes)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        nodes, nics = -(-n // g), min(g, self.nics_per_node)
        factor = comm.FACTOR[collective](n)
        wire = self.latency_s + factor * msg_bytes / (nics * self.rail_Bps)
        # a ring over more (fewer) ranks and nodes than a measured run pays NCCL's latency per step more (less)
        # (comm.hop_latency_s): from the latency's placement to the curve's, and from the curve's to this group's
        def steps(nodes_gpus):
            return comm.hop_latency_s(self.hops, collective, nodes_gpus[0] * nodes_gpus[1], nodes_gpus[1])

        latency = self.latency_s + comm.hop_latency_s(self.hops, collective, n, g) - steps(self.latency_at)
        if self.ring_step_s and nodes > 1 and collective in RING_ONLY:
            latency = (n - 1) * self.ring_step_s  # each of the ring's n - 1 steps waits for the network
        c = self.curve(collective, nodes, g)
        if c is None:
            t = wire + latency - self.latency_s
        else:
            # the measured run at the same bytes per rank and NIC (module docstring), its bandwidth part
            # scaled to this group's bytes and NICs
            nic_ratio = min(c.gpus_per_node, self.nics_per_node) / nics
            size_eq = msg_bytes * c.ranks / n * nic_ratio
            measured_latency = max(self.latency_s + steps((c.nodes, c.gpus_per_node)) - steps(self.latency_at), 0.0)
            moving = max(_interpolate(c.points, size_eq, measured_latency) - measured_latency, 0.0)
            t = latency + moving * factor * msg_bytes * nic_ratio / (comm.FACTOR[c.collective](c.ranks) * size_eq)
            if g < c.gpus_per_node:
                t = max(t, wire + latency - self.latency_s)
        t = max(t, 1e-7)
        if len(self._cache) < 65536:
            self._cache[key] = t
        return t

    def link(self, collective: str, n: int, g: int) -> comm.Link:
        """A comm.Link whose calls are priced by call_s; its α and bandwidth (for volumes and reports) are
        the fabric's latency and the bus bandwidth at 1 GiB."""
        big = 2.0**30
        bw = comm.FACTOR[collective](n) * big / max(self.call_s(collective, n, g, big) - self.latency_s, 1e-12)
        return comm.Link(self.latency_s, bw, (), (self, collective, g))

    def describe(self) -> str:
        reach = sorted({(c.nodes, c.gpus_per_node) for runs in self.curves.values() for c in runs})
        measured = ", ".join(f"{k}: {len(v)} runs" for k, v in self.curves.items()) or "no curves (line rate)"
        return (f"{self.name} ({self.transport}, {self.nics_per_node} x {self.rail_Bps * 8 / 1e9:g} Gb/s per node"
                f"{', in-network reduction' if self.in_network else ''}; measured {measured}; "
                f"node counts {sorted({r[0] for r in reach})})")


def _interpolate(points: tuple, size: float, latency_s: float) -> float:
    """Time at `size` on a measured curve: log-log between points; below, a line from the latency to the
    smallest point; above, the largest point's bandwidth."""
    x = math.log(max(size, 1.0))
    x0, t0 = points[0]
    if x <= x0:
        return latency_s + max(t0 - latency_s, 0.0) * size / math.exp(x0)
    xn, tn = points[-1]
    if x >= xn:
        return tn * size / math.exp(xn)
    for (xa, ta), (xb, tb) in zip(points, points[1:]):
        if x <= xb:
            w = (x - xa) / (xb - xa) if xb > xa else 1.0
            return math.exp(math.log(ta) + w * (math.log(tb) - math.log(ta)))
    return tn
