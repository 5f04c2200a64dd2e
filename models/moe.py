"""Mixture-of-Experts MLP: a top-k router over `n_experts` GELU MLPs, with DeepSpeed's gating math.

    x (B, T, h) -> tokens (S = B*T, h) -> router logits (S, E) -> route -> experts -> combine -> (B, T, h)

Parameters (names the cost model counts; all Linear, no bias by default):
    mlp.router.weight          (E, h)        router, dense: data-parallel like attention
    mlp.experts.<e>.fc1.weight (d_ff, h)     expert e, e = 0..E-1 (global index, kept when sharded)
    mlp.experts.<e>.fc2.weight (h, d_ff)     (model.mlp=swiglu: gate, up, down; model.bias: + biases)
so a MoE block has E*h + E*2*h*d_ff MLP parameters, of which each token uses k experts.

Gating mirrors DeepSpeed 0.19.8 `deepspeed.moe.sharded_moe.TopKGate` (top1gating / top2gating /
topkgating) with noisy_gate_policy=None, use_rts=False, top2_2nd_expert_sampling=False and
drop_tokens = (capacity_factor > 0), min_capacity = MIN_CAPACITY. Over the S tokens of one
micro-batch on one rank (the "group"), in fp32 whatever the autocast dtype:

    p = softmax(x W_r^T)                        (S, E) router probabilities
    experts of token s: k=1: argmax p_s;  k=2: argmax p_s, then argmax of the logits without it;
                        k>2: topk(p_s, k)
    me_e = mean_s p_se                          mean router probability of expert e
    ce_e = fraction of tokens routed to e       k=1, k=2: first choice only;  k>2: all k choices
    aux  = E * sum_e me_e ce_e                  k = 1, 2   (Switch / GShard)
         = E/k * sum_e me_e ce_e                k > 2      (DeepSpeed's topkgating)
    capacity C = max(ceil(S/E * capacity_factor * k'), MIN_CAPACITY),  k' = 1 for k=1, else k
        (capacity_factor 0: no limit, no route dropped). Routes beyond C are dropped:
        k=1: DeepSpeed's torch.topk over the 0/1 assignment column (use_rts=False);
        k=2: by position, first choices before second choices (GShard);
        k>2: the C routes with the highest router probability per expert ("probs" policy).
    combine weights: k=1: w = p_s,e (not renormalised);
                     k>=2: w_se = p_se / max(sum over kept routes of s of p_se, eps)
    y_s = sum over kept routes (s, e) of w_se * expert_e(x_s)   (a token with no kept route gets 0;
                                                                  the block's residual carries it)

Unlike DeepSpeed, tokens are not packed into an (E, C, h) capacity buffer: they are sorted by expert
and each expert runs on its own rows, so no FLOPs go to padding. Each row's result is the same.
`self.dispatch` runs the experts on the expert-sorted rows; the default runs them all here, and
expert parallelism (harness/strategies/ep.py) replaces it with an all-to-all exchange.

The same layer in DeepSpeed (tests/test_moe.py checks outputs, aux loss, drops and gradients):
    deepspeed.moe.layer.MoE(h, expert=models.layers.MLP(h, d_ff, dropout), num_experts=E, ep_size=ep, k=top_k,
        capacity_factor=cf or 1.0, eval_capacity_factor=cf or 1.0, min_capacity=MIN_CAPACITY,
        drop_tokens=cf > 0, use_rts=False, noisy_gate_policy=None, top2_2nd_expert_sampling=False)
    weights: mlp.router.weight -> deepspeed_moe.gate.wg.weight; mlp.experts.<e> ->
    deepspeed_moe.experts.deepspeed_experts[e - ep_rank * E/ep] (ep rank r holds experts r*E/ep .. (r+1)*E/ep - 1,
    in DeepSpeed as here). Its defaults differ: top2_2nd_expert_sampling=True adds Gumbel noise to the
    second choice, use_rts=True picks dropped tokens at random.

Routing (model.routing): `topk`, the router's choice above; `balanced`, the same operators with each
token's choices then overwritten in place by a fixed round robin, token s's j-th route to expert
(s + j) mod E (`round_robin_`). Every expert then gets S*k/E routes (within k where E does not divide
S): the load the cost model prices (harness/costmodel/activations.py: each rank's experts run S*k rows),
of which the capacity keeps min(routes, C) (`balanced_load`). The router still computes its logits,
weights the routes it is given by its probabilities, and gets their gradient; the aux loss is taken on
the given choices. Every tensor topk allocates, balanced allocates with the same shape (k > 2: the
weights of the given experts are gathered anew, an (S, k) fp32 tensor beside topk's values). A dry run
has no router values and routes at this load whatever model.routing says (harness/strategies/ep_fake.py):
balanced makes a real run route as its dry run does.

Sizes: which routes the capacity kept, how many reach each expert, and those counts on the host are read
from tensors' values (`RouteSizes`); every other shape in the layer follows from them.

Expert load of the last forward is kept in `self.last_load`: tokens_per_expert (E,) = routes
assigned to each expert before the capacity limit (sums to S*k), dropped (routes over capacity).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.layers import make_mlp

MIN_CAPACITY = 4  # DeepSpeed MoE layer's default min_capacity; pass the same to a DeepSpeed layer
ROUTINGS = ("topk", "balanced")  # model.routing (harness/validate.py MODEL_OPTIONS["routing"] lists the same)


def _capacity(num_tokens: int, num_experts: int, factor: float, min_capacity: int) -> int:
    # As DeepSpeed's _capacity: a float32 tensor product, so rounding matches theirs exactly.
    cap = torch.ceil((num_tokens / num_experts) * torch.tensor(factor)).to(torch.int64)
    return max(int(cap), min_capacity)


def round_robin_(experts: torch.Tensor, first: int, n_experts: int) -> torch.Tensor:
    """Balanced routing, in place (no allocation): experts (S,) or (S, c) long -> token s's choice j is
    expert (s + first + j) mod E, j = 0 .. c - 1 along the last dim."""
    columns = experts.view(experts.size(0), -1)
    for j in range(columns.size(1)):
        torch.arange(first + j, first + j + columns.size(0), out=columns[:, j])
    return experts.remainder_(n_experts)


def balanced_load(num_tokens: int, k: int, n_experts: int, capacity_factor: float,
                  min_capacity: int = MIN_CAPACITY) -> list[int]:
    """Routes each expert keeps under balanced routing (`round_robin_`) of one group of S = num_tokens
    tokens, on the host: expert e is given #{(s, j): (s + j) mod E = e} routes, and the capacity C keeps
    min(routes, C) of them (k = 1: the top C of its column; k = 2: first choices queue before second
    choices, so together min(first + second, C); k > 2: its C most probable routes), C as `route` takes it."""
    whole, rest = divmod(num_tokens, n_experts)
    routes = [k * whole + sum((e - j) % n_experts < rest for j in range(k)) for e in range(n_experts)]
    if capacity_factor > 0:
        cap = _capacity(num_tokens, n_experts, capacity_factor * k, min_capacity)
        routes = [min(r, cap) for r in routes]
    return routes


def route(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int = MIN_CAPACITY,
          balanced: bool = False):
    """DeepSpeed's TopKGate decisions for one group of S tokens. logits: (S, E) fp32. balanced: the
    choices overwritten by `round_robin_` (model.routing=balanced), the rest as DeepSpeed's.

    Returns (experts (S, k) long, weights (S, k) fp32, kept (S, k) bool, aux_loss (), tokens_per_expert (E,)).
    A dropped route has kept False and weight 0."""
    S, E = logits.shape
    gates = F.softmax(logits, dim=1)
    me = gates.mean(dim=0)
    drop = capacity_factor > 0
    if k <= 2:
        idx1 = gates.argmax(dim=1)
        if balanced:
            round_robin_(idx1, 0, E)
        mask1 = F.one_hot(idx1, E)
        masks, idx = [mask1], [idx1]
        if k == 2:
            idx2 = logits.masked_fill(mask1.bool(), float("-inf")).argmax(dim=1)
            if balanced:
                round_robin_(idx2, 1, E)
            masks.append(F.one_hot(idx2, E))
            idx.append(idx2)
        aux = (me * mask1.float().mean(dim=0)).sum() * E  # first choices only, for k=1 and k=2
        tokens_per_expert = sum(masks).sum(dim=0)
        if drop and k == 1:
            cap = _capacity(S, E, capacity_factor, min_capacity)
            top = torch.topk(mask1, k=min(cap, S), dim=0)[1]
            masks[0] = mask1 * torch.zeros_like(mask1).scatter_(0, top, 1)
        elif drop:
            cap = _capacity(S, E, capacity_factor * 2, min_capacity)
            loc1 = mask1.cumsum(dim=0) - 1
            loc2 = masks[1].cumsum(dim=0) - 1 + mask1.sum(dim=0, keepdim=True)  # second choices queue behind firsts
            masks = [masks[0] * (loc1 < cap), masks[1] * (loc2 < cap)]
        g = torch.stack([(gates * m.float()).sum(dim=1) for m in masks], dim=1)  # (S, k)
        if k == 2:
            g = g / g.sum(dim=1, keepdim=True).clamp(min=torch.finfo(g.dtype).eps)
        experts = torch.stack(idx, dim=1)
        kept = torch.stack([m.bool().any(dim=1) for m in masks], dim=1)
        return experts, g, kept, aux, tokens_per_expert
    top_gate, experts = torch.topk(gates, k=k, dim=1)
    if balanced:  # the given experts' probabilities (topk's values go when nothing holds them)
        top_gate = gates.gather(1, round_robin_(experts, 0, E))
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, experts, True)
    tokens_per_expert = mask.sum(dim=0)
    aux = (me * mask.float().mean(dim=0)).mean() * E * E / k
    if drop:
        cap = _capacity(S, E, capacity_factor * k, min_capacity)
        masked = torch.zeros_like(gates).scatter(1, experts, top_gate)
        _, chosen = torch.topk(masked, k=min(cap, S), dim=0, sorted=False)
        mask &= torch.zeros_like(mask).scatter_(0, chosen, True)
    g = gates * mask
    g = g / g.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(g.dtype).eps)
    return experts, g.gather(1, experts), mask.gather(1, experts), aux, tokens_per_expert


def run_experts(experts: nn.ModuleDict, rows: torch.Tensor, ids: list[int], counts: list[int]) -> torch.Tensor:
    """rows (sum(counts), h), grouped by expert in the order of `ids` -> each expert's output, same order.
    An expert with no rows still runs (on 0 rows) so its parameters get a (zero) gradient everywhere."""
    chunks = rows.split(counts)
    return torch.cat([experts[str(e)](c) for e, c in zip(ids, chunks)])


class RouteSizes:
    """The routing's sizes, read from its tensors' values (a host sync each): the kept routes, the routes
    per expert, and those counts on the host (split sizes). A dry run's tensors have no values:
    harness/strategies/ep_fake.py's BalancedSizes answers the same three for the balanced load."""

    def kept_routes(self, kept: torch.Tensor) -> torch.Tensor:
        """kept (S*k,) bool -> (n,) long: the kept routes r = s*k + j, in order."""
        return kept.nonzero().squeeze(1)

    def per_expert(self, expert_of_route: torch.Tensor, n_experts: int) -> torch.Tensor:
        """(n,) long expert of each kept route -> (E,) long routes per expert."""
        return torch.bincount(expert_of_route, minlength=n_experts)

    def to_host(self, counts: torch.Tensor) -> list[int]:
        """per_expert's counts as host ints."""
        return counts.tolist()


def local_dispatch(moe: "MoE", rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Every expert lives in this process: run them on their rows. counts (E,) rows per expert."""
    return run_experts(moe.experts, rows, list(range(moe.n_experts)), moe.sizes.to_host(counts))


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_experts, self.top_k, self.capacity_factor = cfg.n_experts, cfg.top_k, cfg.capacity_factor
        self.balanced = getattr(cfg, "routing", ROUTINGS[0]) == "balanced"  # a partial cfg (tests): topk
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): make_mlp(cfg) for e in range(cfg.n_experts)})
        self.dispatch = local_dispatch  # (moe, rows sorted by expert, counts (E,)) -> expert outputs, same order
        self.sizes = RouteSizes()  # a dry run's: harness/strategies/ep_fake.py
        self.aux_loss: torch.Tensor | None = None
        self.last_load: dict[str, torch.Tensor] | None = None

    def keep_experts(self, ids: list[int]) -> None:
        """Drop the experts this rank does not hold (expert parallel); names keep the global index."""
        for e in list(self.experts.keys()):
            if int(e) not in ids:
                del self.experts[e]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (S, h)
        S, k = x.size(0), self.top_k
        # The router runs in fp32 whatever the autocast dtype (as DeepSpeed's gate): a softmax over
        # experts in bf16 flips near-tied choices.
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.weight.float())
        experts, weights, kept, self.aux_loss, tokens_per_expert = route(logits, k, self.capacity_factor,
                                                                      balanced=self.balanced)

        # Sort the kept routes by expert (stable: token order within an expert) -> contiguous rows per expert.
        flat_expert = experts.reshape(-1)  # route r = s*k + j
        kept_routes = self.sizes.kept_routes(kept.reshape(-1))
        order = kept_routes[flat_expert[kept_routes].argsort(stable=True)]
        counts = self.sizes.per_expert(flat_expert[order], self.n_experts)
        out_rows = self.dispatch(self, x[order // k], counts)  # (kept routes, h)

        # Combine: back to (S, k) route slots (dropped routes stay 0), weighted sum over the k slots in fp32.
        routed = out_rows.new_zeros(S * k, out_rows.size(1)).index_copy(0, order, out_rows).view(S, k, -1)
        y = (routed.float() * weights.unsqueeze(-1)).sum(dim=1).to(out_rows.dtype)
        self.last_load = {"tokens_per_expert": tokens_per_expert.detach(),
                          "dropped": (S * k - order.numel()) * torch.ones((), dtype=torch.long, device=x.device)}
        return y.view(shape)


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of a model (DDP-wrapped or not), in forward order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def last_load(model: nn.Module) -> torch.Tensor | None:
    """(L, E + 1) long: per MoE layer, tokens per expert of the last forward, then the dropped routes."""
    layers = moe_layers(model)
    if not layers or layers[0].last_load is None:
        return None
    return torch.stack([torch.cat([m.last_load["tokens_per_expert"], m.last_load["dropped"].view(1)])
                        for m in layers])


def summarize_load(per_step: torch.Tensor, first_timed_step: int, num_timed_steps: int) -> dict:
    """per_step (steps, L, E + 1) long, global counts -> the record's `measured.expert_load`.

    max_mean_ratio = max_e tokens_e / mean_e tokens_e per layer (1.0 = perfectly balanced, E = all to one)."""
    tokens = per_step[..., :-1].double()
    ratio = tokens.max(dim=-1).values / tokens.mean(dim=-1).clamp(min=1e-12)
    timed = slice(first_timed_step, first_timed_step + num_timed_steps)
    return {
        "tokens_per_expert": per_step[..., :-1].tolist(),  # [step][layer][expert], routes before capacity
        "max_mean_ratio": [[round(v, 6) for v in row] for row in ratio.tolist()],  # [step][layer]
        "dropped_tokens": per_step[..., -1].tolist(),  # [step][layer], routes over capacity
        "first_timed_step": first_timed_step,  # earlier entries are warm-up steps
        "timed_max_mean_ratio_mean": float(ratio[timed].mean()) if ratio[timed].numel() else math.nan,
        "timed_max_mean_ratio_max": float(ratio[timed].max()) if ratio[timed].numel() else math.nan,
        "timed_dropped_tokens": int(per_step[timed, :, -1].sum()),
    }
