"""Collective bus bandwidth and latency on this machine (part of `python -m harness.calibrate`):
the worker that torchrun starts on every rank (`python -m harness.tools.calibrate_collectives OUT
SIZES BUDGET PROGRESS [BACKEND]`); harness/tools/calibrate_collectives_fit.py launches it and fits
t(S) = alpha + factor * S / B (see harness/calibrate.py for what is measured and why).

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
import sys
import time
from pathlib import Path
from typing import NamedTuple

from harness.costmodel import comm
from harness.costmodel.comm import IN_STEP
from harness.tools.device_timing import run_for, sync, timed_calls

# Imports inside functions: torch and what imports it, which the parent process never loads.

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
# Tensor parallelism's collectives as a step meets them (IN_STEP: the all-reduce, and sequence
# parallelism's all-gather and reduce-scatter): DTensor's functional collective (issue, then wait)
# right after each rank computed on its own, not back to back in lockstep. What the step pays is what
# the collective adds to it: the host work of the functional path, the transfer, the wait for the
# slower rank of two that computed the same work, and the compute after the wait running slower than
# back to back (this VM's core, idle ~2 ms in the wait, runs the next ~5 ms of GEMMs at 0.7-0.9x: one
# 256x256x512 GEMM at 41-46 GFLOP/s right after a 2-5 ms sleep against 64 back to back,
# docs/notes.md#cpu-in-step). So IN_STEP times iterations of (a burst of GEMMs, then the collective) and
# subtracts the same burst timed back to back on every rank at once. tp2 on model=small (the
# fidelity config at world 2): 212 all-reduces per step, about 8 ms of compute between two; the burst:
# BURST_GEMMS GEMMs of BURST_SHAPE, ~5 ms on one core.
FACTOR = {**comm.FACTOR, **{name: comm.FACTOR[coll] for coll, name in IN_STEP.items()}}
BURST_SHAPE, BURST_GEMMS = (256, 1024, 256), 2


def _elems(coll: str, size: int, n: int) -> int:
    """fp32 elements of a size-byte message (nccl-tests' S), divisible into n equal chunks where split."""
    elems = max(1, size // 4)
    return max(n, elems // n * n) if coll in ("all_gather", "reduce_scatter", "all_to_all") else elems


def _buffers(coll: str, size: int, torch, device, team: "Team"):
    """(callable, bytes as nccl-tests counts them) for one message size over the rank's team."""
    import torch.distributed as dist

    n, group = len(team.members), team.group
    elems = _elems(coll, size, n)
    ones, empty = (lambda k: torch.ones(k, device=device)), (lambda k: torch.empty(k, device=device))
    if coll == "all_reduce":
        x = ones(elems)
        return (lambda: dist.all_reduce(x, group=group)), 4 * elems
    if coll == "all_gather":  # S = the gathered output
        out, inp = empty(elems), ones(elems // n)
        return (lambda: dist.all_gather_into_tensor(out, inp, group=group)), 4 * elems
    if coll == "reduce_scatter":  # S = the input
        out, inp = empty(elems // n), ones(elems)
        return (lambda: dist.reduce_scatter_tensor(out, inp, group=group)), 4 * elems
    if coll == "all_to_all":  # S = one rank's buffer
        out, inp = empty(elems), ones(elems)
        return (lambda: dist.all_to_all_single(out, inp, group=group)), 4 * elems
    send, recv = ones(elems), empty(elems)
    me = team.members.index(dist.get_rank())
    after, before = team.members[(me + 1) % n], team.members[(me - 1) % n]

    def ring():
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, after, group),
                                       dist.P2POp(dist.irecv, recv, before, group)])
        for r in reqs:
            r.wait()
    return ring, 4 * elems


def _slowest(t: float, torch, device=None, op: str = "MAX") -> float:
    import torch.distributed as dist

    x = torch.tensor([t], dtype=torch.float64, device=device)
    dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
    return float(x.item())


class Team(NamedTuple):
    """The ranks one timed collective spans (global ranks) and their process group (None: the world)."""
    members: list
    group: object


# With more ranks than calibrate's smallest run, CPU collectives are also timed over pairs of ranks,
# every pair at once (key "2@<ranks>"): a dp 2 x tp 2 step's 2-rank collectives run while the node's
# other ranks run theirs and compute, so they share the cores (comm.collective_link reads the pair
# figure at that sharing; docs/notes.md#cpu-shared-pairs).
PAIR = 2


def worker(out_path: str, sizes: list[int], budget_s: float, progress_path: str, backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":  # one rank per GPU
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    teams = {str(n): Team(list(range(n)), None)}
    if device.type == "cpu" and n > PAIR and n % PAIR == 0:
        pairs = [dist.new_group(list(range(i, i + PAIR))) for i in range(0, n, PAIR)]  # every rank makes every group
        first = rank // PAIR * PAIR
        teams[f"{PAIR}@{n}"] = Team(list(range(first, first + PAIR)), pairs[rank // PAIR])
    per_team = len(COLLECTIVES) * len(sizes) + (len(IN_STEP) * len(sizes) if device.type == "cpu" else 0)
    progress = _Progress(progress_path, len(teams) * per_team, rank)
    by_key = {key: _time_team(team, sizes, budget_s, torch, device, progress) for key, team in teams.items()}
    overlap = None if device.type == "cpu" else _overlap(torch, device, n)
    if rank == 0:
        Path(out_path).write_text(json.dumps({"world_size": n, "results": by_key, "overlap": overlap}))
    dist.barrier()
    dist.destroy_process_group()


class _Progress:
    """rank 0 writes "done total" for the parent's progress bar."""

    def __init__(self, path: str, total: int, rank: int):
        self.path, self.total, self.rank, self.done = path, total, rank, 0

    def step(self) -> None:
        self.done += 1
        if self.rank == 0:
            Path(self.path).write_text(f"{self.done} {self.total}")


def _time_team(team: Team, sizes: list[int], budget_s: float, torch, device, progress: _Progress,
               in_step: bool = True) -> dict:
    """Every collective at every size over the rank's team, every team at once: {name: [row per size]}.
    Counts and the reported time are agreed over the whole world (every rank takes part in each step).
    in_step: also IN_STEP on a CPU (not across nodes: harness/tools/calibrate_fabric.py)."""
    import torch.distributed as dist


    results: dict = {}
    for coll in COLLECTIVES:
        for size in sizes:
            call, nbytes = _buffers(coll, size, torch, device, team)
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
            progress.step()
    if device.type == "cpu" and in_step:
        for coll, name in IN_STEP.items():
            results[name] = []
            for size in sizes:
                results[name].append(_in_step(coll, size, team, budget_s, torch))
                progress.step()
    return results


def _in_step(coll: str, size: int, team: Team, budget_s: float, torch) -> dict:
    """One size of coll's IN_STEP over the rank's team: rounds of (iterations of the burst then the
    functional collective, and iterations of the burst alone, every rank at once); the time added = the
    first's median minus the second's, each rank's, averaged over all ranks. Bytes as nccl-tests counts
    them (_buffers)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    m, k, c = BURST_SHAPE
    a, b = torch.randn(m, k), torch.randn(k, c)
    n = len(team.members)
    elems = _elems(coll, size, n)
    group = team.group or dist.group.WORLD
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
    return {"bytes": 4 * elems, "time_s": max(float(added.item()) / dist.get_world_size(), 1e-6),
            "iters": 4 * per_round}


OVERLAP_GEMM, OVERLAP_GATHER_BYTES, OVERLAP_ROUNDS = 8192, 256 * 2**20, 3


def _overlap(torch, device, n: int) -> dict:
    """How much slower a GEMM loop runs while all-gathers run beside it (module docstring): per rank and
    round, (the loop's time with the collectives) / (its time alone) - 1; the median over the rounds,
    averaged over the ranks. The loop lasts about 0.2 s and enough all-gathers of OVERLAP_GATHER_BYTES
    are queued first to outlast it. On a GPU the GEMMs are bf16 and timed by CUDA events on their stream."""
    import torch.distributed as dist


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


if __name__ == "__main__":
    from harness.worker.main import leave  # the rank's exit; the parent process never imports the worker

    worker(sys.argv[1], [int(x) for x in sys.argv[2].split(",")], float(sys.argv[3]), sys.argv[4],
           sys.argv[5] if len(sys.argv) > 5 else "gloo")
    leave()  # written and destroyed: no teardown beside gloo's threads (harness/worker/main.py leave)
