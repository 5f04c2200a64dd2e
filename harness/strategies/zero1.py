"""zero1 (engine torch): DDP plus torch's ZeroRedundancyOptimizer (ZeRO stage 1).

Params and grads are replicated as in DDP (bucketed gradient all-reduce during backward, 2(N-1)/N x
grad bytes per rank; comm hooks and no_sync accumulation as in ddp). The AdamW state is sharded over
the dp ranks: each parameter tensor is owned by one rank, which alone keeps its moments and updates
it; after the local step every owner broadcasts its updated params ((N-1)/N x param bytes received
per rank in all), so every replica is identical again.

The partition is by whole parameter tensors, sorted-greedy (largest first, each to the rank with
the fewest elements so far), so the optimizer state per rank is close to, not exactly, 1/N: the
measured bytes per rank show the imbalance. DeepSpeed's stage 1 (`strategy.engine=deepspeed`) instead
slices one flat buffer evenly and keeps an fp32 master partition.
"""
from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from harness.strategies.ddp import DDPStrategy


class Zero1(DDPStrategy):
    def make_optimizer(self, params, foreach: bool | None = None) -> torch.optim.Optimizer:
        w = self.run.workload
        return ZeroRedundancyOptimizer(list(params), optimizer_class=torch.optim.AdamW,
                                       process_group=self.mesh["dp"].get_group(), lr=w.lr,
                                       weight_decay=w.weight_decay, betas=(0.9, 0.95), foreach=foreach)

    def state_tensors(self):
        out = super().state_tensors()
        # the wrapper's own .state is empty: the rank's shard lives in the local optimizer it wraps
        out["optimizer"] = [v for st in self.optimizer.optim.state.values() for v in st.values() if torch.is_tensor(v)]
        return out


STRATEGY = Zero1
