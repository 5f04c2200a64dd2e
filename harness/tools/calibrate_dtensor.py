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
A block's DTensor operator costs more on larger tensors (redistributions and wrappers copy and
allocate; the shards' GEMMs run below their standalone rate inside the DTensor step). So the same is
measured again at the shapes the CPU studies run (model=small, a micro-batch of 2 x 128 tokens, as
harness/tools/calibrate_elementwise.py), where the tp shard's kernels are no longer negligible: there
the tp block's time less kappa x the plain block's, kappa = the tp block's kernels over the plain
block's as the profile being calibrated prices them (its GEMM sweep, element-wise rate and dispatch
floor: harness/costmodel/compute.py, no DTensor term), per DTensor operator; the two operator costs
give a slope in the micro-batch's residual-stream elements (tokens x d_model):
      op_us_per_melem  (op cost at model=small - op_us) / (its elements - tiny's elements) x 10^6
Written to the profile as compute.dtensor = {op_us, op_us_per_melem, ops_per_layer, outside_op_us,
ops_outside_layers, optimizer_op_us, optimizer_ops_per_layer, optimizer_ops_outside_layers,
sequence_parallel: {the same with strategy.sequence_parallel=true}}; harness/costmodel/compute.py
charges them to a layout with tp > 1.
"""
from __future__ import annotations

import statistics

from omegaconf import OmegaConf

from harness import strategies
from harness.config import compose_run
from harness.costmodel.compute import microbatch_times
from harness.costmodel.inputs import Hardware, Model, StrategyKnobs
from harness.costmodel.layout import layout
from harness.dims import ParallelDims
from harness.tools.calibrate_compute import cpu_clock
from harness.tools.calibrate_elementwise import MICRO_BATCH, MODEL

# Imports inside functions: torch and what imports it, which the parent process never loads.

LAYERS = (1, 4)  # two depths: the difference is the blocks' share, the rest is outside them
TINY = ["model=tiny", "model.seq_len=8", "model.d_model=64", "model.d_ff=128", "model.vocab_size=64", "model.n_heads=4"]
SIZED = [f"model={MODEL}"]  # the second measurement's shapes, MICRO_BATCH sequences per micro-batch


def tiny_strategy(overrides: list[str], microbatches: int, shapes: list[str] = TINY, sequences: int = 1):
    """The worker's own strategy, set up on the fake group already initialised, for `shapes` (the tiny
    ones unless given) and `overrides`, with `microbatches` (input, target) pairs of `sequences` each."""
    import torch

    from models.gpt import build_model

    run = compose_run([*shapes, *overrides])
    dims = ParallelDims.from_config(run.parallel)
    st = strategies.load(run, dims)(run, dims, dims.build_mesh("cpu"), torch.device("cpu"), None)
    st.setup(build_model(run.model, device="meta"))
    gen = torch.Generator().manual_seed(0)
    shape = (sequences, run.model.seq_len)
    return st, [tuple(torch.randint(0, run.model.vocab_size, shape, generator=gen) for _ in range(2))
                for _ in range(microbatches)]


def _overrides(layers: int, tp: int, sequence_parallel: bool) -> list[str]:
    return [f"model.n_layers={layers}"] + (
        ["strategy=tp", f"parallel.tp={tp}", f"strategy.sequence_parallel={sequence_parallel}"] if tp > 1 else [])


def _build(layers: int, tp: int, sequence_parallel: bool, shapes: list[str] = TINY, sequences: int = 1):
    """(strategy, one micro-batch's forward + backward) on the fake group already initialised."""
    st, [(x, y)] = tiny_strategy(_overrides(layers, tp, sequence_parallel), 1, shapes, sequences)

    def forward_backward():
        st.backward(st.forward_loss(x, y))
    return st, forward_backward


def _count(fn) -> int:
    """DTensor operators `fn` dispatches (an operator with at least one DTensor argument)."""
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


def measure(rounds: int = 30, profile: dict | None = None) -> dict:
    """compute.dtensor for this CPU (see the module docstring), and under `sequence_parallel` the same
    figures with sequence parallelism (its norms and residual stream are DTensors too). `profile`: the
    hardware profile being calibrated (its GEMM sweep and element-wise rate already measured), which
    prices kappa for the model-sized measurement; without it op_us_per_melem is not measured."""
    return {**measure_one(rounds, False, profile), "sequence_parallel": measure_one(rounds, True, profile)}


def measure_one(rounds: int, sequence_parallel: bool, profile: dict | None = None) -> dict:
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
        sized = _sized_times(rounds, sequence_parallel) if profile is not None else None
    finally:
        dist.destroy_process_group()
    lo, hi = LAYERS
    per_layer = (ops[hi] - ops[lo]) / (hi - lo)
    outside = ops[lo] - per_layer * lo
    extra = {n: t["fb", n, 2] - t["fb", n, 1] for n in LAYERS}  # the DTensor time of the whole model
    op_s = (extra[hi] - extra[lo]) / (ops[hi] - ops[lo])
    opt_per_layer = (opt_ops[hi] - opt_ops[lo]) / (hi - lo)
    slope = {}
    if sized is not None:  # a block's operator at SIZED shapes: the tp blocks less kappa x the plain ones
        kappa = kernel_ratio(profile, sequence_parallel)
        sized_op_s = ((sized[hi, 2] - sized[lo, 2]) - kappa * (sized[hi, 1] - sized[lo, 1])) / (ops[hi] - ops[lo])
        grown = _elements(SIZED, MICRO_BATCH) - _elements(TINY, 1)
        slope = {"op_us_per_melem": us((sized_op_s - op_s) / grown * 1e6)}
    return {"op_us": us(op_s), **slope, "ops_per_layer": round(per_layer),
            "outside_op_us": us((extra[lo] - per_layer * lo * op_s) / outside) if outside > 0 else 0.0,
            "ops_outside_layers": round(outside),
            "optimizer_op_us": us((t["opt", hi, 2] - t["opt", hi, 1]) / opt_ops[hi]),
            "optimizer_ops_per_layer": round(opt_per_layer),
            "optimizer_ops_outside_layers": round(opt_ops[lo] - opt_per_layer * lo)}


def _elements(shapes: list[str], sequences: int) -> int:
    """A micro-batch's residual-stream elements (tokens x d_model) at `shapes`."""
    m = compose_run(shapes).model
    return sequences * m.seq_len * m.d_model


def kernel_ratio(profile: dict, sequence_parallel: bool) -> float:
    """kappa: a tp-2 block's kernels over the plain block's, forward + backward of a micro-batch at
    SIZED shapes, as `profile` prices them (GEMMs by shape, attention, element-wise traffic and the
    dispatch floor; its DTensor term left out), one process on one core."""
    compute = {k: v for k, v in dict(profile.get("compute") or {}).items() if k not in ("dtensor", "corun")}
    hw = Hardware.of(OmegaConf.create({**profile, "compute": compute}))
    md = Model.of(compose_run(SIZED).model)

    def block_s(tp: int) -> float:
        st = StrategyKnobs.of(compose_run(["strategy=tp", f"strategy.sequence_parallel={sequence_parallel}"] if tp > 1
                                     else ["strategy=single"]).strategy)
        times = microbatch_times(layout(md, hw, st, 1, tp, 1, 1, 1, "fp32"), MICRO_BATCH)
        return times.layer["none"] + times.layer_traffic["none"]
    return block_s(2) / block_s(1)


def _sized_times(rounds: int, sequence_parallel: bool) -> dict:
    """Median forward + backward of one micro-batch at SIZED shapes, {(layers, tp): seconds}, on the fake
    group already initialised."""
    return _interleaved({(layers, tp): _build(layers, tp, sequence_parallel, SIZED, MICRO_BATCH)[1]
                         for layers in LAYERS for tp in (1, 2)}, rounds)


def us(seconds: float) -> float:
    """Microseconds, never below zero (a negative difference is noise: the two models took the same time)."""
    return round(max(0.0, seconds) * 1e6, 2)


SOURCE = ("tp = 2 on torch's fake process group, one thread, tiny shapes (d_model 64, 8 tokens): median of "
          "{rounds} interleaved forward + backward and AdamW steps of the tp model minus the plain one at 1 and 4 layers, per "
          "DTensor operator counted with a TorchDispatchMode; op_us_per_melem: the same blocks at model=small, "
          "micro-batch 2, less kappa x the plain ones (kappa: the tp block's kernels over the plain block's as "
          "this profile prices them), per operator, against op_us, per 10^6 residual-stream elements "
          "(harness/tools/calibrate_dtensor.py)")
