"""DDP over torch's fake process group (launcher=dryrun): the reducer's all-reduce and its bucket
rebuild on fake tensors.

DDP's reducer (C++) allocates a flat bucket per group of gradients, copies each gradient into its
bucket as it is ready, all-reduces the bucket and copies it back. Three things in it need values a
dry run does not have:
- at construction it verifies parameter shapes across ranks and broadcasts the module's state,
  reading the parameters' data: skipped (`init_sync=False`; over the fake group both are no-ops);
- the fake group completes a collective at once but leaves its future empty, which the reducer
  rejects: a comm hook runs the same collective on the same bucket, with the same allocations (in
  place; a compressed copy under fp16/bf16), and returns a completed future holding the bucket;
- before the second forward the reducer rebuilds its buckets in the order the gradients became
  ready, and exchanges that order as an int32 tensor it writes and reads element by element: those
  integer tensors are made real (they are metadata, tens of bytes), the buckets stay fake.
A real run is untouched.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves


def allreduce_hook(comm_hook: str):
    """The comm hook that stands in for DDP's all-reduce (`strategy.comm_hook`) over the fake group.
    PowerSGD's low-rank factors are computed from values: refused."""
    if comm_hook == "powersgd":
        raise ValueError("strategy.comm_hook=powersgd has no dry run: its low-rank factors need real values")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(comm_hook)

    def hook(group, bucket):
        buffer = bucket.buffer()
        sent = buffer if dtype is None else buffer.to(dtype)
        sent.div_(group.size())
        dist.all_reduce(sent, group=group)
        if dtype is not None:
            buffer.copy_(sent)
        done = torch.futures.Future()
        done.set_result(buffer)
        return done

    return hook


class _IntegersReal(TorchDispatchMode):
    """Runs an operator whose tensors are all integer (and that makes none of floating dtype) on real
    tensors, below any fake mode; every other operator as usual."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtype = kwargs.get("dtype")
        if dtype is None or not dtype.is_floating_point:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if all(not t.is_floating_point() for t in tensors):
                with _disable_current_modes():
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


def rebuild_buckets_before_forward(ddp) -> None:
    """Rebuild the reducer's buckets (once, as DDP's own forward would) with the order exchange on real
    integers; DDP's forward then finds them rebuilt."""

    def pre_forward(module, args):
        if torch.is_grad_enabled():
            with _IntegersReal():
                ddp.reducer._rebuild_buckets()

    ddp.register_forward_pre_hook(pre_forward)
