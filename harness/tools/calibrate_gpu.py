"""The GPU side of `python -m harness.calibrate hardware=<a GPU profile>` (a100_80g, h100_sxm, h200, ...):
measure one CUDA device and write a profile that keeps the base profile's datasheet figures (peak,
memory size, the network) and replaces the figures the cost model takes from measurement.

Measured on cuda:0, every time from CUDA events around calls issued back to back (a training step
keeps the device's queue full; a synchronised call would time the launch, not the kernel):
  - soak: the largest GEMM of the grid back to back for `soak_s` seconds first, so that the sweep meets
    the clock the board holds under a training step's power draw, not the boost of a cold device (the
    rate in the first window and over the last quarter go into the profile's source);
  - the GEMM rate by shape, per dtype (bf16, fp16): a dot (M x K) @ (K x N) of random operands for every
    M, N, K in the grid (256 ... 8192: the grid of the cited sm_90 table, conf/hardware/h100_sxm.yaml,
    and 8192, so the two compare shape by shape), 2MNK FLOP; the shapes take turns for `rounds`
    rounds of `window_s` each and a shape's rate is the median over its rounds
    -> compute.gemm.<dtype> = {max_tflops, shapes: [[M, N, K, TFLOP/s], ...]}, which
    harness/costmodel/compute.py reads as it reads the cited table;
  - memory bandwidth: STREAM triad a = b + s*c over 3 arrays of `triad_mib` MiB -> memory_bw_GBps;
  - brigade's own step (MODEL with MODEL_LAYERS blocks, micro-batch MICRO_BATCH, under the dtype's
    autocast as brigade's mixed-precision runs use it; calibrate_elementwise.measure_profiled):
    forward, the loss and backward under
    torch.profiler, each aten operator's own kernel time (its self time: an operator's kernels counted
    once, by the operator that launched them), sorted by harness/tools/op_profile.py's kinds;
    the element-wise operators' bytes from OpProfile over the same step
    -> compute.elementwise_GBps (bytes / kernel seconds), compute.attention_efficiency.<dtype> and
    compute.attention_backward_efficiency.<dtype> (the fused kernel's counted FLOPs, compute.py's causal
    half and 2.5 forwards for the backward, over its forward's and backward's kernel time, as a fraction
    of the profile's peak).
With two or more GPUs visible, also (harness/tools/calibrate_collectives.py, NCCL, one rank per GPU, at
2 ranks and at all of them): the collectives by message size (nccl-tests' bus bandwidth, the α-β fit)
-> collectives.<name>."<ranks>" and intra_node's bandwidth and start-up (the all-reduce over every GPU:
this node's NVLink), and the GEMMs' slowdown beside running all-gathers -> compute.overlap_slowdown.
Not measured here (kept from the base profile, said so in the source): the network between nodes, the
per-step ring and tree latencies, and the dispatch costs (0 on a GPU profile: kernels launch asynchronously);
with one GPU also the collectives and compute.overlap_slowdown.
`device` is a parameter so that the same code runs on a CPU in the tests (tests/test_calibrate.py).
"""
from __future__ import annotations

import copy
import itertools
import platform
import statistics
import time

from rich.console import Console

from harness.costmodel.compute import GemmCurve
from harness.tools import calibrate_elementwise
from harness.tools.calibrate_collectives import COLLECTIVES
from harness.tools.calibrate_collectives_fit import run_collectives, tables
from harness.tools.device_timing import run_for, sig

# Imports inside functions: torch and what imports it, which the parent process never loads.

GRID = (256, 512, 1024, 2048, 4096, 8192)
NCCL_SIZES, QUICK_NCCL_SIZES = (4, 4096, 262144, 4 * 2**20, 64 * 2**20, 256 * 2**20), (4, 2**20, 64 * 2**20)
DTYPES = ("bf16", "fp16")
MODEL, MODEL_LAYERS, MICRO_BATCH = "gpt_1_3b", 4, 4  # the GPU check's model (scripts/gpu_check.sh), 4 of its 24 blocks
FULL = {"grid": GRID, "rounds": 3, "window_s": 0.05, "soak_s": 20.0, "triad_mib": 1024, "triad_reps": 7,
        "model": MODEL, "model_layers": MODEL_LAYERS, "micro_batch": MICRO_BATCH, "seq_len": None, "model_rounds": 3,
        "nccl_sizes": NCCL_SIZES, "nccl_budget_s": 0.25}
QUICK = {"grid": (256, 1024, 4096), "rounds": 1, "window_s": 0.02, "soak_s": 2.0, "triad_mib": 256, "triad_reps": 3,
         "model": MODEL, "model_layers": 2, "micro_batch": 2, "seq_len": None, "model_rounds": 1,
         "nccl_sizes": QUICK_NCCL_SIZES, "nccl_budget_s": 0.05}


def sm_clock_mhz(device):
    """The SM clock NVML reports for a CUDA device now, or None (no NVML, or a CPU)."""
    if device.type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        return pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
    except Exception:  # nvidia-ml-py absent or NVML unavailable: the clock is only reported, never used
        return None


def soak(dtype, n: int, seconds: float, device) -> tuple[float, float, list]:
    """(TFLOP/s in the first window, median over the last quarter, [SM clock MHz after the first window,
    at the end]) of an n^3 GEMM run back to back."""
    import torch

    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    rates, clocks, t0 = [], [], time.perf_counter()
    while time.perf_counter() - t0 < seconds or len(rates) < 2:
        calls, s = run_for(lambda: a @ b, min(0.25, seconds / 4), device)
        rates.append(2 * n**3 * calls / s / 1e12)
        if len(rates) == 1:
            clocks.append(sm_clock_mhz(device))
    clocks.append(sm_clock_mhz(device))
    return rates[0], statistics.median(rates[-max(1, len(rates) // 4):]), clocks


def gemm_grid(dtype, grid, rounds: int, window_s: float, device) -> dict:
    """{max_tflops, shapes: [[M, N, K, TFLOP/s], ...]}: every (M, N, K) of the grid, rounds interleaved."""
    import torch

    lhs, rhs = {}, {}  # operands shared by the shapes that have their dimensions

    def operand(cache, rows, cols):
        if (rows, cols) not in cache:
            cache[(rows, cols)] = torch.randn(rows, cols, dtype=dtype, device=device)
        return cache[(rows, cols)]

    shapes = list(itertools.product(grid, grid, grid))
    rates = {s: [] for s in shapes}
    for _ in range(rounds):
        for m, n, k in shapes:
            a, b = operand(lhs, m, k), operand(rhs, k, n)
            calls, s = run_for(lambda a=a, b=b: a @ b, window_s, device)
            rates[(m, n, k)].append(2 * m * n * k * calls / s)
    table = [[m, n, k, sig(statistics.median(rates[(m, n, k)]) / 1e12)] for m, n, k in shapes]
    return {"max_tflops": max(row[3] for row in table), "shapes": table}


def triad_GBps(mib: int, reps: int, device) -> float:
    """STREAM triad a = b + s*c over 3 fp32 arrays of `mib` MiB: the median GB/s over reps."""
    import torch

    n = mib * 2**20 // 4
    a, b, c = (torch.empty(n, device=device), torch.rand(n, device=device), torch.rand(n, device=device))
    rates = []
    for _ in range(reps):
        calls, s = run_for(lambda: torch.add(b, c, alpha=3.0, out=a), 0.05, device)
        rates.append(3 * 4 * n * calls / s / 1e9)
    return statistics.median(rates)


def nccl_figures(gpus: int, mode: dict) -> tuple[dict, dict, dict]:
    """(collectives by name and rank count, intra_node's {bus_bw_GBps, latency_us} from the all-reduce over
    every GPU, the overlap measurement at every GPU) from NCCL runs at 2 and at `gpus` ranks."""
    collectives: dict = {name: {} for name in COLLECTIVES}
    overlap = None
    for n in sorted({2, gpus}):
        res = run_collectives(n, mode["nccl_sizes"], mode["nccl_budget_s"], lambda done, total: None, backend="nccl")
        for coll, by_key in tables(res).items():
            collectives[coll].update(by_key)
        overlap = res["overlap"]  # the last: every GPU at once, as a training step's collectives run
    whole = collectives["all_reduce"][str(gpus)]
    return collectives, {"bus_bw_GBps": whole["bus_bw_GBps"], "latency_us": whole["latency_us"]}, overlap


def calibrate(base_hw: dict, name: str, mode: dict, device: str = "cuda", console=None) -> dict:
    """The measured profile (a plain dict in the HardwareConfig schema): the base profile with the
    measured figures in place of its own."""
    import torch

    console = console or Console(stderr=True)
    dev = torch.device(device)
    label = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    peak = dict(base_hw["peak_tflops"])
    prof = copy.deepcopy(dict(base_hw))
    compute, source = dict(prof.get("compute") or {}), dict(prof.get("source") or {})
    gemm, attn_f, attn_b = dict(compute.get("gemm") or {}), {}, {}
    big = max(mode["grid"])
    console.print(f"soak: {big}^3 bf16 back to back for {mode['soak_s']:.0f} s on {label}")
    first, held, clocks = soak(dtypes["bf16"], big, mode["soak_s"], dev)
    console.print(f"soak: {first:.1f} TFLOP/s in the first window, {held:.1f} held; SM clock {clocks[0]} -> {clocks[1]} MHz")
    for d in DTYPES:
        console.print(f"GEMM grid {d}: {len(mode['grid']) ** 3} shapes x {mode['rounds']} rounds")
        gemm[d] = gemm_grid(dtypes[d], mode["grid"], mode["rounds"], mode["window_s"], dev)
    console.print("memory bandwidth (triad)")
    mem_bw = triad_GBps(mode["triad_mib"], mode["triad_reps"], dev)
    console.print(f"element-wise operators and attention (model={mode['model']}, {mode['model_layers']} blocks)")
    ops = calibrate_elementwise.measure_profiled(dtypes["bf16"], peak["bf16"], mode, dev)
    for d in DTYPES:  # the step ran under bf16; fp16 runs the same kernels at the same rate on these parts
        if "attention_efficiency" in ops:
            attn_f[d], attn_b[d] = ops["attention_efficiency"], ops["attention_backward_efficiency"]
    compute.update({"gemm": gemm, "elementwise_GBps": ops["elementwise_GBps"]})
    compute.pop("clock_scale", None)  # the rates measured are this part's own, at whatever power limit it runs
    source.pop("compute.clock_scale", None)
    gpus = torch.cuda.device_count() if dev.type == "cuda" else 0
    if gpus >= 2:
        console.print(f"collectives and compute beside them: NCCL at {sorted({2, gpus})} ranks")
        prof["collectives"], link, overlap = nccl_figures(gpus, mode)
        prof["intra_node"] = {**dict(prof["intra_node"]), **link}
        compute["overlap_slowdown"] = sig(max(overlap["slowdown"], 0.0))
        source["collectives"] = ("NCCL via torchrun, one rank per GPU, nccl-tests busbw; α-β fit t = α + factor*S/B per "
                                 "collective and group size; sizes in bytes (harness/tools/calibrate_collectives.py)")
        source["intra_node"] = f"bus_bw_GBps and latency_us: all_reduce over the {gpus} GPUs (fit); hop latencies from hardware={base_hw['name']}"
        source["compute.overlap_slowdown"] = (
            f"measured: {overlap['gemm'][0]}^3 bf16 GEMMs back to back for ~0.2 s, timed alone and while all-gathers "
            f"of {overlap['gather_bytes'] / 2**20:.0f} MiB run on NCCL's stream across the {gpus} GPUs, (with / alone) "
            f"- 1, median of {overlap['rounds']} rounds, mean over the ranks: {overlap['slowdown']:.3f}")
    if attn_f:
        compute.update({"attention_efficiency": attn_f, "attention_backward_efficiency": attn_b})
    if dev.type == "cuda":  # what the device holds, not the datasheet's round figure: what fits is decided by it
        prof["memory_GiB"] = round(torch.cuda.get_device_properties(dev).total_memory / 2**30, 2)
        source["memory_GiB"] = (f"torch.cuda.get_device_properties().total_memory on {label}; hardware="
                                f"{base_hw['name']} says {base_hw['memory_GiB']}")
    when = time.strftime("%Y-%m-%d %H:%M:%S %z")
    sweep = (f"{len(mode['grid']) ** 3} shapes, M, N, K in {list(mode['grid'])}, a dot (M x K) @ (K x N) of random "
             f"operands, CUDA events around calls back to back, median of {mode['rounds']} interleaved rounds of "
             f"{mode['window_s']} s, after a soak of {big}^3 bf16 for {mode['soak_s']:.0f} s: {first:.1f} TFLOP/s in "
             f"its first window, {held:.1f} over its last quarter"
             + (f", SM clock {clocks[0]} then {clocks[1]} MHz (NVML)" if None not in clocks else "")
             + " (harness/tools/calibrate_gpu.py)")
    source.update({
        "calibrated": f"python -m harness.calibrate hardware={base_hw['name']}{' --quick' if mode is QUICK else ''} "
                      f"on {platform.node()} ({label}, torch {torch.__version__}) at {when}; the network between nodes "
                      f"and peak from hardware={base_hw['name']}"
                      + ("" if gpus >= 2 else "; with one GPU also the collectives and compute.overlap_slowdown"),
        "compute.gemm": sweep,
        "memory_bw_GBps": f"median STREAM triad of {mode['triad_reps']} over 3 x {mode['triad_mib']} MiB fp32 on {label}",
        "compute.elementwise_GBps": (f"model={mode['model']} with {mode['model_layers']} blocks, micro-batch "
                                     f"{mode['micro_batch']}, bf16 autocast, forward + loss + backward: the element-wise "
                                     f"operators' bytes (OpProfile) over their own kernel time (torch.profiler), median "
                                     f"of {mode['model_rounds']} steps"),
    })
    if attn_f:
        source["compute.attention_efficiency"] = ("the fused SDPA kernel's forward FLOPs as compute.py counts them (the "
                                                  "causal half) over its own kernel time, fraction of bf16 peak, in the "
                                                  "same steps; fp16 taken as bf16")
        source["compute.attention_backward_efficiency"] = "the same for its backward (2.5 forwards of FLOPs)"
    achievable = dict(prof.get("achievable_tflops") or {})
    achievable.update({d: gemm[d]["max_tflops"] for d in DTYPES})
    source["achievable_tflops"] = "bf16 / fp16: the GEMM sweep's fastest shape; fp32 from the base profile"
    prof.update({"name": name, "achievable_tflops": achievable, "memory_bw_GBps": sig(mem_bw),
                 "compute": compute, "source": source})
    return prof


def summary(profile: dict, base: dict, written: str, pred: dict) -> str:
    """What a GPU calibration measured, beside what the base profile cites, shape by shape where both
    have the shape."""
    lines = [f"{written} (single model=tiny predicted {pred['step_time_s'] * 1e3:.2f} ms/step)",
             "measured | base profile (cited) | measured / cited"]
    gemm = profile["compute"]["gemm"]["bf16"]
    cited = GemmCurve.of(base["compute"]["gemm"]["bf16"], float(base["compute"].get("clock_scale", 1.0)))
    ratios = sorted(r / (cited.rate(m, n, k) / 1e12) for m, n, k, r in gemm["shapes"])
    big = [r / (cited.rate(m, n, k) / 1e12) for m, n, k, r in gemm["shapes"] if min(m, n, k) >= 2048]
    lines.append(f"  bf16 GEMM, best shape: {gemm['max_tflops']:.1f} TFLOP/s | {cited.max_flops / 1e12:.1f} | "
                 f"{gemm['max_tflops'] / (cited.max_flops / 1e12):.3f}")
    lines.append(f"  bf16 GEMM rate per shape ({len(ratios)} shapes): median {ratios[len(ratios) // 2]:.3f}, "
                 f"{ratios[0]:.3f}-{ratios[-1]:.3f}"
                 + (f"; every dimension >= 2048: median {sorted(big)[len(big) // 2]:.3f}" if big else ""))
    lines.append(f"  device memory: {profile['memory_GiB']:g} GiB | {base['memory_GiB']:g} | "
                 f"{profile['memory_GiB'] / base['memory_GiB']:.3f}")
    lines.append(f"  memory bandwidth: {profile['memory_bw_GBps']:.0f} GB/s | {base.get('memory_bw_GBps', 0):.0f} | "
                 f"{profile['memory_bw_GBps'] / max(base.get('memory_bw_GBps') or 1, 1):.3f}")
    c, bc = profile["compute"], base["compute"]
    lines.append(f"  element-wise operators: {c['elementwise_GBps']:.0f} GB/s | "
                 f"{bc.get('elementwise_GBps') or base.get('memory_bw_GBps', 0):.0f} (memory bandwidth where not measured)")
    for key in ("attention_efficiency", "attention_backward_efficiency"):
        if key in c:
            lines.append(f"  {key}.bf16: {c[key]['bf16']:.3f} | {bc.get(key, {}).get('bf16', '-')}")
    return "\n".join(lines)
