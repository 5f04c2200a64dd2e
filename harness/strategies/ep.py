"""ep: expert parallel. Each MoE layer's experts are split over the ep axis; tokens travel to them.

Placement. ep shares ranks with dp (harness/dims.py): the dp axis is (dp_rep, ep), ep innermost, and
"dp" is their flattening. The rank with ep index r holds experts [r*E/ep, (r+1)*E/ep) of every MoE
layer (global names kept: mlp.experts.<e>); everything else (embeddings, attention, norms, routers,
head) is replicated on every dp rank. Each dp rank trains on its own slice of the global batch.

One MoE layer, forward, on each rank of an ep group (S local tokens, k routes each):

    route locally (router + top-k, models/moe.py) -> the kept routes sorted by expert, so the rows
    for ep rank q are contiguous: send_splits[q] = rows for q's experts
    1. all-to-all of the per-expert counts (E ints)           -> recv_splits, rows per local expert
    2. dispatch all-to-all (uneven splits) of the rows (h)    -> rows for my experts, by source rank
       regroup by local expert, run each expert on its rows, restore the by-source order
    3. combine all-to-all: results go back (splits swapped)   -> weighted sum of the k routes
  Backward (autograd through all_to_all_single_autograd) runs the same two exchanges in reverse:
  the gradient of the combine all-to-all is a dispatch-shaped all-to-all of d(results), the
  gradient of the dispatch is a combine-shaped all-to-all of d(rows). Per layer and micro-batch a
  rank sends about (ep-1)/ep * S*k*h activations four times (2 forward, 2 backward).

Gradients, reduced once per step after the last micro-batch (no overlap with backward), so that
the update equals `single`'s on the global batch: the global loss is the mean of the dp ranks'
local losses, L = 1/dp * sum_r L_r.
  - dense parameter: every rank holds it and computes d L_r: all-reduce SUM over "dp", / dp.
  - expert parameter: the backward all-to-all already brings the gradient of every ep peer's
    tokens to the expert's owner (sum over the ep group of d L_r); the dp_rep replicas of the
    same expert hold the other ep groups' sums: all-reduce SUM over "dp_rep", / dp.
Expert load (routes per expert, dropped routes) is kept per step on device and summed over "dp"
once, after the timed steps, for `measured.expert_load`.

A dry run (launcher=dryrun) has no routing to read: it routes at the balanced load, and the received
counts are the ones that load gives (harness/strategies/ep_fake.py); model.routing=balanced makes a real
run route so too.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from harness.dims import ConfigError
from harness.strategies import ep_fake
from harness.strategies.base import Strategy, over_fake_group
from models.moe import last_load, moe_layers, run_experts, summarize_load


class AllToAllDispatch:
    """MoE.dispatch for expert parallelism: rows sorted by expert -> the experts' outputs, same order."""

    def __init__(self, group, ep: int, ep_rank: int, n_experts: int):
        self.group, self.ep, self.local = group, ep, n_experts // ep
        self.ids = list(range(ep_rank * self.local, (ep_rank + 1) * self.local))  # my experts

    def __call__(self, moe, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, local = self.ep, self.local
        # 1. counts: my routes to each expert -> for each source rank, its routes to my experts
        recv_counts = torch.empty_like(counts)  # [source rank * local + local expert]
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        sent = moe.sizes.to_host(counts)  # host syncs: split sizes are host ints
        received = self.received(recv_counts, sent)
        send_splits = [sum(sent[q * local:(q + 1) * local]) for q in range(ep)]
        recv_splits = [sum(received[q * local:(q + 1) * local]) for q in range(ep)]
        rows_per_expert = [sum(received[q * local + e] for q in range(ep)) for e in range(local)]
        # 2. dispatch: rows arrive grouped by source rank, then by local expert within a source
        got = wait_tensor(all_to_all_single_autograd(rows, recv_splits, send_splits, self.group))
        expert_of_row = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(
            recv_counts, output_size=sum(recv_splits))
        by_expert = expert_of_row.argsort(stable=True)  # regroup: expert-major, source order kept
        out = run_experts(moe.experts, got[by_expert], self.ids, rows_per_expert)
        out = out[by_expert.argsort()]  # back to by-source order
        # 3. combine: results return to the ranks the rows came from
        return wait_tensor(all_to_all_single_autograd(out, send_splits, recv_splits, self.group))

    def received(self, recv_counts: torch.Tensor, sent: list[int]) -> list[int]:
        """The exchanged counts on the host: routes to my experts, by source rank then local expert. (A dry
        run's all-to-all brings no values: harness/strategies/ep_fake.py.)"""
        return recv_counts.tolist()


class ExpertParallel(Strategy):
    def setup(self, model):
        dims, mesh = self.dims, self.mesh
        layers = moe_layers(model)
        if not layers:
            raise ConfigError(f"strategy ep needs a MoE model (model.n_experts > 0, e.g. model=moe_tiny); "
                              f"model {self.run.model.name} has n_experts={self.run.model.n_experts}")
        n_experts = self.run.model.n_experts
        dry = over_fake_group(dist.group.WORLD)  # a dry run routes at the balanced load (ep_fake.py)
        if dry:
            ep_fake.route_at_balanced_load(layers)
        if dims.ep > 1:
            ep_rank = mesh["ep"].get_local_rank()
            assert ep_rank == dims.coords(dist.get_rank())["ep"], (ep_rank, dims.coords(dist.get_rank()))
            dispatch_class = ep_fake.balanced_dispatch(AllToAllDispatch) if dry else AllToAllDispatch
            dispatch = dispatch_class(mesh["ep"].get_group(), dims.ep, ep_rank, n_experts)
            for layer in layers:
                layer.keep_experts(dispatch.ids)
                layer.dispatch = dispatch
            self.expert_group = mesh["dp_rep"].get_group() if dims.dp // dims.ep > 1 else None
        else:  # ep 1: every rank holds every expert, replicated over the whole dp axis
            self.expert_group = mesh["dp"].get_group() if dims.dp > 1 else None
        self.model = self.materialize(model)  # after keep_experts: only this rank's experts are allocated
        self.dp_group = mesh["dp"].get_group() if dims.dp > 1 else None
        named = list(self.model.named_parameters())
        self.expert_params = [p for n, p in named if ".experts." in n]
        self.dense_params = [p for n, p in named if ".experts." not in n]
        self.optimizer = self.make_optimizer(self.model.parameters())
        self._load_steps: list[torch.Tensor] = []  # (L, E + 1) per step, this rank's routes
        self._load_step: torch.Tensor | None = None
        self._sync = True  # gradient all-reduces on; off only for the profiled window's A/B steps

    # -- one step --------------------------------------------------------------------------
    def forward_loss(self, inputs, targets):
        loss = super().forward_loss(inputs, targets)
        load = last_load(self.model)  # read now: a checkpointed block re-runs its forward in backward
        self._load_step = load if self._load_step is None else self._load_step + load
        return loss

    def optimizer_step(self) -> None:
        if self._sync:
            self._reduce_grads(self.dense_params, self.dp_group)
            self._reduce_grads(self.expert_params, self.expert_group)
        self._load_steps.append(self._load_step)
        self._load_step = None
        super().optimizer_step()

    def _reduce_grads(self, params, group) -> None:
        """SUM over `group` (None: nothing to sum with), then / dp: the mean over every dp rank's
        loss (see the module docstring)."""
        if self.dims.dp == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = _flatten_dense_tensors(grads)  # one collective per group (a single bucket)
        if group is not None:
            dist.all_reduce(flat, group=group)
        flat /= self.dims.dp
        for p, g in zip(params, _unflatten_dense_tensors(flat, grads)):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)

    # -- measurement ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _no_grad_sync(self):
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def sync_disabled(self):
        """Skip the gradient all-reduces (the A/B measurement of exposed communication). The token
        all-to-alls stay: the forward cannot run without them."""
        return self._no_grad_sync()

    def extra_measurements(self) -> dict:
        w = self.run.workload
        # the loop's warm-up and timed steps; the profiled window's steps (run before this) are left out
        load = torch.stack(self._load_steps[:w.warmup_steps + w.steps])  # (steps, L, E + 1)
        if self.dp_group is not None:  # every dp rank routed its own tokens: sum = the global batch
            dist.all_reduce(load, group=self.dp_group)
        return {"expert_load": summarize_load(load.cpu(), w.warmup_steps, w.steps)}


STRATEGY = ExpertParallel
