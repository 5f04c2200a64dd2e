"""Communication: bytes each rank sends per optimizer step, per parallel axis, and their time.

Volumes use the nccl-tests bus factors (NVIDIA nccl-tests doc/PERFORMANCE.md): for a message of S
bytes (all-reduce: the buffer; all-gather: the gathered output; reduce-scatter: the input) over a
group of n ranks, a ring sends per rank
    all_reduce 2(n-1)/n * S     all_gather, reduce_scatter, all_to_all (n-1)/n * S
    send_recv S                 broadcast (ZeroRedundancyOptimizer's parameter sync) (n-1)/n * S,
so with the bus bandwidth B (busbw = algbw * factor) and latency α each call takes
    t = α + factor * S / B                                       (Hockney's α-β model)

Per axis (Ψ_b = a rank's parameter bytes, G = its gradient bytes, m micro-batches of b sequences,
E = b*s*h activation elements, L_r = layers on the rank):
    dp  per engine and accumulation mode: harness/costmodel/dp_comm.py.
    tp  Megatron's split, per micro-batch: all-reduces of E per layer (params.tp_block_collectives:
        2 forward, one backward per column-parallel projection brigade's plan wraps alone), plus the
        vocab-parallel embedding's forward all-reduce and the head input's backward all-reduce. With
        sequence parallel (DTensor, measured on the runtime's trace, docs/notes.md#cpu-in-step): 4
        all-gathers and 4 reduce-scatters of E per layer, one of each more on the first stage (the
        embedding) and the last (the head's input); and an all-reduce of every norm parameter's
        gradient (replicated, fed a sequence-sharded input), 2 per LayerNorm, 1 per RMSNorm.
    pp  point-to-point E (fp32 residual stream) forward and its gradient backward, per micro-batch
        per stage boundary a rank owns.
    ep  all-to-all of the routed tokens b*s*top_k*h twice in forward (dispatch, combine) and twice
        in backward, per MoE layer per micro-batch.
On gloo (CPU) a reduce-scatter runs as an all-reduce (docs/notes.md#gloo-reduce-scatter): the calibrated
reduce_scatter bus bandwidth already carries that cost, the volumes keep the algorithmic definition.
"""
from __future__ import annotations

import math
from typing import NamedTuple

FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
          "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
          "send_recv": lambda n: 1.0, "broadcast": lambda n: (n - 1) / n}
# calibrate measures these; broadcast is costed as an all-gather of the same bytes
MEASURED_AS = {"broadcast": "all_gather"}
# calibrate's tensor-parallel collectives as a step meets them: the time DTensor's functional collective
# adds to each rank's own compute (harness/tools/calibrate_collectives.py), under the profile's name
# "<collective>_in_step"; the tp axis uses them where the profile has them (harness/costmodel/layout.py
# axis_links): the all-reduce without sequence parallelism, the all-gather and reduce-scatter with it
IN_STEP = {c: f"{c}_in_step" for c in ("all_reduce", "all_gather", "reduce_scatter")}


class Link:
    """One (α, bus bandwidth) pair: latency in seconds, bandwidth in bytes/s; and, where calibrate
    timed this collective per message size, those times ((log bytes, seconds) sorted); across a fabric
    with measured curves, (fabric, collective, ranks per node): its calls priced by fabric.py."""
    __slots__ = ("alpha_s", "bw_Bps", "measured", "fabric")

    def __init__(self, alpha_s: float, bw_Bps: float, measured: tuple = (), fabric: tuple = ()):
        self.alpha_s, self.bw_Bps, self.measured, self.fabric = alpha_s, bw_Bps, measured, fabric


class Hops(NamedTuple):
    """Seconds one step of a ring, or one level of a tree, adds to a collective's latency, within a node
    (NVLink) and across nodes (the network): NCCL's own latency model (src/graph/tuning.cc, hwLat)."""
    ring_intra: float = 0.0
    ring_inter: float = 0.0
    tree_intra: float = 0.0
    tree_inter: float = 0.0


def spanning_latency_s(hw, collective: str, n: int, g: int) -> float:
    """Latency of one collective over n ranks on n / g nodes (g ranks on each), as NCCL models it
    (src/graph/tuning.cc, ncclTopoTuneModel): a ring's chunks pass every rank one step after another,
    so an all-gather or reduce-scatter pays n - 1 steps, N - 1 of them between nodes; an all-reduce
    (reduce-scatter then all-gather) twice that; NCCL's tree, for all-reduce only, 2 (g - 1) steps
    within the nodes and 2 floor(log2 N) levels between them, and NCCL takes the quicker. On top of
    the profile's per-call start-up (inter_node.latency_us). Other collectives, and profiles without
    hop latencies, pay the start-up alone."""
    return hw.inter.alpha_s + hop_latency_s(hw.hops, collective, n, g)


def hop_latency_s(h: Hops, collective: str, n: int, g: int) -> float:
    """The ring steps' or tree levels' part of spanning_latency_s (0 for other collectives)."""
    nodes = -(-n // g)
    steps = {"all_gather": 1, "reduce_scatter": 1, "broadcast": 1, "all_reduce": 2}.get(collective)
    if steps is None or not (h.ring_intra or h.ring_inter):
        return 0.0
    ring = steps * ((n - nodes) * h.ring_intra + (nodes - 1) * h.ring_inter)
    if collective != "all_reduce" or not (h.tree_intra or h.tree_inter):
        return ring
    return min(ring, 2 * ((g - 1) * h.tree_intra + int(math.log2(nodes)) * h.tree_inter))


def call_s(link: Link, collective: str, n: int, msg_bytes: float) -> float:
    """Seconds of one collective on a message of msg_bytes. Within the sizes calibrate timed, its
    measured times interpolated in log size: the α-β fit is a least-squares line through them and on
    gloo misses the middle (cpu_reference: all_reduce of 256 KiB at 2 ranks measured 2.31 ms, the fit
    says 0.74 ms), where a tensor-parallel activation's all-reduce falls. Outside them, the fit. Across
    a fabric profile: its measured curve at this placement (harness/costmodel/fabric.py)."""
    if link.fabric:
        fabric, _, g = link.fabric
        return fabric.call_s(collective, n, g, msg_bytes)
    pts = link.measured
    if pts and pts[0][0] <= math.log(max(msg_bytes, 1.0)) <= pts[-1][0]:
        x = math.log(max(msg_bytes, 1.0))
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return link.alpha_s + FACTOR[collective](n) * msg_bytes / link.bw_Bps


def collective_link(hw, collective: str, n: int, stride: int, ranks_per_node: int) -> Link:
    """The link of a collective over n ranks `stride` apart in rank order. Within a node: the
    calibrated figure at the nearest measured group size (calibration runs on one machine), timed at
    the core sharing nearest the step's (time_shared), else the intra-node link. Across nodes: NCCL
    builds one ring per channel and spreads the channels over the node's NICs, so a group with g ranks
    on each node drives min(g, NICs) of them at once: its bus bandwidth is that many times one NIC's
    (inter_node.bus_bw_GBps), up to the intra-node link's (NCCL src/graph/tuning.cc: ring bus bandwidth
    = channels x per-channel speed; docs/published.md#nics), and its latency grows with the ranks and nodes
    the ring or tree passes (spanning_latency_s). A profile with a named fabric (hardware.fabric) prices
    every call across nodes on that fabric's measured curves instead (harness/costmodel/fabric.py)."""
    cache = getattr(hw, "links", None)
    if cache is None:
        return _collective_link(hw, collective, n, stride, ranks_per_node)
    key = (collective, n, stride, ranks_per_node)
    if key not in cache:
        cache[key] = _collective_link(hw, collective, n, stride, ranks_per_node)
    return cache[key]


def _collective_link(hw, collective: str, n: int, stride: int, ranks_per_node: int) -> Link:
    if not crosses_nodes(n, stride, ranks_per_node):
        table = hw.collectives.get(MEASURED_AS.get(collective, collective))
        if table:
            timed = table[min(table, key=lambda k: (abs(k - n), -k))]
            share = core_sharing(hw, ranks_per_node)
            among = min(timed, key=lambda r: (abs(core_sharing(hw, r) - share), -r))
            return time_shared(timed[among], share / core_sharing(hw, among))
        return hw.intra
    g = max(1, min(n, ranks_per_node // max(1, stride)))
    if hw.fabric is not None:
        return hw.fabric.link(collective, n, g)
    nics = min(g, hw.nics_per_node)
    return Link(spanning_latency_s(hw, collective, n, g),
                min(hw.intra.bw_Bps, nics * hw.inter.bw_Bps) if nics > 1 else hw.inter.bw_Bps)


def crosses_nodes(n: int, stride: int, ranks_per_node: int) -> bool:
    """Whether a group of n ranks `stride` apart in rank order spans more than one node."""
    return n * stride > ranks_per_node


def core_sharing(hw, ranks: float) -> float:
    """How many of `ranks` CPU ranks share one core of the node (beyond the cores they time-share them);
    1 on a GPU node, whose ranks each hold a device. Compute (layout.cpu_slowdowns) and collectives
    (time_shared) both divide by it."""
    return max(1.0, ranks / hw.devices_per_node)


def time_shared(link: Link, f: float) -> Link:
    """A calibrated collective in a step whose ranks share the cores f times more than when calibrate
    timed it. On gloo a collective is CPU work (copies, reductions, loopback syscalls and the dispatch
    around them), so like compute it runs at the rank's share of a core: every time x f. calibrate times
    each group size alone (2 ranks on 2 cores: no sharing) and, at 4 ranks, pairs of ranks all at once
    ("2@4", sharing 2); a step's call reads the figure timed nearest its own sharing and scales the rest
    (the demo's dp 2 tp 2 pp 2: 8 ranks on 2 cores, the pairs' figure x 2). Measured per call on model
    small (docs/notes.md#collectives-shared-cores): the tp all-reduce's measured / predicted time grew 1.6 -> 3.6-4.1 ->
    6.2 from 2 to 4 to 8 ranks on the 2 cores when only the alone figure was scaled. Pairs timed at once
    (docs/notes.md#cpu-shared-pairs): in-step collectives took 1.5-2.0x their time alone, back-to-back
    ones 0.5-1.5x (waiting, not computing, one pair's core serves the other). f = 1 on a GPU profile."""
    if f <= 1.0:
        return link
    return Link(link.alpha_s * f, link.bw_Bps / f, tuple((x, t * f) for x, t in link.measured), link.fabric)


def time_s(link: Link, collective: str, n: int, size_bytes: float, calls: float) -> float:
    """α-β time of `calls` collectives moving `size_bytes` in total (nccl-tests message sizes)."""
    if n <= 1 or calls <= 0:
        return 0.0
    return calls * link.alpha_s + FACTOR[collective](n) * size_bytes / link.bw_Bps


def volume(collective: str, n: int, size_bytes: float) -> float:
    """Bytes one rank sends for messages totalling `size_bytes` over n ranks."""
    return 0.0 if n <= 1 else FACTOR[collective](n) * size_bytes


def pp_sends(stages: tuple, n_stages: int) -> int:
    """Point-to-point sends per micro-batch of a pp rank: forward unless last, backward unless first,
    and neither to a stage the rank holds itself (a V-shaped schedule's turn: stage pp - 1 -> pp)."""
    return sum(int(st < n_stages - 1 and st + 1 not in stages) + int(st > 0 and st - 1 not in stages)
               for st in stages)
