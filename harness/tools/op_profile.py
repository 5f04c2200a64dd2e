"""What brigade's own aten operators do, op by op: a TorchDispatchMode that sorts every operator a
forward and backward dispatches into the cost model's kinds and adds up, per kind, the operators,
the bytes they move (tensor inputs read once, outputs written once) and, when timed, this thread's
CPU seconds inside them.

Kinds (harness/costmodel/compute.py charges each its own way):
    gemm         mm, addmm, bmm: the GEMM curve
    attention    the fused SDPA kernel and its backward: attention_efficiency
    view         views and aliases: no data moved, only their dispatch
    elementwise  everything else (norms, activations, adds, the loss, copies): traffic.py's bytes over
                 the element-wise bandwidth
Used by `harness.calibrate` (harness/tools/calibrate_elementwise.py: the element-wise bandwidth and
the attention efficiency of this core) and by tests/test_traffic.py (traffic.py's byte count
against the bytes the ops move).
"""
from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from harness.collect.compute_classes import (  # which aten operator is which kind (pure, shared with traces)
    KINDS,
    kind_of,
)


class OpProfile(TorchDispatchMode):
    """Per kind: ops, bytes (element-wise only: views move none, GEMMs and attention are timed by
    FLOPs) and seconds (timed=True: this thread's CPU time inside each operator, so the mode's own
    Python between operators is not counted). `by_op`: element-wise bytes per operator name;
    `seconds_by_op`: seconds per operator name (the fused attention's forward and backward apart)."""

    def __init__(self, timed: bool = False):
        super().__init__()
        self.timed = timed
        self.ops = dict.fromkeys(KINDS, 0)
        self.bytes = dict.fromkeys(KINDS, 0)
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.by_op: dict[str, int] = {}
        self.seconds_by_op: dict[str, float] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.thread_time() if self.timed else 0.0
        out = func(*args, **(kwargs or {}))
        dt = time.thread_time() - t0 if self.timed else 0.0
        name = func._schema.name.split("::")[-1]
        kind = kind_of(name)
        self.ops[kind] += 1
        self.seconds[kind] += dt
        self.seconds_by_op[name] = self.seconds_by_op.get(name, 0.0) + dt
        if kind == "elementwise":
            moved = sum(t.numel() * t.element_size() for t in tree_flatten((args, kwargs, out))[0]
                        if isinstance(t, torch.Tensor))
            self.bytes[kind] += moved
            self.by_op[name] = self.by_op.get(name, 0) + moved
        return out
