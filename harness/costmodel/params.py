"""Parameter inventory of models/gpt.py and where each tensor lives after TP, PP and EP.

The model (models/gpt.py): token embedding (V, h) and learned position embedding (s, h); per block
ln1 (weight h, bias h), q, k, v, o (h, h each, no bias), ln2 (h, h), MLP fc1 (d_ff, h), fc2 (h, d_ff)
(or, with experts, a router (E, h) and E expert MLPs); final ln_f (h, h); untied head (V, h).
Shapes are nn.Linear weights, (out, in). Per block 4h^2 + 2h*d_ff + 4h parameters (dense).

Placement (the numbers the strategies hold, so memory predictions match measured bytes):
  - tensor parallel (Megatron, Shoeybi et al. 2019): q, k, v, fc1 column-parallel (dim 0 split by
    tp), o, fc2 row-parallel (dim 1 split by tp); the token embedding is vocab-parallel (dim 0 split)
    and the head column-parallel on the vocabulary (loss_parallel); LayerNorms and the position
    embedding are replicated. TP_SHARD below is that plan as data.
  - pipeline: the model is cut into pp*vpp stages of n_layers/(pp*vpp) blocks; stage 0 also holds the
    embeddings, the last stage ln_f and the head. Rank r of the pp axis holds stages r + i*pp
    (looped schedules) or [r, 2pp-1-r] (V schedules), so under a V schedule rank 0 holds both ends.
  - expert parallel: each ep rank holds n_experts/ep experts; the router is replicated.

A rank's inventory is a tuple of groups (count, dim0, rest, kind): `count` tensors of shape
(dim0, ...) with `rest` elements per dim-0 row; kind "dense" (replicated over dp) or "expert"
(replicated over dp/ep). Grouping identical shapes keeps the sharding rules fast for the planner.
Groups of equal shape are merged: ZeroRedundancyOptimizer's greedy split depends on parameter order
only through ties of equal size, which do not change per-rank bytes.
"""
from __future__ import annotations

from functools import lru_cache

from harness import catalog
from models.tp_plan import SHARDED_DIM, role_of

# tensor -> dimension split by tp (None: replicated), read once from models/tp_plan.py's PLAN so the
# planner's inner loop needs no name matching.
_MODULE_OF = {"tok_emb": "tok_emb", "pos_emb": "pos_emb", "ln": "blocks.0.ln1", "q": "blocks.0.attn.q",
              "k": "blocks.0.attn.k", "v": "blocks.0.attn.v", "o": "blocks.0.attn.o", "fc1": "blocks.0.mlp.fc1",
              "fc2": "blocks.0.mlp.fc2", "router": "blocks.0.mlp.router", "head": "head"}
TP_SHARD = {name: SHARDED_DIM.get(role_of(module)) for name, module in _MODULE_OF.items()}


def _local(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, int]:
    """(dim0, rest) of this tensor's local shard under tensor parallel."""
    dims = list(shape)
    split = TP_SHARD[name]
    if split is not None and tp > 1:
        dims[split] = -(-dims[split] // tp)  # torch.chunk: tp rank 0 holds ceil(d/tp), the most
    rest = 1
    for d in dims[1:]:
        rest *= d
    return dims[0], rest


def block_tensors(h: int, d_ff: int, n_experts: int, tp: int, ep: int) -> list[tuple[int, int, int, str]]:
    """One block's local tensors, in named_parameters() order: (count, dim0, rest, kind)."""
    out = [(2, *_local("ln", (h,), tp), "dense")]  # ln1.weight, ln1.bias
    out += [(1, *_local(n, (h, h), tp), "dense") for n in ("q", "k", "v", "o")]
    out += [(2, *_local("ln", (h,), tp), "dense")]  # ln2
    if n_experts:
        out += [(1, *_local("router", (n_experts, h), tp), "dense")]
        local_experts = n_experts // ep
        # experts are whole on every tp rank: models/tp_plan.py plans mlp.fc1 / mlp.fc2 of dense MLPs
        # only, a MoE MLP runs replicated on the tp group's (replicated) activations (strategies/moe3d.py)
        out += [(local_experts, *_local("fc1", (d_ff, h), 1), "expert"),
                (local_experts, *_local("fc2", (h, d_ff), 1), "expert")]
    else:
        out += [(1, *_local("fc1", (d_ff, h), tp), "dense"), (1, *_local("fc2", (h, d_ff), tp), "dense")]
    return out


@lru_cache(maxsize=4096)
def rank_inventory(shape: tuple, tp: int, pp: int, vpp: int, ep: int, schedule: str, pp_rank: int) -> tuple:
    """Local parameter groups of one pp rank (the same on every tp and dp rank of that stage).

    shape = (n_layers, h, n_heads, d_ff, V, s, n_experts, top_k)."""
    L, h, _, d_ff, V, s, E, _ = shape
    n_stages = pp * vpp
    per_stage = L // n_stages
    groups: list = []
    stages = catalog.stages_of_rank(schedule, pp_rank, pp, vpp)
    n_blocks = per_stage * len(stages)
    if 0 in stages:
        groups += [(1, *_local("tok_emb", (V, h), tp), "dense"), (1, *_local("pos_emb", (s, h), tp), "dense")]
    groups += [(c * n_blocks, d0, r, kind) for c, d0, r, kind in block_tensors(h, d_ff, E, tp, ep)]
    if n_stages - 1 in stages:
        groups += [(2, *_local("ln", (h,), tp), "dense"), (1, *_local("head", (V, h), tp), "dense")]
    merged: dict = {}  # equal shapes merged: every sharding rule here depends on shapes only
    for c, d0, r, kind in groups:
        merged[(d0, r, kind)] = merged.get((d0, r, kind), 0) + c
    return tuple((c, d0, r, kind) for (d0, r, kind), c in merged.items())


def numel(groups) -> int:
    return sum(c * d0 * r for c, d0, r, _ in groups)


def n_tensors(groups) -> int:
    return sum(c for c, _, _, _ in groups)


def params_total(m) -> int:
    """Parameters of the whole model (untied head, position table of seq_len rows)."""
    h, d_ff, L, V, s, E = m.d_model, m.d_ff, m.n_layers, m.vocab_size, m.seq_len, m.n_experts
    mlp = (E * 2 * h * d_ff + E * h) if E else 2 * h * d_ff
    return L * (4 * h * h + mlp + 4 * h) + V * h + s * h + 2 * h + V * h


def params_active(m) -> int:
    """Parameters a token passes through (MoE: top_k of the experts), for 6*N*tokens-style checks."""
    if not m.n_experts:
        return params_total(m)
    h, d_ff = m.d_model, m.d_ff
    return params_total(m) - m.n_layers * (m.n_experts - m.top_k) * 2 * h * d_ff
