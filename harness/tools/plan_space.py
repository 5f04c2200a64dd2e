"""The planner's search space beyond the parallel degrees (harness/plan.py): the variants one layout
has (sequence parallelism, bf16 parameters for the distributed optimizer, HSDP's replica counts) and how
an HSDP variant's prediction is made from two base estimates, as `predict` makes it."""
from __future__ import annotations

from dataclasses import replace

from harness import catalog
from harness.costmodel import hsdp_cp
from harness.dims import ParallelDims


def with_sequence_parallel(knobs: dict, tp: int, model) -> list[dict]:
    """The layout's knobs, and with tp > 1 also with Megatron's sequence parallelism (what lets TP 4-8
    hold long sequences: LayerNorm/dropout activations / tp), where validate allows it (dense MLP,
    seq_len divisible by tp)."""
    if tp == 1 or model.n_experts or model.seq_len % tp:
        return [knobs]
    return [knobs, {**knobs, "sequence_parallel": True}]


def with_low_precision_params(knobs: dict, precision: str) -> list[dict]:
    """The layout's knobs, and for the distributed optimizer under bf16-mixed also with bf16 parameters
    (Megatron-LM's --bf16: fp32 only in the master slice; half the params, a bf16 residual stream)."""
    if catalog.DATA_PARALLEL.get(knobs.get("data_parallel"), ("",))[0] != "distributed" or precision != "bf16-mixed":
        return [knobs]
    return [knobs, {**knobs, "low_precision_params": True}]


def hsdp_replicas(dp: int, world: int, ranks_per_node: int) -> list[int]:
    """HSDP's replica counts R for a dp axis of dp ranks: every R with 1 < R < dp dividing it (FSDP over
    S = dp / R ranks, its shard group, and an all-reduce over the R replicas), where the layout spans
    nodes: HSDP keeps the shard group's per-unit collectives on fewer nodes and sends only the replicas'
    all-reduce further; within one node it only adds that all-reduce."""
    if world <= ranks_per_node:
        return []
    return [r for r in divisors(dp) if 1 < r < dp]


def hsdp_dims(lo, rep: int) -> ParallelDims:
    """The degrees of lo's layout with its dp axis split into rep replicas of dp / rep ranks (HSDP)."""
    pl = lo.place
    return ParallelDims(dp=pl.dp, tp=pl.tp, pp=pl.pp, vpp=pl.vpp, world_size=pl.world, dp_replicate=rep)


def candidate_workload(run, precision: str, mb: int, ckpt: str):
    """The run's workload with a candidate's micro-batch size and checkpointing (what hsdp_cp.adjust reads)."""
    return replace(run.workload, micro_batch_size=mb, precision=precision, activation_checkpointing=ckpt)


def hsdp_prediction(full: dict, shard: dict, lo, st, run, hw, m: int, w, dims: ParallelDims) -> dict:
    """The prediction of an HSDP layout from the two base estimates, as `predict` makes it
    (harness/costmodel/hsdp_cp.py adjust): `full` at the whole dp, `shard` at its shard group; w:
    candidate_workload, dims: hsdp_dims."""
    full["ranks_per_node"] = lo.place.ranks_per_node  # `full` is the candidate's own: adjust completes it in place
    return hsdp_cp.adjust(full, shard, run.model, w, st.fsdp_accumulate, dims, hw, m)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
