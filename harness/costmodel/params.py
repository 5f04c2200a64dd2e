"""Parameter inventory of models/gpt.py and where each tensor lives after TP, PP and EP.

The model (models/gpt.py): token embedding (V, h) and, with position=learned, a position table
(s, h); per block ln1, q (h, h), k and v (kv, h) with kv = n_kv_heads * h / n_heads (GQA), o (h, h),
ln2, the MLP: gelu fc1 (d_ff, h), fc2 (h, d_ff) or swiglu gate, up (d_ff, h), down (h, d_ff) (or,
with experts, a router (E, h) and E expert MLPs); final ln_f; the head (V, h) unless tied to the
embedding. Norms: layernorm weight + bias (h each), rmsnorm weight only. With model.bias every
attention/MLP linear has a bias of its output size. Shapes are nn.Linear weights, (out, in).
Per dense block: 2h^2 + 2h*kv + n_mlp*h*d_ff (+ biases) + 2 norms (n_mlp = 2 gelu, 3 swiglu).
models/tp_plan.py:param_shapes lists the same tensors by name (tests check they agree).

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

import functools
from functools import lru_cache

from harness import catalog
from harness.config import ModelConfig
from models.pipeline_split import compute_balanced_split, nanotron_block_costs, stage_layer_counts
from models.tp_plan import PLAN, SHARDED_DIM, role_of

ROW_PARALLEL = ("o", "fc2", "down")  # their bias is replicated; a column-parallel bias is split
MLP_MATRICES = {"gelu": (("fc1", 0), ("fc2", 1)), "swiglu": (("gate", 0), ("up", 0), ("down", 1))}  # (name, in = d_ff dim)
# selective_op (models/gpt.py) keeps every other matmul's output, the 1st, 3rd, ...: the
# projections it recomputes in backward are the 2nd, 4th, ... of block_projections' list (k, o, and fc2
# or SwiGLU's up)
SELECTIVE_OP_RECOMPUTED = slice(1, None, 2)


def block_projections(h: int, kv: int, d_ff: int, mlp: str) -> list:
    """(out, in) features of each projection of a dense block, in models/gpt.py's call order: q, k, v, o,
    then the MLP's matrices (MLP_MATRICES)."""
    return [(h, h), (kv, h), (kv, h), (h, h)] + [(d_ff, h) if i == 0 else (h, d_ff) for _, i in MLP_MATRICES[mlp]]

@functools.lru_cache(maxsize=None)
def tp_block_collectives(mlp: str, sp: bool) -> dict:
    """One dense block's tensor-parallel collectives per micro-batch, read from models/tp_plan.py's PLAN
    for the block's own projections (MLP_MATRICES[mlp]). Forward: an all-reduce per row-parallel output
    (o and the MLP's output). Backward: one per column-parallel projection fed by a replicated input,
    since tp_plan.py wraps each one alone and each reduces its input gradient (q, k, v + fc1, or
    + gate and up: 6 for gelu, 7 for swiglu; Megatron fuses them). With sequence parallel each input
    is gathered once and its gradient reduce-scattered once: 4 all-reduce equivalents either way."""
    names = {"attn": ("q", "k", "v", "o"), "mlp": tuple(n for n, _ in MLP_MATRICES[mlp])}
    col, rows = {"attn": 0, "mlp": 0}, 0
    for pattern, role in PLAN:
        parts = pattern.split(".")
        if len(parts) == 4 and parts[0] == "blocks" and parts[3] in names.get(parts[2], ()):
            col[parts[2]] += role == "colwise"
            rows += role == "rowwise"
    if sp:
        return {"fwd": 2 * 2, "bwd": 2 * 2, "allreduce_equiv": 4, "attn_bwd": 1, "mlp_bwd": 1, "rows": rows}
    return {"fwd": rows, "bwd": col["attn"] + col["mlp"], "allreduce_equiv": rows + col["attn"] + col["mlp"],
            "attn_bwd": col["attn"], "mlp_bwd": col["mlp"], "rows": rows}


# tensor -> dimension split by tp (None: replicated), read once from models/tp_plan.py's PLAN so the
# planner's inner loop needs no name matching.
_MODULE_OF = {"tok_emb": "tok_emb", "pos_emb": "pos_emb", "ln": "blocks.0.ln1", "q": "blocks.0.attn.q",
              "k": "blocks.0.attn.k", "v": "blocks.0.attn.v", "o": "blocks.0.attn.o", "fc1": "blocks.0.mlp.fc1",
              "fc2": "blocks.0.mlp.fc2", "gate": "blocks.0.mlp.gate", "up": "blocks.0.mlp.up",
              "down": "blocks.0.mlp.down", "router": "blocks.0.mlp.router", "head": "head"}
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


_ABSENT = object()


def option(m, name: str):
    """A Llama-family option of a model config; the schema's default where an object lacks it (read in the
    planner's inner loop: the default is looked up only when the attribute is missing)."""
    value = getattr(m, name, _ABSENT)
    return _schema_default(name) if value is _ABSENT else value


@lru_cache(maxsize=None)
def _schema_default(name: str):
    return ModelConfig.__dataclass_fields__[name].default


def kv_dim(m) -> int:
    """Output features of k (and of v): n_kv_heads * head_dim (= d_model without GQA)."""
    return (option(m, "n_kv_heads") or m.n_heads) * (m.d_model // m.n_heads)


def model_shape(m) -> tuple:
    """A model config reduced to a hashable tuple (the key of rank_inventory's cache):
    (L, h, n_heads, d_ff, V, s, E, top_k, kv, mlp, norm, position, tie_embeddings, bias)."""
    return (m.n_layers, m.d_model, m.n_heads, m.d_ff, m.vocab_size, m.seq_len, m.n_experts, m.top_k, kv_dim(m),
            option(m, "mlp"), option(m, "norm"), option(m, "position"), bool(option(m, "tie_embeddings")),
            bool(option(m, "bias")))


def _linear(name: str, out_in: tuple[int, int], tp: int, bias: bool, kind: str = "dense", count: int = 1) -> list:
    out = [(count, *_local(name, out_in, tp), kind)]
    if bias:  # column-parallel: split with the outputs; row-parallel: replicated
        out.append((count, -(-out_in[0] // tp) if name not in ROW_PARALLEL else out_in[0], 1, kind))
    return out


def norm_tensors(norm: str) -> int:
    """Parameter tensors of one norm: LayerNorm's weight and bias, RMSNorm's weight."""
    return 2 if norm == "layernorm" else 1


def _norms(norm: str, h: int, count: int) -> list:
    return [(count * norm_tensors(norm), h, 1, "dense")]  # replicated


def block_tensors(shape: tuple, tp: int, ep: int) -> list[tuple[int, int, int, str]]:
    """One block's local tensors, in named_parameters() order: (count, dim0, rest, kind)."""
    _, h, _, d_ff, _, _, n_experts, _, kv, mlp, norm, _, _, bias = shape
    out = _norms(norm, h, 1)  # ln1
    for n, out_in in (("q", (h, h)), ("k", (kv, h)), ("v", (kv, h)), ("o", (h, h))):
        out += _linear(n, out_in, tp, bias)
    out += _norms(norm, h, 1)  # ln2
    experts = n_experts // ep if n_experts else 1
    kind = "expert" if n_experts else "dense"
    if n_experts:
        out += [(1, *_local("router", (n_experts, h), tp), "dense")]
    # experts are whole on every tp rank: models/tp_plan.py plans the MLPs of dense blocks only, a MoE
    # MLP runs replicated on the tp group's (replicated) activations (strategies/moe_stages.py)
    mlp_tp = 1 if n_experts else tp
    for n, d_ff_in in MLP_MATRICES[mlp]:
        out += _linear(n, (h, d_ff) if d_ff_in else (d_ff, h), mlp_tp, bias, kind, experts)
    return out


@lru_cache(maxsize=4096)
def local_block_numel(shape: tuple, tp: int, ep: int) -> int:
    """Parameters of one block on one (tp, ep) rank, experts as they are sharded."""
    return numel(block_tensors(shape, tp, ep))


@lru_cache(maxsize=4096)
def block_numel(shape: tuple, tp: int = 1) -> int:
    """Parameters of one block on one tp rank, a MoE block counted as its dense twin (one MLP)."""
    return numel(block_tensors(shape[:6] + (0,) + shape[7:], tp, 1))


@lru_cache(maxsize=4096)
def stage_split(shape: tuple, n_stages: int, stage_layers: tuple = (), rule: str = "even") -> tuple:
    """(decoder layers per stage, the head's stage, the fp32 cast's and the loss's (nanotron's: the logits pass
    from the head's stage to them), the last stage holding a block) as the runtime splits (conf/runtime/ pipeline_split): even = models/pipeline_split.py, the head and the loss on the
    last stage; compute_balanced = nanotron's (compute_balanced_split). An explicit split (strategy.stage_layers)
    is brigade's own runtime's."""
    if rule == "compute_balanced" and n_stages > 1 and not stage_layers:
        return compute_balanced_split(shape[0], n_stages, *nanotron_block_costs(shape[1], shape[3], shape[4]))
    last = n_stages - 1
    return stage_layer_counts(shape[0], n_stages, stage_layers), last, last, last, last


@lru_cache(maxsize=4096)
def rank_inventory(shape: tuple, tp: int, pp: int, vpp: int, ep: int, schedule: str, pp_rank: int,
                   stage_layers: tuple = (), head_stage: int = -1) -> tuple:
    """Local parameter groups of one pp rank (the same on every tp and dp rank of that stage).

    shape = model_shape(model config); stage_layers: the layers of each stage where not the even split
    (models/pipeline_split.py); head_stage: the stage holding the final norm and the head (-1: the last)."""
    L, h, _, d_ff, V, s, E, _, _, _, norm, position, tie, _ = shape
    n_stages = pp * vpp
    groups: list = []
    stages = catalog.stages_of_rank(schedule, pp_rank, pp, vpp)
    n_blocks = rank_layers(L, n_stages, stages, stage_layers)
    if 0 in stages:
        groups += [(1, *_local("tok_emb", (V, h), tp), "dense")]
        if position == "learned":
            groups += [(1, *_local("pos_emb", (s, h), tp), "dense")]
    groups += [(c * n_blocks, d0, r, kind) for c, d0, r, kind in block_tensors(shape, tp, ep)]
    if (n_stages - 1 if head_stage < 0 else head_stage) in stages:
        groups += _norms(norm, h, 1)
        if not tie:  # a tied head is the embedding's tensor (one stage only: validation)
            groups += [(1, *_local("head", (V, h), tp), "dense")]
    merged: dict = {}  # equal shapes merged: every sharding rule here depends on shapes only
    for c, d0, r, kind in groups:
        merged[(d0, r, kind)] = merged.get((d0, r, kind), 0) + c
    return tuple((c, d0, r, kind) for (d0, r, kind), c in merged.items())


def rank_layers(n_layers: int, n_stages: int, stages: tuple, stage_layers: tuple = ()) -> int:
    """Blocks a pp rank holds: its stages' counts (models/pipeline_split.py, as the runtime splits)."""
    counts = stage_layer_counts(n_layers, n_stages, stage_layers)
    return sum(counts[st] for st in stages)


def numel(groups) -> int:
    return sum(c * d0 * r for c, d0, r, _ in groups)


def n_tensors(groups) -> int:
    return sum(c for c, _, _, _ in groups)


def params_total(m) -> int:
    """Parameters of the whole model (one pp rank holding every stage, tp 1, ep 1)."""
    return numel(rank_inventory(model_shape(m), 1, 1, 1, 1, catalog.DEFAULT_SCHEDULE, 0))


def params_active(m) -> int:
    """Parameters a token passes through (MoE: top_k of the experts), for 6*N*tokens-style checks."""
    if not m.n_experts:
        return params_total(m)
    mlp, bias = option(m, "mlp"), option(m, "bias")
    per_expert = len(MLP_MATRICES[mlp]) * m.d_model * m.d_ff + (m.d_ff * (len(MLP_MATRICES[mlp]) - 1) + m.d_model
                                                                 if bias else 0)
    return params_total(m) - m.n_layers * (m.n_experts - m.top_k) * per_expert
