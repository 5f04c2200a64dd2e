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

from harness.strategies.base import Strategy, over_fake_group


class DDPStrategy(Strategy):
    def setup(self, model):
        s = self.run.strategy
        self.model = wrap_ddp(self, self.materialize(model), self.mesh["dp"].get_group(), s.bucket_cap_mb, s.comm_hook)
        self.optimizer = self.make_optimizer(self.model.parameters())

    def accumulating(self, last: bool):
        return contextlib.nullcontext() if last else self.model.no_sync()


def wrap_ddp(strategy, module, group, bucket_cap_mb: float, comm_hook: str = "none") -> DDP:
    """`module` (materialised) in DDP on `group`, with `comm_hook`. Over the fake group (a dry run) the
    reducer's buckets are fake and its all-reduce and bucket rebuild run as harness/strategies/ddp_fake.py
    says."""
    device_ids = [strategy.device.index] if strategy.device.type == "cuda" else None
    dry = over_fake_group(group)
    with strategy.allocation():
        ddp = DDP(module, device_ids=device_ids, process_group=group, bucket_cap_mb=bucket_cap_mb, init_sync=not dry)
    if dry:
        from harness.strategies import ddp_fake  # a dry run's only: a real run does not read it

        ddp.register_comm_hook(group, ddp_fake.allreduce_hook(comm_hook))
        ddp_fake.rebuild_buckets_before_forward(ddp)
    elif comm_hook == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif comm_hook == "bf16":
        ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
    elif comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=strategy.run.strategy.powersgd_rank,
                                            start_powerSGD_iter=2, random_seed=strategy.run.workload.seed)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp


STRATEGY = DDPStrategy
