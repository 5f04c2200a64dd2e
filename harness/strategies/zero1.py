"""zero1 (engine torch): ZeRO stage 1, in one of two implementations (`strategy.zero1_impl`).

torch_zero (default): DDP plus torch's ZeroRedundancyOptimizer. Params and grads are replicated as
in DDP (bucketed gradient all-reduce during backward, 2(N-1)/N x grad bytes per rank; comm hooks
and no_sync accumulation as in ddp). The AdamW state is sharded over the dp ranks: each parameter
tensor is owned by one rank, which alone keeps its moments and updates it; after the local step
every owner broadcasts its updated params ((N-1)/N x param bytes received per rank in all), so
every replica is identical again. The partition is by whole parameter tensors, sorted-greedy
(largest first, each to the rank with the fewest elements so far), so the optimizer state per rank
is close to, not exactly, 1/N: the measured bytes per rank show the imbalance.

distributed: Megatron's distributed optimizer (harness/strategies/distributed_optimizer.py): no
DDP; grads accumulate locally and are reduce-scattered once per step on a flat buffer, each rank
steps an even 1/N slice, the slices are all-gathered back into the params.

DeepSpeed's stage 1 (`strategy.engine=deepspeed`) slices one flat buffer evenly, like `distributed`.
"""
from __future__ import annotations

import contextlib

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from harness.strategies.base import Strategy
from harness.strategies.ddp import DDPStrategy
from harness.strategies.distributed_optimizer import DistributedOptimizer


class Zero1(DDPStrategy):
    def setup(self, model):
        if self.run.strategy.zero1_impl != "distributed":
            return super().setup(model)
        self.model = self.materialize(model)  # built on meta: allocate and initialise as single does
        with self.allocation():  # its flat fp32 master and grad buffers are local shards too (fake in a dry run)
            self.optimizer = DistributedOptimizer(self.model.parameters(), self.mesh["dp"].get_group(),
                                                  lambda ps: Strategy.make_optimizer(self, ps), self.param_dtype())

    def autocast(self):
        if self.param_dtype() is not None:  # the params are bf16 themselves (strategy.low_precision_params)
            return contextlib.nullcontext()
        return super().autocast()

    def accumulating(self, last: bool):
        if self.run.strategy.zero1_impl == "distributed":
            return Strategy.accumulating(self, last)  # nothing to sync until the step
        return super().accumulating(last)

    def make_optimizer(self, params, foreach: bool | None = None) -> torch.optim.Optimizer:
        w = self.run.workload
        return ZeroRedundancyOptimizer(list(params), optimizer_class=torch.optim.AdamW,
                                       process_group=self.mesh["dp"].get_group(), lr=w.lr,
                                       weight_decay=w.weight_decay, betas=(0.9, 0.95), foreach=foreach)

    def state_tensors(self):
        out = Strategy.state_tensors(self) if isinstance(self.optimizer, DistributedOptimizer) else super().state_tensors()
        if isinstance(self.optimizer, DistributedOptimizer):
            out.update(self.optimizer.state_tensors())
        else:
            # the wrapper's own .state is empty: the rank's shard lives in the local optimizer it wraps
            out["optimizer"] = [v for st in self.optimizer.optim.state.values() for v in st.values()
                                if torch.is_tensor(v)]
        return out


STRATEGY = Zero1
