"""Calibration: `python -m harness.calibrate --quick` measures this machine (torchrun, gloo) and writes a
hardware profile that composes as `hardware=<name>`, validates and drives a prediction."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.calibrate import check_profile
from harness.tools.calibrate_collectives import COLLECTIVES
from harness.tools.calibrate_collectives_fit import fit_alpha_beta
from tests.helpers import REPO


def core_peak_tflops(dtype: str) -> float:
    """An upper bound on one core's matmul rate from /proc/cpuinfo: FLOP per cycle of its widest
    units (2 FMA pipes x lanes x 2: AVX-512 64, AVX2+FMA 32 fp32 FLOP/cycle; AMX 1024 and
    AVX512-BF16 128 bf16 FLOP/cycle, per the vendors' optimisation manuals; without bf16 units bf16 is
    computed in fp32) times the clock, with 1.5x headroom for turbo (a VM reports the base clock)."""
    info = Path("/proc/cpuinfo").read_text()
    flags = set(re.search(r"^flags\s*:(.*)$", info, re.M).group(1).split())
    mhz = max(float(x) for x in re.findall(r"^cpu MHz\s*:\s*([\d.]+)", info, re.M))
    fp32 = 64 if "avx512f" in flags else 32 if {"avx2", "fma"} <= flags else 16
    per_cycle = {"fp32": fp32, "bf16": 1024 if "amx_bf16" in flags else 128 if "avx512_bf16" in flags else fp32}
    return per_cycle[dtype] * mhz * 1e6 * 1.5 / 1e12


def test_alpha_beta_fit_recovers_a_line():
    alpha, bw = 300e-6, 0.5e9
    points = [(x, alpha + x / bw) for x in (4, 4096, 262144, 4 * 2**20, 64 * 2**20)]
    a, b = fit_alpha_beta(points)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(bw, rel=1e-6)


def test_gemm_sweep_and_dispatch_are_measured():
    from harness.tools.calibrate_compute import gemm_sweep, op_dispatch_us, ops_per_layer

    sweep = gemm_sweep("fp32", quick=True, rounds=1, window_s=0.0)
    shapes = {tuple(s[:3]) for s in sweep["shapes"]}
    # model=small's head at 256 tokens (256 x 8192 x 256) as its forward, input and weight gradient
    assert {(256, 8192, 256), (256, 256, 8192), (8192, 256, 256)} <= shapes
    assert sweep["max_tflops"] == max(s[3] for s in sweep["shapes"]) > 0
    assert 0 < op_dispatch_us(50) < 1000
    assert 50 < ops_per_layer() < 1000  # LayerNorms, 6 linears, SDPA, GELU, adds: forward and backward


def test_dtensor_dispatch_is_measured_on_the_fake_group():
    """tp 2 on torch's fake group in this process: the counts are the plan's (shape-independent), the
    costs positive microseconds, and the process group is gone afterwards."""
    import torch.distributed as dist

    from harness.tools.calibrate_dtensor import measure

    fig = measure(rounds=2)
    assert not dist.is_initialized()
    # a block: 6 linears (weight, bias) forward and backward, the grad hooks, the all-reduce wrappers
    assert 20 < fig["ops_per_layer"] < 500 and fig["ops_outside_layers"] > 0, fig
    assert fig["optimizer_ops_per_layer"] > 0 and fig["optimizer_ops_outside_layers"] >= 0, fig
    # a unit check, not a speed: an operator's host time is microseconds; 0.1 s each would take a
    # thousandfold slowdown, where a fair-share scheduler slows a process by about load / cores
    assert all(0 <= fig[k] < 1e5 for k in ("op_us", "outside_op_us", "optimizer_op_us")), fig
    sp = fig["sequence_parallel"]  # the norms and the residual stream become DTensors: more of them
    assert sp["ops_per_layer"] > fig["ops_per_layer"], (sp, fig)


def test_dtensor_operator_growth_is_priced_against_the_profiles_kernels():
    """At model=small the tp block's own kernels are a kappa of the plain block's, as the profile prices
    them (about half: the shards' GEMMs, with the norms whole); what the tp block takes beyond kappa x
    plain is DTensor's, and its growth over the tiny shapes' operator is the slope."""
    import torch.distributed as dist

    from harness.config import as_dict, compose_run
    from harness.tools.calibrate_dtensor import kernel_ratio, measure_one

    profile = as_dict(compose_run(["hardware=cpu_calibrated"]))["hardware"]
    for sp in (False, True):
        assert 0.35 < kernel_ratio(profile, sp) < 0.85, sp
    fig = measure_one(2, False, profile)
    assert not dist.is_initialized()
    assert 0 <= fig["op_us_per_melem"] < 1e5 and fig["ops_per_layer"] > 20, fig  # units, as above
    assert "op_us_per_melem" not in measure_one(1, False)  # without a profile: not measured


def test_fsdp_host_work_is_measured_on_the_fake_group():
    import torch.distributed as dist

    from harness.tools.calibrate_fsdp import measure

    fig = measure(rounds=2)
    assert not dist.is_initialized()
    assert set(fig) == {"block_us", "outside_us", "step_block_us", "step_outside_us"}
    assert all(0 <= v < 1e6 for v in fig.values()) and fig["block_us"] + fig["step_block_us"] > 0, fig  # units (< 1 s)


@pytest.mark.slow
def test_corunning_is_measured_on_every_core():
    from harness.tools.calibrate_corun import measure

    fig = measure(2, rounds=1, window_s=0.1)
    assert fig["cores"] == 2 and fig["gemm"] >= 1.0 and fig["memory"] >= 1.0, fig
    assert measure(1) == {"cores": 1, "gemm": 1.0, "memory": 1.0}


def test_alpha_beta_fit_of_noisy_points_stays_physical():
    """all_to_all at 2 ranks measured at load 17: the 1 MB message ran faster than the 64 KB one. The
    fit once returned B = 1e15 B/s (β clamped at 1e-15); a bandwidth no message achieved is not one."""
    for points in ([(0.5 * 8, 1630.8e-6), (0.5 * 65536, 3509.7e-6), (0.5 * 1048576, 850.0e-6)],
                   # and at load 6 (CI beside the suite): the 8 B message the slowest; the fit gave α = 0
                   [(0.5 * 8, 2040.3e-6), (0.5 * 65536, 853.1e-6), (0.5 * 1048576, 808.3e-6)]):
        alpha, bw = fit_alpha_beta(points)
        # every message pays α: positive, and no more than the shortest time measured
        assert 0 < alpha <= min(t for _, t in points) and 0 < bw <= max(x / t for x, t in points), (alpha, bw)


@pytest.mark.slow
def test_calibrate_quick_writes_a_profile_that_composes(tmp_path):
    path = tmp_path / "hardware" / "cpu_quick_test.yaml"
    out = subprocess.run([sys.executable, "-m", "harness.calibrate", "hardware=cpu", "--quick", "--output", str(path)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "composes as hardware=cpu_quick_test" in out.stdout
    prof = yaml.safe_load(path.read_text())
    assert prof["name"] == "cpu_quick_test" and prof["device"] == "cpu"
    # physically plausible for this machine: no faster than one core's peak, no slower than 1 MFLOP/s
    # (bf16 without bf16 units, measured here at load 17: 8e-5 TFLOP/s)
    for dtype in ("fp32", "bf16"):
        assert 1e-6 < prof["achievable_tflops"][dtype] <= core_peak_tflops(dtype), (dtype, prof["achievable_tflops"])
    assert 0.1 < prof["memory_bw_GBps"] < 500, prof["memory_bw_GBps"]  # one core's STREAM triad
    assert prof["compute"]["gemm"]["fp32"]["shapes"] and prof["compute"]["op_dispatch_us"] > 0
    # element-wise operators on one core: slower than memory could feed them, not slower than 10 MB/s
    assert 0.01 < prof["compute"]["elementwise_GBps"] <= 2 * prof["memory_bw_GBps"], prof["compute"]
    assert 0 < prof["compute"]["attention_efficiency"]["fp32"] <= 1, prof["compute"]
    assert 0 < prof["compute"]["attention_backward_efficiency"]["fp32"] <= 1, prof["compute"]
    assert prof["compute"]["dtensor"]["ops_per_layer"] > 0 and prof["compute"]["corun"]["gemm"] >= 1.0
    for coll in COLLECTIVES:
        fig = prof["collectives"][coll]["2"]
        # two processes on one host move bytes through memory: no faster than one core's triad
        assert 0 < fig["bus_bw_GBps"] <= prof["memory_bw_GBps"], (coll, fig, prof["memory_bw_GBps"])
        # a gloo round trip: microseconds, not seconds; 1 us is below any inter-process hand-off (load only
        # raises it), 0.1 s is 390x the 77-257 us measured on 2 cores at load 10
        assert 1 <= fig["latency_us"] <= 1e5, (coll, fig)
        assert len(fig["busbw_GBps_by_bytes"]) == 3
    pred = check_profile(path)  # composes as hardware=<name> from its folder, validates, predicts
    assert pred["hardware"] == "cpu_quick_test" and pred["step_time_s"] > 0
    assert pred["achievable_flops_per_rank"] == pytest.approx(prof["achievable_tflops"]["fp32"] * 1e12)


GPU_TEST_MODE = {"grid": (16, 32), "rounds": 1, "window_s": 0.001, "soak_s": 0.05, "triad_mib": 4, "triad_reps": 2,
                 "model": "tiny", "model_layers": 1, "micro_batch": 1, "seq_len": 32, "model_rounds": 1}


def test_gpu_calibration_runs_its_whole_path_and_composes(tmp_path):
    """harness/tools/calibrate_gpu.py on this CPU (device=cpu, a 2 x 2 x 2 grid, model=tiny): the soak, the
    GEMM grid per dtype, the triad, brigade's step under torch.profiler. The profile keeps what the base
    cites and was not measured (the network, the overlap slowdown, peak), replaces what was, and the
    cost model reads the measured figures: the same config is predicted slower on this CPU's rates."""
    from harness.calibrate import write_profile
    from harness.config import as_dict, compose_run
    from harness.tools import calibrate_gpu

    base = as_dict(compose_run(["hardware=h100_sxm"]))["hardware"]
    prof = calibrate_gpu.calibrate(base, "h100_cpu_test", GPU_TEST_MODE, device="cpu")
    for dtype in calibrate_gpu.DTYPES:
        table = prof["compute"]["gemm"][dtype]
        assert sorted(tuple(s[:3]) for s in table["shapes"]) == [(m, n, k) for m in (16, 32) for n in (16, 32) for k in (16, 32)]
        assert 0 < min(s[3] for s in table["shapes"]) and table["max_tflops"] == max(s[3] for s in table["shapes"])
        assert prof["achievable_tflops"][dtype] == table["max_tflops"] <= core_peak_tflops("bf16")  # bf16 units, or fp32
        # the step ran SDPA's fused kernel: its forward and backward timed apart, fractions of H100's peak
        assert 0 < prof["compute"]["attention_efficiency"][dtype] < 0.01
        assert 0 < prof["compute"]["attention_backward_efficiency"][dtype] < 0.01
    assert 0.1 < prof["memory_bw_GBps"] < 500 and 0.01 < prof["compute"]["elementwise_GBps"] < 500
    for kept in ("intra_node", "inter_node", "peak_tflops", "memory_GiB", "devices_per_node", "device"):
        assert prof[kept] == base[kept], kept
    assert prof["compute"]["overlap_slowdown"] == base["compute"]["overlap_slowdown"]
    assert "calibrate_gpu.py" in prof["source"]["compute.gemm"] and prof["source"]["inter_node"] == base["source"]["inter_node"]
    path = tmp_path / "hardware" / "h100_cpu_test.yaml"
    write_profile(prof, path, "test")
    pred = check_profile(path)
    assert pred["hardware"] == "h100_cpu_test"
    cited = check_profile(REPO / "conf" / "hardware" / "h100_sxm.yaml")
    # Slower, by however much this CPU and its load make it: every rate measured here is bounded above by
    # the physics asserted above (a core's peak, < 500 GB/s, < 1 % of H100's attention efficiency), which
    # load only lowers, and each is below the H100 rate the base cites for the same term (its slowest
    # GEMM, 256^3, runs 6.7 TFLOP/s; HBM 3350 GB/s). The ratio itself is this machine's speed, not asserted.
    assert pred["step_time_s"] > cited["step_time_s"], (pred["step_time_s"], cited["step_time_s"])
    assert core_peak_tflops("bf16") < min(s[3] for s in base["compute"]["gemm"]["bf16"]["shapes"])
    summary = calibrate_gpu.summary(prof, base, f"wrote {path}", pred)
    assert "bf16 GEMM rate per shape (8 shapes)" in summary and "attention_backward_efficiency.bf16" in summary
    assert "device memory: 80 GiB | 80 | 1.000" in summary  # a CPU keeps the base's; a GPU's own total_memory


def test_calibrating_a_gpu_profile_without_a_gpu_is_refused_with_the_reason():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: calibrate would measure it")
    out = subprocess.run([sys.executable, "-m", "harness.calibrate", "hardware=h100_sxm"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "sees none" in out.stderr and "hardware=cpu" in out.stderr, out.stderr


def _overlap_rank(rank: int, store: str, out: str) -> None:
    import json

    import torch
    import torch.distributed as dist

    from harness.tools.calibrate_collectives import _overlap

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        res = _overlap(torch, torch.device("cpu"), 2)
        if rank == 0:
            Path(out).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def test_compute_beside_collectives_is_measured_on_every_rank(tmp_path):
    """The worker's overlap measurement (on GPUs: compute.overlap_slowdown) runs its whole path here on
    gloo: all-gathers queued asynchronously, the GEMM loop timed beside them and alone, rounds
    interleaved, the ranks' medians averaged."""
    import json

    import torch.multiprocessing as mp

    out = tmp_path / "overlap.json"
    mp.spawn(_overlap_rank, args=(str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    res = json.loads(out.read_text())
    assert res["rounds"] == 3 and res["gemm"] == [256, 256, 256] and res["gather_bytes"] == 2**16 * 4
    # two processes on two cores, gloo's thread beside the GEMMs: slower or about the same, never 20x
    assert -0.5 < res["slowdown"] < 20, res


def test_pairs_of_ranks_are_timed_at_once_beside_the_whole_world():
    """At 4 ranks the worker times every collective (and each in-step one) over all 4 ranks, then over
    the two pairs at once, as a dp 2 x tp 2 step's 2-rank collectives meet the node's other ranks: the
    profile's "4" and "2@4" figures, which the cost model reads at those sharings (comm.collective_link)."""
    from harness.costmodel.comm import IN_STEP
    from harness.tools.calibrate_collectives_fit import run_collectives, tables

    polls = []
    res = run_collectives(4, (4, 65536), 0.01, lambda done, total: polls.append((done, total)))
    figs = tables(res)
    assert sorted(figs) == sorted((*COLLECTIVES, *IN_STEP.values()))
    for coll, by_key in figs.items():
        assert sorted(by_key) == ["2@4", "4"], (coll, by_key)
        for key, fig in by_key.items():
            assert fig["bus_bw_GBps"] > 0 and len(fig["time_us_by_bytes"]) == 2, (coll, key, fig)
    # the pairs' messages are a pair's: an all-gather's output splits into 2 chunks, not 4
    assert list(figs["all_gather"]["2@4"]["time_us_by_bytes"]) == ["8", "65536"]
    assert list(figs["all_gather"]["4"]["time_us_by_bytes"]) == ["16", "65536"]
    # progress counts every timing of both teams (2 sizes each), so the bar ends where the work does
    assert polls and {total for _, total in polls} == {2 * (len(COLLECTIVES) + len(IN_STEP)) * 2}, polls
    assert all(done <= total for done, total in polls)


def test_an_output_that_could_not_compose_is_refused_before_measuring(tmp_path):
    """A profile composes as hardware=<name> only from a folder named hardware: --output elsewhere is
    refused at once with the path that would work, instead of after minutes of measuring."""
    path = tmp_path / "profiles" / "my_box.yaml"
    out = subprocess.run([sys.executable, "-m", "harness.calibrate", "hardware=cpu", "--quick", "--output", str(path)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"--output {tmp_path / 'profiles' / 'hardware' / 'my_box.yaml'}" in out.stderr
    assert "matmul" not in out.stderr + out.stdout and not path.exists()  # nothing was measured or written
