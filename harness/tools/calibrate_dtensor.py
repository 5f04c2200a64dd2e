"""The DTensor part of `python -m harness.calibrate`: what tensor parallelism's DTensor dispatch costs
on this CPU, per operator, and how many DTensor operators a training step runs.

Every operator on a DTensor (a TP-sharded parameter, or an activation derived from one) goes through
DTensor's Python dispatch before its local aten kernel runs: sharding propagation, placement checks,
wrapping and unwrapping. On a GPU that host time hides under asynchronous kernels; on a CPU eager
step it adds to the step. The plain per-operator floor (compute.op_dispatch_us) does not include it.

Method, in this process on torch's fake process group at tp = 2 (collectives return at once, so
nothing but dispatch and the local kernels is timed), one thread, tiny shapes (d_model 64, 8 tokens:
the kernels cost microseconds, the dispatch dominates):
  - the same model built twice, plain (strategy=single) and tensor-parallel (strategy=tp, the worker's
    own path: models/tp_plan.py, the grad hooks, AdamW foreach=False), at 1 and 4 layers;
  - DTensor operators counted with a TorchDispatchMode (an operator with a DTensor argument; the
    local kernels it runs inside are not seen again), forward + backward of one micro-batch and one
    optimizer step;
  - per operator, the extra time of the tp model over the plain one divided by its DTensor operators:
      op_us          a block's forward + backward: (t_tp(4) - t_tp(1) - t_plain(4) + t_plain(1)) / ops of 3 blocks
      outside_op_us  embedding, head and loss parallel (the 1-layer model less one block), per its ops
      optimizer_op_us  the AdamW step of the 4-layer model, per its DTensor ops
Written to the profile as compute.dtensor = {op_us, ops_per_layer, outside_op_us, ops_outside_layers,
optimizer_op_us, optimizer_ops_per_layer, optimizer_ops_outside_layers, sequence_parallel: {the same
with strategy.sequence_parallel=true}}; harness/costmodel/compute.py charges them to a layout with tp > 1.
"""
from __future__ import annotations

import statistics

from harness.tools.calibrate_compute import cpu_clock

LAYERS = (1, 4)  # two depths: the difference is the blocks' share, the rest is outside them
TINY = ["model=tiny", "model.seq_len=8", "model.d_model=64", "model.d_ff=128", "model.vocab_size=64", "model.n_heads=4"]


def tiny_strategy(overrides: list[str], microbatches: int):
    """The worker's own strategy, set up on the fake group already initialised, for the tiny shapes and
    `overrides`, with `microbatches` (input, target) pairs of one sequence each."""
    import torch

    from harness import strategies
    from harness.config import compose_run
    from harness.dims import ParallelDims
    from models.gpt import build_model

    run = compose_run([*TINY, *overrides])
    dims = ParallelDims.from_config(run.parallel)
    st = strategies.load(run, dims)(run, dims, dims.build_mesh("cpu"), torch.device("cpu"), None)
    st.setup(build_model(run.model, device="meta"))
    gen = torch.Generator().manual_seed(0)
    return st, [tuple(torch.randint(0, run.model.vocab_size, (1, run.model.seq_len), generator=gen) for _ in range(2))
                for _ in range(microbatches)]


def _build(layers: int, tp: int, sequence_parallel: bool):
    """(strategy, one micro-batch's forward + backward) on the fake group already initialised."""
    st, [(x, y)] = tiny_strategy([f"model.n_layers={layers}"] + (
        ["strategy=tp", f"parallel.tp={tp}", f"strategy.sequence_parallel={sequence_parallel}"] if tp > 1 else []), 1)

    def forward_backward():
        st.backward(st.forward_loss(x, y))
    return st, forward_backward


def _count(fn) -> int:
    """DTensor operators `fn` dispatches (an operator with at least one DTensor argument)."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(isinstance(a, DTensor) for a in tree_leaves((args, kwargs))):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def _interleaved(fns: dict, rounds: int) -> dict:
    """Median time of each callable, run in turn round after round, so that a slow spell of the
    machine slows every one of them alike rather than one alone. The median, not the best: the
    figures are differences between the models' times and must describe the same sustained state of
    the core as calibrate's GEMM sweep (harness/tools/calibrate_compute.py), not each its fastest
    moment; in this thread's CPU time, as the sweep."""
    for fn in fns.values():
        fn()  # warm-up: DTensor caches its sharding propagation per operator schema
    times = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            t0 = cpu_clock()
            fn()
            times[key].append(cpu_clock() - t0)
    return {key: statistics.median(ts) for key, ts in times.items()}


def measure(rounds: int = 30) -> dict:
    """compute.dtensor for this CPU (see the module docstring), and under `sequence_parallel` the same
    figures with sequence parallelism (its norms and residual stream are DTensors too)."""
    return {**measure_one(rounds, False), "sequence_parallel": measure_one(rounds, True)}


def measure_one(rounds: int, sequence_parallel: bool) -> dict:
    """The figures for one setting of strategy.sequence_parallel; tp = 2 on the fake group."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        steps, ops, opt_ops = {}, {}, {}
        for layers in LAYERS:
            for tp in (1, 2):
                st, forward_backward = _build(layers, tp, sequence_parallel)
                if tp > 1:
                    ops[layers], opt_ops[layers] = _count(forward_backward), _count(st.optimizer_step)
                steps["fb", layers, tp], steps["opt", layers, tp] = forward_backward, st.optimizer_step
        t = _interleaved(steps, rounds)
    finally:
        dist.destroy_process_group()
    lo, hi = LAYERS
    per_layer = (ops[hi] - ops[lo]) / (hi - lo)
    outside = ops[lo] - per_layer * lo
    extra = {n: t["fb", n, 2] - t["fb", n, 1] for n in LAYERS}  # the DTensor time of the whole model
    op_s = (extra[hi] - extra[lo]) / (ops[hi] - ops[lo])
    opt_per_layer = (opt_ops[hi] - opt_ops[lo]) / (hi - lo)
    return {"op_us": us(op_s), "ops_per_layer": round(per_layer),
            "outside_op_us": us((extra[lo] - per_layer * lo * op_s) / outside) if outside > 0 else 0.0,
            "ops_outside_layers": round(outside),
            "optimizer_op_us": us((t["opt", hi, 2] - t["opt", hi, 1]) / opt_ops[hi]),
            "optimizer_ops_per_layer": round(opt_per_layer),
            "optimizer_ops_outside_layers": round(opt_ops[lo] - opt_per_layer * lo)}


def us(seconds: float) -> float:
    """Microseconds, never below zero (a negative difference is noise: the two models took the same time)."""
    return round(max(0.0, seconds) * 1e6, 2)


SOURCE = ("tp = 2 on torch's fake process group, one thread, tiny shapes (d_model 64, 8 tokens): median of "
          "{rounds} interleaved forward + backward and AdamW steps of the tp model minus the plain one at 1 and 4 layers, per "
          "DTensor operator counted with a TorchDispatchMode (harness/tools/calibrate_dtensor.py)")
