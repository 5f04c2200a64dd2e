"""The FSDP part of `python -m harness.calibrate`: what FSDP2's own per-module work costs a CPU step.

FSDP2 (strategy fsdp, zero2, 3d with data_parallel=fsdp) runs hooks around every sharded block: before its
forward and backward it all-gathers the block's parameters into a flat buffer and copies them out as
the unsharded parameters, after its backward it copies the gradients into a reduce-scatter buffer and
back out as sharded gradients; the optimizer then steps DTensor shards (AdamW with foreach off on CPU).
The collectives themselves are costed apart (harness/costmodel/dp_comm.py); the rest is host work that
the GEMM sweep and the per-operator floor do not see.

Method, in this process on torch's fake process group at dp = 2 (collectives return at once), one
thread, the tiny shapes of harness/tools/calibrate_dtensor.py: the worker's own train_step (strategy
fsdp, its accumulation mode) minus the plain model's (strategy single) at 1 and 4 layers and with 1
and 2 micro-batches, the median of interleaved rounds:
    per micro-batch  t(m=2) - t(m=1)      per step (the optimizer, the last reduce)  t(m=1) - per micro-batch
    per block        the difference between 4 and 1 layers, / 3   outside the blocks  the rest at 1 layer
Written as compute.fsdp2 = {block_us, outside_us (per micro-batch), step_block_us, step_outside_us (per
optimizer step)}; harness/costmodel/compute.py charges them to layouts whose parameters FSDP2 shards.
"""
from __future__ import annotations

from harness.tools.calibrate_dtensor import _interleaved, tiny_strategy, us

# Imports inside functions: torch and what imports it, which the parent process never loads.

LAYERS = (1, 4)


def _step(layers: int, sharded: bool, microbatches: int):
    st, mbs = tiny_strategy([f"model.n_layers={layers}"] + (["strategy=fsdp", "parallel.dp=2"] if sharded else []),
                            microbatches)
    return lambda: st.train_step(mbs)


def measure(rounds: int = 20) -> dict:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        t = _interleaved({(n, s, m): _step(n, s, m) for n in LAYERS for s in (False, True) for m in (1, 2)},
                              rounds)
    finally:
        dist.destroy_process_group()
    extra = {(n, m): t[n, True, m] - t[n, False, m] for n in LAYERS for m in (1, 2)}
    per_mb = {n: extra[n, 2] - extra[n, 1] for n in LAYERS}
    per_step = {n: extra[n, 1] - per_mb[n] for n in LAYERS}
    lo, hi = LAYERS
    block, step_block = (per_mb[hi] - per_mb[lo]) / (hi - lo), (per_step[hi] - per_step[lo]) / (hi - lo)
    return {"block_us": us(block), "outside_us": us(per_mb[lo] - lo * block),
            "step_block_us": us(step_block), "step_outside_us": us(per_step[lo] - lo * step_block)}


SOURCE = ("dp = 2 on torch's fake process group, one thread, tiny shapes: median of {rounds} interleaved train_steps "
          "of strategy fsdp minus the plain model at 1 and 4 layers, 1 and 2 micro-batches "
          "(harness/tools/calibrate_fsdp.py)")
