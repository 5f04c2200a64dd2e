"""3d: data x tensor x pipeline parallel on one DeviceMesh with named axes ("pp", "dp", "tp").

Rank placement is ParallelDims': tp innermost, then dp, then pp,

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

so a tp group is adjacent ranks (inside a node, where its per-layer all-reduces are cheapest) and the
pipeline's point-to-point sends cross the widest stride. Every rank builds the stages its pp
coordinate owns (harness/strategies/pp.py: split points, schedule, gradient scaling, timeline), and
each stage's module is parallelised in this fixed order before it becomes a PipelineStage:

    1. tensor parallel on mesh["tp"]   (apply_tensor_parallel, models/tp_plan.py): shards the linear
       layers first, because FSDP/DDP must see the final (DTensor) parameters they manage;
    2. activation checkpointing        (the model's own per-block / attention-core checkpoint(), set
       again here so it wraps the TP-sharded blocks);
    3. data parallel on mesh["dp"]     strategy.dp_shard=fsdp: FSDP2 per block then the stage root
       (apply_fsdp; over TP DTensors this gives 2-D (dp, tp) shards); =ddp: DDP on the dp group;
    4. pipeline stage on mesh["pp"]    (PipelineStage(group=mesh["pp"].get_group())).

Communication per step, for each axis: tp: 2 all-reduces of (B, T, h) per block forward and 2
backward per micro-batch; dp: one gradient reduction per step (the pipeline schedule keeps DDP in
no_sync / FSDP from syncing until each stage's last backward; FSDP also all-gathers params per
micro-batch forward); pp: one activation and one gradient per stage boundary per micro-batch.

Any degree may be 1: tp=1 skips TP (apply_tensor_parallel is a no-op), dp=1 skips the dp wrapper,
pp=1 is a one-stage "pipeline"; so every 2D combination (dp x pp, tp x pp, dp x tp) is this code.
"""
from __future__ import annotations

import contextlib

from torch.nn.parallel import DistributedDataParallel as DDP

from harness.strategies.fsdp import apply_fsdp
from harness.strategies.pp import PipelineStrategy
from harness.strategies.tp import apply_tensor_parallel, loss_parallel_context


class Mesh3D(PipelineStrategy):
    def parallelize_stage(self, module):
        run, mesh = self.run, self.mesh
        module = module.to(self.device)
        module = apply_tensor_parallel(module, mesh["tp"], run)  # 1. TP
        module.set_activation_checkpointing(run.workload.activation_checkpointing)  # 2. AC
        if self.dims.dp > 1:  # 3. data parallel
            if run.strategy.dp_shard == "fsdp":
                module = apply_fsdp(module, mesh["dp"], run)
            else:
                device_ids = [self.device.index] if self.device.type == "cuda" else None
                module = DDP(module, device_ids=device_ids, process_group=mesh["dp"].get_group(),
                             bucket_cap_mb=run.strategy.bucket_cap_mb)
                # The pipeline stage decides when DDP syncs: it runs every forward in no_sync and arms
                # the reducer itself before each stage's last backward. Left on, DDP's own forward
                # would arm it during the stage's shape-inference forward, whose input-only backward
                # never completes the buckets: the first step's hooks then count twice (torch 2.13:
                # "rebuilt parameter indices size is not same as original model parameters size").
                module.require_backward_grad_sync = False
        return module  # 4. the caller (PipelineStrategy.setup) makes it a PipelineStage on mesh["pp"]

    def autocast(self):
        # FSDP's MixedPrecisionPolicy casts params and inputs itself (harness/strategies/fsdp.py)
        if self.dims.dp > 1 and self.run.strategy.dp_shard == "fsdp":
            return contextlib.nullcontext()
        return super().autocast()

    def step_context(self):
        # loss parallel: the last stage's logits are vocab-sharded DTensors; its cross-entropy and the
        # backward through it must run inside torch's loss_parallel context
        return loss_parallel_context(self.run, self.mesh["tp"])

    def foreach(self):
        # TP leaves some parameters plain (LayerNorms, pos_emb) beside DTensor shards: one foreach
        # kernel cannot mix them (docs/notes.md#dtensor-foreach)
        return False if self.dims.tp > 1 else None


STRATEGY = Mesh3D
