"""MoE blocks inside 3d (4D: dp x tp x pp with ep sharing the dp ranks), e.g.
    brigade model=moe_tiny strategy=3d parallel.dp=2 parallel.ep=2 parallel.tp=2 parallel.pp=2

Placement: attention, norms and embeddings are TP-sharded as in dense 3d (models/tp_plan.py); a
MoE MLP is replicated over tp (its input is the all-reduced, replicated residual stream, so every
tp rank routes the same tokens and computes the same experts: no tp communication inside it);
its experts are split over ep exactly as strategy=ep does (harness/strategies/ep.py: ep shares the
dp ranks, the all-to-all runs among the ranks of one (pp, tp) coordinate). Pipeline stages hold
MoE blocks like dense ones.

Load-balancing loss across stages (Megatron's MoEAuxLossAutoScaler): a stage that is not the last
has no loss to add its MoE layers' aux loss to, so each MoE layer's output passes through an
identity whose backward also sends d(total)/d(aux) = aux_loss_coef / m into the router, m the
micro-batches of the step: the gradient `single` gets from (CE + coef * aux) / m. The reported loss
adds coef * the stages' aux (summed over the pp group once per step, after the schedule).

Gradients (no DDP / FSDP wrapper: expert and dense params reduce over different groups), once per
step after the schedule, as strategy=ep: dense grads all-reduced (sum) over dp, expert grads over
the dp / ep replicas of the expert (the all-to-all's backward already summed its ep peers), each / dp.

A dry run routes at the balanced load, as strategy=ep's does (harness/strategies/ep_fake.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from harness.strategies import ep_fake
from harness.strategies.base import over_fake_group
from harness.strategies.ep import AllToAllDispatch
from models.moe import moe_layers


class AuxLossScaler(torch.autograd.Function):
    """Identity on x; its backward gives `aux` the gradient `scale` and logs aux's value in `sink`
    (once per real backward: a recomputed forward under checkpointing does not log twice)."""

    @staticmethod
    def forward(ctx, x, aux, scale: float, sink: list):
        ctx.scale, ctx.sink = scale, sink
        ctx.save_for_backward(aux.detach())
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        ctx.sink.append(aux)
        return grad, torch.full_like(aux, ctx.scale), None, None


def _local(t):
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class MoEStages:
    """What a 3d rank does for its stages' MoE layers: dispatch over ep, aux loss, gradient reduction."""

    def __init__(self, run, dims, mesh, num_microbatches: int):
        self.run, self.dims, self.mesh, self.m = run, dims, mesh, num_microbatches
        self.sink: list[torch.Tensor] = []  # aux values of this rank's MoE layers, one per layer and micro-batch
        self.layers = 0
        self.dispatch = None
        self.dry = over_fake_group(dist.group.WORLD)  # a dry run routes at the balanced load (ep_fake.py)
        if dims.ep > 1:
            ep_rank = mesh["ep"].get_local_rank()
            dispatch_class = ep_fake.balanced_dispatch(AllToAllDispatch) if self.dry else AllToAllDispatch
            self.dispatch = dispatch_class(mesh["ep"].get_group(), dims.ep, ep_rank, run.model.n_experts)

    def prepare(self, module) -> None:
        """Give a stage module's MoE layers the ep dispatch and the aux-loss identity."""
        coef = self.run.model.aux_loss_coef / self.m
        if self.dry:
            ep_fake.route_at_balanced_load(moe_layers(module))
        for layer in moe_layers(module):
            self.layers += 1
            if self.dispatch is not None:
                layer.keep_experts(self.dispatch.ids)
                layer.dispatch = self.dispatch
            layer.register_forward_hook(lambda mod, args, out: AuxLossScaler.apply(out, mod.aux_loss, coef, self.sink))

    def step_aux(self, device) -> torch.Tensor:
        """coef * (the step's aux losses of every stage, / m), the same on every rank of the pp group.
        The sink's last layers * m values are this step's (the first step also logs the pipeline's
        shape-inference backward before them)."""
        n = self.layers * self.m
        mine = torch.stack(self.sink[-n:]).sum() if n else torch.zeros((), device=device)
        self.sink.clear()
        total = mine.detach().float().reshape(1).clone()
        if self.dims.pp > 1:
            dist.all_reduce(total, group=self.mesh["pp"].get_group())
        return self.run.model.aux_loss_coef * total[0] / self.m

    def reduce_grads(self, params) -> None:
        dims = self.dims
        if dims.dp == 1:
            return
        named = list(params)
        dense = [p for n, p in named if ".experts." not in n]
        expert = [p for n, p in named if ".experts." in n]
        expert_group = (self.mesh["dp_rep"].get_group() if dims.dp // dims.ep > 1 else None) if dims.ep > 1 \
            else self.mesh["dp"].get_group()
        for group_params, group in ((dense, self.mesh["dp"].get_group()), (expert, expert_group)):
            for p in group_params:
                if p.grad is None:  # an expert no token reached on this rank: its replicas may have grads
                    p.grad = torch.zeros_like(p)
            grads = [_local(p.grad) for p in group_params]
            if not grads:
                continue
            flat = _flatten_dense_tensors(grads)  # one collective per group
            if group is not None:
                dist.all_reduce(flat, group=group)
            flat /= dims.dp
            for g, new in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(new)
