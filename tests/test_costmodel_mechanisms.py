"""Pure tier: the cost model's mechanisms: FSDP accumulation modes, overlap per mechanism and
shape-aware GEMM time. (The distributed optimizer's states and collectives: tests/test_hsdp_cp.py.)"""
from __future__ import annotations

import pytest

from harness.config import compose_run
from harness.costmodel import comm
from harness.costmodel.compute import GemmCurve, gemm_time
from harness.costmodel.estimate import evaluate
from harness.costmodel.inputs import Hardware, Model, StrategyKnobs

HW = Hardware.of(compose_run(["hardware=h100_sxm"]).hardware)
MD = Model.of(compose_run(["model=gpt_7b"]).model)


def strategy(*overrides):
    return StrategyKnobs.of(compose_run(list(overrides)).strategy)


def run(st, dp=8, m=4, mb=1, precision="bf16-mixed"):
    return evaluate(MD, HW, st, dp, 1, 1, 1, 1, mb, m, precision, "full", detail=False)


def test_sharded_accumulation_holds_nothing_between_microbatches_and_moves_more():
    """unsharded: Ψ + m Ψ_blocks gathered, G reduce-scattered once, full grads held; sharded: per
    micro-batch Ψ + Ψ_blocks gathered and G reduce-scattered, nothing held between micro-batches (the
    root unit, embeddings, final norm and head, stays gathered from its forward to its backward in both)."""
    unsharded = run(strategy("strategy=zero3"))
    sharded = run(strategy("strategy=zero3", "strategy.fsdp_accumulate=sharded"))
    root = 2 * (2 * MD.V * MD.h + MD.s * MD.h + 2 * MD.h)  # bf16: token and position embeddings, head, ln_f
    assert sharded["fsdp_unsharded_bytes"] == root and unsharded["fsdp_unsharded_bytes"] > 10 * root
    assert sharded["peak_mem_bytes"] < unsharded["peak_mem_bytes"]
    assert sharded["comm_dp_bytes"] > unsharded["comm_dp_bytes"]
    one = run(strategy("strategy=zero3", "strategy.fsdp_accumulate=sharded"), m=1)
    assert sharded["comm_dp_bytes"] == pytest.approx(4 * one["comm_dp_bytes"])


def test_unsharded_accumulation_holds_the_grads_in_the_reduce_dtype():
    """Between micro-batches FSDP2 holds each block's unsharded grads cast to its reduce dtype: fp32 under
    bf16-mixed, so 4 bytes a parameter, 2 with comm_hook=bf16 (the 3d dry runs of dryrun_scale hold
    them so: 16.4 GiB a rank for llama3_70b at tp8 pp2)."""
    from harness.costmodel.params import params_total

    fp32 = run(strategy("strategy=zero3"))
    bf16 = run(strategy("strategy=zero3", "strategy.comm_hook=bf16"))
    assert fp32["fsdp_unsharded_bytes"] - bf16["fsdp_unsharded_bytes"] == 2 * params_total(compose_run(["model=gpt_7b"]).model)


def test_deepspeed_zero3_gathers_again_only_what_it_released():
    """DeepSpeed keeps a module's params gathered from forward to backward when the modules after it hold
    fewer than stage3_max_reuse_distance / 2 elements (harness/costmodel/ds_zero3.py)."""
    from harness.costmodel.ds_zero3 import gathered_elements
    from harness.costmodel.params import model_shape, params_total

    cfg = compose_run(["model=gpt_7b"]).model
    shape, total = model_shape(cfg), params_total(cfg)
    fwd, again, kept = gathered_elements(shape, 0, 0)  # distance 0: every module released after forward
    assert (fwd, again, kept) == (total, total, 0)
    fwd, again, kept = gathered_elements(shape, 10**12, 0)  # beyond the model: nothing gathered twice
    assert (fwd, again, kept) == (total, 0, total)
    fwd, again, kept = gathered_elements(shape, 10**9, 0)  # DeepSpeed's default on 6.7B: the last ~0.5e9 kept
    head = cfg.vocab_size * cfg.d_model
    assert fwd == total and again + kept == total and head <= kept < 5 * 10**8 + cfg.d_model * cfg.d_ff
    # tensors of at most the persistence threshold are never partitioned, so never gathered: here the
    # LayerNorms' weights and biases (gpt_7b has no linear biases), 2 per block and ln_f
    fwd_p, _, _ = gathered_elements(shape, 10**9, 10**5)
    assert not cfg.bias and fwd_p == total - (2 * cfg.n_layers + 1) * 2 * cfg.d_model

    st = {d: strategy("strategy=zero3", "strategy.engine=deepspeed", f"strategy.ds.stage3_max_reuse_distance={d}")
          for d in (0, 10**12)}
    one, twice = run(st[10**12], m=1, precision="fp32"), run(st[0], m=1, precision="fp32")
    assert one["comm_dp_bytes"] == pytest.approx(twice["comm_dp_bytes"] * 2 / 3)  # (Ψ + G) / (2Ψ + G), Ψ = G
    assert one["fsdp_unsharded_bytes"] == 4 * total and twice["fsdp_unsharded_bytes"] == 0


def test_deepspeed_prefetch_bucket_bounds_the_overlap():
    """ZeRO-3 can only prefetch stage3_prefetch_bucket_size elements ahead: a tiny bucket exposes the gathers."""
    big = strategy("strategy=zero3", "strategy.engine=deepspeed", "strategy.ds.stage3_prefetch_bucket_size=1000000000")
    tiny = strategy("strategy=zero3", "strategy.engine=deepspeed", "strategy.ds.stage3_prefetch_bucket_size=1000")
    assert run(tiny, mb=8)["comm_dp_exposed_time_s"] > 5 * run(big, mb=8)["comm_dp_exposed_time_s"]


def test_megatron_overlaps_hide_the_distributed_optimizers_collectives():
    """overlap_grad_reduce: the reduce-scatter under the last micro-batch's backward; overlap_param_gather:
    the all-gather under the next forward. Same bytes (in buckets, so more calls), less exposed; each
    knob alone hides less."""
    base = ("strategy=zero1", "strategy.zero1_impl=distributed")
    plain, both = run(strategy(*base)), run(strategy(*base, "strategy.overlap_grad_reduce=true",
                                                      "strategy.overlap_param_gather=true"))
    grad = run(strategy(*base, "strategy.overlap_grad_reduce=true"))
    assert both["comm_dp_bytes"] == plain["comm_dp_bytes"] and both["comm_dp_time_s"] >= plain["comm_dp_time_s"]
    assert plain["comm_dp_exposed_time_s"] == pytest.approx(plain["comm_dp_time_s"])
    assert both["comm_dp_exposed_time_s"] < grad["comm_dp_exposed_time_s"] < plain["comm_dp_exposed_time_s"]


def test_gemm_wave_quantization_and_roofline():
    curve = GemmCurve(800e12, 256, 128, 132)
    full = gemm_time(curve, 256 * 12, 128 * 11, 8192, 2, 3.35e12, 1.0)  # 132 tiles: one full wave
    extra = gemm_time(curve, 256 * 12, 128 * 11 + 1, 8192, 2, 3.35e12, 1.0)  # 144 tiles: a second wave
    assert extra / full == pytest.approx((1409 / 1408) * (2 * 132) / 144)  # 144 tiles take two waves of 132
    skinny = gemm_time(curve, 8, 8192, 8192, 2, 3.35e12, 1.0)  # memory-bound: reads the 8192^2 weight
    assert skinny == pytest.approx(2 * (8 * 8192 * 2 + 8192 * 8192) / 3.35e12)


def test_measured_sweep_interpolates_in_log_flops():
    curve = GemmCurve.of({"max_tflops": 1.0, "points": [[1e6, 0.1], [1e9, 0.4]]})
    assert curve.rate(50, 100, 100) == pytest.approx(0.1e12)  # 1e6 FLOPs
    assert curve.rate(1000, 1000, 500) == pytest.approx(0.4e12)
    assert 0.1e12 < curve.rate(100, 1000, 500) < 0.4e12


def test_measured_shapes_give_each_gemm_its_own_rate():
    """Two GEMMs of equal FLOPs, one measured slow (a head's 256 x 8192 x 256) and one fast: each gets its
    own rate, and a shape between measured ones a rate between theirs, nearest weighing most."""
    curve = GemmCurve.of({"max_tflops": 0.05, "shapes": [[256, 8192, 256, 0.03], [2048, 512, 512, 0.05],
                                                         [256, 256, 256, 0.02]]})
    assert curve.rate(256, 8192, 256) == pytest.approx(0.03e12)
    assert curve.rate(2048, 512, 512) == pytest.approx(0.05e12)
    near_head = curve.rate(256, 4096, 256)
    assert 0.02e12 < near_head < 0.05e12
    assert abs(near_head - 0.03e12) < abs(near_head - 0.05e12)


def test_h100_gemms_run_at_measured_rates_and_agree_with_an_independent_measurement():
    """The H100 profile carries OpenXLA's measured table (conf/hardware/h100_sxm.yaml): a measured shape
    takes its own rate (the one-tile roofline curve it replaced gave half), and a shape beyond the table
    lands within 3 % of the 742.7 TFLOP/s cuBLAS 12.0.2 measured at 2048 x 8192 x 8192 in 2023
    (pytorch/pytorch issue 100850; the old curve gave 655)."""
    curve = HW.gemm["bf16"]
    assert curve.rate(1024, 2048, 2048) == pytest.approx(529.5e12)
    assert 2 * 2048 * 8192 * 8192 / gemm_time(curve, 2048, 8192, 8192, 2, HW.mem_bw, 1.0) == pytest.approx(742.7e12, rel=0.03)


def test_gemm_saturates_above_the_ridge_point_and_moves_with_it():
    """sat(I) = I / (I + c R/B): a mid-size GEMM runs below R, the rate rises with size towards R, and the
    same GEMM runs at a smaller fraction of R on a profile whose ridge point R/B is higher."""
    def rate(curve, bw, size, k):
        return 2 * size * size * k / gemm_time(curve, size, size, k, 2, bw, 1.0)

    a100 = GemmCurve(267.9e12, half_ridge=1.0)
    rates = [rate(a100, 2.039e12, size, 2048) for size in (1024, 2048, 4096, 8192, 16384)]
    assert all(x < y for x, y in zip(rates, rates[1:])) and rates[-1] < 267.9e12
    assert rates[1] / 267.9e12 == pytest.approx(1 / (1 + 131.4 / (2 * 2048**3 / (2 * 3 * 2048**2))), rel=1e-3)
    h100 = GemmCurve(792.1e12, half_ridge=1.0)
    assert rate(h100, 3.35e12, 4096, 2048) / 792.1e12 < rates[2] / 267.9e12
    # c = 1 is the additive roofline: math time + operand traffic time
    flops, moved = 2 * 4096 * 4096 * 2048, 2 * (2 * 4096 * 2048 + 4096 * 4096)
    assert gemm_time(a100, 4096, 4096, 2048, 2, 2.039e12, 1.0) == pytest.approx(flops / 267.9e12 + moved / 2.039e12)
    assert gemm_time(GemmCurve(267.9e12), 4096, 4096, 2048, 2, 2.039e12, 1.0) == pytest.approx(flops / 267.9e12)


def test_fused_attention_backward_recomputes_the_scores():
    """FlashAttention's backward runs 5 matmuls against the forward's 2 (forward + backward = 3.5
    forwards of FLOPs; eager: 3), the backward at its own fraction of peak; checkpointing the core
    adds one more forward of it, at the forward's."""
    import copy

    from harness.costmodel.compute import _core_time, microbatch_times
    from harness.costmodel.layout import layout

    def core(attention, hw=HW):
        md = Model.of(compose_run(["model=gpt_7b", f"model.attention={attention}"]).model)
        lo = layout(md, hw, strategy("strategy=ddp"), 8, 1, 1, 1, 1, "bf16-mixed", 1, False, 0.0)
        both, forward = _core_time(lo, 2 * md.s, hw.gemm["bf16"])
        times = microbatch_times(lo, 2).layer
        return both / forward, times["selective"] - times["none"], forward

    fwd, bwd = HW.attention_efficiency["bf16"], HW.attention_backward_efficiency["bf16"]
    assert bwd < fwd  # the profile's backward kernel is the slower one per FLOP
    ratio, selective_extra, forward = core("sdpa")
    assert ratio == pytest.approx(1 + 2.5 * fwd / bwd) and selective_extra == pytest.approx(forward)
    one = copy.copy(HW)  # a profile without the backward's own fraction: one fraction for both passes
    one.attention_backward_efficiency = {}
    assert core("sdpa", one)[0] == pytest.approx(3.5) and core("sdpa", one)[2] == pytest.approx(forward)
    assert core("eager")[0] == pytest.approx(3.0)


def test_bf16_gradient_reduction_moves_half_the_gradient_bytes(tmp_path):
    """DDP's bf16 compress hook moves 2-byte gradients like fp16's; FSDP2 with comm_hook=bf16 reduce-scatters
    in bf16 (Composer's PURE), its all-gathers unchanged; FSDP refuses DDP-only hooks before launch."""
    from harness.config import to_run_config
    from harness.dims import ConfigError
    from harness.validate import validate
    from tests.helpers import compose_config

    ddp = {h: run(strategy("strategy=ddp", f"strategy.comm_hook={h}"))["comm_dp_bytes"]
           for h in ("none", "fp16", "bf16")}
    assert ddp["bf16"] == ddp["fp16"] == pytest.approx(ddp["none"] / 2)
    fsdp = {h: run(strategy("strategy=zero3", "strategy.fsdp_accumulate=sharded", f"strategy.comm_hook={h}"))
            for h in ("none", "bf16")}
    saved = fsdp["none"]["comm_dp_bytes"] - fsdp["bf16"]["comm_dp_bytes"]
    # m = 4 fp32 reduce-scatters of (n-1)/n G each lose half: 4 (n-1)/n G/2 = DDP's fp32 all-reduce, 2 (n-1)/n G
    assert saved == pytest.approx(ddp["none"], rel=1e-6)
    with pytest.raises(ConfigError, match="comm_hook fp16 is a DDP hook"):
        validate(to_run_config(compose_config(["model=tiny", "strategy=fsdp", "parallel.dp=2",
                                               "strategy.comm_hook=fp16"], tmp_path)))


def test_a_collective_across_nodes_pays_nccls_latency_per_ring_step_and_tree_level():
    """NCCL's latency model (conf/hardware/a100_80g.yaml, source collective_latency): a ring's chunks
    pass every rank in turn, so a collective over 1536 ranks pays milliseconds where one over a node
    pays microseconds; an all-reduce takes NCCL's tree where it is quicker. Within a node, and on a
    profile without hop latencies (the CPU's), one flat latency per call as before."""
    a100, us = Hardware.of(compose_run(["hardware=a100_80g"]).hardware), 1e-6
    assert comm.collective_link(a100, "all_gather", 1536, 1, 8).alpha_s == pytest.approx((20 + 1344 * 1.9 + 191 * 4.0) * us)
    assert comm.collective_link(a100, "reduce_scatter", 16, 1, 8).alpha_s == pytest.approx((20 + 14 * 1.9 + 4.0) * us)
    # an all-reduce: ring (twice the steps) or tree, whichever is quicker
    assert comm.collective_link(a100, "all_reduce", 2, 8, 8).alpha_s == pytest.approx((20 + 2 * 4.0) * us)
    assert comm.collective_link(a100, "all_reduce", 16, 1, 8).alpha_s == pytest.approx((20 + 2 * (7 * 1.25 + 8.5)) * us)
    # 48 nodes, one rank on each (tp 8): 5 tree levels each way beat 94 ring steps
    assert comm.collective_link(a100, "all_reduce", 48, 8, 8).alpha_s == pytest.approx((20 + 2 * 5 * 8.5) * us)
    assert comm.collective_link(a100, "all_gather", 8, 1, 8).alpha_s == pytest.approx(10 * us)
    cpu = Hardware.of(compose_run(["hardware=cpu_reference"]).hardware)
    assert cpu.hops == comm.Hops()
    assert comm.collective_link(cpu, "all_gather", 1536, 1, 1).alpha_s == cpu.inter.alpha_s


def test_fsdp_reduce_scatters_once_per_unit_and_pays_the_ring_at_scale():
    """FSDP reduce-scatters each unit's gradients (not DDP's 25 MB buckets): per micro-batch as many
    calls as units, whatever the reduce dtype. At 1024 ranks each call pays the ring's ~1.8 ms, and
    part of it shows in the step; within a node nothing changes."""
    st = strategy("strategy=zero3", "strategy.fsdp_accumulate=sharded")
    flat = Hardware.of(compose_run(["hardware=h100_sxm"] + [f"hardware.{link}.{hop}_hop_latency_us=0"
                                   for link in ("intra_node", "inter_node") for hop in ("ring", "tree")]).hardware)
    def at(hw, dp):
        return evaluate(MD, hw, st, dp, 1, 1, 1, 1, 1, 4, "bf16-mixed", "full", detail=False)
    units, m = MD.L + 1, 4
    gathers, scatters = 2 * m * units, m * units  # reshard after forward: gathered again for backward
    n, nodes = 1024, 128
    extra = (gathers + scatters) * ((n - nodes) * 1.9 + (nodes - 1) * 4.0) * 1e-6
    assert at(HW, n)["comm_time_s"] - at(flat, n)["comm_time_s"] == pytest.approx(extra)
    assert at(HW, n)["comm_exposed_time_s"] > at(flat, n)["comm_exposed_time_s"] + 0.1 * extra
    assert at(HW, 8)["comm_time_s"] == at(flat, 8)["comm_time_s"]


def test_compute_under_a_collective_pays_the_profiles_overlap_slowdown():
    """On a GPU the overlapped seconds of the collectives slow the compute under them by s / (1 + s)
    (s = compute.overlap_slowdown, estimate.py); without the figure, and on a CPU where nothing
    overlaps, nothing is added."""
    import copy

    out = run(strategy("strategy=zero3"), dp=64)
    overlapped = out["comm_time_s"] - out["comm_exposed_time_s"]
    s = HW.overlap_slowdown
    assert s > 0 and overlapped > 0
    assert out["comm_interference_time_s"] == pytest.approx(min(overlapped, out["compute_time_s"]) * s / (1 + s))
    plain = copy.copy(HW)
    plain.overlap_slowdown = 0.0
    off = evaluate(MD, plain, strategy("strategy=zero3"), 64, 1, 1, 1, 1, 1, 4, "bf16-mixed", "full", detail=False)
    assert off["comm_interference_time_s"] == 0.0
    assert out["step_time_s"] == pytest.approx(off["step_time_s"] + out["comm_interference_time_s"])
    cpu = Hardware.of(compose_run(["hardware=cpu"]).hardware)
    tiny = Model.of(compose_run(["model=tiny"]).model)
    assert evaluate(tiny, cpu, strategy("strategy=zero3"), 2, 1, 1, 1, 1, 1, 2, "fp32", "none",
                    detail=False)["comm_interference_time_s"] == 0.0


def test_hsdp_replica_all_reduce_hides_behind_the_backward_on_a_gpu_not_on_a_cpu():
    """FSDP all-reduces each unit's gradient shard over the replicas during the rest of the backward
    (hsdp_cp.replicate_exposed_s): on a GPU only the last unit's and any excess over the backward show;
    on a CPU all of it."""
    from harness.costmodel import predict
    from harness.validate import validate

    def hsdp(hardware, model, dp, rep, mb, *extra):
        r = compose_run([f"hardware={hardware}", f"model={model}", "strategy=zero3", f"parallel.dp={dp}",
                         f"parallel.dp_replicate={rep}", f"workload.micro_batch_size={mb}",
                         f"workload.global_batch_size={dp * mb}", *extra])
        return predict(r, validate(r, torch_runs=False))

    gpu = hsdp("h100_sxm", "gpt_7b", 64, 8, 4, "workload.precision=bf16-mixed")
    rep, exposed = gpu["comm_dp_replicate_time_s"], gpu["comm_dp_replicate_exposed_time_s"]
    assert 0 < exposed < 0.2 * rep
    # a backward shorter than the shard group's and the replicas' traffic leaves the excess exposed
    short = hsdp("h100_sxm", "gpt_7b", 64, 8, 1, "workload.precision=bf16-mixed")
    assert short["comm_dp_replicate_exposed_time_s"] > 0.5 * short["comm_dp_replicate_time_s"]
    cpu = hsdp("cpu", "tiny", 4, 2, 1, "launcher.nproc_per_node=4")
    assert cpu["comm_dp_replicate_time_s"] > 0
    assert cpu["comm_dp_replicate_exposed_time_s"] == pytest.approx(cpu["comm_dp_replicate_time_s"])


def test_a_power_limited_part_runs_every_tensor_core_rate_at_its_clock_scale():
    """compute.clock_scale (conf/hardware/h100_hbm2e_96g.yaml: the 500 W part) slows the GEMMs and the fused
    attention kernels by exactly that factor and nothing else: the element-wise work (memory-bound) and the
    communication keep their time, and MFU keeps the datasheet peak as its denominator."""
    from harness.costmodel import predict
    from harness.validate import validate

    def pred(*extra):
        r = compose_run(["hardware=h100_sxm", "model=llama3_8b", "model.n_layers=2", "strategy=single", "logger=none",
                         "workload.precision=bf16-mixed", "workload.global_batch_size=2", "workload.micro_batch_size=1",
                         *extra])
        return predict(r, validate(r, torch_runs=False))

    full, half = pred(), pred("+hardware.compute.clock_scale=0.5")
    assert half["compute_gemm_time_s"] == pytest.approx(2 * full["compute_gemm_time_s"], rel=1e-9)
    assert half["compute_attention_time_s"] == pytest.approx(2 * full["compute_attention_time_s"], rel=1e-9)
    for key in ("compute_elementwise_time_s", "compute_optimizer_time_s"):
        assert half[key] == pytest.approx(full[key], rel=1e-9)
    assert half["mfu_pct"] * half["step_time_s"] == pytest.approx(full["mfu_pct"] * full["step_time_s"], rel=1e-9)
    derated = Hardware.of(compose_run(["hardware=h100_hbm2e_96g", "logger=none"]).hardware)
    sxm = Hardware.of(compose_run(["hardware=h100_sxm", "logger=none"]).hardware)
    assert derated.peak == sxm.peak and 0.85 < derated.clock_scale < 0.95
    assert derated.gemm["bf16"].rate(4096, 4096, 4096) == pytest.approx(
        derated.clock_scale * sxm.gemm["bf16"].rate(4096, 4096, 4096))


def test_megatron_lms_bf16_module_under_ddp_is_priced_with_its_bytes():
    """strategy.low_precision_params on DDP (the Megatron-LM rows of lab/published_runs.yaml): bf16 params, an fp32
    main copy and fp32 main grads per parameter (2 + 4 + 4 B against autocast's 4 + 4), and no autocast: the
    residual stream and the pipeline's sends in bf16, so the element-wise time falls and the pp bytes halve."""
    from harness.costmodel import predict
    from harness.validate import validate

    def pred(*extra):
        r = compose_run(["hardware=a100_80g", "model=gpt_1_3b", "strategy=3d", "parallel.dp=2", "parallel.tp=2",
                         "parallel.pp=2", "strategy.data_parallel=ddp", "workload.precision=bf16-mixed",
                         "workload.global_batch_size=16", "workload.micro_batch_size=1", "logger=none", *extra])
        return predict(r, validate(r, torch_runs=False))

    autocast, bf16 = pred(), pred("strategy.low_precision_params=true")
    assert bf16["params_bytes"] * 2 == autocast["params_bytes"] == bf16["grads_bytes"] == bf16["master_bytes"]
    assert bf16["optimizer_bytes"] == autocast["optimizer_bytes"] and autocast["master_bytes"] == 0
    assert bf16["comm_pp_bytes"] * 2 == autocast["comm_pp_bytes"]
    assert bf16["comm_dp_bytes"] == autocast["comm_dp_bytes"]  # gradients all-reduced in fp32 either way
    assert bf16["compute_elementwise_time_s"] < autocast["compute_elementwise_time_s"]
    assert bf16["compute_gemm_time_s"] == pytest.approx(autocast["compute_gemm_time_s"])
