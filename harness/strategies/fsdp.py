"""fsdp (and zero2 / zero3 on engine torch): fully sharded data parallel with FSDP2 `fully_shard`.

Every parameter becomes a DTensor sharded on dim 0 over the mesh's "dp" axis: rank r holds rows
[r*c, (r+1)*c) with c = ceil(d0 / N) (fewer on the last ranks when N does not divide d0: FSDP pads
its storage to c rows; the local DTensor view, which is what brigade counts, holds only the rank's
own rows). Gradients and Adam moments follow the same shards, so params, grads and optimizer state
are all 1/N per rank (AdamW's 0-d step counters excepted: one per parameter tensor, on every rank).

One FSDP unit per block, then the root (embeddings, final norm, head). Per unit and step, with P
its parameter bytes and N the dp degree:
    forward : all-gather the unit's params              (N-1)/N * P per rank
    backward: all-gather again if it was resharded      (N-1)/N * P   (not with reshard_after_forward=false)
              reduce-scatter its grads (averaged)        (N-1)/N * P
    step    : local AdamW on the 1/N shard, no communication
So ZeRO-3 moves 3(N-1)/N * P per step against DDP's 2(N-1)/N * P (all-reduce), and holds 1/N.
The root is never resharded after forward (FSDP's default for the root: it would be gathered again
at once by backward). On gloo the reduce-scatter runs as an all-reduce (docs/notes.md#gloo-reduce-scatter).

reshard_after_forward=false keeps every block's gathered params from its forward to its backward
(one all-gather fewer per step; full params held during the step, sharded at rest): `zero2` on
engine torch. `zero3` and `fsdp` reshard (ZeRO-3).

Gradient accumulation over m micro-batches: on the m-1 non-last ones, gradient sync is off (unsharded
grads accumulate locally, no reduce-scatter) and params are not resharded after backward (so the
next forward needs no all-gather); the last micro-batch reduce-scatters the summed grads and
reshards. That is m-1 fewer reduce-scatters and m-1 fewer all-gathers per unit, for holding
unsharded params and grads between micro-batches (model=tiny, 5 units, m=4, counted with the
profiler: 21 all-gathers and 5 reduce-scatters per step instead of 36 and 20).

`strategy.fsdp_accumulate=sharded` (llm-foundry's and torchtitan's default) instead reshards after
every micro-batch's backward and reduce-scatters every micro-batch's grads into the sharded grads:
m reduce-scatters and 2m all-gathers per unit and step, holding only 1/N between micro-batches.

HSDP (`parallel.dp_replicate` = R > 1): FSDP2 on the 2-D (dp_replicate, dp_shard) mesh, S = dp / R:
params sharded 1/S over the shard group (neighbouring ranks, one node), replicated R times across
it. Per unit and step: all-gathers and the reduce-scatter over the S shard ranks ((S-1)/S * P
each), then an all-reduce of the 1/S grad shard over the R replicas (2(R-1)/R * P/S), so the
inter-node traffic is 1/S of DDP's. With context parallel (3d, cp > 1) the shard group is
dp_shard x cp (torchtitan's dp_shard_cp): cp ranks hold different tokens of the same sequences,
so their grads are summed like data parallel's.

Mixed precision: bf16-mixed / fp16-mixed use a MixedPrecisionPolicy (params all-gathered and computed
in bf16/fp16, half the all-gather bytes; grads reduce-scattered in fp32 into the fp32 sharded
params, or in bf16 with strategy.comm_hook=bf16, half the reduce-scatter bytes). Autocast is not used
on top: the policy already casts params and floating inputs.
"""
from __future__ import annotations

import contextlib

import torch

from harness.strategies.base import AUTOCAST_DTYPES, Strategy

# Imports inside functions: the parts of torch, DeepSpeed and brigade that only some strategies, devices or
# modes use.


def mixed_precision_policy(precision: str, comm_hook: str = "none"):
    """Params gathered and computed in the precision's dtype; gradients reduce-scattered in fp32, or in
    bf16 with strategy.comm_hook=bf16 (what Composer's FSDP mixed_precision PURE does: half the bytes)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = AUTOCAST_DTYPES.get(precision)
    if comm_hook == "bf16":  # as DDP's bf16 compress hook, whatever the training precision
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.bfloat16)
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)


def fsdp_mesh(mesh, dims):
    """What FSDP shards over: the 1-D data axis (times cp), or (replicate, shard) for HSDP."""
    if dims.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard_cp"]
    return mesh["dp_cp"] if dims.cp > 1 else mesh["dp"]


def apply_fsdp(model: torch.nn.Module, dp_mesh, run) -> torch.nn.Module:
    """Shard `model` over `dp_mesh` (fsdp_mesh: 1-D, or 2-D for HSDP) with FSDP2: each block (of those this module holds, e.g.
    a pipeline stage's) is one unit, then the root. Parameters may already be tp DTensors (3D: apply
    after tensor parallel and activation checkpointing). Returns the same module, now an FSDPModule."""
    from torch.distributed.fsdp import fully_shard

    mp = mixed_precision_policy(run.workload.precision, run.strategy.comm_hook)
    for block in model.blocks.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=run.strategy.reshard_after_forward, mp_policy=mp)
    # reshard_after_forward=None: the root keeps its params gathered from forward to backward
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=None, mp_policy=mp)
    return model


def accumulation_context(model, last: bool, mode: str = "unsharded"):
    """For one micro-batch's forward+backward. unsharded: sync grads and reshard only on the last
    one; sharded: on every one."""
    every = mode == "sharded"
    model.set_requires_gradient_sync(last or every)
    model.set_reshard_after_backward(last or every)
    return contextlib.nullcontext()


class FSDP(Strategy):
    def setup(self, model):
        self.model = self.materialize(apply_fsdp(model, fsdp_mesh(self.mesh, self.dims), self.run))  # shard on meta, then allocate
        self.optimizer = self.make_optimizer(self.model.parameters())  # every param is a DTensor: foreach works

    def autocast(self):
        return contextlib.nullcontext()  # the MixedPrecisionPolicy does the casting

    def accumulating(self, last: bool):
        return accumulation_context(self.model, last, self.run.strategy.fsdp_accumulate)


STRATEGY = FSDP
