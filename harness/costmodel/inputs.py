"""The cost model's inputs, reduced once to plain numbers: the model shape, the hardware profile in SI
units, and the strategy knobs the formulas read. The planner builds each once and reuses it for
thousands of layouts, so nothing here depends on degrees or batch sizes."""
from __future__ import annotations

import math

from harness.costmodel import comm
from harness.costmodel import memory as mem
from harness.costmodel.compute import GemmCurve
from harness.costmodel.fabric import Fabric
from harness.costmodel.flops import (
    attention_core_flops_per_token,
    head_forward_flops_per_token,
    layer_forward_flops_per_token,
    selective_op_recompute_flops_per_token,
)
from harness.costmodel.params import model_shape, params_total


class Model:
    """A model config with per-token FLOPs precomputed. Short names follow the papers' notation:
    L layers, h = d_model, a heads, V vocabulary, s sequence length, E experts, k = top_k."""
    __slots__ = ("cfg", "shape", "L", "h", "a", "d_ff", "V", "s", "E", "k", "params_total",
                 "layer_flops", "core_flops", "head_flops", "op_recompute_flops")

    @classmethod
    def of(cls, m) -> "Model":
        self = cls()
        self.cfg = m
        self.L, self.h, self.a, self.d_ff, self.V, self.s = (m.n_layers, m.d_model, m.n_heads, m.d_ff,
                                                             m.vocab_size, m.seq_len)
        self.E, self.k = m.n_experts, m.top_k
        self.shape = model_shape(m)
        self.params_total = params_total(m)
        self.layer_flops = layer_forward_flops_per_token(m)
        self.core_flops = attention_core_flops_per_token(m)
        self.head_flops = head_forward_flops_per_token(m)
        self.op_recompute_flops = selective_op_recompute_flops_per_token(m)
        return self


class Hardware:
    """A hardware profile in SI units: FLOP/s, bytes, seconds, bytes/s."""
    __slots__ = ("name", "device", "devices_per_node", "memory_bytes", "rate", "peak", "tensor_peak", "clock_scale", "intra", "inter", "nics_per_node", "hops",
                 "collectives", "mem_bw", "elem_bw", "gemm", "attention_efficiency", "attention_backward_efficiency", "op_dispatch_s", "ops_per_layer", "allocator_overhead",
                 "overlap_slowdown", "corun_gemm", "corun_memory", "dtensor", "fsdp2", "fabric", "links")

    @classmethod
    def of(cls, hw) -> "Hardware":
        self = cls()
        self.name, self.device, self.devices_per_node = hw.name, hw.device, hw.devices_per_node
        self.memory_bytes = hw.memory_GiB * 1024**3
        compute = dict(getattr(hw, "compute", None) or {})
        # a part held at a lower power limit than the part whose compute figures the profile carries runs
        # every tensor-core rate (GEMM table, achievable rate, the attention kernels' peak) at this fraction;
        # the datasheet peak stays MFU's denominator (profile source; absent: 1)
        self.clock_scale = float(compute.get("clock_scale", 1.0))
        self.peak = {k: v * 1e12 for k, v in dict(hw.peak_tflops).items()}
        self.tensor_peak = {k: v * self.clock_scale for k, v in self.peak.items()}
        self.rate = {k: v * self.clock_scale for k, v in
                     {**self.peak, **{k: v * 1e12 for k, v in dict(hw.achievable_tflops).items()}}.items()}
        self.intra = comm.Link(hw.intra_node.latency_us * 1e-6, hw.intra_node.bus_bw_GBps * 1e9)
        self.inter = comm.Link(hw.inter_node.latency_us * 1e-6, hw.inter_node.bus_bw_GBps * 1e9)
        self.nics_per_node = int(getattr(hw.inter_node, "nics_per_node", None) or 1)  # absent: one
        # NCCL's per-step latencies of a ring and a tree over NVLink / the network (comm.collective_link);
        # absent (CPU profiles): 0, every call pays the flat latency_us
        self.hops = comm.Hops(*(float(getattr(link, key, None) or 0.0) * 1e-6
                                for key in ("ring_hop_latency_us", "tree_hop_latency_us")
                                for link in (hw.intra_node, hw.inter_node)))
        # the named fabric (conf/hardware/fabric/): prices every collective across nodes (fabric.py); absent:
        # the inter_node link above
        self.fabric = Fabric.of(getattr(hw, "fabric", None), self.hops)
        self.links = {}  # comm.collective_link's answers on this profile: the planner asks for the same few often
        self.mem_bw = getattr(hw, "memory_bw_GBps", 0.0) * 1e9  # 0: memory-bound work not modelled
        self.collectives = _collective_table(hw.collectives or {})
        self.gemm = {k: GemmCurve.of(v, self.clock_scale) for k, v in dict(compute.get("gemm") or {}).items()}
        self.attention_efficiency = dict(compute.get("attention_efficiency") or {})
        # the fused kernel's backward at its own fraction of peak; absent: the forward's (compute.py)
        self.attention_backward_efficiency = dict(compute.get("attention_backward_efficiency") or {})
        # element-wise operators' bandwidth where calibrate measured it (compute.py), else the memory's
        self.elem_bw = float(compute.get("elementwise_GBps", 0.0)) * 1e9 or self.mem_bw
        self.op_dispatch_s = float(compute.get("op_dispatch_us", 0.0)) * 1e-6
        self.ops_per_layer = int(compute.get("ops_per_layer", 0))
        self.allocator_overhead = float(compute.get("allocator_overhead", 0.0))
        # compute overlapped by a collective runs this much slower (estimate.py); absent: 0
        self.overlap_slowdown = float(compute.get("overlap_slowdown", 0.0))
        corun = dict(compute.get("corun") or {})  # harness/tools/calibrate_corun.py; absent: 1
        self.corun_gemm, self.corun_memory = float(corun.get("gemm", 1.0)), float(corun.get("memory", 1.0))
        self.dtensor = DTensorDispatch.of(compute.get("dtensor"))
        # FSDP2's host work per block and outside the blocks, per micro-batch and per optimizer step,
        # seconds (harness/tools/calibrate_fsdp.py); absent: 0
        fsdp2 = dict(compute.get("fsdp2") or {})
        self.fsdp2 = {k[:-3] + "_s": float(fsdp2.get(k, 0.0)) * 1e-6 for k in ("block_us", "outside_us", "step_block_us", "step_outside_us")}
        return self


class DTensorDispatch:
    """What tensor parallelism's DTensor dispatch adds on a CPU (harness/tools/calibrate_dtensor.py):
    seconds per DTensor operator and operators per micro-batch (a block's, and the embedding, head and
    loss parallel's outside the blocks) and per optimizer step; a block's operator costs more on larger
    tensors: op_s + op_s_per_elem x the micro-batch's residual-stream elements (tokens x d_model), the
    slope from calibrate's second, model-sized measurement; `sp` the same under sequence parallelism
    (itself where not measured apart). Absent from a profile: all 0."""
    __slots__ = ("op_s", "op_s_per_elem", "ops_per_layer", "outside_op_s", "ops_outside_layers", "optimizer_op_s",
                 "optimizer_ops_per_layer", "optimizer_ops_outside_layers", "sp")

    @classmethod
    def of(cls, cfg) -> "DTensorDispatch":
        cfg = dict(cfg or {})
        self = cls()
        self.op_s, self.outside_op_s = float(cfg.get("op_us", 0.0)) * 1e-6, float(cfg.get("outside_op_us", 0.0)) * 1e-6
        self.optimizer_op_s = float(cfg.get("optimizer_op_us", 0.0)) * 1e-6
        self.op_s_per_elem = float(cfg.get("op_us_per_melem", 0.0)) * 1e-12  # us per 10^6 elements -> s per element
        self.ops_per_layer, self.ops_outside_layers = int(cfg.get("ops_per_layer", 0)), int(cfg.get("ops_outside_layers", 0))
        self.optimizer_ops_per_layer = int(cfg.get("optimizer_ops_per_layer", 0))
        self.optimizer_ops_outside_layers = int(cfg.get("optimizer_ops_outside_layers", 0))
        # with sequence parallelism (measured apart: its norms and residual stream are DTensors too)
        self.sp = cls.of(cfg["sequence_parallel"]) if cfg.get("sequence_parallel") else self
        return self

    def block_op_s(self, elements: float) -> float:
        """Seconds of one of a block's DTensor operators in a micro-batch of `elements` residual-stream
        elements (tokens x d_model)."""
        return self.op_s + self.op_s_per_elem * elements


def _measured(fig) -> tuple:
    """calibrate's time per message size: ((log bytes, seconds), ...) sorted by size."""
    times = dict(fig.get("time_us_by_bytes") or {})
    return tuple(sorted((math.log(max(float(b), 1.0)), float(t) * 1e-6) for b, t in times.items()))


def _collective_table(collectives) -> dict:
    """calibrate's per-collective α-β fits: {name: {group size: {ranks running when timed: Link}}}. Keys
    "<n>" (the group alone) and "<n>@<ranks>" (every pair of `ranks` timed at once)."""
    out: dict = {}
    for name, by_key in dict(collectives).items():
        if not hasattr(by_key, "items"):
            continue
        for key, fig in dict(by_key).items():
            n, _, among = str(key).partition("@")
            if n.isdigit() and (among or n).isdigit() and fig.get("bus_bw_GBps"):
                link = comm.Link(fig["latency_us"] * 1e-6, fig["bus_bw_GBps"] * 1e9, _measured(fig))
                out.setdefault(name, {}).setdefault(int(n), {})[int(among or n)] = link
    return out


class Runtime:
    """What the training runtime does that the cost model prices (conf/runtime/, harness/config.py RuntimeConfig):
    brigade's own by default; another runtime's where a run was made with it (priced only)."""
    __slots__ = ("name", "pipeline_split", "host_layer_s", "tp_collectives", "tp_ring_step_remote_pp_s",
                 "tp_saved_inputs", "grad_accumulation", "ddp_grad_buckets", "allocator_overhead")

    @classmethod
    def of(cls, cfg=None) -> "Runtime":
        self = cls()
        self.name = getattr(cfg, "name", "brigade")
        self.pipeline_split = getattr(cfg, "pipeline_split", "even")  # params.stage_split
        # the host's time to launch one decoder layer's forward and backward (step_time.compute_time); 0: not priced
        self.host_layer_s = float(getattr(cfg, "host_layer_us", 0.0)) * 1e-6
        self.tp_collectives = getattr(cfg, "tp_collectives", "dtensor")  # step_time.tp_comm
        # a TP ring step's time while the rank's pipeline sends cross nodes (step_time.nanotron_tp); 0: not priced
        self.tp_ring_step_remote_pp_s = float(getattr(cfg, "tp_ring_step_remote_pp_us", 0.0)) * 1e-6
        self.tp_saved_inputs = getattr(cfg, "tp_saved_inputs", "gathered")  # activations.brigade_layer_bytes
        # memory_peak.memory_peak: the 16-bit grads at the end of backward, DDP's bucket copies, the allocator's share
        self.grad_accumulation = getattr(cfg, "grad_accumulation", "in_place")
        self.ddp_grad_buckets = getattr(cfg, "ddp_grad_buckets", "none")
        overhead = getattr(cfg, "allocator_overhead", None)
        self.allocator_overhead = None if overhead is None else float(overhead)
        return self


class StrategyKnobs:
    """The strategy knobs the cost model reads (the torch side's strategy classes: harness/strategies/base.py),
    and the runtime that runs them (Runtime)."""
    __slots__ = ("name", "engine", "state_sharding", "zero_stage", "schedule", "sp", "reshard_after_forward", "bucket_bytes",
                 "comm_hook", "powersgd_rank", "overlap_comm", "ds_knobs", "ds_buckets", "ds_reuse", "uses_ddp", "autocast",
                 "fsdp_accumulate", "zero1_impl", "tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather", "pp_recv_buffers",
                 "low_precision_params", "state_knobs", "stage_layers", "runtime")

    @classmethod
    def of(cls, s, runtime=None) -> "StrategyKnobs":
        """s: the strategy config; runtime: the runtime config (None: brigade's own)."""
        self = cls()
        self.runtime = Runtime.of(runtime)
        self.name, self.engine, self.zero_stage = s.name, s.engine, s.zero_stage
        self.zero1_impl = getattr(s, "zero1_impl", "torch_zero")
        self.state_sharding = mem.state_sharding(s)
        self.schedule = s.schedule
        self.stage_layers = tuple(getattr(s, "stage_layers", None) or ())  # explicit pipeline split (models/pipeline_split.py)
        self.sp = bool(s.sequence_parallel)
        self.reshard_after_forward = bool(s.reshard_after_forward)
        self.fsdp_accumulate = getattr(s, "fsdp_accumulate", "unsharded")
        self.tp_comm_overlap = bool(getattr(s, "tp_comm_overlap", False))
        self.overlap_grad_reduce = bool(getattr(s, "overlap_grad_reduce", False))
        self.overlap_param_gather = bool(getattr(s, "overlap_param_gather", False))
        self.pp_recv_buffers = getattr(s, "pp_recv_buffers", "step")
        self.bucket_bytes = s.bucket_cap_mb * 1024**2
        self.comm_hook, self.powersgd_rank = s.comm_hook, s.powersgd_rank
        # DeepSpeed: None means DeepSpeed's own default, which overlaps at stage 3 only
        ds_overlap = s.ds.overlap_comm if s.ds.overlap_comm is not None else s.zero_stage == 3
        self.overlap_comm = bool(ds_overlap) if s.engine == "deepspeed" else True
        # (stage, persistence threshold, offload): memory.deepspeed leaves offloaded states out
        self.ds_knobs = ((s.zero_stage, s.ds.stage3_param_persistence_threshold, s.offload)
                         if s.engine == "deepspeed" else ())
        self.ds_buckets = ((s.ds.reduce_bucket_size, s.ds.stage3_prefetch_bucket_size, s.ds.stage3_max_live_parameters)
                           if s.engine == "deepspeed" else None)
        # ZeRO-3's (reuse distance, persistence threshold): which params it gathers again (ds_zero3.py)
        self.ds_reuse = ((getattr(s.ds, "stage3_max_reuse_distance", 10**9), s.ds.stage3_param_persistence_threshold)
                         if s.engine == "deepspeed" and s.zero_stage == 3 else None)
        # DDP wraps the model (reducer buckets, no_sync) for ddp, zero1 and 3d with data_parallel=ddp
        self.uses_ddp = self.state_sharding in ("replicated", "zero1_torch") and s.engine == "torch"
        # torch autocast keeps fp32 params and residual stream; FSDP2's MixedPrecisionPolicy and
        # DeepSpeed's bf16/fp16 modes cast the parameters (and so the activations) instead
        # bf16 params (strategy.low_precision_params) likewise: the distributed optimizer's, or Megatron-LM's bf16
        # module under DDP (priced only, harness/validate.py)
        self.low_precision_params = (bool(getattr(s, "low_precision_params", False))
                                     and self.state_sharding in ("distributed", "replicated"))
        self.autocast = self.state_sharding not in ("sharded", "deepspeed") and not self.low_precision_params
        # what memory.model_states reads beyond the state_sharding: DeepSpeed's knobs, the bf16 params
        self.state_knobs = self.ds_knobs or ((True,) if self.low_precision_params else ())
        return self


def ranks_per_node(hw: Hardware, world: int, nodes: int) -> int:
    """Ranks sharing a node. CPU ranks time-share a node's cores; a GPU node holds at most
    devices_per_node ranks, so a larger world spans at least world / devices_per_node nodes."""
    nodes = max(1, nodes)
    if hw.device != "cpu":
        nodes = max(nodes, -(-world // hw.devices_per_node))
    return max(1, -(-world // nodes))


def ideal_stage(st: StrategyKnobs) -> int:
    """The ZeRO stage whose ideal memory this engine approximates."""
    if st.state_sharding == "replicated":
        return 0
    if st.state_sharding in ("zero1_torch", "distributed"):
        return 1
    if st.state_sharding == "sharded":
        return st.zero_stage if st.zero_stage >= 2 else 3
    return st.zero_stage
