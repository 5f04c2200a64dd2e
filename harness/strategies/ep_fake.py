"""MoE routing over torch's fake process group (launcher=dryrun): the balanced load, stated.

A MoE layer's shapes follow from its routing: how many of the S*k routes the capacity keeps, how many
reach each expert, and how many rows each ep rank sends to and receives from each other (the all-to-all
splits). Those are values of the router's output, which a fake tensor does not have (FakeTensorMode:
DynamicOutputShapeException on aten.nonzero, DataDependentOutputException on .tolist()), and over the
fake group the exchanged counts never arrive. So a dry run routes at one definite load, the balanced
one: every expert is given S*k/E routes of each rank's S tokens (models/moe.py `balanced_load`, within
k where E does not divide S), of which the capacity keeps min(routes, C).

Why that load: it is the one the cost model prices (each rank's experts run S*k rows), the one a
perfectly trained router reaches, and the only one a run can name without its data: any other load is a
property of the weights and tokens of one step. It is reproducible: a real run with
model.routing=balanced routes exactly so (models/moe.py `round_robin_`), so its peak can be compared
with the dry run's byte for byte (tests/test_dryrun_ep.py). A real run with the router's top-k
(model.routing=topk, the default) is imbalanced: an ep rank whose experts are given more than S*k rows
holds that many more rows of expert activations (the record's `measured.expert_load.max_mean_ratio`
says how many, per layer); its dry run is the balanced load whatever model.routing says.

Measured (moe_tiny ep dp2 ep2, 2 micro-batches of 2 x 64 tokens a rank, LiveTensors): the balanced real
run peaks at 51,858,216 B on both ranks, as the dry run, in the same step, phase and live bytes by kind.
The router's top-k after the same seed peaks at 51,405,064 and 52,311,368 B: -/+ 453,152 B = 98 rows
received at the peak fewer / more than balanced, 4,624 B a row (fc1's fp32 input, GELU's input and fc2's
input, 4 (h + 2 d_ff) B, and two int64 indices); the two ranks' mean is the balanced peak.

What stands in, and what does not: every operator of the real layer still runs on fake tensors, the
router, top-k, masks, sorting, the three all-to-alls, the experts, at the shapes the balanced load
gives. Only the three reads of values are answered from `balanced_load` instead (models/moe.py
`RouteSizes`): the kept routes (nonzero's (n, 1) long, as an empty tensor of that shape), the routes
per expert (bincount's (E,) long, empty) and those counts on the host; and the ep dispatch's received
counts (harness/strategies/ep.py `AllToAllDispatch.received`): every ep peer routes a micro-batch of
the same S tokens at the same load, so it sends this rank's experts what this rank sends them. A real
run is untouched.
"""
from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import _disable_current_modes

from models.moe import RouteSizes, balanced_load


@functools.cache
def _load(num_tokens: int, k: int, n_experts: int, capacity_factor: float) -> tuple[int, ...]:
    # on real tensors below every mode: the capacity's float32 product is arithmetic, not a step's tensor
    with _disable_current_modes():
        return tuple(balanced_load(num_tokens, k, n_experts, capacity_factor))


class BalancedSizes(RouteSizes):
    """One MoE layer's routing sizes at the balanced load (see the module docstring). kept_routes fixes
    the load of the forward under way (S from its shape), which per_expert and to_host then read."""

    def __init__(self, moe):
        self.top_k, self.n_experts, self.capacity_factor = moe.top_k, moe.n_experts, moe.capacity_factor
        self.load: tuple[int, ...] = ()

    def kept_routes(self, kept: torch.Tensor) -> torch.Tensor:
        self.load = _load(kept.numel() // self.top_k, self.top_k, self.n_experts, self.capacity_factor)
        # as the real nonzero: (n, 1) long, squeezed
        return torch.empty((sum(self.load), 1), dtype=torch.long, device=kept.device).squeeze(1)

    def per_expert(self, expert_of_route: torch.Tensor, n_experts: int) -> torch.Tensor:
        return expert_of_route.new_empty(n_experts)  # as bincount: (E,) long

    def to_host(self, counts: torch.Tensor) -> list[int]:
        return list(self.load)


def route_at_balanced_load(layers) -> None:
    """A dry run: these MoE layers read their routing sizes from the balanced load."""
    for layer in layers:
        layer.sizes = BalancedSizes(layer)


def balanced_dispatch(dispatch_class: type) -> type:
    """harness/strategies/ep.py's AllToAllDispatch whose received counts are the balanced load's."""

    class BalancedDispatch(dispatch_class):
        def received(self, recv_counts: torch.Tensor, sent: list[int]) -> list[int]:
            # every ep peer sends my experts what I send them (same S, same load)
            return [sent[e] for _ in range(self.ep) for e in self.ids]

    BalancedDispatch.__name__ = f"Balanced{dispatch_class.__name__}"
    return BalancedDispatch
