"""The compute part of `python -m harness.calibrate`: a GEMM sweep and the per-operator dispatch cost
of one device (one thread: a CPU device is one core, launch/local.py).

GEMM sweep: projections (T tokens, N out, K in) from square sizes and the projections of brigade's
transformer blocks at the sizes the CPU runs (tokens x d_model x d_model and x 4 d_model), each timed
as the three GEMMs an nn.Linear runs in training, in their own memory layouts: the forward x @ W^T
(T, N, K), the input gradient dY @ W (T, K, N) and the weight gradient dY^T @ x (N, K, T), 2TNK FLOP
each. The rate is *sustained*, not the best repeat: the shapes take turns for `rounds` rounds of
`window_s` each (so a slow spell of this machine slows all of them alike, not one point of the
curve); a round's rate is its FLOPs over its CPU time (the mean time per call, which is what a step of
hundreds of GEMMs adds up), and a shape's rate the median over its rounds (a burst of another
tenant's work in one round does not move it). A best-of-5 over single calls (this sweep
until 12-02) took the fastest moment of a core whose speed moves by ±20 % from one second to the next
(docs/notes.md#cpu-step): two calibrations an hour apart predicted `single` 16 % apart.
Written to the profile as compute.gemm.<dtype> = {max_tflops, points: [[GEMM FLOPs, TFLOP/s], ...]}:
harness/costmodel/compute.py interpolates the rate of every GEMM in log FLOPs, so small GEMMs (TP
shards, small models) run as slowly as they measured. A shape whose three GEMMs would take more than
MAX_TRIPLE_S at the previous shape's rate is not timed (bf16 without bf16 units: ~1 GFLOP/s); the
curve holds its last point beyond.
Dispatch: the seconds one tiny eager op (a 1-element add) costs on this thread, the floor every
operator of a step pays: compute.op_dispatch_us; and how many aten operators one transformer block
of models/gpt.py dispatches in forward + backward (counted with a TorchDispatchMode on model=tiny's
shapes): compute.ops_per_layer. Their product is a block's dispatch floor per micro-batch.
"""
from __future__ import annotations

import statistics
import time

SQUARE = (32, 64, 128, 256, 512, 1024)
BLOCK = ((256, 128, 128), (256, 1024, 256), (1024, 256, 256), (1024, 1024, 256), (2048, 512, 512),
         (2048, 2048, 512), (4096, 768, 768), (4096, 3072, 768))
QUICK_SQUARE = (64, 256, 512)
QUICK_BLOCK = ((1024, 256, 256),)
MAX_TRIPLE_S = 3.0
# The compute figures are this thread's CPU seconds, not the wall clock's: on a machine shared with
# other tenants (2 cores, 7 developers' tests), the seconds the OS gave this core to another process
# are not this core's speed, and a calibration taken then described the tenants (a co-running factor
# of 2.05 where the quiet machine measures 1.0-1.25, docs/notes.md#cpu-step). What the core itself
# loses to a busy neighbour (shared cache, memory, clock) still counts: that is compute.corun.
cpu_clock = time.thread_time
FULL_SWEEP = {"rounds": 8, "window_s": 0.1}
QUICK_SWEEP = {"rounds": 1, "window_s": 0.01}


def linear_gemms(t: int, n: int, k: int, dtype):
    """One callable running the forward, input-gradient and weight-gradient GEMMs of an nn.Linear
    (k -> n) on t tokens, with the operand layouts autograd gives them."""
    import torch

    x, w, dy = torch.randn(t, k, dtype=dtype), torch.randn(n, k, dtype=dtype), torch.randn(t, n, dtype=dtype)

    def run():
        x @ w.t()
        dy @ w
        dy.t() @ x
    return run


def gemm_sweep(dtype_name: str, quick: bool, rounds: int, window_s: float) -> dict:
    """{max_tflops, points} for one dtype, points sorted by GEMM FLOPs (see the module docstring)."""
    import torch

    torch.set_num_threads(1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    shapes = sorted({(n, n, n) for n in (QUICK_SQUARE if quick else SQUARE)} | set(QUICK_BLOCK if quick else BLOCK),
                    key=lambda s: (s[0] * s[1] * s[2], s))
    fns, rate = {}, None
    for shape in shapes:  # warm-up, smallest first, and the shapes this dtype can time
        flops = 6 * shape[0] * shape[1] * shape[2]
        if rate and flops / rate > MAX_TRIPLE_S:
            break
        fns[shape] = linear_gemms(*shape, dtype)
        fns[shape]()  # the first call allocates and picks its kernels: time the second
        t0 = cpu_clock()
        fns[shape]()
        rate = flops / max(cpu_clock() - t0, 1e-9)
    rates = {shape: [] for shape in fns}  # per round: the round's FLOPs over its time
    for _ in range(rounds):
        for shape, fn in fns.items():
            calls, t0, c0 = 0, time.perf_counter(), cpu_clock()
            while time.perf_counter() - t0 < window_s or not calls:
                fn()
                calls += 1
            rates[shape].append(6 * shape[0] * shape[1] * shape[2] * calls / max(cpu_clock() - c0, 1e-9))
    points = {}  # two shapes of equal FLOPs share one point
    for (t, n, k), rs in rates.items():
        points.setdefault(2 * t * n * k, []).extend(rs)
    curve = sorted((f, round(statistics.median(rs) / 1e12, 6)) for f, rs in points.items())
    return {"max_tflops": max(r for _, r in curve), "points": [[f, r] for f, r in curve]}


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

    sweep = QUICK_SWEEP if quick else FULL_SWEEP
    gemm = {d: gemm_sweep(d, quick, **sweep) for d in ("fp32", "bf16")}
    compute = {"gemm": gemm, "op_dispatch_us": op_dispatch_us(500 if quick else 2000), "ops_per_layer": ops_per_layer()}
    n = {d: len(g["points"]) for d, g in gemm.items()}
    source = {"compute.gemm": f"sustained rate of an nn.Linear's three training GEMMs (forward, input and weight "
                              f"gradient) per projection shape: median over {sweep['rounds']} interleaved rounds of "
                              f"FLOPs / time in {sweep['window_s']} s; fp32 {n['fp32']} points, bf16 {n['bf16']} (shapes "
                              f"over {MAX_TRIPLE_S} s a call not timed); squares and transformer-block projections, "
                              f"one thread, torch {torch.__version__} (harness/tools/calibrate_compute.py)",
              "compute.op_dispatch_us": "best per-op time of a 1-element eager add, one thread",
              "compute.ops_per_layer": "aten ops of one models/gpt.py Block, forward + backward (TorchDispatchMode)"}
    return compute, source
