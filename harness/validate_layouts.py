"""Refusals for the layouts of issue 14: HSDP (dp_replicate), context parallel (cp), the distributed
optimizer (dp_shard=zero1, zero1_impl) and FSDP's accumulation modes. Pure (no torch); each message
shows the arithmetic or names the field that makes the config meaningless."""
from __future__ import annotations

from harness import catalog
from harness.dims import ConfigError, ParallelDims

ZERO1_IMPLS = ("torch_zero", "distributed")
FSDP_ACCUMULATE = ("unsharded", "sharded")


def runs_fsdp(s) -> bool:
    """Whether this strategy config shards with FSDP2 (the only one HSDP and fsdp_accumulate apply to)."""
    return catalog.state_family(s.name, s.engine, s.zero_stage, s.dp_shard) == "sharded"


def reads_dp_shard(s) -> bool:
    return s.engine == "torch" and catalog.strategy(s.name).states == "by_dp_shard"


def validate_layouts(run, dims: ParallelDims, torch_runs: bool = True) -> None:
    s, m = run.strategy, run.model
    if s.dp_shard not in catalog.DP_SHARD:
        raise ConfigError(f"unknown dp_shard '{s.dp_shard}'; available: {', '.join(catalog.DP_SHARD)}")
    if s.dp_shard != catalog.DEFAULT_DP_SHARD and not reads_dp_shard(s):
        raise ConfigError(f"strategy.dp_shard={s.dp_shard} means nothing for strategy {s.name}: only 3d reads it "
                          f"(plain zero1 takes strategy.zero1_impl=distributed instead)")
    if s.zero1_impl not in ZERO1_IMPLS:
        raise ConfigError(f"unknown zero1_impl '{s.zero1_impl}'; available: {', '.join(ZERO1_IMPLS)}")
    if s.zero1_impl != "torch_zero" and not (s.engine == "torch" and catalog.strategy(s.name).states == "zero1_torch"):
        raise ConfigError(f"strategy.zero1_impl={s.zero1_impl} means nothing for strategy {s.name} "
                          f"(engine {s.engine}): it chooses zero1's optimizer on engine torch; in 3d use "
                          f"strategy.dp_shard=zero1")
    distributed = catalog.state_family(s.name, s.engine, s.zero_stage, s.dp_shard, s.zero1_impl) == "distributed"
    if distributed and s.comm_hook != "none":
        raise ConfigError(f"comm_hook {s.comm_hook} compresses DDP's all-reduce; the distributed optimizer "
                          f"reduce-scatters its own flat buffer: use comm_hook=none")
    if runs_fsdp(s) and s.comm_hook not in ("none", "bf16"):
        raise ConfigError(f"comm_hook {s.comm_hook} is a DDP hook; FSDP2 reduce-scatters in its mixed-precision "
                          f"reduce dtype: comm_hook=bf16 sets it to bf16 (NCCL), none keeps fp32")
    if distributed and run.workload.precision == "fp16-mixed":
        raise ConfigError("fp16-mixed needs a loss scaler that unscales and checks every rank's grads; the "
                          "distributed optimizer steps a flat slice it does not coordinate: use bf16-mixed or fp32")
    if s.low_precision_params:
        _validate_low_precision_params(s, run.workload.precision, distributed, torch_runs)
    _validate_megatron_overlaps(s, dims, distributed, torch_runs)
    if s.fsdp_accumulate not in FSDP_ACCUMULATE:
        raise ConfigError(f"unknown fsdp_accumulate '{s.fsdp_accumulate}'; available: {', '.join(FSDP_ACCUMULATE)}")
    if s.fsdp_accumulate != "unsharded" and not runs_fsdp(s):
        raise ConfigError(f"strategy.fsdp_accumulate={s.fsdp_accumulate} applies to FSDP2 only (fsdp, zero2, "
                          f"zero3 and 3d with dp_shard=fsdp, engine torch); strategy {s.name} "
                          f"(engine {s.engine}, dp_shard {s.dp_shard}) does not shard with FSDP")
    if torch_runs and reads_dp_shard(s) and not catalog.dp_shard_runs(s.dp_shard, dims.dp * dims.cp, dims.tp, m.n_experts):
        raise ConfigError(f"3d with dp_shard={s.dp_shard} at dp {dims.dp} x cp {dims.cp} x tp {dims.tp}: torch's "
                          f"DistributedDataParallel cannot reduce tensor-parallel (DTensor) gradients; use "
                          f"strategy.dp_shard=zero1 (the distributed optimizer, as Megatron-LM runs dp with tp) "
                          f"or strategy.dp_shard=fsdp")
    if m.n_experts and reads_dp_shard(s) and dims.dp > 1 and s.dp_shard != catalog.MOE_DP_SHARD:
        raise ConfigError(f"MoE in 3d (model {m.name}: n_experts {m.n_experts}) reduces dense grads over dp and "
                          f"expert grads over dp/ep replicas itself, as strategy=ep does; dp_shard={s.dp_shard} "
                          f"(FSDP or the distributed optimizer over experts) is not implemented: use "
                          f"strategy.dp_shard=ddp")
    if dims.dp_replicate > 1:
        if not runs_fsdp(s):
            raise ConfigError(f"dp_replicate {dims.dp_replicate} (HSDP) needs FSDP2: strategy fsdp, zero2 or zero3 on "
                              f"engine torch, or 3d with dp_shard=fsdp; got {s.name} (engine {s.engine}, "
                              f"dp_shard {s.dp_shard})")
    if dims.cp > 1:
        if m.seq_len % (2 * dims.cp):
            raise ConfigError(f"seq_len {m.seq_len} not divisible by 2 x cp = {2 * dims.cp}: the sequence is cut "
                              f"into 2*cp chunks for causal load balance ({m.seq_len} % {2 * dims.cp} = "
                              f"{m.seq_len % (2 * dims.cp)})")
        if m.attention not in ("sdpa", "eager"):
            raise ConfigError(f"context parallel supports attention sdpa and eager, not '{m.attention}'")
        if m.n_experts:
            raise ConfigError(f"context parallel with MoE (model {m.name}: n_experts {m.n_experts}) is not "
                              f"supported: the load-balancing loss is E * sum_e mean(p_e) * frac(e) over a "
                              f"micro-batch's tokens, a product of means that does not split over sequence chunks")
        if dims.tp > 1 and s.sequence_parallel:
            raise ConfigError(f"cp {dims.cp} with sequence_parallel is not supported: both would split the "
                              f"sequence dimension (set strategy.sequence_parallel=false)")


def _validate_low_precision_params(s, precision: str, distributed: bool, torch_runs: bool) -> None:
    """bf16 parameters with fp32 main params and grads in the optimizer (Megatron-LM's --bf16): run with the
    distributed optimizer; with DDP (Megatron-LM's Float16OptimizerWithFloat16Params) priced, not run."""
    replicated = catalog.state_family(s.name, s.engine, s.zero_stage, s.dp_shard, s.zero1_impl) == "replicated"
    if precision != "bf16-mixed" or not (distributed or (replicated and s.engine == "torch")):
        raise ConfigError(f"strategy.low_precision_params holds the parameters in bf16 with fp32 main params and "
                          f"gradients in the optimizer: it needs workload.precision=bf16-mixed and the distributed "
                          f"optimizer (strategy=zero1 with zero1_impl=distributed, or 3d with dp_shard=zero1), or, "
                          f"priced by the cost model only, DDP (ddp, tp, pp, 3d with dp_shard=ddp) (got strategy "
                          f"{s.name}, engine {s.engine}, precision {precision})")
    if replicated and torch_runs:
        raise ConfigError("strategy.low_precision_params with DDP (Megatron-LM's bf16 module with an fp32 copy of every "
                          "parameter and gradient in its optimizer) is priced by the cost model (docs/published.md), "
                          "not run: brigade runs bf16 parameters with the distributed optimizer (strategy=zero1 "
                          "strategy.zero1_impl=distributed, or 3d strategy.dp_shard=zero1)")


def _validate_megatron_overlaps(s, dims: ParallelDims, distributed: bool, torch_runs: bool) -> None:
    """Megatron-Core's overlap knobs: meaningful only where Megatron accepts them, and priced, not run."""
    if s.tp_comm_overlap and not (dims.tp > 1 and s.sequence_parallel):
        raise ConfigError(f"strategy.tp_comm_overlap overlaps sequence parallelism's all-gathers / reduce-scatters "
                          f"with the GEMMs: it needs tp > 1 (tp {dims.tp}) and strategy.sequence_parallel=true "
                          f"(got {str(s.sequence_parallel).lower()}), as Megatron-Core asserts")
    for knob in ("overlap_grad_reduce", "overlap_param_gather"):
        if getattr(s, knob) and not distributed:
            raise ConfigError(f"strategy.{knob} overlaps the distributed optimizer's collectives: it needs "
                              f"strategy=zero1 with zero1_impl=distributed or 3d with dp_shard=zero1")
    on = [k for k in ("tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather") if getattr(s, k)]
    if torch_runs and on:
        raise ConfigError(f"strategy.{', strategy.'.join(on)}: Megatron-Core's overlaps, which the cost model prices "
                          f"(docs/published.md) but brigade's runtime does not implement (its distributed optimizer "
                          f"reduces and gathers after the backward, its TP collectives run between the GEMMs): set "
                          f"them false to run")
