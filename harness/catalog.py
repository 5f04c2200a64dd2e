"""What each strategy and each pipeline schedule *is*, declared once (pure Python, no torch).

Validation, the cost model, the planner and the report read these rows; only harness/strategies/
maps names to torch classes. A new strategy or schedule is one module, one yaml and one row here.

Strategies (the rows of STRATEGIES):
    axes         the parallel axes it may set > 1 (the others must be 1)
    module       the module that runs it on engine torch (its STRATEGY class), named whole so a reader can open it
    state_sharding  how engine torch holds the model states over dp (read by the cost model and validation):
                   replicated     every dp rank holds everything (DDP; tp/pp/ep hold their shards)
                   zero1_torch    ZeroRedundancyOptimizer: whole params/grads, optimizer state by rank
                   sharded        FSDP2: params, grads, optimizer state split on dim 0 over dp
                   by_data_parallel    the strategy's `data_parallel` knob decides (DATA_PARALLEL)
    Engine deepspeed holds its own way whatever the name (state_sharding "deepspeed", its ZeRO stage).

Pipeline schedules (the rows of SCHEDULES), as torch.distributed.pipelining runs them:
    placement    which of the S = pp * vpp stages pp rank r holds:
                   one      stage r (gpipe, 1f1b; vpp = 1)
                   looped   stages r, r + pp, ..., r + (vpp-1) pp
                   v        stages r and 2 pp - 1 - r (vpp = 2): rank 0 holds both ends and the loss
    vpp          virtual stages per rank it needs: 1, 2, or ANY_VPP (any >= 2)
    split_backward  the backward is split in B (input grads) and W (weight grads): zero-bubble family
    order        the order of a rank's F/B actions in the schedule simulator (harness/costmodel/schedule.py)
    bubble       the idle-time formula (harness/costmodel/pipeline.py) and in_flight the peak of
                 micro-batches alive on a rank (harness/costmodel/activations.py), by kind
    min_microbatches  "stages": m >= pp * vpp on every engine; torch_microbatches: what torch's
                 schedule class refuses at construction ("stages_pp": m >= pp; "rounds": m a multiple
                 of its rounds max(1, m // pp))
    plan_vpps    the vpp values the planner tries for this schedule (empty: not searched)
    derive_middle  a dry run derives the peak of the ranks between two simulated middle ranks from theirs
                 (harness/strategies/pp_derive.py; proven by tests/test_dryrun_derive.py)
"""
from __future__ import annotations

from dataclasses import dataclass

ENGINES = ("torch", "deepspeed")
# Element size of the low-precision copies (activations, bf16/fp16 params and grads) per precision;
# fp32 master weights and AdamW state stay 4 bytes whatever the precision.
# workload.activation_checkpointing: none | selective (attention core) | full (each block) | selective_op
# (torchtitan's op policy, models/gpt.py); validate accepts these, the cost model prices each
CHECKPOINTING = ("none", "selective", "full", "selective_op")
PRECISION_BYTES = {"fp32": 4, "bf16-mixed": 2, "fp16-mixed": 2}
# model.attention (models/gpt.py): sdpa = a fused kernel, scores never stored; eager = scores
# materialised, scale, mask, softmax one op each; fused_softmax = scores materialised, the scale
# applied to q, mask + softmax in one kernel (Megatron-LM's FusedScaleMaskSoftmax)
ATTENTIONS = ("sdpa", "eager", "fused_softmax")
PRECISIONS = tuple(PRECISION_BYTES)
PEAK_KEY = {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}  # -> hardware peak_tflops / achievable_tflops key


def fp32_on_gpu_note(name: str, device: str, peak_tflops: dict, precision: str) -> str | None:
    """What the workload's CPU default precision means on a GPU profile (predict and plan print it)."""
    if device == "cpu" or precision != "fp32":
        return None
    return (f"precision fp32 on {name}: every GEMM at the fp32 peak ({peak_tflops.get('fp32', 0):g} TFLOP/s) where "
            f"bf16 tensor cores give {peak_tflops.get('bf16', 0):g}; GPU training runs workload.precision=bf16-mixed")


@dataclass(frozen=True)
class StrategyRow:
    name: str
    axes: tuple[str, ...]
    module: str
    state_sharding: str


STRATEGIES = {s.name: s for s in (
    StrategyRow("single", (), "harness.strategies.single", "replicated"),
    StrategyRow("ddp", ("dp",), "harness.strategies.ddp", "replicated"),
    StrategyRow("zero1", ("dp",), "harness.strategies.zero1", "zero1_torch"),
    StrategyRow("zero2", ("dp",), "harness.strategies.fsdp", "sharded"),
    StrategyRow("zero3", ("dp",), "harness.strategies.fsdp", "sharded"),
    StrategyRow("fsdp", ("dp",), "harness.strategies.fsdp", "sharded"),
    StrategyRow("tp", ("tp",), "harness.strategies.tp", "replicated"),
    StrategyRow("pp", ("pp",), "harness.strategies.pp", "replicated"),
    StrategyRow("3d", ("dp", "tp", "pp", "cp", "ep"), "harness.strategies.multi_axis", "by_data_parallel"),
    StrategyRow("ep", ("dp", "ep"), "harness.strategies.ep", "replicated"),
)}
# launcher=<name>: the module that runs it (its execute(), and preflight() where it has one)
LAUNCHERS = {"local": "launch.local", "slurm": "launch.slurm", "dryrun": "launch.dryrun"}
# 3d's strategy.data_parallel: how the data axis holds the model states (and the zero stage it amounts to)
# (zero1: the distributed optimizer, harness/strategies/distributed_optimizer.py)
DATA_PARALLEL = {"fsdp": ("sharded", 3), "ddp": ("replicated", 0), "zero1": ("distributed", 1)}
# zero1's strategy.zero1_impl: ZeroRedundancyOptimizer, or the distributed optimizer (state_sharding "distributed")
ZERO1_IMPL = {"torch_zero": "zero1_torch", "distributed": "distributed"}
DEFAULT_DATA_PARALLEL = "fsdp"
MOE_DATA_PARALLEL = "ddp"  # 3d with MoE blocks: brigade's own dense / expert reductions (strategies/moe_stages.py)


def data_parallel_runs(data_parallel: str, dp: int, tp: int, n_experts: int = 0) -> bool:
    """Whether 3d's data axis can hold this layout on engine torch. torch's DistributedDataParallel
    buckets plain tensors and cannot reduce tensor-parallel DTensor gradients (docs/notes.md#ddp-dtensor),
    so data_parallel=ddp needs dp or tp to be 1; MoE blocks reduce their own gradients (no DDP wrapper)."""
    return not (data_parallel == "ddp" and dp > 1 and tp > 1 and not n_experts)


# What schema 1 configs said per strategy before this catalog held it: (axes, impl). Only run_id
# reads it (harness/run/record.py), so records written before keep their run_ids.
SCHEMA_1_STRATEGY_FIELDS = {
    "single": ([], ""), "ddp": (["dp"], ""), "zero1": (["dp"], ""), "zero2": (["dp"], "fsdp"),
    "zero3": (["dp"], "fsdp"), "fsdp": (["dp"], ""), "tp": (["tp"], ""), "pp": (["pp"], ""),
    "3d": (["dp", "tp", "pp"], "mesh3d"), "ep": (["dp", "ep"], ""),
}


def strategy(name: str) -> StrategyRow:
    if name not in STRATEGIES:
        raise KeyError(f"unknown strategy '{name}'; available: {', '.join(sorted(STRATEGIES))}")
    return STRATEGIES[name]


def state_sharding(name: str, engine: str, zero_stage: int, data_parallel: str = DEFAULT_DATA_PARALLEL,
                 zero1_impl: str = "torch_zero") -> str:
    """How a strategy config holds its model states: replicated | zero1_torch | distributed | sharded |
    deepspeed (the row's state_sharding, resolved by the engine and the strategy's knobs)."""
    if engine == "deepspeed":
        return "deepspeed"
    sharding = strategy(name).state_sharding
    if sharding == "zero1_torch":
        return ZERO1_IMPL[zero1_impl]
    return DATA_PARALLEL[data_parallel][0] if sharding == "by_data_parallel" else sharding


def zero_stage(name: str, engine: str, zero_stage: int, data_parallel: str = DEFAULT_DATA_PARALLEL) -> int:
    """What is sharded over dp, as a ZeRO stage (0 nothing, 1 optimizer, 2 + grads, 3 + params)."""
    row = STRATEGIES.get(name)  # records of unknown or unnamed strategies (invalid configs) keep their stage
    if engine != "deepspeed" and row is not None and row.state_sharding == "by_data_parallel":
        return DATA_PARALLEL[data_parallel][1]
    return zero_stage


def module_of(name: str, engine: str, pp: int = 1, n_experts: int = 0) -> str:
    """The module that runs this strategy (its STRATEGY class). On engine deepspeed the mechanism
    decides, whatever the name: a PipelineModule when pp > 1, DeepSpeed MoE layers when the model has
    experts, else ZeRO (ddp = stage 0)."""
    if engine == "deepspeed":
        return ("harness.strategies.deepspeed.pipeline" if pp > 1 else "harness.strategies.deepspeed.moe" if n_experts
                else "harness.strategies.deepspeed.zero")
    return strategy(name).module


def strategy_for(dp: int, tp: int, pp: int, ep: int, zero: int) -> tuple[str, dict] | None:
    """The strategy (name, strategy overrides) that runs this layout on engine torch, or None.

    dp only: ZeRO 0-3 = ddp / zero1 / zero2 / zero3 (single on one device); tp only: tp; pp only: pp;
    ep (with dp): ep; mixed axes: 3d, whose dp axis is DDP (ZeRO 0), the distributed optimizer
    (ZeRO 1) or FSDP2 (ZeRO 3, or ZeRO 2 with reshard_after_forward=false). DDP with dp and tp both
    over 1 is a layout torch cannot run (data_parallel_runs), but it is what Megatron-LM's published rows
    ran, so it is returned for the cost model; the planner drops it."""
    if ep > 1:
        return ("ep", {}) if tp == 1 and pp == 1 and zero == 0 else None
    if tp == 1 and pp == 1:
        if dp == 1:
            return ("single", {}) if zero == 0 else None
        return ({0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}[zero], {})
    if dp == 1 and zero == 0 and (tp == 1 or pp == 1):
        return ("tp", {}) if pp == 1 else ("pp", {})
    if zero == 0:
        return "3d", {"data_parallel": "ddp"}
    if zero == 1:
        return "3d", {"data_parallel": "zero1"}
    if zero in (2, 3):
        return "3d", {"data_parallel": "fsdp", "reshard_after_forward": zero == 3}
    return None


# -- pipeline schedules --------------------------------------------------------------------------
ANY_VPP = None  # "any vpp >= 2"


@dataclass(frozen=True)
class ScheduleRow:
    name: str
    placement: str
    vpp: int | None
    split_backward: bool
    order: str
    bubble: str
    in_flight: str
    min_microbatches: str = ""
    torch_microbatches: str = ""
    plan_vpps: tuple[int, ...] = ()
    derive_middle: bool = False


SCHEDULES = {s.name: s for s in (
    ScheduleRow("gpipe", "one", 1, False, "all_forward_first", "textbook", "all", derive_middle=True),
    ScheduleRow("1f1b", "one", 1, False, "one_f_one_b", "textbook", "one_f_one_b", torch_microbatches="stages_pp",
                plan_vpps=(1,), derive_middle=True),
    ScheduleRow("interleaved_1f1b", "looped", ANY_VPP, False, "interleaved", "textbook", "interleaved",
                torch_microbatches="rounds", plan_vpps=(2, 4, 8), derive_middle=True),
    ScheduleRow("looped_bfs", "looped", ANY_VPP, False, "breadth_first", "textbook", "all", derive_middle=True),
    ScheduleRow("interleaved_zero_bubble", "looped", ANY_VPP, True, "interleaved", "zb_h1", "zero_bubble_looped",
                torch_microbatches="rounds", derive_middle=True),
    ScheduleRow("zbv_zero_bubble", "v", 2, True, "greedy", "zbv", "zbv", plan_vpps=(2,)),
    ScheduleRow("dualpipev", "v", 2, True, "greedy", "dualpipe_v", "dualpipe_v", min_microbatches="stages"),
)}
DEFAULT_SCHEDULE = "1f1b"
DEEPSPEED_SCHEDULE = "1f1b"  # DeepSpeed's PipelineEngine runs its own 1F1B (TrainSchedule)


def schedule(name: str) -> ScheduleRow:
    if name not in SCHEDULES:
        raise KeyError(f"unknown schedule '{name}'; available: {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def stages_of_rank(name: str, pp_rank: int, pp: int, vpp: int) -> tuple[int, ...]:
    """The stage indices pp rank `pp_rank` holds, in the order its schedule expects them."""
    if pp == 1 and vpp == 1:
        return (0,)
    if schedule(name).placement == "v":
        return (pp_rank, 2 * pp - 1 - pp_rank)
    return tuple(pp_rank + i * pp for i in range(vpp))


def loss_rank(name: str, pp: int) -> int:
    """The pp coordinate of the rank that holds the last stage, and so computes the loss."""
    return 0 if schedule(name).placement == "v" else pp - 1


def chunks_per_rank(name: str, vpp: int) -> int:
    """Stage chunks a pp rank runs (its v in the bubble formulas)."""
    row = schedule(name)
    return 2 if row.placement == "v" else (vpp if row.placement == "looped" else 1)


def microbatch_rule_broken(name: str, engine: str, pp: int, vpp: int, m: int) -> str:
    """Which micro-batch rule of the schedule m breaks on this engine ("" when none): `min_microbatches`
    on every engine, `torch_microbatches` on torch (validate.py words each refusal; plan skips them)."""
    row = schedule(name)
    if row.min_microbatches == "stages" and m < pp * vpp:
        return "stages"
    if engine == "torch":
        if row.torch_microbatches == "stages_pp" and m < pp:
            return "stages_pp"
        if row.torch_microbatches == "rounds" and m % max(1, m // pp):
            return "rounds"
    return ""
