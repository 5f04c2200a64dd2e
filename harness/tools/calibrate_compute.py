"""The compute part of `python -m harness.calibrate`: a GEMM sweep and the per-operator dispatch cost
of one device (one thread: a CPU device is one core, launch/local.py).

GEMM sweep, by shape: the GEMMs of model=small's projections and head (the CPU demo model) at 256
and 1024 tokens per micro-batch and tensor-parallel degrees 1, 2 and 4, and squares 32-1024, each
projection as the three GEMMs an nn.Linear runs in training, in their own memory layouts and timed
apart: the forward x @ W^T (T, N, K), the input gradient dY @ W (T, K, N) and the weight gradient
dY^T @ x (N, K, T), 2MNK FLOP each. A rate indexed by FLOPs alone put the head (256 x 8192 x 256) on
the curve of (2048 x 512 x 512), which has its FLOPs, and charged it 0.77x of its time: on one
core a GEMM's rate depends on its shape, not only its size. The rate is *sustained*, not the best
repeat: the GEMMs take turns for `rounds` rounds of `window_s` each (so a slow spell of this machine
slows all of them alike, not one point of the curve); a round's rate is its FLOPs over its CPU time,
and a GEMM's rate the median over its rounds (a burst of another tenant's work in one round does not
move it). Written to the profile as compute.gemm.<dtype> = {max_tflops, shapes: [[M, N, K, TFLOP/s],
...]}: harness/costmodel/compute.py takes a GEMM's rate from the measured shapes nearest it in
(log M, log N, log K). A shape whose GEMMs would take more than MAX_TRIPLE_S at the previous rate is
not timed (bf16 without bf16 units: ~1 GFLOP/s).
Dispatch: the seconds one tiny eager op (a 1-element add) costs on this thread, the floor every
operator of a step pays: compute.op_dispatch_us; and how many aten operators one transformer block
of models/gpt.py dispatches in forward + backward (counted with a TorchDispatchMode on model=tiny's
shapes): compute.ops_per_layer. Their product is a block's dispatch floor per micro-batch.
"""
from __future__ import annotations

import statistics
import time

from harness.config import compose_run
from harness.costmodel.compute import layer_projections
from harness.costmodel.inputs import Model

# Imports inside functions: torch and what imports it, which the parent process never loads.

SQUARE = (32, 64, 128, 256, 512, 1024)
QUICK_SQUARE = (64, 256, 512)
# the shapes brigade's CPU runs meet: model=small's projections and head at these tokens per
# micro-batch (micro-batches of 2 and 8 sequences) and tensor-parallel degrees
MODEL, TOKENS, TPS = "small", (256, 1024), (1, 2, 4)
QUICK_TOKENS, QUICK_TPS = (256,), (1,)
MAX_TRIPLE_S = 3.0
# The compute figures are this thread's CPU seconds, not the wall clock's: on a machine shared with
# other tenants (2 cores, 7 developers' tests), the seconds the OS gave this core to another process
# are not this core's speed, and a calibration taken then described the tenants (a co-running factor
# of 2.05 where the quiet machine measures 1.0-1.25, docs/notes.md#cpu-step). What the core itself
# loses to a busy neighbour (shared cache, memory, clock) still counts: that is compute.corun.
cpu_clock = time.thread_time
FULL_SWEEP = {"rounds": 6, "window_s": 0.1}
QUICK_SWEEP = {"rounds": 1, "window_s": 0.01}


def linear_gemms(t: int, n: int, k: int, dtype) -> dict:
    """The forward, input-gradient and weight-gradient GEMMs of an nn.Linear (k -> n) on t tokens, with
    the operand layouts autograd gives them, keyed by their (M, N, K) as compute.py names them."""
    import torch

    x, w, dy = torch.randn(t, k, dtype=dtype), torch.randn(n, k, dtype=dtype), torch.randn(t, n, dtype=dtype)
    return {(t, n, k): lambda: x @ w.t(), (t, k, n): lambda: dy @ w, (n, k, t): lambda: dy.t() @ x}


def projection_shapes(quick: bool) -> list[tuple]:
    """Forward (tokens, out, in) of model=small's projections and head at TOKENS x TPS, and squares."""
    md = Model.of(compose_run([f"model={MODEL}"]).model)
    shapes = {(n, n, n) for n in (QUICK_SQUARE if quick else SQUARE)}
    for t in (QUICK_TOKENS if quick else TOKENS):
        for tp in (QUICK_TPS if quick else TPS):
            shapes |= {tuple(int(x) for x in s) for s in layer_projections(md, tp, t)}
            shapes.add((t, md.V // tp, md.h))
    return sorted(shapes, key=lambda s: (s[0] * s[1] * s[2], s))


def gemm_sweep(dtype_name: str, quick: bool, rounds: int, window_s: float) -> dict:
    """{max_tflops, shapes: [[M, N, K, TFLOP/s], ...]} for one dtype (see the module docstring)."""
    import torch

    torch.set_num_threads(1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    fns, rate = {}, None
    for shape in projection_shapes(quick):  # warm-up, smallest first, and the shapes this dtype can time
        if rate and 6 * shape[0] * shape[1] * shape[2] / rate > MAX_TRIPLE_S:
            break
        for mnk, fn in linear_gemms(*shape, dtype).items():
            fn()  # the first call allocates and picks its kernel: time the second
            t0 = cpu_clock()
            fn()
            rate = 2 * mnk[0] * mnk[1] * mnk[2] / max(cpu_clock() - t0, 1e-9)
            fns.setdefault(mnk, fn)
    rates = {mnk: [] for mnk in fns}  # per round: the round's FLOPs over its time
    for _ in range(rounds):
        for (m, n, k), fn in fns.items():
            calls, t0, c0 = 0, time.perf_counter(), cpu_clock()
            while time.perf_counter() - t0 < window_s or not calls:
                fn()
                calls += 1
            rates[(m, n, k)].append(2 * m * n * k * calls / max(cpu_clock() - c0, 1e-9))
    shapes = [[m, n, k, round(statistics.median(rs) / 1e12, 6)] for (m, n, k), rs in sorted(rates.items())]
    return {"max_tflops": max(s[3] for s in shapes), "shapes": shapes}


def op_dispatch_us(reps: int = 2000) -> float:
    """Best per-op time of a 1-element eager add over batches of ops, microseconds."""
    import torch

    torch.set_num_threads(1)
    x = torch.ones(1)
    best = float("inf")
    for _ in range(5):
        t0 = cpu_clock()
        for _ in range(reps):
            torch.add(x, x)
        best = min(best, (cpu_clock() - t0) / reps)
    return round(best * 1e6, 3)


def ops_per_layer() -> int:
    """aten operators one Block dispatches in forward + backward (shape-independent; model=tiny)."""
    import torch

    from harness.tools.op_profile import OpProfile
    from models.gpt import Block

    block = Block(compose_run(["model=tiny"]).model)
    x = torch.randn(2, 16, block.ln1.normalized_shape[0], requires_grad=True)
    with OpProfile() as prof:
        block(x).sum().backward()
    return sum(prof.ops.values()) - 2  # less the sum and its backward


def measure(quick: bool) -> tuple[dict, dict]:
    """(the profile's compute section, its source lines)."""
    import torch

    sweep = QUICK_SWEEP if quick else FULL_SWEEP
    gemm = {d: gemm_sweep(d, quick, **sweep) for d in ("fp32", "bf16")}
    compute = {"gemm": gemm, "op_dispatch_us": op_dispatch_us(500 if quick else 2000), "ops_per_layer": ops_per_layer()}
    n = {d: len(g["shapes"]) for d, g in gemm.items()}
    source = {"compute.gemm": f"sustained rate of an nn.Linear's three training GEMMs (forward, input and weight "
                              f"gradient) per projection shape: median over {sweep['rounds']} interleaved rounds of "
                              f"FLOPs / time in {sweep['window_s']} s, each GEMM apart; fp32 {n['fp32']} shapes, bf16 {n['bf16']} (shapes "
                              f"over {MAX_TRIPLE_S} s a call not timed); squares and transformer-block projections, "
                              f"one thread, torch {torch.__version__} (harness/tools/calibrate_compute.py)",
              "compute.op_dispatch_us": "best per-op time of a 1-element eager add, one thread",
              "compute.ops_per_layer": "aten ops of one models/gpt.py Block, forward + backward (TorchDispatchMode)"}
    return compute, source
