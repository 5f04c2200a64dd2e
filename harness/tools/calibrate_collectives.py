"""Collective bus bandwidth and latency on this machine (part of `python -m harness.calibrate`):
the worker that torchrun starts on every rank (`python -m harness.tools.calibrate_collectives OUT
SIZES BUDGET PROGRESS [BACKEND]`), and the parent side that launches it and fits t(S) = alpha + factor * S / B
(see harness/tools/calibrate.py for what is measured and why).

On GPUs (BACKEND nccl, one rank per GPU, harness/tools/calibrate_gpu.py) the buffers live on each rank's
device and a call's time runs until the device has finished it; tensor parallelism's IN_STEP figures
are a CPU's (DTensor's host work between GEMMs on one core) and are not measured there. Instead the
worker measures what compute loses to a collective running beside it (`_overlap`): a GEMM loop timed
alone and again while all-gathers run on NCCL's stream, each rank, rounds interleaved
-> compute.overlap_slowdown, the figure harness/costmodel/estimate.py charges overlapped compute.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.config import CONF_DIR
from harness.costmodel import comm
from harness.costmodel.comm import IN_STEP

REPO = CONF_DIR.parent
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
# Tensor parallelism's collectives as a step meets them (IN_STEP: the all-reduce, and sequence
# parallelism's all-gather and reduce-scatter): DTensor's functional collective (issue, then wait)
# right after each rank computed on its own, not back to back in lockstep. What the step pays is what
# the collective adds to it: the host work of the functional path, the transfer, the wait for the
# slower rank of two that computed the same work, and the compute after the wait running slower than
# back to back (this VM's core, idle ~2 ms in the wait, runs the next ~5 ms of GEMMs at 0.7-0.9x: one
# 256x256x512 GEMM at 41-46 GFLOP/s right after a 2-5 ms sleep against 64 back to back, 12-02 06:59,
# docs/notes.md#cpu-in-step). So IN_STEP times iterations of (a burst of GEMMs, then the collective) and
# subtracts the same burst timed back to back on every rank at once. tp2 on model=small (12-02,
# fidelity at world 2): 212 all-reduces per step, about 8 ms of compute between two; the burst:
# BURST_GEMMS GEMMs of BURST_SHAPE, ~5 ms on one core.
FACTOR = {**comm.FACTOR, **{name: comm.FACTOR[coll] for coll, name in IN_STEP.items()}}
BURST_SHAPE, BURST_GEMMS = (256, 1024, 256), 2


def _elems(coll: str, size: int, n: int) -> int:
    """fp32 elements of a size-byte message (nccl-tests' S), divisible into n equal chunks where split."""
    elems = max(1, size // 4)
    return max(n, elems // n * n) if coll in ("all_gather", "reduce_scatter", "all_to_all") else elems


def _buffers(coll: str, size: int, n: int, torch, device):
    """(callable, bytes as nccl-tests counts them) for one message size."""
    import torch.distributed as dist

    elems = _elems(coll, size, n)
    rank = dist.get_rank()
    ones, empty = (lambda k: torch.ones(k, device=device)), (lambda k: torch.empty(k, device=device))
    if coll == "all_reduce":
        x = ones(elems)
        return (lambda: dist.all_reduce(x)), 4 * elems
    if coll == "all_gather":  # S = the gathered output
        out, inp = empty(elems), ones(elems // n)
        return (lambda: dist.all_gather_into_tensor(out, inp)), 4 * elems
    if coll == "reduce_scatter":  # S = the input
        out, inp = empty(elems // n), ones(elems)
        return (lambda: dist.reduce_scatter_tensor(out, inp)), 4 * elems
    if coll == "all_to_all":  # S = one rank's buffer
        out, inp = empty(elems), ones(elems)
        return (lambda: dist.all_to_all_single(out, inp)), 4 * elems
    send, recv = ones(elems), empty(elems)

    def ring():
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, (rank + 1) % n),
                                       dist.P2POp(dist.irecv, recv, (rank - 1) % n)])
        for r in reqs:
            r.wait()
    return ring, 4 * elems


def _slowest(t: float, torch, device=None, op: str = "MAX") -> float:
    import torch.distributed as dist

    x = torch.tensor([t], dtype=torch.float64, device=device)
    dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
    return float(x.item())


def worker(out_path: str, sizes: list[int], budget_s: float, progress_path: str, backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist

    from harness.tools.device_timing import sync

    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":  # one rank per GPU
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    results: dict = {}
    done, total = 0, len(COLLECTIVES) * len(sizes)
    for coll in COLLECTIVES:
        for size in sizes:
            call, nbytes = _buffers(coll, size, n, torch, device)
            fn = call if device.type == "cpu" else (lambda call=call: (call(), sync(device)))  # till the GPU is done
            fn()  # warm-up (connection set-up, allocation)
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            first = _slowest(time.perf_counter() - t0, torch, device)
            iters = int(min(50, max(2, budget_s / max(first, 1e-6))))  # the same count on every rank
            dist.barrier()
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            # the median, not the mean: on a shared machine one preempted iteration would set the mean
            t = _slowest(statistics.median(times), torch, device)
            results.setdefault(coll, []).append({"bytes": nbytes, "time_s": t, "iters": iters})
            done += 1
            if rank == 0:
                Path(progress_path).write_text(f"{done} {total}")
    overlap = None
    if device.type == "cpu":
        for coll, name in IN_STEP.items():
            results[name] = [_in_step(coll, size, n, budget_s, torch) for size in sizes]
    else:
        overlap = _overlap(torch, device, n)
    if rank == 0:
        Path(out_path).write_text(json.dumps({"world_size": n, "results": results, "overlap": overlap}))
    dist.barrier()
    dist.destroy_process_group()


def _in_step(coll: str, size: int, n: int, budget_s: float, torch) -> dict:
    """One size of coll's IN_STEP: rounds of (iterations of the burst then the functional collective, and
    iterations of the burst alone, every rank at once); the time added = the first's median minus
    the second's, each rank's, averaged over the ranks. Bytes as nccl-tests counts them (_buffers)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    m, k, c = BURST_SHAPE
    a, b = torch.randn(m, k), torch.randn(k, c)
    elems = _elems(coll, size, n)
    group = dist.group.WORLD
    x = torch.ones(elems // n if coll == "all_gather" else elems)
    functional = {"all_reduce": lambda: funcol.all_reduce(x, "sum", group),
                  "all_gather": lambda: funcol.all_gather_tensor(x, 0, group),
                  "reduce_scatter": lambda: funcol.reduce_scatter_tensor(x, "sum", 0, group)}[coll]

    def burst() -> float:
        t0 = time.perf_counter()
        for _ in range(BURST_GEMMS):
            a @ b
        return time.perf_counter() - t0

    def cycle() -> float:
        t0 = time.perf_counter()
        burst()
        functional().wait()
        return time.perf_counter() - t0

    cycle(), burst()
    dist.barrier()
    first = _slowest(cycle(), torch)
    per_round = int(min(25, max(2, budget_s / first)))  # ~4 budgets over 4 rounds of both kinds
    cycles, bursts = [], []
    for _ in range(4):  # interleaved, so drift on a shared machine falls on both alike
        dist.barrier()
        cycles += [cycle() for _ in range(per_round)]
        dist.barrier()
        bursts += [burst() for _ in range(per_round)]
    # a rank that arrives last waits little, the other long: the mean over ranks. Not below 1 µs: with
    # more ranks than cores a waiting rank's core computes for another, and noise can cancel the rest.
    added = torch.tensor([statistics.median(cycles) - statistics.median(bursts)], dtype=torch.float64)
    dist.all_reduce(added)
    return {"bytes": 4 * elems, "time_s": max(float(added.item()) / n, 1e-6), "iters": 4 * per_round}


OVERLAP_GEMM, OVERLAP_GATHER_BYTES, OVERLAP_ROUNDS = 8192, 256 * 2**20, 3


def _overlap(torch, device, n: int) -> dict:
    """How much slower a GEMM loop runs while all-gathers run beside it (module docstring): per rank and
    round, (the loop's time with the collectives) / (its time alone) - 1; the median over the rounds,
    averaged over the ranks. The loop lasts about 0.2 s and enough all-gathers of OVERLAP_GATHER_BYTES
    are queued first to outlast it. On a GPU the GEMMs are bf16 and timed by CUDA events on their stream."""
    import torch.distributed as dist

    from harness.tools.device_timing import run_for, sync, timed_calls

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    m = OVERLAP_GEMM if cuda else 256
    a, b = torch.randn(m, m, dtype=dtype, device=device), torch.randn(m, m, dtype=dtype, device=device)
    elems = max(n, OVERLAP_GATHER_BYTES // 2 // n * n) if cuda else 2**16 // n * n
    out, inp = torch.empty(elems, dtype=dtype, device=device), torch.ones(elems // n, dtype=dtype, device=device)
    calls, alone = run_for(lambda: a @ b, 0.2, device)  # also the loop's length for every round
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_gather_into_tensor(out, inp)
    sync(device)
    gather_s = _slowest(time.perf_counter() - t0, torch, device)
    # the same count on every rank (a collective every rank does not join never completes)
    queued = int(_slowest(alone, torch, device) / max(gather_s, 1e-6)) + 2
    slow = []
    for _ in range(OVERLAP_ROUNDS):
        dist.barrier()
        works = [dist.all_gather_into_tensor(out, inp, async_op=True) for _ in range(queued)]
        _, with_comm = timed_calls(lambda: a @ b, calls, device)
        for w in works:
            w.wait()
        sync(device)
        dist.barrier()
        _, alone = timed_calls(lambda: a @ b, calls, device)
        slow.append(with_comm / alone - 1.0)
    mean = _slowest(statistics.median(slow), torch, device, op="SUM") / n
    return {"slowdown": mean, "gemm": [m, m, m], "gather_bytes": elems * out.element_size(), "rounds": OVERLAP_ROUNDS}


# -- the parent ---------------------------------------------------------------------------------

def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Fit t = α + x / B to (x = factor * bytes, t seconds), least squares in relative error:
    minimise Σ ((α + x_i β - t_i) / t_i)^2 over α >= 0 and β = 1/B > 0. Returns (α s, B bytes/s)."""
    w = [1.0 / t**2 for _, t in points]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
    st = sum(wi * t for wi, (_, t) in zip(w, points))
    sxt = sum(wi * x * t for wi, (x, t) in zip(w, points))
    det = sw * sxx - sx * sx
    if det <= 0:
        x, t = max(points)
        return 0.0, x / t
    alpha = (sxx * st - sx * sxt) / det
    beta = (sw * sxt - sx * st) / det
    if alpha > 0 and beta > 0:
        return alpha, 1.0 / beta
    # Noise (a loaded machine: the 8 B message slower than the 1 MB one) left no physical line. Every
    # message pays α, so the shortest time measured bounds it from above and is its best estimate here;
    # β from the weighted ratio of what remains, and no bandwidth above what some message achieved.
    alpha = min(t for _, t in points)
    beta = sum(wi * x * max(t - alpha, 0.0) for wi, (x, t) in zip(w, points)) / sxx
    fastest = max(x / t for x, t in points)
    return alpha, min(1.0 / beta, fastest) if beta > 0 else fastest


def run_collectives(n: int, sizes, budget_s: float, on_poll, backend: str = "gloo") -> dict:
    """Start the worker on n ranks with torchrun; return its results."""
    with tempfile.TemporaryDirectory(prefix="brigade-calibrate-") as tmp:
        out, progress = Path(tmp) / "out.json", Path(tmp) / "progress"
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(REPO) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                "-m", "harness.tools.calibrate_collectives", str(out), ",".join(map(str, sizes)), str(budget_s), str(progress),
                backend]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
        t0 = time.monotonic()
        while proc.poll() is None:
            try:
                done, total = map(int, progress.read_text().split())  # may be mid-write: skip then
                on_poll(done, total)
            except (OSError, ValueError):
                pass
            if time.monotonic() - t0 > 600:
                proc.kill()
                raise RuntimeError(f"collective calibration at {n} ranks took over 600 s")
            time.sleep(0.2)
        log = proc.stdout.read().decode(errors="replace")
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"torchrun at {n} ranks failed (exit {proc.returncode}):\n{log[-3000:]}")
        return json.loads(out.read_text())


def summarise(coll: str, n: int, rows: list[dict]) -> dict:
    f = FACTOR[coll](n)
    alpha, bw = fit_alpha_beta([(f * r["bytes"], r["time_s"]) for r in rows])
    return {"bus_bw_GBps": round(bw / 1e9, 4), "latency_us": round(alpha * 1e6, 1),
            "busbw_GBps_by_bytes": {str(r["bytes"]): round(f * r["bytes"] / r["time_s"] / 1e9, 4) for r in rows},
            "time_us_by_bytes": {str(r["bytes"]): round(r["time_s"] * 1e6, 1) for r in rows}}


if __name__ == "__main__":
    worker(sys.argv[1], [int(x) for x in sys.argv[2].split(",")], float(sys.argv[3]), sys.argv[4],
           sys.argv[5] if len(sys.argv) > 5 else "gloo")
