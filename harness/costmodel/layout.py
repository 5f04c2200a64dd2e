"""A parallel layout: everything about a config that does not depend on micro-batching or
checkpointing. The planner builds one per (dp, tp, pp, vpp, ep, strategy) and finishes it for every
(micro-batch size, micro-batch count, checkpointing mode) cheaply (harness/costmodel/estimate.py).

    Placement      degrees, ranks per node, the CPU time-sharing and co-running slowdowns
    PipelineRank   one pp rank's parameters and model states (worst dp rank), layers, ends
    PerToken       per-token (or per-sequence) activation bytes, FLOPs and element-wise bytes
    AxisLinks      the link each axis' collectives use (calibrated where measured)
    Layout         the above + the dp collectives of the busiest pp rank (harness/costmodel/comm.py)
"""
from __future__ import annotations

from dataclasses import dataclass, field

from harness import catalog
from harness.costmodel import activations as act
from harness.costmodel import comm, traffic
from harness.costmodel import memory as mem
from harness.costmodel.dp_comm import dp_collectives
from harness.costmodel.inputs import Hardware, Model, StrategyKnobs, ideal_stage, ranks_per_node
from harness.costmodel.params import (
    block_numel,
    block_tensors,
    norm_tensors,
    numel,
    option,
    rank_inventory,
    stage_split,
    tp_block_collectives,
)


@dataclass(slots=True)
class Placement:
    dp: int
    tp: int
    pp: int
    vpp: int  # virtual stages per pp rank (1 without a pipeline)
    ep: int
    world: int
    n_stages: int
    ranks_per_node: int
    slowdown: float  # CPU: ranks time-sharing the cores x co-running (GEMM): rates divide by this
    mem_slowdown: float  # CPU: time-sharing x co-running (STREAM triad): memory bandwidth divides by this


@dataclass(slots=True)
class PipelineRank:
    pp_rank: int
    stages: tuple
    groups: tuple  # parameter groups (count, dim0, rest, kind), harness/costmodel/params.py
    numel: int
    states: tuple  # per dp rank (params, grads, optimizer, master) bytes
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    master_bytes: int
    model_states_bytes: int  # the four above
    layers: int
    first: bool  # holds the embeddings
    last: bool  # holds ln_f, the head and (unless the runtime puts it on a later stage: AxisLinks.pp_logits_elem_bytes) the loss
    weight: int = 1  # pp ranks this one stands for (pipeline_ranks: the ranks holding the same kind of stages)


@dataclass(slots=True)
class PerToken:
    """Per checkpointing mode where it matters; activation bytes per sequence, the rest per token."""
    layer_activation_bytes: dict  # one layer, one sequence
    head_activation_bytes: float  # last stage, one sequence
    logits_bytes: float  # the loss's gradients, one sequence (a transient at the loss)
    loss: str  # model.loss (models/gpt.py): fp32 | chunked
    loss_chunk_tokens: int  # chunked: tokens per fp32 working copy (activations.loss_chunk_bytes)
    layer_flops: dict  # forward + backward (+ recompute) of one layer's shard
    head_flops: float
    layer_traffic_bytes: dict  # element-wise bytes (harness/costmodel/traffic.py)
    head_traffic_bytes: float
    act_elem_bytes: int  # matmul output dtype
    residual_elem_bytes: int  # the residual stream: fp32 under autocast
    unsharded_elem_bytes: int  # FSDP gathers params in this dtype


@dataclass(slots=True)
class AxisLinks:
    tp: comm.Link | None  # the all-reduce (sequence parallel: the norm parameters' gradients)
    pp: comm.Link | None
    ep: comm.Link | None
    tp_calls_per_microbatch: int  # all-reduces of the activations; with sequence parallel, all-gathers
    pp_sends_per_microbatch: int
    ep_layers: int
    tp_gather: comm.Link | None = None  # sequence parallel: its all-gathers and reduce-scatters of the
    tp_scatter: comm.Link | None = None  # activations, tp_calls_per_microbatch of each
    tp_norm_grads_per_microbatch: int = 0  # sequence parallel: all-reduces of a norm parameter's gradient
    pp_logits_elem_bytes: tuple = ()  # bytes per logit of each hop the logits make past the head's stage (logits_hops)


@dataclass(slots=True)
class Layout:
    model: Model
    hw: Hardware
    strategy: StrategyKnobs
    precision: str
    dtype: str  # the hardware profile's key for the precision: fp32 | bf16 | fp16
    place: Placement
    ranks: list  # PipelineRank: pp ranks 0, 1 and p-1 (every pp rank with detail)
    per_token: PerToken
    links: AxisLinks
    dp_collectives: list  # comm.DpCollective
    matmul_rate: float  # FLOP/s of one rank at this precision
    mem_bw: float  # bytes/s of one rank (0: memory-bound work not modelled)
    can_overlap: bool
    params_per_rank: int
    ideal_model_states_bytes: float
    optimizer_traffic_bytes: float
    grad_elems: int
    fsdp_block_bytes: float
    gemm_cache: dict = field(default_factory=dict)  # per-micro-batching figures step_time.py and memory_peak.py keep
    # micro-batch size -> layer and head times (compute.microbatch_times): shared by layouts that differ in dp
    # only where their ranks' rates do (the planner's HSDP shard groups on a GPU)
    mb_times: dict = field(default_factory=dict)
    optimizer_dispatch_s: float = 0.0  # CPU: the optimizer step's DTensor dispatch (tp > 1), FSDP2's step work
    elem_bw: float = 0.0  # bytes/s of one rank's element-wise operators (compute.py; 0: not modelled)

    @property
    def busiest(self) -> PipelineRank:
        return max(self.ranks, key=lambda r: r.numel)


def placement(hw: Hardware, dp: int, tp: int, pp: int, vpp: int, ep: int, nodes: int) -> Placement:
    v = vpp if pp > 1 else 1
    world = dp * tp * pp
    rpn = ranks_per_node(hw, world, nodes)
    if hw.device != "cpu":
        return Placement(dp, tp, pp, v, ep, world, pp * v, rpn, 1.0, 1.0)
    return Placement(dp, tp, pp, v, ep, world, pp * v, rpn, *cpu_slowdowns(hw, rpn))


def node_crossing_axes(pl: Placement) -> tuple[str, ...]:
    """The parallel axes whose groups span nodes. Rank order puts tp innermost, then dp (ep within it),
    then pp (ParallelDims' mesh and axis_links below): tp's stride is 1, dp's and ep's tp, pp's dp x tp."""
    axes = (("tp", pl.tp, 1), ("ep", pl.ep, pl.tp), ("dp", pl.dp, pl.tp), ("pp", pl.pp, pl.dp * pl.tp))
    return tuple(name for name, n, stride in axes if n > 1 and comm.crosses_nodes(n, stride, pl.ranks_per_node))


def cpu_slowdowns(hw: Hardware, busy_ranks: float) -> tuple[float, float]:
    """(GEMM, memory) slowdown of each of `busy_ranks` CPU ranks computing at once on a node: beyond the
    core count they time-share; from 2 ranks on, every core computes at once and each runs at the rate
    calibrate measured with all cores busy (harness/tools/calibrate_corun.py)."""
    sharing = comm.core_sharing(hw, busy_ranks)
    corun = (hw.corun_gemm, hw.corun_memory) if busy_ranks > 1 else (1.0, 1.0)
    return sharing * corun[0], sharing * corun[1]


def pipeline_ranks(md: Model, st: StrategyKnobs, pl: Placement, precision: str, detail: bool,
                   split: tuple | None = None) -> list[PipelineRank]:
    """Without detail only pp ranks 0, 1 and p-1: with equal stages the middle ranks hold the same
    parameters and rank 1 has the most micro-batches in flight among them, so every maximum is among
    these three. With unequal stages (pp * vpp not dividing the layers, or an explicit split) also the
    first rank of every other kind (its blocks, whether it holds the embeddings or the head): the lowest
    rank of a kind has the most micro-batches in flight. Each stands for `weight` ranks of its kind.
    split: params.stage_split's (layers per stage, head's stage, ...) as the runtime splits."""
    counts, head_stage = (split or stage_split(md.shape, pl.n_stages, st.stage_layers, st.runtime.pipeline_split))[:2]
    kind, weight = {}, {}
    if not detail and len(set(counts)) == 1:  # equal stages: the three ranks above, the middle ones like rank 1
        for r in range(pl.pp) if pl.pp <= 3 else (0, 1, pl.pp - 1):
            weight[r] = pl.pp - 2 if r == 1 and pl.pp > 3 else 1
    for r in range(pl.pp) if not weight else ():
        stages = catalog.stages_of_rank(st.schedule, r, pl.pp, pl.vpp)
        key = (sum(counts[s] for s in stages), 0 in stages, head_stage in stages)
        first = r if detail or r <= 1 or r == pl.pp - 1 else kind.setdefault(key, r)
        kind.setdefault(key, first)
        weight[first] = weight.get(first, 0) + 1
    out = []
    for r in sorted(weight):
        stages = catalog.stages_of_rank(st.schedule, r, pl.pp, pl.vpp)
        groups = rank_inventory(md.shape, pl.tp, pl.pp, pl.vpp, pl.ep, st.schedule, r, counts, head_stage)
        states = mem.model_states(st.state_sharding, groups, pl.dp, pl.ep, precision, st.state_knobs, detail)
        p, g, o, x = max(states, key=sum)
        out.append(PipelineRank(r, stages, groups, numel(groups), states, p, g, o, x, p + g + o + x,
                                sum(counts[s] for s in stages), 0 in stages,
                                head_stage in stages, weight[r]))
    return out


def per_token_costs(md: Model, st: StrategyKnobs, tp: int, precision: str) -> PerToken:
    e = catalog.PRECISION_BYTES[precision]
    e_res = 4 if st.autocast else e
    cfg = md.cfg
    loss = option(cfg, "loss")
    return PerToken(
        layer_activation_bytes={c: act.layer_bytes(cfg, 1, tp, st.sp, precision, c, st.autocast,
                                                   st.runtime.tp_saved_inputs == "sharded") for c in catalog.CHECKPOINTING},
        # fp32: vocab-parallel head and loss (models/tp_plan.py); chunked: whole logits (activations.py)
        head_activation_bytes=act.head_bytes(md.s, 1, md.h, md.V, tp, True, loss, e),
        logits_bytes=act.loss_grad_bytes(md.s, md.V, tp, loss, e),
        loss=loss, loss_chunk_tokens=option(cfg, "loss_chunk_tokens"),
        # forward+backward FLOPs per token of one layer (x3; full recompute x4; selective + the core;
        # selective_op + every other projection's forward)
        layer_flops={"none": 3 * md.layer_flops / tp, "selective": (3 * md.layer_flops + md.core_flops) / tp,
                     "full": 4 * md.layer_flops / tp, "selective_op": (3 * md.layer_flops + md.op_recompute_flops) / tp},
        head_flops=3 * md.head_flops / tp,
        layer_traffic_bytes={c: traffic.layer_bytes_per_token(cfg, tp, st.sp, e, e_res, c) for c in catalog.CHECKPOINTING},
        head_traffic_bytes=traffic.head_bytes_per_token(cfg, tp),
        act_elem_bytes=e, residual_elem_bytes=e_res,
        unsharded_elem_bytes=e if st.state_sharding == "sharded" else 4)


def axis_links(md: Model, hw: Hardware, st: StrategyKnobs, pl: Placement, ranks: list, split: tuple | None = None,
               pt: PerToken | None = None) -> AxisLinks:
    def link(coll, n, stride):
        return comm.collective_link(hw, coll, n, stride, pl.ranks_per_node)

    def tp_link(coll):  # as a step meets it where calibrate measured that (comm.IN_STEP)
        return link(comm.IN_STEP[coll] if comm.IN_STEP[coll] in hw.collectives else coll, pl.tp, 1) if pl.tp > 1 else None

    # Per layer: params.tp_block_collectives (6 all-reduces for a GELU MLP, 7 for SwiGLU; the profiled
    # window counted 6 per layer on model=tiny; with sequence parallel 4 all-gathers and 4
    # reduce-scatters, tp2 on model=small's trace: 136 of each per step = (4 x 8 layers + 2) x 4
    # micro-batches, and 136 all-reduces of a (256,) norm gradient = (4 x 8 + 2) x 4; comm.py).
    # A MoE MLP is not TP-sharded (experts whole on every tp rank): its block has attention's 4 (o
    # forward; q, k, v backward; the 4D run on moe_tiny measured 9 per stage and micro-batch, 2 layers).
    per_layer = 4 if (st.sp or md.E) else tp_block_collectives(md.shape[9], False)["allreduce_equiv"]
    tp_calls = max(per_layer * r.layers + int(r.first) + int(r.last) for r in ranks)
    norm = norm_tensors(option(md.cfg, "norm"))
    return AxisLinks(
        tp=tp_link("all_reduce"),
        pp=link("send_recv", 2, pl.dp * pl.tp) if pl.pp > 1 else None,
        ep=link("all_to_all", pl.ep, pl.tp) if pl.ep > 1 and md.E else None,
        tp_calls_per_microbatch=tp_calls,
        pp_sends_per_microbatch=max(comm.pp_sends(r.stages, pl.n_stages) for r in ranks),
        ep_layers=max(r.layers for r in ranks),
        tp_gather=tp_link("all_gather") if st.sp else None,
        tp_scatter=tp_link("reduce_scatter") if st.sp else None,
        tp_norm_grads_per_microbatch=max(norm * (2 * r.layers + int(r.last)) for r in ranks) if st.sp and pl.tp > 1 else 0,
        pp_logits_elem_bytes=logits_hops(split, pt))


def logits_hops(split: tuple | None, pt: PerToken | None) -> tuple:
    """Bytes per logit of each point-to-point hop the logits make after the head's stage where the runtime puts
    the fp32 cast and the loss on later stages (params.stage_split; nanotron): the head's output in the matmul's
    dtype to the cast's stage, fp32 from there to the loss's. Each hop's gradient comes back the same way."""
    if split is None or pt is None:
        return ()
    _, head, cast, loss, _ = split
    return ((pt.act_elem_bytes,) if cast > head else ()) + ((4,) if loss > cast else ())


def layout(md: Model, hw: Hardware, st: StrategyKnobs, dp: int, tp: int, pp: int, vpp: int, ep: int, precision: str,
           nodes: int = 1, detail: bool = False, weight_decay: float = 0.0, per_token: PerToken | None = None) -> Layout:
    """per_token: per_token_costs(md, st, tp, precision) where the caller has it (no dp in it: the planner's
    HSDP shard groups share their whole dp's)."""
    pl = placement(hw, dp, tp, pp, vpp, ep, nodes)
    split = stage_split(md.shape, pl.n_stages, st.stage_layers, st.runtime.pipeline_split)
    ranks = pipeline_ranks(md, st, pl, precision, detail, split)
    pt = per_token or per_token_costs(md, st, tp, precision)
    psi_rank = max(r.numel for r in ranks)
    rate = (hw.rate.get(catalog.PEAK_KEY[precision]) or hw.rate["fp32"]) / pl.slowdown
    # AdamW state is 8 B per element it updates: the rank with the most optimizer state steps longest
    opt_traffic = traffic.optimizer_bytes(max(r.optimizer_bytes for r in ranks) / 8, weight_decay)
    fsdp_block = pt.unsharded_elem_bytes * block_numel(md.shape, tp)
    links = axis_links(md, hw, st, pl, ranks, split, pt)
    lo = Layout(md, hw, st, precision, catalog.PEAK_KEY[precision], pl, ranks, pt, links, [], rate,
                hw.mem_bw / pl.mem_slowdown if hw.mem_bw else 0.0, hw.device != "cpu", psi_rank,
                mem.ideal_model_states(psi_rank, dp, ideal_stage(st), precision), opt_traffic, psi_rank, fsdp_block)
    lo.dp_collectives = dp_collectives(lo, block_tensors(md.shape, tp, ep))
    lo.elem_bw = hw.elem_bw / pl.mem_slowdown if hw.elem_bw else 0.0
    if tp > 1:  # AdamW (foreach=False) over DTensor shards: per parameter, on the busiest pp rank
        dt = hw.dtensor.sp if st.sp else hw.dtensor
        ops = max(dt.optimizer_ops_per_layer * r.layers + dt.optimizer_ops_outside_layers * (r.first or r.last)
                  for r in ranks)
        lo.optimizer_dispatch_s = ops * dt.optimizer_op_s * pl.slowdown
    if st.state_sharding == "sharded":  # FSDP2's last reduce and the step over DTensor shards (calibrate_fsdp.py)
        f = hw.fsdp2
        lo.optimizer_dispatch_s += max(f["step_block_s"] * r.layers + f["step_outside_s"] for r in ranks) * pl.slowdown
    return lo
