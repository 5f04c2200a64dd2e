"""The co-running part of `python -m harness.calibrate`: how much slower one core computes while every
other core of the node computes too.

calibrate's GEMM sweep and STREAM triad run on one thread with the other cores idle; a run of 2 ranks
on 2 cores has both busy at once, sharing the last-level cache, the memory controllers and the
package's power budget (the clock). The cost model divided a CPU rank's rate only by the time-sharing
factor ranks/cores (harness/costmodel/layout.py placement), which is 1 at 2 ranks on 2 cores.

Method: `cores` processes (one thread each) start a kernel together at a barrier and each runs it
for a fixed window, reporting its median time per call; the same kernel runs alone in one process.
Alone and together alternate, one pair per round (so load from elsewhere on the machine meets both
alike); a round's ratio is together (the slowest process's median) over alone, and the slowdown is
the median of the rounds' ratios. (The best of 3 rounds of each, kept apart, gave 1.0-1.89 for the
GEMMs in four runs of one quiet minute: a lucky quiet round of either side decided it;
docs/notes.md#cpu-in-step.) Times are each process's CPU seconds (harness/tools/calibrate_compute.py
cpu_clock): the slowdown is what the cores cost each other (cache, memory, clock), not another
tenant's process time-sharing a core with them. Kernels:
    gemm    the GEMM sweep's transformer-block projections (1024 tokens x 256 x 256 and x 1024), fp32
    memory  the STREAM triad of calibrate (3 x 64 MiB fp32)
slowdown = together / alone, at least 1 (co-running cannot speed a core up; below 1 is noise).
Written as compute.corun = {cores, gemm, memory}: harness/costmodel/layout.py multiplies the compute
rate's slowdown by `gemm` and the memory bandwidth's by `memory` when a node runs more than one rank.
"""
from __future__ import annotations

import multiprocessing as mp
import statistics
import time

from harness.tools.calibrate_compute import cpu_clock

# Imports inside functions: torch and what imports it, which the parent process never loads.

GEMMS = ((1024, 256, 256), (1024, 1024, 256))
TRIAD_MIB = 64


def _kernel(kind: str):
    import torch

    torch.set_num_threads(1)
    if kind == "memory":
        n = TRIAD_MIB * 2**20 // 4
        a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
        return lambda: torch.add(b, c, alpha=3.0, out=a)
    pairs = [(torch.randn(m, k), torch.randn(k, n)) for m, n, k in GEMMS]
    return lambda: [a @ b for a, b in pairs]


def _worker(rank: int, commands, barrier, results) -> None:
    """One core's process: runs a kernel for a window on each command (kind, window_s, together),
    at the shared barrier when together, and reports its median seconds per call."""
    kernels = {}
    for kind, window_s, together in iter(commands.get, None):
        if kind not in kernels:
            kernels[kind] = _kernel(kind)
            kernels[kind]()  # warm-up: pages touched, kernels chosen
        fn = kernels[kind]
        if together:
            barrier.wait()
        times, t_end = [], time.perf_counter() + window_s
        while time.perf_counter() < t_end or len(times) < 3:
            t0 = cpu_clock()
            fn()
            times.append(cpu_clock() - t0)
        times.sort()
        results.put((rank, times[len(times) // 2]))


def measure(cores: int, rounds: int = 7, window_s: float = 0.5) -> dict:
    """compute.corun for a node of `cores` cores (see the module docstring)."""
    if cores <= 1:
        return {"cores": cores, "gemm": 1.0, "memory": 1.0}
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(cores), ctx.Queue()
    commands = [ctx.Queue() for _ in range(cores)]
    workers = [ctx.Process(target=_worker, args=(r, commands[r], barrier, results), daemon=True) for r in range(cores)]
    for w in workers:
        w.start()
    out = {"cores": cores}
    try:
        for kind in ("gemm", "memory"):
            ratios = []
            for _ in range(rounds):
                commands[0].put((kind, window_s, False))
                alone = results.get(timeout=300)[1]
                for q in commands:
                    q.put((kind, window_s, True))
                ratios.append(max(results.get(timeout=300)[1] for _ in workers) / alone)
            out[kind] = round(max(1.0, statistics.median(ratios)), 3)
    finally:
        for q in commands:
            q.put(None)
        for w in workers:
            w.join(timeout=30)
    return out


SOURCE = ("one process per core running a kernel at once vs one alone, median per call over {window_s} s, the "
          "median ratio of {rounds} alternating rounds: fp32 GEMMs 1024x256x256 and 1024x1024x256 (gemm), STREAM triad 3 x 64 MiB "
          "(memory); slowdown = together / alone, at least 1 (harness/tools/calibrate_corun.py)")
