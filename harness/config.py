"""The config schema: one dataclass per Hydra group, registered in the ConfigStore.

YAML files in conf/ hold values; these dataclasses hold the schema, so a typo in an override is
an error, not a silently ignored key. This module imports no torch: the parent process, the cost
model and `python -m harness.predict` all read it.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from harness.catalog import DEFAULT_DATA_PARALLEL, DEFAULT_SCHEDULE, LAUNCHERS
from harness.dims import ConfigError, world_size

# Imports inside functions: Hydra (only the parent composes configs).

GiB, MiB = 1024**3, 1024**2  # one name per unit, wherever bytes are shown or compared
ADHOC_STUDY = "adhoc"  # the study of a run started without one: records go to <results_dir>/adhoc.jsonl

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"  # absolute: works from any cwd


@dataclass
class ModelConfig:
    name: str = MISSING  # preset name, recorded as is
    n_layers: int = MISSING
    d_model: int = MISSING  # hidden size h
    n_heads: int = MISSING
    d_ff: int = MISSING  # MLP inner size; 4 * d_model for the GPT-2/3 style presets
    vocab_size: int = MISSING
    seq_len: int = MISSING  # tokens per sequence s (also the size of the learned position table)
    dropout: float = 0.0
    attention: str = "sdpa"  # sdpa | eager | fused_softmax (the last two store the (B, nh, T, T) scores; catalog.py)
    n_experts: int = 0  # 0 = dense MLP; >0 = MoE MLP with this many experts per layer
    top_k: int = 2  # experts per token (MoE only)
    capacity_factor: float = 0.0  # MoE: 0 = no capacity limit (no token dropped)
    aux_loss_coef: float = 0.01  # MoE: weight of the load-balancing loss (Switch Transformer)
    routing: str = "topk"  # MoE: topk (the router's choice) | balanced (token s's j-th route to expert (s + j) mod E: S*k/E routes each, the load a dry run assumes; models/moe.py)
    # Llama-family options (defaults reproduce the GPT above)
    norm: str = "layernorm"  # layernorm | rmsnorm
    mlp: str = "gelu"  # gelu (2 matmuls) | swiglu (3 matmuls: gate, up, down)
    position: str = "learned"  # learned (a seq_len x d_model table) | rope
    rope_theta: float = 10000.0  # RoPE base frequency (Llama 2: 1e4, Llama 3: 5e5)
    n_kv_heads: Optional[int] = None  # grouped-query attention: key/value heads; None = n_heads
    tie_embeddings: bool = False  # head shares the token embedding's weight
    bias: bool = False  # biases on the linear layers
    # the loss (models/gpt.py): fp32 (F.cross_entropy on fp32 logits: ~12 B x V per token at the loss) |
    # chunked (logits kept in their dtype, fp32 work loss_chunk_tokens at a time: ~2 x dtype x V per token)
    loss: str = "fp32"
    loss_chunk_tokens: int = 2048  # chunked: tokens per fp32 (chunk, V) working buffer


@dataclass
class DeepSpeedKnobs:
    """DeepSpeed ZeRO knobs, with DeepSpeed 0.19's defaults unless noted."""

    overlap_comm: Optional[bool] = None  # None = DeepSpeed's default: True at stage 3, False at stages 0-2
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = 5_000_000  # DeepSpeed default 5e8 allocates ~1.9 GB/rank under ZeRO-3 on CPU
    allgather_bucket_size: int = 500_000_000
    stage3_param_persistence_threshold: int = 0  # DeepSpeed default 1e5 keeps small params whole; 0 shows full sharding
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000  # keep a param gathered if reused within this many elements
    cpu_adam: bool = False  # offload with DeepSpeedCPUAdam (needs prebuilt ops); False = client torch AdamW
    wall_clock_breakdown: bool = False  # DeepSpeed's own timers, recorded under measured.deepspeed
    comms_logger: bool = False  # DeepSpeed's comms logger, recorded under measured.deepspeed
    extra: dict[str, Any] = field(default_factory=dict)  # free-form overrides merged into the generated JSON


@dataclass
class StrategyConfig:
    """One schema for every strategy: each conf/strategy/<name>.yaml sets the fields it uses."""

    name: str = MISSING  # a row of harness/catalog.py STRATEGIES (its axes and implementing module are there)
    engine: str = "torch"  # torch | deepspeed
    zero_stage: int = 0  # 0-3: what is sharded over dp (1: optimizer, 2: + grads, 3: + params)
    zero1_impl: str = "torch_zero"  # zero1 on engine torch: torch_zero (ZeroRedundancyOptimizer) | distributed
    # DDP
    bucket_cap_mb: float = 25.0
    comm_hook: str = "none"  # none | fp16 | bf16 (NCCL only) | powersgd; FSDP2: none (fp32) | bf16 reduce dtype
    powersgd_rank: int = 1
    # FSDP / 3D data axis
    reshard_after_forward: bool = True
    fsdp_accumulate: str = "unsharded"  # FSDP across micro-batches: unsharded (gathered until the step) | sharded
    data_parallel: str = DEFAULT_DATA_PARALLEL  # 3d: how the dp axis holds the model states: a key of catalog.DATA_PARALLEL
    dp_shard: Optional[str] = None  # the old name of data_parallel, read as it (RENAMED)
    # Tensor parallel
    sequence_parallel: bool = False
    loss_parallel: bool = True
    # Megatron-Core's overlaps, priced by the cost model only: brigade's runtime has none of them, so a run
    # that sets one is refused at launch (harness/validate.py); the published set predicts with them
    tp_comm_overlap: bool = False  # TP collectives pipelined with the GEMMs (--tp-comm-overlap; needs sequence_parallel)
    overlap_grad_reduce: bool = False  # distributed optimizer: reduce-scatter in buckets during the last backward
    overlap_param_gather: bool = False  # distributed optimizer: all-gather in buckets during the next forward
    # distributed optimizer under bf16-mixed: parameters held in bf16, fp32 only in the optimizer's master
    # slice and a gradient buffer (Megatron-LM's --bf16; harness/strategies/distributed_optimizer.py); with
    # DDP (Megatron-LM's bf16 module, fp32 main params and grads) priced by the cost model only
    low_precision_params: bool = False
    # Pipeline receive buffers: step = torch's PipelineStage, a buffer for every micro-batch of the step made
    # when the schedule starts (brigade's runtime); in_flight = Megatron-LM's p2p, a tensor per transfer,
    # alive while its micro-batch is in flight (priced for the published Megatron rows; refused at launch)
    pp_recv_buffers: str = "step"
    # Pipeline
    schedule: str = DEFAULT_SCHEDULE  # a row of harness/catalog.py SCHEDULES
    stage_layers: list[int] = field(default_factory=list)  # blocks per pipeline stage (pp * vpp counts); empty: as even as n_layers allows (models/pipeline_split.py)
    # DeepSpeed
    offload: str = "none"  # none | optimizer | optimizer+params
    ds: DeepSpeedKnobs = field(default_factory=DeepSpeedKnobs)


@dataclass
class ParallelConfig:
    dp: int = 1  # data-parallel degree
    tp: int = 1  # tensor-parallel degree (innermost: ranks of a tp group are adjacent)
    pp: int = 1  # pipeline stages
    vpp: int = 1  # virtual pipeline stages per rank (interleaved / looped / V schedules)
    ep: int = 1  # expert-parallel degree; shares ranks with dp (ep must divide dp)
    cp: int = 1  # context-parallel degree: the sequence split over cp ranks (3d)
    dp_replicate: int = 1  # HSDP: dp = dp_replicate x dp_shard; FSDP shards within a group, replicas across


@dataclass
class WorkloadConfig:
    global_batch_size: int = 8  # sequences per optimizer step, all data-parallel ranks together
    micro_batch_size: int = 2  # sequences per forward/backward on one rank
    num_microbatches: Optional[int] = None  # per rank per step; None = global / (dp * micro)
    precision: str = "fp32"  # fp32 | bf16-mixed | fp16-mixed
    activation_checkpointing: str = "none"  # none | selective (attention core) | full (whole block) | selective_op (models/gpt.py)
    warmup_steps: int = 3  # excluded from every statistic
    steps: int = 10  # timed steps (statistics need at least 10)
    profile_steps: int = 2  # profiled steps, after and apart from the timed ones (0 = none)
    compile: bool = False  # torch.compile the trained model (nn.Module.compile, after the strategy's setup)
    live_tensors: bool = False  # count the storages alive through warm-up steps 1 and 2, as a dry run does (measured.live_peak_*)
    seed: int = 1234  # seeds the model's initialisation and the synthetic data (harness/worker/loop.py)
    lr: float = 1e-3  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay


@dataclass
class LinkConfig:
    bus_bw_GBps: float = MISSING  # achievable bus bandwidth, nccl-tests definition, GB/s (1e9 B/s)
    latency_us: float = MISSING  # per-collective start-up latency (alpha), microseconds
    nics_per_node: int = 1  # inter_node: NICs a node's rings can spread over (bus_bw_GBps is one NIC's)
    ring_hop_latency_us: float = 0.0  # latency of one ring step over this link (NCCL's hwLat); 0 = a flat latency_us per call
    tree_hop_latency_us: float = 0.0  # latency of one tree level over this link (NCCL's hwLat, all-reduce); 0 = no tree


@dataclass
class HardwareConfig:
    name: str = MISSING
    device: str = "cpu"  # cpu | cuda (backend: gloo on cpu, nccl on cuda)
    devices_per_node: int = 1
    memory_GiB: float = MISSING  # memory per device
    peak_tflops: dict[str, float] = field(default_factory=dict)  # dense peak per precision (fp32, bf16, fp16)
    achievable_tflops: dict[str, float] = field(default_factory=dict)  # measured matmul rate; falls back to peak
    intra_node: LinkConfig = field(default_factory=LinkConfig)
    inter_node: LinkConfig = field(default_factory=LinkConfig)
    collectives: dict[str, Any] = field(default_factory=dict)  # calibrated per-collective figures (harness.calibrate)
    fabric: dict[str, Any] = field(default_factory=dict)  # the network between nodes, hardware/fabric=<name> (conf/hardware/fabric/, harness/costmodel/fabric.py); empty: inter_node
    memory_bw_GBps: float = 0.0  # achievable memory bandwidth of one device, GB/s: memory-bound work (optimizer step, element-wise ops) in the cost model; 0 = not modelled
    compute: dict[str, Any] = field(default_factory=dict)  # shape-aware compute (harness/costmodel/compute.py): gemm.<dtype>.{max_tflops, tile, units, half_ridge | points}, attention_efficiency.<dtype>, attention_backward_efficiency.<dtype>, op_dispatch_us, ops_per_layer, dtensor.{op_us, op_us_per_melem, ops_per_layer, outside_op_us, ops_outside_layers, optimizer_op_us, optimizer_ops_per_layer, optimizer_ops_outside_layers, sequence_parallel: {the same}}, corun.{cores, gemm, memory}, fsdp2.{block_us, outside_us, step_block_us, step_outside_us}, allocator_overhead, overlap_slowdown, clock_scale
    precisions: list[str] = field(default_factory=lambda: ["fp32"])  # workload.precision values it can run
    source: dict[str, str] = field(default_factory=dict)  # where each number comes from


@dataclass
class LauncherConfig:
    name: str = "local"  # local | slurm | dryrun (fake process group, launch/dryrun.py)
    nodes: int = 1
    nproc_per_node: int = 0  # ranks per node; 0 = world size / nodes (world size = dp * cp * tp * pp)
    timeout_s: float = 900.0  # wall-clock limit per run; the process group is killed at expiry
    master_port: int = 0  # 0 = a free port picked at launch
    # SLURM (launcher=slurm)
    partition: Optional[str] = None
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    time_min: int = 30
    array_parallelism: int = 16
    additional_parameters: dict[str, Any] = field(default_factory=dict)
    # Dry run (launcher=dryrun): global ranks to simulate; [] = one rank of every role (launch/dryrun.py roles)
    ranks: list[int] = field(default_factory=list)
    # Dry run: the forked children's total host memory (GiB, PSS); 0 = 90 % of MemAvailable at launch
    memory_GiB: float = 0.0
    # Dry run: a pipeline runs the micro-batches that decide its peak, the rest extrapolated from them where
    # its schedule repeats (harness/strategies/pp_shorten.py); false runs every micro-batch
    shorten: bool = True
    # Dry run: the middle pipeline ranks between two simulated ones with the same modules derived from them
    # (harness/strategies/pp_derive.py); false simulates every role
    derive: bool = True


@dataclass
class LoggerConfig:
    name: str = "wandb"  # wandb | none
    project: str = "brigade"
    entity: Optional[str] = None
    mode: str = "offline"  # offline | online | disabled; WANDB_MODE in the environment wins


@dataclass
class RuntimeConfig:
    """The training runtime whose behaviour the cost model prices (conf/runtime/): brigade's own, which it
    launches, or another that measured runs were made with (priced only: a run with it is refused at launch).
    Each field says what the runtime does, not how fast a machine is; the values and their sources are in
    the runtime's yaml."""
    name: str = "brigade"
    # how pipeline stages get their blocks: even (models/pipeline_split.py) | compute_balanced (nanotron:
    # blocks in order, a stage closed once the running sum of its blocks' estimated compute passes its share;
    # the head and the loss are blocks of their own, so they may land on a stage before the last)
    pipeline_split: str = "even"
    # the host (CPU) time to launch one decoder layer's forward and backward kernels, microseconds: eager Python
    # dispatch, autograd, the runtime's hooks; a micro-batch on a rank takes at least its layers' worth. 0: not priced
    host_layer_us: float = 0.0
    # tensor parallelism's collectives and what overlaps them: dtensor (brigade: DTensor's, exposed; with sequence
    # parallelism the norm gradients all-reduced each micro-batch) | nanotron_async (nanotron's REDUCE_SCATTER mode
    # with async communication: all-gathers and reduce-scatters under the GEMMs they feed, harness/costmodel/step_time.py)
    tp_collectives: str = "dtensor"
    # microseconds each step of a TP collective's ring takes, exposed, while the rank's pipeline sends cross nodes
    # (nanotron_async only); 0: not priced
    tp_ring_step_remote_pp_us: float = 0.0
    # what a column-parallel matmul keeps for backward under sequence parallelism: gathered (its gathered input;
    # brigade's DTensor plan) | sharded (its rank's sequence shard, gathered again in backward)
    tp_saved_inputs: str = "gathered"
    # where backward's 16-bit gradients go when the parameters are 16-bit (strategy.low_precision_params): in_place
    # (accumulated into the fp32 main grad as each is made, Megatron-LM's) | after_backward (every parameter's 16-bit
    # .grad is made by backward and added to the fp32 buffer once backward ends: all of them exist at its end)
    grad_accumulation: str = "in_place"
    # DDP's flat 16-bit bucket copies of the gradients beside the fp32 buffer, on ranks that DDP wraps (dp > 1 and
    # no ZeRO): none (brigade's low-precision DDP reduces its fp32 buffer in place) | bf16 (torch DDP's reducer)
    ddp_grad_buckets: str = "none"
    # the caching allocator's reserved bytes beyond the allocated peak, a fraction of it, where the runtime's
    # measured memory is torch's max reserved; absent (None): the hardware profile's compute.allocator_overhead
    allocator_overhead: Optional[float] = None
    source: dict[str, str] = field(default_factory=dict)


@dataclass
class PlanConfig:
    gpus: int = 8
    top_k: int = 10
    run_top: int = 0
    # what makes two of --run-top's layouts distinct: "degrees" (dp, tp, pp, ep), each with its best
    # strategy, schedule, ZeRO stage, micro-batch and checkpointing; or "variant" (strategy, knobs and
    # schedule too: e.g. the same dp2 pp2 under 1f1b and ZB-V), harness/tools/plan_check.py
    run_top_by: str = "degrees"
    # rank only the layouts whose predicted peak plus their family's memory margin (how far its validation runs'
    # measured peak exceeded the predicted one, p90) fits the device: harness/costmodel/family_errors.py memory_limit
    memory_margin: bool = True


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    study: str = ADHOC_STUDY  # records go to <results_dir>/<study>.jsonl
    series: str = ""  # the scaling series a study run belongs to (e.g. strong, weak): the report's curves and fits
    repeats: int = 1  # a sweep runs its configs this many times round-robin (A B C A B C ...): harness/collect/aggregate.py
    repeat: int = 0  # which repeat this run is (set by the sweeper; a record's `repeat`)
    results_dir: str = "results"
    allow_oversubscribe_memory: bool = False  # run even when predicted memory exceeds the device (or, on CPU, the host)
    allow_failures: bool = False  # exit 0 once every run has its record, even failed/invalid ones (harness/run/ending.py)
    rerun: str = "none"  # none | failed (re-run failed/timeout/oom configs) | all
    fault: str = "none"  # test-only fault switch: none | crash_rank1 | hang_rank1 | oom_rank1 (4 GiB: in a memory cgroup)
    # a regression on purpose: every training step busy-waits this % of its own time more, inside the timed
    # region (harness/worker/main.py). Part of run_id, so a slowed record never stands for the clean config in
    # a study (nor resumes as its `ok`); the record's `slowed_on_purpose` names the clean run_id, which
    # `harness.compare` and the index match the slowed runs against.
    slow_step_pct: float = 0.0
    report: bool = True  # write the HTML report at the end of a sweep


# Fields that do not change what is measured: excluded from run_id so a resumed study matches.
NON_SEMANTIC_KEYS = ("launcher", "logger", "plan", "results_dir", "rerun", "report", "study", "allow_oversubscribe_memory",
                     "allow_failures", "repeats", "repeat")


_registered = False


def register_configs() -> None:
    """Once per process: storing the schema builds it (OmegaConf.structured, ~0.05 s on a 2-core CPU)."""
    global _registered
    if _registered:
        return
    _registered = True
    from hydra.core.config_store import ConfigStore

    # One schema node at the root types every group (conf/config.yaml lists it first). None is stored
    # inside a group: it would be offered as an option there (`strategy=strategy_schema`) in --help and
    # tab completion, and fail when chosen.
    ConfigStore.instance().store(name="run_schema", node=RunConfig)

    # conf/config.yaml's Hydra dirs: one per invocation (start time and pid), so two invocations of
    # one study never share hydra/<study>/<job number>
    OmegaConf.register_new_resolver("brigade_invocation", _invocation, use_cache=True, replace=True)


def _invocation() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def compose_run(overrides: list[str]) -> "RunConfig":
    """Hydra's compose API over conf/ -> RunConfig (the same composition `brigade` does)."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    return to_run_config(cfg)


def to_run_config(cfg: Any) -> RunConfig:
    """DictConfig (from Hydra or a frozen YAML) -> RunConfig dataclass, validated by OmegaConf types; a key
    under its old name (RENAMED) is read as the new one."""
    if isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is RunConfig:
        run = OmegaConf.to_object(cfg)  # Hydra's composition: already merged into (and checked by) the schema
    else:
        run = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), cfg))
    return _read_renamed(run)  # type: ignore[arg-type]


# Config keys renamed, old -> new. A config, override or record that gives the old key is read as the new
# one (to_run_config, renamed); run_id hashes the new key under its old name, so run_ids stay.
RENAMED = {"strategy.dp_shard": "strategy.data_parallel"}


def _read_renamed(run: RunConfig) -> RunConfig:
    s = run.strategy
    if s.dp_shard is not None:
        if s.data_parallel not in (DEFAULT_DATA_PARALLEL, s.dp_shard):
            raise ConfigError(f"strategy.dp_shard={s.dp_shard} and strategy.data_parallel={s.data_parallel}: "
                              f"dp_shard is the old name of data_parallel; give strategy.data_parallel only")
        s.data_parallel, s.dp_shard = s.dp_shard, None
    return run


def renamed(flat: dict) -> dict:
    """A flattened config (or record's config) with each old key read as its new one; an old key left
    unset is dropped."""
    out: dict = {}
    for k, v in flat.items():  # in place: the config's order is what labels show
        if k in RENAMED:
            if v is not None:
                out[RENAMED[k]] = v
        elif not (k in RENAMED.values() and k in out):
            out[k] = v
    return out


def flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1} (an empty dict stays a value)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def as_dict(run: RunConfig) -> dict:
    """The plain nested dict of a RunConfig (its values are resolved: to_run_config made it)."""
    return dataclasses.asdict(run)


# -- domains ---------------------------------------------------------------------------------------
# Each config field's domain, checked before any rule that divides by it or any launch.
#
# A field out of its domain (micro_batch_size=0, dropout=2.0, lr=nan, seq_len=-1) is refused with
# every offending field named at once; validate() runs this first, so no later rule and no cost-model
# formula ever sees a zero divisor, a negative size or a non-finite float. Pure (no torch).

def _int_at_least(lo: int, hi: float = math.inf):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _real(lo: float, hi: float = math.inf, lo_open: bool = False, hi_open: bool = False):
    def ok(v):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            return False
        return (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    return ok


def _one_of(*choices):
    return lambda v: v in choices


SIZE, COUNT = (_int_at_least(1), ">= 1"), (_int_at_least(0), ">= 0")
# The cost model keeps per-rank lists: 65536 ranks take it a few seconds, more would stall a sweep.
MAX_WORLD = 65536
DEGREE = (_int_at_least(1, MAX_WORLD), f"in 1..{MAX_WORLD}")
POSITIVE, NON_NEGATIVE = (_real(0, lo_open=True), "> 0 and finite"), (_real(0), ">= 0 and finite")

DOMAINS = {
    "model.n_layers": SIZE, "model.d_model": SIZE, "model.n_heads": SIZE, "model.d_ff": SIZE,
    "model.vocab_size": SIZE, "model.seq_len": SIZE, "model.n_experts": COUNT, "model.top_k": SIZE,
    "model.dropout": (_real(0, 1, hi_open=True), "in [0, 1)"),
    "model.capacity_factor": NON_NEGATIVE, "model.aux_loss_coef": NON_NEGATIVE, "model.rope_theta": POSITIVE,
    "model.n_kv_heads": (lambda v: v is None or _int_at_least(1)(v), "null or >= 1"),
    "model.loss_chunk_tokens": SIZE,
    "parallel.dp": DEGREE, "parallel.tp": DEGREE, "parallel.pp": DEGREE, "parallel.vpp": DEGREE,
    "parallel.ep": DEGREE, "parallel.cp": DEGREE, "parallel.dp_replicate": DEGREE,
    "workload.global_batch_size": SIZE, "workload.micro_batch_size": SIZE,
    "workload.num_microbatches": (lambda v: v is None or _int_at_least(1)(v), "null or >= 1"),
    "workload.warmup_steps": COUNT, "workload.steps": SIZE, "workload.profile_steps": COUNT,
    "workload.seed": (_int_at_least(0, 2**63 - 1), "in [0, 2**63)"),
    "workload.lr": POSITIVE, "workload.weight_decay": NON_NEGATIVE,
    "strategy.zero_stage": (_int_at_least(0, 3), "0, 1, 2 or 3"), "strategy.bucket_cap_mb": POSITIVE,
    "strategy.powersgd_rank": SIZE, "strategy.ds.reduce_bucket_size": SIZE,
    "strategy.ds.allgather_bucket_size": SIZE, "strategy.ds.stage3_param_persistence_threshold": COUNT,
    "strategy.ds.stage3_prefetch_bucket_size": COUNT, "strategy.ds.stage3_max_live_parameters": SIZE,
    "hardware.device": (_one_of("cpu", "cuda"), "cpu or cuda"), "hardware.devices_per_node": SIZE,
    "hardware.memory_GiB": POSITIVE, "hardware.memory_bw_GBps": NON_NEGATIVE,
    "hardware.intra_node.bus_bw_GBps": POSITIVE, "hardware.intra_node.latency_us": NON_NEGATIVE,
    "hardware.inter_node.bus_bw_GBps": POSITIVE, "hardware.inter_node.latency_us": NON_NEGATIVE,
    "hardware.intra_node.ring_hop_latency_us": NON_NEGATIVE, "hardware.inter_node.ring_hop_latency_us": NON_NEGATIVE,
    "hardware.intra_node.tree_hop_latency_us": NON_NEGATIVE, "hardware.inter_node.tree_hop_latency_us": NON_NEGATIVE,
    "launcher.nodes": DEGREE, "launcher.nproc_per_node": (_int_at_least(0, MAX_WORLD), f"in 0..{MAX_WORLD}"), "launcher.timeout_s": POSITIVE,
    "launcher.memory_GiB": NON_NEGATIVE,
    "launcher.master_port": (_int_at_least(0, 65535), "0 (a free port) or 1-65535"),
    "launcher.cpus_per_task": SIZE, "launcher.gpus_per_node": COUNT, "launcher.time_min": SIZE,
    "launcher.array_parallelism": SIZE,
    "repeats": SIZE, "repeat": COUNT, "slow_step_pct": NON_NEGATIVE,
    "logger.name": (_one_of("wandb", "none"), "wandb or none"),
    "logger.mode": (_one_of("offline", "online", "disabled"), "offline, online or disabled"),
    "plan.gpus": SIZE, "plan.top_k": SIZE, "plan.run_top": COUNT,
    "plan.run_top_by": (_one_of("degrees", "variant"), "degrees or variant"),
    "rerun": (_one_of("none", "failed", "all"), "none, failed or all"),
    "fault": (_one_of("none", "crash_rank1", "hang_rank1", "oom_rank1"), "none, crash_rank1, hang_rank1 or oom_rank1"),
}


def _get(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check_domains(run) -> None:
    """Raise ConfigError naming every field outside its domain (all at once, so one fix suffices)."""
    bad = [f"{path}={_get(run, path)!r} (must be {want})" for path, (ok, want) in DOMAINS.items()
           if not ok(_get(run, path))]
    for table in ("peak_tflops", "achievable_tflops"):
        bad += [f"hardware.{table}.{k}={v!r} (must be > 0 and finite)"
                for k, v in getattr(run.hardware, table).items() if not POSITIVE[0](v)]
    p = run.parallel
    world = world_size({"dp": p.dp, "tp": p.tp, "pp": p.pp, "cp": p.cp})
    if not bad and world > MAX_WORLD:
        bad.append(f"dp {p.dp} * tp {p.tp} * pp {p.pp} * cp {p.cp} = {world} ranks "
                   f"(must be <= {MAX_WORLD})")
    launchers = sorted(LAUNCHERS)
    if run.launcher.name not in launchers:
        bad.append(f"launcher.name={run.launcher.name!r} (must be one of: {', '.join(launchers)})")
    if bad:
        raise ConfigError(f"out of range: {'; '.join(bad)}")
