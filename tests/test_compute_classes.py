"""A profiled step's compute split by kind of work (harness/collect/compute_classes.py) and its predicted
twin (harness/costmodel/estimate.py): known answers on a synthetic CUDA trace, the stored CPU traces,
one real profiled run, and the cost model's split adding up to its compute."""
from __future__ import annotations

import pytest

from harness.collect import trace_analysis as ta
from harness.collect.compute_classes import KEYS, kernel_class
from harness.config import compose_run
from harness.costmodel import predict
from harness.validate import validate
from tests.test_trace_analysis import FIX as FIXTURES


def _x(name, ts, dur, cat="kernel", **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 7 if cat == "kernel" else 1, "ts": ts, "dur": dur,
            "args": args}


def _cuda_trace() -> dict:
    """One step of 1000 us on a GPU: two overlapping GEMM kernels (100-400), the flash forward and the
    cuDNN SDPA backward (400-600), an element-wise kernel (600-650), the AdamW kernel launched inside
    torch's Optimizer.step (700-800) and a multi-tensor kernel launched after it (850-900: gradient
    clipping's, element-wise)."""
    return {"brigade": {}, "traceEvents": [
        _x(ta.STEP_EVENT, 0, 1000, cat="user_annotation"),
        _x(ta.STEP_EVENT, 0, 1000, cat="gpu_user_annotation"),
        _x("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", 100, 200),
        _x("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NNT", 250, 150),
        _x("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>", 400, 100),
        _x("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3_64x128x128_4x1x1", 500, 100),
        _x("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", 600, 50),
        _x("Optimizer.step#AdamW.step", 640, 60, cat="user_annotation"),
        _x("Optimizer.step#AdamW.step", 700, 100, cat="gpu_user_annotation"),
        _x("cudaLaunchKernel", 650, 5, cat="cuda_runtime", correlation=7),
        _x("void at::native::multi_tensor_apply_kernel<FusedAdamWMathFunctor>", 700, 100, correlation=7),
        _x("cudaLaunchKernel", 720, 5, cat="cuda_runtime", correlation=8),
        _x("void at::native::multi_tensor_apply_kernel<L2NormFunctor>", 850, 50, correlation=8),
    ]}


def test_a_cuda_steps_compute_splits_by_kernel_name_and_the_optimizers_launches():
    out = ta.analyse(_cuda_trace())
    got = {k: round(out[k] * 1e6, 6) for k in ("compute_time_s", *KEYS)}
    assert got == {"compute_time_s": 700, "compute_attention_time_s": 200, "compute_gemm_time_s": 300,
                   "compute_optimizer_time_s": 100, "compute_elementwise_time_s": 100}
    top = [(k["name"][:20], k["kind"], round(k["time_s"] * 1e6, 6)) for k in out["compute_top_kernels"]]
    assert top[:3] == [("sm90_xmma_gemm_bf16b", "gemm", 200), ("nvjet_hsh_128x256_64", "gemm", 150),
                       ("void pytorch_flash::", "attention", 100)]
    assert len(top) == 7 and ta.merge_ranks([out])["compute_top_kernels"] == out["compute_top_kernels"]


@pytest.mark.parametrize("kernel, kind", [
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "gemm"),
    ("sm80_xmma_gemm_bf16bf16_bf16f32_f32_nn_n_tilesize96x128x32_stage4_warpsize2x2x1_tensor16x8x16_kernel", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(Params)", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>(...)", "gemm"),
    ("triton_tem_fused_addmm_0", "gemm"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(...)>", "elementwise"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>", "elementwise"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "elementwise"),
])
def test_cuda_kernel_names_by_kind(kernel, kind):
    assert kernel_class(kernel) == kind


@pytest.mark.parametrize("name", ["ddp", "fsdp", "tp", "pp"])
def test_the_stored_cpu_traces_split_their_whole_compute(name):
    for rank in (0, 1):
        out = ta.analyse(ta.load(FIXTURES / f"{name}_rank{rank}.json.gz"))
        assert sum(out[k] for k in KEYS) == pytest.approx(out["compute_time_s"], rel=1e-9)
        # model=tiny runs its linears and SDPA on every rank
        assert out["compute_gemm_time_s"] > 0 and out["compute_attention_time_s"] > 0
    merged = ta.merge_ranks([ta.analyse(ta.load(FIXTURES / f"{name}_rank{r}.json.gz")) for r in (0, 1)])
    assert all(k in merged for k in KEYS)


@pytest.mark.slow
def test_a_profiled_run_records_its_compute_split_beside_the_prediction(single_reference):
    rec = single_reference("workload.profile_steps=1")
    m, p = rec["measured"], rec["predicted"]
    assert sum(m[k] for k in KEYS) == pytest.approx(m["compute_time_s"], rel=1e-6)
    assert all(m[k] > 0 for k in KEYS), {k: m[k] for k in KEYS}  # the real trace has AdamW's annotation
    assert all(isinstance(rec["fidelity"].get(k), float) for k in KEYS)
    assert rec["fidelity"]["compute_gemm_time_s"] == pytest.approx(m["compute_gemm_time_s"] / p["compute_gemm_time_s"])


def _predict(*overrides):
    run = compose_run(["logger=none", *overrides])
    return predict(run, validate(run, torch_runs=False))


@pytest.mark.parametrize("overrides", [
    ("hardware=h100_sxm", "model=llama3_8b", "model.n_layers=8", "workload.precision=bf16-mixed",
     "workload.global_batch_size=8", "workload.micro_batch_size=2"),
    ("hardware=a100_80g", "model=gpt_1_3b", "workload.precision=bf16-mixed", "workload.activation_checkpointing=full",
     "workload.global_batch_size=8", "workload.micro_batch_size=4"),
    ("hardware=cpu_calibrated", "model=small", "strategy=3d", "parallel.dp=1", "parallel.tp=2", "parallel.pp=2"),
    ("hardware=cpu", "model=moe_tiny", "strategy=ep", "parallel.ep=2", "parallel.dp=2"),
])
def test_the_predicted_split_adds_up_to_the_predicted_compute(overrides):
    p = _predict(*overrides)
    assert sum(p[k] for k in KEYS) == pytest.approx(p["compute_time_s"], rel=1e-9)
    assert all(p[k] >= 0 for k in KEYS) and p["compute_attention_time_s"] > 0


def test_the_attention_share_grows_with_the_sequence():
    share = {}
    for s in (2048, 8192):
        p = _predict("hardware=h100_sxm", "model=llama3_8b", "model.n_layers=8", f"model.seq_len={s}",
                     "workload.precision=bf16-mixed", "workload.global_batch_size=8", "workload.micro_batch_size=1")
        share[s] = p["compute_attention_time_s"] / p["compute_time_s"]
    assert share[8192] > 2 * share[2048]


def test_host_work_and_gradient_accumulation_are_element_wise_in_the_predicted_split():
    """Where a trace sees them: the operators' dispatch spread over the (mostly element-wise) operators,
    gradient accumulation's adds in the backward; the GEMM and AdamW terms do not move."""
    base = ("hardware=cpu_calibrated", "model=small", "workload.global_batch_size=8")
    p1 = _predict(*base, "workload.micro_batch_size=8")  # m = 1: no accumulation
    p4 = _predict(*base, "workload.micro_batch_size=2")  # m = 4
    assert p4["compute_optimizer_time_s"] == pytest.approx(p1["compute_optimizer_time_s"])
    slower = _predict(*base, "workload.micro_batch_size=2", "hardware.compute.op_dispatch_us=11.534")
    run = compose_run(["logger=none", *base])
    extra = run.hardware.compute["ops_per_layer"] * 10e-6 * run.model.n_layers * 4  # 10 us more per op, 4 micro-batches
    assert slower["compute_gemm_time_s"] == pytest.approx(p4["compute_gemm_time_s"])
    assert slower["compute_elementwise_time_s"] - p4["compute_elementwise_time_s"] == pytest.approx(extra)
