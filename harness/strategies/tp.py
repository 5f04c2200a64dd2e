"""tp: Megatron-style tensor parallel with DTensor `parallelize_module` on the mesh's "tp" axis.

The plan (which module is split how, and the math of the split) is data beside the model in
models/tp_plan.py; this module only applies it. Every rank of a tp group sees the same micro-batch.
Communication per block and micro-batch, activations A = B*T*h elements:
    without SP: 2 all-reduces of A forward (after Wo, after W2), 2 backward (before Wq/k/v, W1)
    with SP   : each all-reduce becomes a reduce-scatter + an all-gather of A (same bytes), and the
                norms and residual stream hold T/t tokens.
Loss parallel (`strategy.loss_parallel`): the head's logits stay sharded on the vocabulary and the
cross-entropy is reduced across ranks (a max and a sum-exp all-reduce of (B, T) scalars), instead
of all-gathering (B, T, V) logits; its loss is a replicated DTensor, turned into a plain tensor here.

Optimizer: AdamW with foreach=False, because replicated parameters that the plan leaves plain
(pos_emb, LayerNorms without SP) and DTensor shards cannot be mixed in one foreach kernel (docs/notes.md#dtensor-foreach).
"""
from __future__ import annotations

import contextlib

import torch

from harness.strategies.base import Strategy
from models.tp_plan import parallel_styles

# Imports inside functions: the parts of torch, DeepSpeed and brigade that only some strategies, devices or
# modes use.


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh, run) -> torch.nn.Module:
    """Shard `model` (on meta, or on its device) over the 1-D `tp_mesh` following models/tp_plan.py.
    A no-op at tp=1, so 3D compositions call it unconditionally. Apply before activation
    checkpointing wrappers and before FSDP/DDP on the dp axis; then call `register_grad_hooks`."""
    if tp_mesh.size() == 1:
        return model
    from torch.distributed.tensor.parallel import parallelize_module

    from models.gpt import retie, tied_names

    ties = tied_names(model)  # tie_embeddings: tok_emb and head are both Shard(0) on the vocabulary
    names = [name for name, _ in model.named_modules() if name]
    plan = parallel_styles(names, run.strategy.sequence_parallel, run.strategy.loss_parallel)
    model = parallelize_module(model, tp_mesh, plan)
    retie(model, ties)
    return model


def register_grad_hooks(model: torch.nn.Module) -> None:
    """Give every TP parameter's gradient its parameter's placements as backward produces it
    (_grad_like_param). The hook goes on the parameter a module's forward actually uses, at that
    forward: under FSDP that is FSDP's unsharded parameter, not the sharded one `model.parameters()`
    lists (which autograd never reaches), so a hook registered on the latter would never run."""
    for module in model.modules():
        if any(hasattr(p, "placements") for p in module.parameters(recurse=False)):
            module.register_forward_pre_hook(_hook_used_params)


def _hook_used_params(module, _inputs):
    for name, _ in module.named_parameters(recurse=False):
        p = getattr(module, name)
        if hasattr(p, "placements") and p.requires_grad and not getattr(p, "_grad_like_param", False):
            p.register_hook(_grad_like_param(p))
            p._grad_like_param = True  # once per parameter object (FSDP keeps its unsharded one across steps)


def _grad_like_param(param):
    """DTensor has no vocab-sharded rule for the embedding's backward: the vocab-parallel embedding's
    grad comes out Replicate, the full (V, h) on every rank, and would be kept so: redistributed at
    every optimizer step, or under FSDP cast to fp32 and accumulated across micro-batches whole.
    Give every grad its parameter's placements as it is produced: for Replicate -> Shard(0) a local
    slice, no communication; only the transient grad is full-size."""
    def hook(grad):
        if grad.placements != param.placements:
            return grad.redistribute(param.device_mesh, param.placements)
        return grad
    return hook


def loss_parallel_context(run, tp_mesh):
    """The context in which the forward's cross-entropy and the backward must run when the logits
    are vocabulary-sharded DTensors (loss parallel); a null context otherwise."""
    if tp_mesh.size() > 1 and run.strategy.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def plain_loss(loss: torch.Tensor) -> torch.Tensor:
    """Loss parallel returns a replicated DTensor; the loop and the accumulation want a plain tensor
    (differentiable: backward flows back into the DTensor graph)."""
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


class TensorParallel(Strategy):
    def setup(self, model):
        self.tp_mesh = self.mesh["tp"]
        self.model = self.materialize(apply_tensor_parallel(model, self.tp_mesh, self.run))
        register_grad_hooks(self.model)
        self.optimizer = self.make_optimizer(self.model.parameters(), foreach=False)

    def forward_loss(self, inputs, targets):
        with loss_parallel_context(self.run, self.tp_mesh):
            return plain_loss(super().forward_loss(inputs, targets))

    def backward(self, loss):
        with loss_parallel_context(self.run, self.tp_mesh):  # the vocab-parallel cross-entropy's backward
            super().backward(loss)


STRATEGY = TensorParallel
