"""3d: data x context x tensor x pipeline parallel on one DeviceMesh (axes "pp", "dp", "cp", "tp").

Rank placement is ParallelDims': tp innermost, then dp, then pp,

    rank = pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank

so a tp group is adjacent ranks (inside a node, where its per-layer all-reduces are cheapest) and the
pipeline's point-to-point sends cross the widest stride. Every rank builds the stages its pp
coordinate owns (harness/strategies/pp.py: split points, schedule, gradient scaling, timeline), and
each stage's module is parallelised in this fixed order before it becomes a PipelineStage:

    1. tensor parallel on mesh["tp"]   (apply_tensor_parallel, models/tp_plan.py): shards the linear
       layers first, because FSDP/DDP must see the final (DTensor) parameters they manage;
    1b. context parallel over cp       (apply_context_parallel, harness/strategies/cp.py): attention
       gathers K/V over cp; each rank keeps its 2 of the 2*cp sequence chunks (train_step cuts them);
    2. activation checkpointing        (the model's own per-block / attention-core checkpoint(), set
       again here so it wraps the TP-sharded blocks);
    3. data parallel on mesh["dp"]     strategy.data_parallel=fsdp: FSDP2 per block then the stage root
       (apply_fsdp; over TP DTensors this gives 2-D (dp, tp) shards; HSDP with dp_replicate > 1);
       =ddp: DDP on the dp group; =zero1: no wrapper, the distributed optimizer reduce-scatters
       at the step (harness/strategies/distributed_optimizer.py). With cp > 1 the group is dp x cp;
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

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage

from harness.strategies.cp import apply_context_parallel, cp_group, local_positions, shard_sequence
from harness.strategies.ddp import wrap_ddp
from harness.strategies.distributed_optimizer import DistributedOptimizer
from harness.strategies.fsdp import apply_fsdp, fsdp_mesh
from harness.strategies.moe_stages import MoEStages
from harness.strategies.pp import PipelineStrategy
from harness.strategies.tp import apply_tensor_parallel, loss_parallel_context, register_grad_hooks
from harness.validate import num_microbatches


class ShardedAccumulationStage(PipelineStage):
    """A stage whose FSDP reduce-scatters and reshards after every micro-batch's backward
    (strategy.fsdp_accumulate=sharded); torch's stage defers both to the step's last backward."""

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        out = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if isinstance(self.submod, FSDPModule) and backward_type in ("full", "weight"):
            self.submod.set_requires_gradient_sync(True)  # the grads of this micro-batch are complete now
            self.submod.set_reshard_after_backward(True)
            state = self.submod._get_fsdp_state()
            for st in state._state_ctx.all_states:
                for group in st._fsdp_param_groups:
                    group.post_backward()  # reduce-scatter into the sharded grads, then reshard
        return out


class Mesh3D(PipelineStrategy):
    @property
    def data_parallel(self) -> int:
        return self.dims.dp * self.dims.cp  # cp ranks hold other tokens of the same sequences

    def data_group(self):
        return (self.mesh["dp_cp"] if self.dims.cp > 1 else self.mesh["dp"]).get_group()

    @property
    def stage_class(self):
        s = self.run.strategy
        sharded = s.data_parallel == "fsdp" and s.fsdp_accumulate == "sharded" and self.data_parallel > 1
        return ShardedAccumulationStage if sharded else PipelineStage

    def setup(self, model):
        # MoE blocks (4D): ep dispatch, the aux loss across stages, brigade's own grad reduction
        self.moe = MoEStages(self.run, self.dims, self.mesh, self._microbatches()) if self.run.model.n_experts else None
        self.cp_rank = self.dims.coords(torch.distributed.get_rank())["cp"]
        self.cp_group = cp_group(self.dims) if self.dims.cp > 1 else None
        super().setup(model)

    def _microbatches(self) -> int:
        return num_microbatches(self.run, self.dims)

    def parallelize_stage(self, module):
        run, mesh = self.run, self.mesh
        if self.moe is not None:
            self.moe.prepare(module)  # 0. experts over ep (before TP: the plan leaves MoE MLPs replicated)
        module = apply_tensor_parallel(module, mesh["tp"], run)  # 1. TP (on meta)
        if self.dims.cp > 1:  # 1b. CP
            module = apply_context_parallel(module, self.cp_group, run, self.dims, self.cp_rank, self.device)
        module.set_activation_checkpointing(run.workload.activation_checkpointing)  # 2. AC
        wrap = self.data_parallel > 1 and run.strategy.data_parallel != "zero1" and self.moe is None
        fsdp = wrap and run.strategy.data_parallel == "fsdp"
        if fsdp:  # 3. data parallel, sharded (on meta)
            module = apply_fsdp(module, fsdp_mesh(mesh, self.dims), run)
        module = self.materialize(module)  # this rank's shards only
        register_grad_hooks(module)
        if wrap:  # 3. data parallel, replicated: DDP needs the real tensors
            if not fsdp:
                module = wrap_ddp(self, module, self.data_group(), run.strategy.bucket_cap_mb)
                # The pipeline stage decides when DDP syncs: it runs every forward in no_sync and arms
                # the reducer itself before each stage's last backward. Left on, DDP's own forward
                # would arm it during the stage's shape-inference forward, whose input-only backward
                # never completes the buckets: the first step's hooks then count twice (torch 2.13:
                # "rebuilt parameter indices size is not same as original model parameters size").
                module.require_backward_grad_sync = False
        return module  # 4. the caller (PipelineStrategy.setup) makes it a PipelineStage on mesh["pp"]

    def make_optimizer(self, params, foreach=None):
        if self.run.strategy.data_parallel == "zero1" and (self.data_parallel > 1 or self.param_dtype() is not None):
            with self.allocation():  # its flat fp32 master and grad buffers are local shards too (fake in a dry run)
                return DistributedOptimizer(params, self.data_group(),
                                            lambda ps: super(Mesh3D, self).make_optimizer(ps, foreach), self.param_dtype())
        return super().make_optimizer(params, foreach)

    def train_step(self, microbatches):
        if self.dims.cp > 1:  # this rank's 2 of the 2*cp sequence chunks (harness/strategies/cp.py)
            microbatches = shard_sequence(microbatches, local_positions(self.run.model.seq_len, self.dims.cp, self.cp_rank))
        total = super().train_step(microbatches)
        if self.moe is not None:
            aux = self.moe.step_aux(self.device)  # every stage's load-balancing loss, as single reports it
            total = None if total is None else total + aux
        return total

    def optimizer_step(self) -> None:
        if self.moe is not None:
            self.moe.reduce_grads(self.model.named_parameters())
        super().optimizer_step()

    def state_tensors(self):
        out = super().state_tensors()
        if isinstance(self.optimizer, DistributedOptimizer):
            out.update(self.optimizer.state_tensors())
        return out

    def autocast(self):
        # FSDP's MixedPrecisionPolicy casts params and inputs itself (harness/strategies/fsdp.py)
        # and the distributed optimizer's bf16 params are low-precision themselves (strategy.low_precision_params)
        if (self.data_parallel > 1 and self.run.strategy.data_parallel == "fsdp") or self.param_dtype() is not None:
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
