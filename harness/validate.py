"""Refuse configs that cannot run, before anything is launched; each message shows the arithmetic.

Pure (no torch). Rules are keyed on config fields, not on strategy names, so a new strategy adds
no branch here unless it brings a new constraint.
"""
from __future__ import annotations

import ast
import importlib.util
from importlib.metadata import version
from pathlib import Path

from harness import catalog
from harness.config import CONF_DIR, RunConfig, check_domains
from harness.dims import MESH_AXES, ConfigError, ParallelDims
from models.pipeline_split import compute_balanced_split, nanotron_block_costs

# Imports inside functions: torch and what imports it, which the parent process never loads.

# model.<option> -> its values (models/layers.py builds them; tests/test_llama.py checks the two agree)
MODEL_OPTIONS = {"norm": ("layernorm", "rmsnorm"), "mlp": ("gelu", "swiglu"), "position": ("learned", "rope"),
                 "loss": ("fp32", "chunked"),  # models/gpt.py LOSSES
                 "routing": ("topk", "balanced")}  # models/moe.py ROUTINGS


def available_strategies() -> list[str]:
    """Strategies that have both a catalog row and a conf/strategy/<name>.yaml to compose."""
    return sorted(p.stem for p in (CONF_DIR / "strategy").glob("*.yaml") if p.stem in catalog.STRATEGIES)


def torch_version() -> tuple[int, int]:
    """(major, minor) of the torch the launcher will run, read from its metadata (importing torch takes seconds)."""
    major, minor = version("torch").split(".")[:2]
    return int(major), int(minor)


def num_microbatches(run: RunConfig, dims: ParallelDims) -> int:
    w = run.workload
    per_step = dims.dp * w.micro_batch_size  # cp ranks share their dp rank's sequences
    if w.global_batch_size % per_step:
        raise ConfigError(f"global_batch_size {w.global_batch_size} not divisible by "
                          f"dp*micro_batch_size {per_step} (dp {dims.dp} * micro_batch_size {w.micro_batch_size})")
    derived = w.global_batch_size // per_step
    if w.num_microbatches is not None and w.num_microbatches != derived:
        raise ConfigError(f"num_microbatches {w.num_microbatches} != global_batch_size {w.global_batch_size} / "
                          f"(dp {dims.dp} * micro_batch_size {w.micro_batch_size}) = {derived}")
    return derived


def validate(run: RunConfig, torch_runs: bool = True) -> ParallelDims:
    """Return the ParallelDims of a runnable config, or raise ConfigError saying why it cannot run.
    torch_runs=False keeps the cost model's checks but not the refusals of layouts only brigade's torch
    runtime cannot run (the published set predicts Megatron-LM's DDP x TP rows, which Megatron ran)."""
    check_domains(run)  # every size >= 1, every rate finite: no rule below divides by zero
    m, s, p, w, hw = run.model, run.strategy, run.parallel, run.workload, run.hardware
    names = available_strategies()
    if s.name not in names:
        raise ConfigError(f"unknown strategy '{s.name}'; available: {', '.join(names)}")
    if s.engine not in catalog.ENGINES:
        raise ConfigError(f"unknown strategy.engine '{s.engine}'; available: {', '.join(catalog.ENGINES)}")
    axes = catalog.strategy(s.name).axes
    dims = ParallelDims.from_config(p, run.launcher)
    if run.launcher.name == "local" and run.launcher.nodes != 1:
        raise ConfigError(f"launcher local runs on this machine only (nodes={run.launcher.nodes}); "
                          f"use launcher=slurm for several nodes")
    if run.launcher.name == "dryrun":
        _validate_dryrun(run, dims)
    if run.launcher.nodes < 1 or dims.world_size % run.launcher.nodes:
        raise ConfigError(f"world size {dims.world_size} not divisible by launcher.nodes {run.launcher.nodes}")

    for axis in MESH_AXES:
        if getattr(dims, axis) > 1 and axis not in axes:
            raise ConfigError(f"strategy {s.name} does not use the {axis} axis ({axis}={getattr(dims, axis)}); "
                              f"it uses: {', '.join(axes) or 'none (one process)'}")
    if dims.vpp > 1 and "pp" not in axes:
        raise ConfigError(f"strategy {s.name} has no pipeline, so vpp must be 1 (got vpp={dims.vpp})")

    if m.d_model % m.n_heads:
        raise ConfigError(f"d_model {m.d_model} not divisible by n_heads {m.n_heads}")
    if m.n_heads % dims.tp:
        raise ConfigError(f"n_heads {m.n_heads} not divisible by tp {dims.tp}")
    if dims.tp > 1 and m.d_ff % dims.tp:
        raise ConfigError(f"d_ff {m.d_ff} not divisible by tp {dims.tp}")
    if dims.tp > 1 and s.sequence_parallel:  # the residual stream is split on the sequence over tp
        if m.seq_len % dims.tp:
            raise ConfigError(f"sequence_parallel: seq_len {m.seq_len} not divisible by tp {dims.tp}")
        if m.n_experts:
            raise ConfigError("sequence_parallel covers dense MLPs only (models/tp_plan.py); "
                              f"model {m.name} has {m.n_experts} experts: set strategy.sequence_parallel=false")
    _validate_llama_options(m, dims)
    if m.loss != "fp32" and dims.tp > 1 and s.loss_parallel:
        raise ConfigError(f"model.loss={m.loss} takes whole (B, T, V) logits; with tp {dims.tp} and "
                          f"strategy.loss_parallel=true they are vocabulary-sharded DTensors (torch's loss_parallel "
                          f"runs its own cross-entropy): set strategy.loss_parallel=false or model.loss=fp32")
    _validate_stage_layers(m.n_layers, dims, s)
    _validate_runtime(run, dims, torch_runs)
    if m.attention not in catalog.ATTENTIONS:
        raise ConfigError(f"unknown model.attention '{m.attention}'; available: {', '.join(catalog.ATTENTIONS)}")
    if m.n_experts:
        if not 1 <= m.top_k <= m.n_experts:
            raise ConfigError(f"top_k {m.top_k} must be in 1..n_experts {m.n_experts}")
        if m.n_experts % dims.ep:
            raise ConfigError(f"n_experts {m.n_experts} not divisible by ep {dims.ep} "
                              f"({m.n_experts} % {dims.ep} = {m.n_experts % dims.ep}): each ep rank holds n_experts/ep experts")
    elif dims.ep > 1:
        raise ConfigError(f"ep {dims.ep} needs a MoE model (model.n_experts > 0, e.g. model=moe_tiny); "
                          f"model {m.name} has n_experts {m.n_experts}, so there is nothing to shard over ep")

    nmb = num_microbatches(run, dims)
    if w.precision not in catalog.PRECISIONS:
        raise ConfigError(f"unknown precision '{w.precision}'; available: {', '.join(catalog.PRECISIONS)}")
    if w.precision not in hw.precisions:
        raise ConfigError(f"precision {w.precision} cannot run on hardware {hw.name} ({hw.device}); "
                          f"it runs: {', '.join(hw.precisions)}")
    if w.activation_checkpointing not in catalog.CHECKPOINTING:
        raise ConfigError(f"unknown activation_checkpointing '{w.activation_checkpointing}'; "
                          f"available: {', '.join(catalog.CHECKPOINTING)}")
    if w.activation_checkpointing == "selective_op":
        _validate_selective_op(run, dims)
    if w.steps < 1 or w.warmup_steps < 0:
        raise ConfigError(f"steps {w.steps} must be >= 1 and warmup_steps {w.warmup_steps} >= 0")
    if w.live_tensors and w.warmup_steps < 2 and run.launcher.name != "dryrun":
        raise ConfigError(f"workload.live_tensors counts warm-up steps 1 and 2: warmup_steps {w.warmup_steps} must be >= 2")

    validate_layouts(run, dims, torch_runs)
    if s.comm_hook not in ("none", "fp16", "bf16", "powersgd"):
        raise ConfigError(f"unknown comm_hook '{s.comm_hook}'; available: none, fp16, bf16, powersgd")
    if s.comm_hook == "bf16" and hw.device != "cuda":
        raise ConfigError(f"comm_hook bf16 needs NCCL (CUDA); hardware {hw.name} uses gloo: use fp16 or powersgd")

    if "pp" in axes and dims.pp > 1:
        _validate_pipeline(run, dims, nmb, torch_runs)
    if s.engine == "deepspeed":
        _validate_deepspeed(run, dims)
    if s.offload not in ("none", "optimizer", "optimizer+params"):
        raise ConfigError(f"unknown offload '{s.offload}'; available: none, optimizer, optimizer+params")
    if s.offload != "none":
        if s.engine != "deepspeed":
            raise ConfigError(f"offload {s.offload} is DeepSpeed's ZeRO-Offload: it needs strategy.engine=deepspeed "
                              f"(got {s.engine})")
        need = 3 if s.offload == "optimizer+params" else 1
        if s.zero_stage < need:
            why = ("only stage 3 partitions the parameters, so only it can keep them in host memory"
                   if need == 3 else "stage 0 has no ZeRO optimizer whose partition could live in host memory")
            raise ConfigError(f"offload {s.offload} needs ZeRO stage >= {need} (got {s.zero_stage}): {why}")
    return dims


def _validate_dryrun(run: RunConfig, dims: ParallelDims) -> None:
    s = run.strategy
    if s.engine == "deepspeed":
        # DeepSpeed's ZeRO engine runs on the fake group with its value reads answered
        # (harness/strategies/ds_fake.py); these read values no fake tensor holds, or run ops on raw pointers
        why = [f"pp {dims.pp} (its pipeline engine)" if dims.pp > 1 else "",
               f"MoE layers (model {run.model.name}: {run.model.n_experts} experts; routing reads the tokens)"
               if run.model.n_experts else "",
               f"offload {s.offload} (ZeRO-Offload tracks overflow and norms per gradient on the host)"
               if s.offload != "none" else "",
               "strategy.ds.cpu_adam (DeepSpeedCPUAdam steps raw host pointers)" if s.ds.cpu_adam else "",
               f"ZeRO stage 0 under {run.workload.precision} (its unfused optimizer reads the gradient norm's value)"
               if s.zero_stage == 0 and run.workload.precision != "fp32" else ""]
        why = [w for w in why if w]
        if why:
            raise ConfigError(f"a dry run simulates DeepSpeed's ZeRO engine (stages 1-3, and 0 in fp32; no offload) "
                              f"on torch's fake process group, not {', '.join(why)}: run it for real, or dry-run the "
                              f"torch engine")
    outside = [r for r in run.launcher.ranks if not 0 <= r < dims.world_size]
    if outside:
        raise ConfigError(f"launcher.ranks {outside} outside the world: ranks are 0..{dims.world_size - 1} "
                          f"(dp {dims.dp} * tp {dims.tp} * pp {dims.pp} = {dims.world_size})")


def _validate_llama_options(m, dims: ParallelDims) -> None:
    for option, values in MODEL_OPTIONS.items():
        if getattr(m, option) not in values:
            raise ConfigError(f"unknown model.{option} '{getattr(m, option)}'; available: {', '.join(values)}")
    kv = m.n_kv_heads or m.n_heads
    if kv < 1 or m.n_heads % kv:
        raise ConfigError(f"n_heads {m.n_heads} not divisible by n_kv_heads {kv} ({m.n_heads} % {kv} = "
                          f"{m.n_heads % kv if kv else 'undefined'}): each kv head serves n_heads/n_kv_heads query heads")
    if kv % dims.tp:
        raise ConfigError(f"n_kv_heads {kv} not divisible by tp {dims.tp} ({kv} % {dims.tp} = {kv % dims.tp}): "
                          f"tensor parallel gives each rank n_kv_heads/tp whole kv heads")
    head_dim = m.d_model // m.n_heads
    if m.position == "rope" and head_dim % 2:
        raise ConfigError(f"rope rotates pairs of features: head_dim d_model {m.d_model} / n_heads {m.n_heads} = "
                          f"{head_dim} is odd")
    if m.tie_embeddings and dims.pp * dims.vpp > 1:
        raise ConfigError(f"tie_embeddings shares one tensor between the embedding (first stage) and the head "
                          f"(last stage); with pp {dims.pp} * vpp {dims.vpp} = {dims.pp * dims.vpp} stages they are "
                          f"on different ranks and brigade does not synchronise the tie: use pp=1 or "
                          f"model.tie_embeddings=false")


def _validate_pipeline(run: RunConfig, dims: ParallelDims, nmb: int, torch_runs: bool = True) -> None:
    s = run.strategy
    if s.schedule not in catalog.SCHEDULES:
        raise ConfigError(f"unknown schedule '{s.schedule}'; available: {', '.join(catalog.SCHEDULES)}")
    row = catalog.schedule(s.schedule)
    need = row.vpp
    if need == 1 and dims.vpp != 1:
        raise ConfigError(f"schedule {s.schedule} runs one stage per rank: vpp must be 1 (got {dims.vpp}); "
                          f"use {' or '.join(n for n, r in catalog.SCHEDULES.items() if r.placement == 'looped')} "
                          f"for vpp > 1")
    if need is catalog.ANY_VPP and dims.vpp < 2:
        raise ConfigError(f"schedule {s.schedule} needs vpp >= 2 virtual stages per rank (got {dims.vpp})")
    if need == 2 and dims.vpp != 2:
        raise ConfigError(f"schedule {s.schedule} is V-shaped: vpp must be 2 (got {dims.vpp})")
    if torch_runs and s.engine == "torch" and row.placement == "v" and run.hardware.device != "cuda":
        # torch 2.11's schedules.py _initialize_stages sends from the rank holding stages 1 and 2 to itself; gloo
        # refuses ("Pair is not connected"); 2.12 and 2.13 do not (docs/notes.md#gpu-offline)
        have = torch_version()
        if have < (2, 12):
            raise ConfigError(f"schedule {s.schedule} on gloo ({run.hardware.name}) needs torch >= 2.12: torch "
                              f"{'.'.join(map(str, have))} opens a V-shaped pipeline with a send from a rank to itself, "
                              f"which gloo refuses; use 1f1b or interleaved_1f1b, or torch 2.13.0 (requirements.txt)")
    stages = dims.pp * dims.vpp
    w = run.workload
    m_math = (f"num_microbatches {nmb} = global_batch_size {w.global_batch_size} / (dp {dims.dp} * "
              f"micro_batch_size {w.micro_batch_size})")
    # torch's own rules (stages_pp, rounds) bind its runtime only: the cost model prices the schedule anyway
    broken = catalog.microbatch_rule_broken(s.schedule, s.engine if torch_runs else "", dims.pp, dims.vpp, nmb)
    if broken == "stages":
        raise ConfigError(f"{s.schedule} needs num_microbatches >= stages: {m_math} < pp {dims.pp} * vpp {dims.vpp} "
                          f"= {stages} stages")
    if broken == "stages_pp":
        # Schedule1F1B: "Number of microbatches must be greater than or equal to the number of stages"
        raise ConfigError(f"{s.schedule} needs num_microbatches >= stages: {m_math} < pp {dims.pp}")
    if broken == "rounds":
        # torch runs rounds = max(1, m // pp) rounds of m / rounds micro-batches each
        rounds = max(1, nmb // dims.pp)
        raise ConfigError(f"{s.schedule} needs num_microbatches to be a multiple of its rounds: {m_math}; "
                          f"rounds = max(1, {nmb} // pp {dims.pp}) = {rounds}, {nmb} % {rounds} = "
                          f"{nmb % rounds}; use a multiple of pp {dims.pp}")
    if s.engine == "torch":
        _validate_torch_pipeline(run)


def _validate_stage_layers(n_layers: int, dims, s) -> None:
    """Every stage holds a block; an explicit split adds up (models/pipeline_split.py); DeepSpeed: even only."""
    stages = dims.pp * dims.vpp
    if s.stage_layers:
        if len(s.stage_layers) != stages or sum(s.stage_layers) != n_layers or min(s.stage_layers) < 1:
            raise ConfigError(f"strategy.stage_layers {list(s.stage_layers)}: {len(s.stage_layers)} counts summing "
                              f"to {sum(s.stage_layers)}, need pp {dims.pp} * vpp {dims.vpp} = {stages} counts of at "
                              f"least 1 summing to n_layers {n_layers}")
    elif n_layers < stages:
        raise ConfigError(f"n_layers {n_layers} < pp*vpp {stages} (pp {dims.pp} * vpp {dims.vpp}): a stage "
                          f"would hold no block")
    if s.engine == "deepspeed" and dims.pp > 1 and (s.stage_layers or n_layers % stages):
        raise ConfigError(f"engine deepspeed splits a pipeline evenly only: n_layers {n_layers} % pp*vpp {stages} = "
                          f"{n_layers % stages}" + (", strategy.stage_layers set" if s.stage_layers else ""))


# each runtime key's domain (harness/config.py RuntimeConfig, where each is described)
RUNTIME_CHOICES = {"pipeline_split": ("even", "compute_balanced"), "tp_collectives": ("dtensor", "nanotron_async"),
                   "tp_saved_inputs": ("gathered", "sharded"), "grad_accumulation": ("in_place", "after_backward"),
                   "ddp_grad_buckets": ("none", "bf16")}


def _validate_runtime(run: RunConfig, dims, torch_runs: bool) -> None:
    """Another runtime than brigade's is priced, never launched (conf/runtime/); its pipeline split must give every
    stage a block, as the runtime itself needs (models/pipeline_split.py compute_balanced_split)."""
    rt, m = run.runtime, run.model
    for key, choices in RUNTIME_CHOICES.items():
        if getattr(rt, key) not in choices:
            raise ConfigError(f"unknown runtime.{key} '{getattr(rt, key)}'; available: {', '.join(choices)}")
    if rt.allocator_overhead is not None and not 0 <= rt.allocator_overhead < 1:
        raise ConfigError(f"runtime.allocator_overhead {rt.allocator_overhead} is a fraction of the allocated peak: "
                          f"0 <= it < 1")
    if torch_runs and rt.name != "brigade":
        raise ConfigError(f"runtime={rt.name} is priced by the cost model only: brigade launches its own runtime "
                          f"(runtime=brigade); python -m harness.predict prices it")
    if rt.pipeline_split != "compute_balanced" or dims.pp <= 1:
        return
    if dims.vpp > 1 or run.strategy.stage_layers:
        raise ConfigError(f"runtime {rt.name} splits one stage per pp rank by its own rule: vpp {dims.vpp} and "
                          f"strategy.stage_layers {list(run.strategy.stage_layers)} have no meaning there")
    layer, head = nanotron_block_costs(m.d_model, m.d_ff, m.vocab_size)
    counts, head_stage, _, loss_stage, last = compute_balanced_split(m.n_layers, dims.pp, layer, head)
    if last < dims.pp - 1:
        raise ConfigError(f"runtime {rt.name}'s pipeline split leaves pp ranks {last + 1}..{dims.pp - 1} without a "
                          f"block: {m.n_layers} layers of cost {layer:.3g} and a head of {head:.3g} over pp {dims.pp} put "
                          f"{list(counts)} layers on the ranks, the head on rank {head_stage}, the loss on rank {loss_stage}")


def _validate_torch_pipeline(run: RunConfig) -> None:
    """What torch 2.13's pipelining schedules refuse beyond their micro-batch rules (catalog.py, checked
    against schedules.py), and what brigade's pp/3d strategies do not carry across stages."""
    s = run.strategy
    if run.workload.precision == "fp16-mixed":
        raise ConfigError("fp16-mixed needs one loss scale and one inf/nan check across every pipeline stage, "
                          "which the torch pipeline strategies do not coordinate: use bf16-mixed or fp32")
    if run.model.n_experts and "ep" not in catalog.strategy(s.name).axes:  # 3d carries it (strategies/moe_stages.py)
        raise ConfigError(f"strategy {s.name} does not carry the MoE load-balancing loss across stages "
                          f"(model {run.model.name}: n_experts {run.model.n_experts}): use a dense model, or "
                          f"strategy=3d, which does")


def _validate_deepspeed(run: RunConfig, dims: ParallelDims) -> None:
    """What DeepSpeed 0.19 (or brigade's use of it) refuses, said before launch instead of mid-init."""
    s, m = run.strategy, run.model
    if not 0 <= s.zero_stage <= 3:
        raise ConfigError(f"zero_stage must be 0-3, got {s.zero_stage}")
    if s.zero_stage >= 2 and dims.pp > 1:
        raise ConfigError(f"DeepSpeed refuses ZeRO stage {s.zero_stage} with pipeline parallelism (pp={dims.pp}): "
                          f"its PipelineEngine asserts 'ZeRO-2 and ZeRO-3 are incompatible with pipeline "
                          f"parallelism' (stages 2/3 partition gradients during each backward, the pipeline "
                          f"schedule runs many backwards per step); use zero_stage 0 or 1")
    if s.zero_stage == 3 and m.n_experts:
        raise ConfigError(f"DeepSpeed refuses ZeRO stage 3 with MoE layers (model {m.name}: n_experts "
                          f"{m.n_experts}): its engine raises 'MoE not supported with Stage 3' for "
                          f"deepspeed.moe layers; use zero_stage 0, 1 or 2")
    if m.n_experts and m.routing != "topk":
        raise ConfigError(f"model.routing={m.routing} is brigade's MoE layer's (models/moe.py); DeepSpeed's gate "
                          f"routes by its router: use model.routing=topk or strategy.engine=torch")
    if dims.tp > 1:
        raise ConfigError(f"the DeepSpeed engine has no tensor parallelism here (tp={dims.tp}); "
                          f"use strategy.engine=torch for tp")
    if dims.pp > 1:
        if dims.vpp != 1:
            raise ConfigError(f"DeepSpeed's pipeline runs one stage per rank: vpp must be 1 (got {dims.vpp})")
        if s.schedule != catalog.DEEPSPEED_SCHEDULE:
            raise ConfigError(f"DeepSpeed's pipeline runs its own {catalog.DEEPSPEED_SCHEDULE} schedule (TrainSchedule); "
                              f"strategy.schedule={s.schedule} needs strategy.engine=torch")
        if m.n_experts:
            raise ConfigError(f"brigade's DeepSpeed pipeline builds dense blocks only; model {m.name} has "
                              f"{m.n_experts} experts: use strategy=ep or the torch engine")
        if s.ds.wall_clock_breakdown:
            raise ConfigError("DeepSpeed 0.19's pipeline engine fails with wall_clock_breakdown (its backward "
                              "starts the bwd_microstep timer twice: 'timer has already been started'); "
                              "use strategy.ds.comms_logger or brigade's profiler for the pipeline")
    if s.ds.cpu_adam:
        if s.offload == "none":
            raise ConfigError("strategy.ds.cpu_adam=true steps the optimizer on the host: it needs "
                              "strategy.offload=optimizer or optimizer+params")
        if not prebuilt_ops().get("cpu_adam"):
            raise ConfigError("strategy.ds.cpu_adam=true but this DeepSpeed install has no prebuilt cpu_adam op: "
                              "it would JIT-compile DeepSpeedCPUAdam (~280 s on a 2-core CPU); install DeepSpeed "
                              "with DS_BUILD_CPU_ADAM=1, or keep cpu_adam=false (a client torch AdamW on the host)")


def _validate_selective_op(run, dims) -> None:
    """selective_op (models/gpt.py) is torchtitan's op policy for a dense block without biases
    under a fused attention kernel; elsewhere its saved set differs from what the cost model counts."""
    m, s = run.model, run.strategy
    why = [f"model.attention={m.attention} (needs sdpa: the saved kernel output)" if m.attention != "sdpa" else "",
           f"model.n_experts={m.n_experts} (needs a dense MLP)" if m.n_experts else "",
           "model.bias=true (its projections run addmm, not the mm the policy counts)" if m.bias else "",
           f"strategy.engine={s.engine} (DeepSpeed checkpoints its own way)" if s.engine != "torch" else "",
           f"parallel.cp={dims.cp} (the context-parallel core is not one fused kernel)" if dims.cp > 1 else ""]
    why = [w for w in why if w]
    if why:
        raise ConfigError("activation_checkpointing=selective_op cannot run with " + "; ".join(why))


# -- validate layouts ------------------------------------------------------------------------------
# Refusals for the large runs' layouts: HSDP (dp_replicate), context parallel (cp), the distributed
# optimizer (data_parallel=zero1, zero1_impl) and FSDP's accumulation modes. Pure (no torch); each message
# shows the arithmetic or names the field that makes the config meaningless.

ZERO1_IMPLS = ("torch_zero", "distributed")
FSDP_ACCUMULATE = ("unsharded", "sharded")


def runs_fsdp(s) -> bool:
    """Whether this strategy config shards with FSDP2 (the only one HSDP and fsdp_accumulate apply to)."""
    return catalog.state_sharding(s.name, s.engine, s.zero_stage, s.data_parallel) == "sharded"


def reads_data_parallel(s) -> bool:
    return s.engine == "torch" and catalog.strategy(s.name).state_sharding == "by_data_parallel"


def validate_layouts(run, dims: ParallelDims, torch_runs: bool = True) -> None:
    s, m = run.strategy, run.model
    if s.data_parallel not in catalog.DATA_PARALLEL:
        raise ConfigError(f"unknown data_parallel '{s.data_parallel}'; available: {', '.join(catalog.DATA_PARALLEL)}")
    if s.data_parallel != catalog.DEFAULT_DATA_PARALLEL and not reads_data_parallel(s):
        raise ConfigError(f"strategy.data_parallel={s.data_parallel} means nothing for strategy {s.name}: only 3d reads it "
                          f"(plain zero1 takes strategy.zero1_impl=distributed instead)")
    if s.zero1_impl not in ZERO1_IMPLS:
        raise ConfigError(f"unknown zero1_impl '{s.zero1_impl}'; available: {', '.join(ZERO1_IMPLS)}")
    if s.zero1_impl != "torch_zero" and not (s.engine == "torch" and catalog.strategy(s.name).state_sharding == "zero1_torch"):
        raise ConfigError(f"strategy.zero1_impl={s.zero1_impl} means nothing for strategy {s.name} "
                          f"(engine {s.engine}): it chooses zero1's optimizer on engine torch; in 3d use "
                          f"strategy.data_parallel=zero1")
    distributed = catalog.state_sharding(s.name, s.engine, s.zero_stage, s.data_parallel, s.zero1_impl) == "distributed"
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
                          f"zero3 and 3d with data_parallel=fsdp, engine torch); strategy {s.name} "
                          f"(engine {s.engine}, data_parallel {s.data_parallel}) does not shard with FSDP")
    if torch_runs and reads_data_parallel(s) and not catalog.data_parallel_runs(s.data_parallel, dims.dp * dims.cp, dims.tp, m.n_experts):
        raise ConfigError(f"3d with data_parallel={s.data_parallel} at dp {dims.dp} x cp {dims.cp} x tp {dims.tp}: torch's "
                          f"DistributedDataParallel cannot reduce tensor-parallel (DTensor) gradients; use "
                          f"strategy.data_parallel=zero1 (the distributed optimizer, as Megatron-LM runs dp with tp) "
                          f"or strategy.data_parallel=fsdp")
    if m.n_experts and reads_data_parallel(s) and dims.dp > 1 and s.data_parallel != catalog.MOE_DATA_PARALLEL:
        raise ConfigError(f"MoE in 3d (model {m.name}: n_experts {m.n_experts}) reduces dense grads over dp and "
                          f"expert grads over dp/ep replicas itself, as strategy=ep does; data_parallel={s.data_parallel} "
                          f"(FSDP or the distributed optimizer over experts) is not implemented: use "
                          f"strategy.data_parallel=ddp")
    if dims.dp_replicate > 1:
        if not runs_fsdp(s):
            raise ConfigError(f"dp_replicate {dims.dp_replicate} (HSDP) needs FSDP2: strategy fsdp, zero2 or zero3 on "
                              f"engine torch, or 3d with data_parallel=fsdp; got {s.name} (engine {s.engine}, "
                              f"data_parallel {s.data_parallel})")
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
    replicated = catalog.state_sharding(s.name, s.engine, s.zero_stage, s.data_parallel, s.zero1_impl) == "replicated"
    if precision != "bf16-mixed" or not (distributed or (replicated and s.engine == "torch")):
        raise ConfigError(f"strategy.low_precision_params holds the parameters in bf16 with fp32 main params and "
                          f"gradients in the optimizer: it needs workload.precision=bf16-mixed and the distributed "
                          f"optimizer (strategy=zero1 with zero1_impl=distributed, or 3d with data_parallel=zero1), or, "
                          f"priced by the cost model only, DDP (ddp, tp, pp, 3d with data_parallel=ddp) (got strategy "
                          f"{s.name}, engine {s.engine}, precision {precision})")
    if replicated and torch_runs:
        raise ConfigError("strategy.low_precision_params with DDP (Megatron-LM's bf16 module with an fp32 copy of every "
                          "parameter and gradient in its optimizer) is priced by the cost model (docs/published.md), "
                          "not run: brigade runs bf16 parameters with the distributed optimizer (strategy=zero1 "
                          "strategy.zero1_impl=distributed, or 3d strategy.data_parallel=zero1)")


def _validate_megatron_overlaps(s, dims: ParallelDims, distributed: bool, torch_runs: bool) -> None:
    """Megatron-Core's overlap knobs: meaningful only where Megatron accepts them, and priced, not run."""
    if s.tp_comm_overlap and not (dims.tp > 1 and s.sequence_parallel):
        raise ConfigError(f"strategy.tp_comm_overlap overlaps sequence parallelism's all-gathers / reduce-scatters "
                          f"with the GEMMs: it needs tp > 1 (tp {dims.tp}) and strategy.sequence_parallel=true "
                          f"(got {str(s.sequence_parallel).lower()}), as Megatron-Core asserts")
    for knob in ("overlap_grad_reduce", "overlap_param_gather"):
        if getattr(s, knob) and not distributed:
            raise ConfigError(f"strategy.{knob} overlaps the distributed optimizer's collectives: it needs "
                              f"strategy=zero1 with zero1_impl=distributed or 3d with data_parallel=zero1")
    on = [k for k in ("tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather") if getattr(s, k)]
    if torch_runs and on:
        raise ConfigError(f"strategy.{', strategy.'.join(on)}: Megatron-Core's overlaps, which the cost model prices "
                          f"(docs/published.md) but brigade's runtime does not implement (its distributed optimizer "
                          f"reduces and gathers after the backward, its TP collectives run between the GEMMs): set "
                          f"them false to run")
    if s.pp_recv_buffers not in ("step", "in_flight"):
        raise ConfigError(f"strategy.pp_recv_buffers={s.pp_recv_buffers}: step (torch's pipeline stages) or in_flight "
                          f"(Megatron-LM's p2p)")
    if torch_runs and s.pp_recv_buffers != "step":
        raise ConfigError("strategy.pp_recv_buffers=in_flight prices Megatron-LM's pipeline receives (a tensor per "
                          "transfer); brigade's runtime runs torch's pipeline stages, which make a buffer for every "
                          "micro-batch of the step: set it to step to run")


def prebuilt_ops() -> dict[str, bool]:
    """DeepSpeed's `installed_ops` (which ops were compiled at install time), read from its
    git_version_info_installed.py without importing deepspeed (that would import torch here)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return {}
    path = Path(list(spec.submodule_search_locations)[0]) / "git_version_info_installed.py"
    if not path.exists():
        return {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "installed_ops":
            return ast.literal_eval(node.value)
    return {}
