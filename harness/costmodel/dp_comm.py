"""The data-parallel axis' collectives per optimizer step, per engine, and how each one overlaps.

Ψ = a rank's parameter bytes in the dtype the engine moves them, Ψ_blocks = the part inside the
transformer blocks, G = its gradient bytes (after any comm hook), m = micro-batches per step:
    DDP: one all-reduce of G per step (no_sync on the other micro-batches), bucket by bucket,
        overlapped with the last micro-batch's backward;
    ZeroRedundancyOptimizer (zero1_impl=torch_zero): that all-reduce + a broadcast of the updated
        parameters from their owners after the step (nothing left to hide it behind);
    distributed optimizer (zero1_impl=distributed, 3d data_parallel=zero1; state_sharding "distributed" of
        harness/catalog.py): one flat reduce-scatter of G after the backward, each rank steps its 1/n,
        one all-gather of Ψ after the step (harness/strategies/distributed_optimizer.py overlaps
        neither); Megatron-Core's overlap_grad_reduce / overlap_param_gather (strategy knobs of those
        names, cost model only) make them backward_last / next_forward;
    FSDP2 / ZeRO-3, fsdp_accumulate=unsharded (brigade's default, harness/strategies/fsdp.py keeps
        params gathered and grads unsharded between micro-batches): all-gather the blocks' params in
        forward and again in backward, m + 1 times over m micro-batches (once with
        reshard_after_forward=False, i.e. zero2), the root unit (embeddings, ln_f, head) once, + one
        reduce-scatter of G: (2Ψ + Ψ_blocks)(n-1)/n at m = 1, the paper's 3(n-1)/n Ψ up to the root;
    FSDP, fsdp_accumulate=sharded (reduce-scatter every micro-batch, as Composer / FSDP1 without
        no_sync): per micro-batch Ψ + Ψ_blocks gathered (Ψ under zero2) and G reduce-scattered;
    DeepSpeed: stage 0 all-reduce; 1: all-reduce (each rank keeps its partition) + all-gather;
        2: all-reduce every micro-batch + all-gather; 3: every micro-batch an all-gather in forward, a
        second in backward of what its coordinator released after forward (ds_zero3.py: on a model
        smaller than half of stage3_max_reuse_distance, nothing) and a reduce-scatter.
Overlap mechanisms (harness/costmodel/step_time.py turns each into exposed time):
    backward_last   gradient buckets reduced during the last micro-batch's backward; the last bucket waits
    backward_each   reduced during every micro-batch's backward; the last bucket waits
    prefetch        parameter gathers one unit ahead of the compute that needs them; the first waits.
                    DeepSpeed ZeRO-3 prefetches at most stage3_prefetch_bucket_size elements ahead, so of
                    a unit larger than that only that fraction can hide (175B: 5e7 of 1.8e9 per block)
    next_forward    parameter gathers overlapped with the next step's forward; the first bucket waits
    after_step      nothing to hide behind: fully exposed
"""
from __future__ import annotations

from dataclasses import dataclass

from harness import catalog
from harness.costmodel import comm, ds_zero3


@dataclass(slots=True)
class DpOp:
    """One dp collective per step: total message bytes = bytes_once + m * bytes_per_microbatch."""
    collective: str
    bytes_once: float
    bytes_per_microbatch: float
    mechanism: str


@dataclass(slots=True)
class DpCollective:
    """A DpOp placed on a link: what step_time needs to cost it and its overlap."""
    op: DpOp
    group: int
    alpha_s: float
    bus_bw_Bps: float
    bucket_bytes: float  # gradient buckets (0: one call per parameter unit)
    unit_bytes: float  # bytes of one pass over every unit (parameters gathered, gradients reduced): calls when not bucketed
    units: int  # FSDP units / DeepSpeed gather groups: one per block + the root
    factor: float  # nccl-tests bus factor of the collective over the group (comm.FACTOR)
    prefetch_fraction: float = 1.0  # of one unit's gather that can be in flight ahead of its compute
    link: comm.Link | None = None  # across a named fabric: each call priced at its own size (comm.call_s)


def dp_ops(st, n: int, param_bytes: float, grad_bytes: float, block_param_bytes: float | None = None,
           ds_gathers: float = 2.0) -> list[DpOp]:
    """The dp axis' collectives of one rank for a strategy (inputs.StrategyKnobs) over n ranks. ds_gathers:
    DeepSpeed ZeRO-3's gathered elements per micro-batch over the parameters (ds_zero3.py; 2 = the paper's)."""
    if n <= 1:
        return []
    fam, stage, p, g = st.state_sharding, st.zero_stage, param_bytes, grad_bytes
    if fam == "replicated" or (fam == "deepspeed" and stage == 0):
        return [DpOp("all_reduce", g, 0.0, "backward_last")]
    if fam == "zero1_torch":
        return [DpOp("all_reduce", g, 0.0, "backward_last"), DpOp("broadcast", p, 0.0, "after_step")]
    if fam == "distributed":  # Megatron-Core's --overlap-grad-reduce / --overlap-param-gather, where set
        return [DpOp("reduce_scatter", g, 0.0, "backward_last" if st.overlap_grad_reduce else "after_step"),
                DpOp("all_gather", p, 0.0, "next_forward" if st.overlap_param_gather else "after_step")]
    if fam == "sharded":
        return _fsdp_ops(st, p, g, p if block_param_bytes is None else block_param_bytes)
    # DeepSpeed 0.19 stages 1 and 2 all-reduce each gradient bucket and keep their partition of it
    # (average_tensor with use_multi_rank_bucket_allreduce, default true; the profiled window's flight
    # recorder sees c10d all-reduces of the whole gradients).
    if stage == 1:
        return [DpOp("all_reduce", g, 0.0, "backward_last"), DpOp("all_gather", p, 0.0, "after_step")]
    if stage == 2:
        return [DpOp("all_reduce", 0.0, g, "backward_each"), DpOp("all_gather", p, 0.0, "after_step")]
    return [DpOp("all_gather", 0.0, ds_gathers * p, "prefetch"), DpOp("reduce_scatter", 0.0, g, "backward_each")]


def _fsdp_ops(st, p: float, g: float, blocks: float) -> list[DpOp]:
    if st.fsdp_accumulate == "sharded":
        per_mb = p + blocks if st.reshard_after_forward else p
        return [DpOp("all_gather", 0.0, per_mb, "prefetch"), DpOp("reduce_scatter", 0.0, g, "backward_each")]
    # unsharded: a resharding unit is gathered for the first forward and for every backward; it stays
    # gathered from a non-last backward into the next forward: m + 1. The root unit is not resharded
    # after forward (fsdp.py passes reshard_after_forward=None for it): gathered once per step. So
    # Ψ + m Ψ_blocks, not (m + 1) Ψ (the flight recorder counted 1 + 3 x 4 gathers at m = 2, model=tiny).
    gathers = (p, blocks) if st.reshard_after_forward else (p, 0.0)
    return [DpOp("all_gather", *gathers, "prefetch"), DpOp("reduce_scatter", g, 0.0, "backward_last")]


def grad_comm_bytes(st, groups, grad_elem_bytes: int) -> tuple[float, float]:
    """(dense, expert) gradient bytes a dp all-reduce / reduce-scatter moves, after any comm hook."""
    def elems(kind, compress=False):
        if compress:  # PowerSGD (Vogels et al. 2019): a rank-r P (n x r) and Q (m x r) per matrix
            return sum(c * (st.powersgd_rank * (d0 + r) if r > 1 else d0) for c, d0, r, k in groups if k == kind)
        return sum(c * d0 * r for c, d0, r, k in groups if k == kind)
    if st.comm_hook in ("fp16", "bf16"):  # DDP's compress hooks; FSDP2's bf16 reduce dtype (fsdp.py)
        return 2 * elems("dense"), 2 * elems("expert")
    if st.comm_hook == "powersgd":
        return 4 * elems("dense", True), 4 * elems("expert", True)
    return grad_elem_bytes * elems("dense"), grad_elem_bytes * elems("expert")


def dp_collectives(lo, block_groups) -> list[DpCollective]:
    """The dp collectives of the pp rank with the most parameters (lo: a layout.Layout under construction)."""
    st, pl, precision = lo.strategy, lo.place, lo.precision
    e = catalog.PRECISION_BYTES[precision]
    busiest = lo.busiest
    grad_elem = 4 if (st.state_sharding != "deepspeed" or precision == "fp32") else e
    param_elem = e if st.state_sharding in ("sharded", "deepspeed") or st.low_precision_params else 4
    dense_g, expert_g = grad_comm_bytes(st, busiest.groups, grad_elem)
    dense_p = param_elem * sum(c * d0 * r for c, d0, r, k in busiest.groups if k == "dense")
    expert_p = param_elem * sum(c * d0 * r for c, d0, r, k in busiest.groups if k == "expert")
    # dense params inside the blocks (FSDP re-gathers only those per micro-batch)
    block_p = param_elem * busiest.layers * sum(c * d0 * r for c, d0, r, k in block_groups if k == "dense")
    bucket = st.ds_buckets[0] * grad_elem if st.ds_buckets else st.bucket_bytes
    ds_gathers = 2.0
    if st.ds_reuse:  # DeepSpeed 3 has no tp/pp/ep here: the busiest rank holds the whole model
        forward, again, _ = ds_zero3.gathered_elements(lo.model.shape, *st.ds_reuse)
        ds_gathers = (forward + again) / max(1, busiest.numel)
    out = []
    for n, pb, gb, blk in ((pl.dp, dense_p, dense_g, block_p), (pl.dp // pl.ep, expert_p, expert_g, expert_p)):
        if n <= 1 or (pb == 0 and gb == 0):
            continue
        for op in dp_ops(st, n, pb, gb, blk, ds_gathers):
            link = comm.collective_link(lo.hw, op.collective, n, pl.tp, pl.ranks_per_node)
            # DDP, DeepSpeed and Megatron reduce by gradient bucket; FSDP one reduce-scatter per unit
            bucketed = (op.mechanism in ("backward_last", "backward_each", "next_forward")
                        and st.state_sharding != "sharded")
            units = busiest.layers + 1
            ahead = (min(1.0, st.ds_buckets[1] * param_elem / (pb / units))
                     if st.ds_buckets and op.mechanism == "prefetch" else 1.0)
            once = gb if op.collective in ("reduce_scatter", "all_reduce") else pb  # one pass over the units
            out.append(DpCollective(op, n, link.alpha_s, link.bw_Bps, bucket if bucketed else 0.0, once, units,
                                    comm.FACTOR[op.collective](n), ahead, link if link.fabric else None))
    return out
