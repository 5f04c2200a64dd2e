"""The compute part of `python -m harness.calibrate`: a GEMM sweep and the per-operator dispatch cost
of one device (one thread: a CPU device is one core, launch/local.py).

GEMM sweep: (M, N, K) from square sizes and the projections of brigade's transformer blocks at
the sizes the CPU runs (tokens x d_model x d_model and x 4 d_model), 2MNK FLOP each, the best of a
few repeats (mamf-finder's method: the maximum achievable). Written to the profile as
compute.gemm.<dtype> = {max_tflops, points: [[GEMM FLOPs, TFLOP/s], ...]}: harness/costmodel/
compute.py interpolates the rate of every GEMM in log FLOPs, so small GEMMs (TP shards, small
models) run as slowly as they measured.
Dispatch: the seconds one tiny eager op (a 1-element add) costs on this thread, the floor every
operator of a step pays: compute.op_dispatch_us; and how many aten operators one transformer block
of models/gpt.py dispatches in forward + backward (counted with a TorchDispatchMode on model=tiny's
shapes): compute.ops_per_layer. Their product is a block's dispatch floor per micro-batch.
"""
from __future__ import annotations

import time

SQUARE = (32, 64, 128, 256, 512, 1024)
BLOCK = ((256, 128, 128), (1024, 256, 256), (1024, 1024, 256), (2048, 512, 512), (2048, 2048, 512),
         (4096, 768, 768), (4096, 3072, 768))
QUICK_SQUARE = (64, 256, 512)
QUICK_BLOCK = ((1024, 256, 256),)


def gemm_tflops(m: int, n: int, k: int, dtype, reps: int) -> float:
    import torch

    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * m * n * k / best / 1e12


def gemm_sweep(dtype_name: str, quick: bool, reps: int) -> dict:
    """{max_tflops, points} for one dtype, points sorted by GEMM FLOPs."""
    import torch

    torch.set_num_threads(1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    shapes = [(n, n, n) for n in (QUICK_SQUARE if quick else SQUARE)] + list(QUICK_BLOCK if quick else BLOCK)
    points = sorted((2 * m * n * k, round(gemm_tflops(m, n, k, dtype, reps), 6)) for m, n, k in shapes)
    return {"max_tflops": max(r for _, r in points), "points": [[f, r] for f, r in points]}


def op_dispatch_us(reps: int = 2000) -> float:
    """Best per-op time of a 1-element eager add over batches of ops, microseconds."""
    import torch

    torch.set_num_threads(1)
    x = torch.ones(1)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.add(x, x)
        best = min(best, (time.perf_counter() - t0) / reps)
    return round(best * 1e6, 3)


def ops_per_layer() -> int:
    """aten operators one Block dispatches in forward + backward (shape-independent; model=tiny)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from harness.config import compose_run
    from models.gpt import Block

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    block = Block(compose_run(["model=tiny"]).model)
    x = torch.randn(2, 16, block.ln1.normalized_shape[0], requires_grad=True)
    with Count():
        block(x).sum().backward()
    return Count.n - 2  # less the sum and its backward


def measure(quick: bool) -> tuple[dict, dict]:
    """(the profile's compute section, its source lines)."""
    import torch

    reps = 2 if quick else 5
    gemm = {"fp32": gemm_sweep("fp32", quick, reps), "bf16": gemm_sweep("bf16", quick, max(1, reps // 2))}
    compute = {"gemm": gemm, "op_dispatch_us": op_dispatch_us(500 if quick else 2000), "ops_per_layer": ops_per_layer()}
    n = len(gemm["fp32"]["points"])
    source = {"compute.gemm": f"best of {reps} per shape, {n} GEMM shapes (squares and transformer-block projections), "
                              f"one thread, torch {torch.__version__} (harness/tools/calibrate_compute.py)",
              "compute.op_dispatch_us": "best per-op time of a 1-element eager add, one thread",
              "compute.ops_per_layer": "aten ops of one models/gpt.py Block, forward + backward (TorchDispatchMode)"}
    return compute, source
