"""ddp: data parallel with torch DistributedDataParallel.

Every rank holds the whole model and optimizer and runs its slice of the global batch. During
backward, gradients are grouped into buckets of `bucket_cap_mb` and each bucket is all-reduced
(averaged) as soon as it is ready, overlapping communication with the rest of backward. A ring
all-reduce sends 2(N-1)/N x the gradient bytes per rank (reduce-scatter, then all-gather).
With gradient accumulation only the last micro-batch syncs (`no_sync` on the others).

Optional communication hooks compress what is all-reduced: fp16 (halves the bytes), bf16 (NCCL
only), PowerSGD (low-rank approximation, lossy by design).
"""
from __future__ import annotations

import contextlib

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.strategies.base import Strategy


class DDPStrategy(Strategy):
    def setup(self, model):
        s = self.run.strategy
        model = self.materialize(model)
        dp_group = self.mesh["dp"].get_group()
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        self.model = DDP(model, device_ids=device_ids, process_group=dp_group, bucket_cap_mb=s.bucket_cap_mb)
        if s.comm_hook == "fp16":
            self.model.register_comm_hook(dp_group, default_hooks.fp16_compress_hook)
        elif s.comm_hook == "bf16":
            self.model.register_comm_hook(dp_group, default_hooks.bf16_compress_hook)
        elif s.comm_hook == "powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=dp_group, matrix_approximation_rank=s.powersgd_rank,
                                                start_powerSGD_iter=2, random_seed=self.run.workload.seed)
            self.model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        self.optimizer = self.make_optimizer(self.model.parameters())

    def accumulating(self, last: bool):
        return contextlib.nullcontext() if last else self.model.no_sync()


STRATEGY = DDPStrategy
