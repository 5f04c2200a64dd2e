"""The GPT's tensor-parallel plan: which module is split how, as data beside the model.

Megatron-LM's split (Shoeybi et al. 2019, sec. 3) on a tp group of size t, for one block:

    attention  Y = softmax(X Wq_i (X Wk_i)^T) X Wv_i   per rank i: Wq, Wk, Wv split by columns
               (output features) = by heads, so each rank runs n_heads/t whole heads with no
               communication; Z = sum_i Y_i Wo_i      Wo split by rows (input features): each rank
               holds a partial sum of Z -> one all-reduce in forward (and one in backward, on the
               input side of the column-parallel projections).
    MLP        Z = sum_i GeLU(X W1_i) W2_i            W1 by columns, W2 by rows: same pattern, GeLU
               is element-wise so it needs no communication between the two matmuls.
    SwiGLU     Z = sum_i (silu(X Wg_i) * X Wu_i) Wd_i  gate and up by columns, down by rows.
    GQA        Wk, Wv have n_kv_heads * head_dim columns, split by columns = by kv heads: each rank
               holds n_kv_heads/t kv heads, the ones its n_heads/t query heads use (validation makes
               t divide n_kv_heads). Biases: a column-parallel bias is split with its outputs, a
               row-parallel bias is replicated (added once, after the all-reduce).

So a block costs 2 all-reduces of the (B, T, h) activations forward and 2 backward, and each rank
holds 1/t of the 4h^2 + 2h*d_ff linear weights.

Outside the blocks (what the cost model reads, `PLAN` below):
  - tok_emb: vocab-parallel (weight (V, h) split by rows = vocabulary ids): each rank looks up the
    ids it owns (others contribute 0), then all-reduce (reduce-scatter on the sequence with SP).
  - pos_emb: replicated (s*h, small). With SP each rank adds the rows of its own sequence slice.
  - LayerNorms (ln1, ln2, ln_f): replicated. Without SP they see the same full activations on every
    rank, so their grads are identical and need no reduction; with SP they run on a sequence slice
    (params are Replicate DTensors, grads all-reduced over tp by DTensor).
  - head: column-parallel (weight (V, h) split by rows = vocabulary). With loss parallel the logits
    stay sharded on the vocabulary (B, T, V/t) and the cross-entropy is computed distributed (a
    max and a sum all-reduce of (B, T) scalars), never all-gathering the V-wide logits; without it
    the logits are all-gathered.

Sequence parallel (Korthikanti et al. 2022): between the row-parallel output and the next
column-parallel input, activations are sharded on the sequence (dim 1) instead of replicated, so
the norms and the residual stream hold T/t tokens. Each all-reduce becomes a reduce-scatter (after
Wo, W2) plus an all-gather (before Wq/k/v, W1): the same bytes, 1/t the activation memory.

Parameters split on a dim of size d follow torch.chunk: rank r holds min(c, max(0, d - r*c)) rows
with c = ceil(d / t). brigade's validation makes tp divide n_heads and d_ff; V need not divide.

This module imports torch only inside `parallel_styles`, so the cost model (pure) can read `PLAN`,
`param_shapes` and `local_param_numel`.
"""
from __future__ import annotations

import math
import re

# Imports inside functions: torch and what imports it, which the parent process never loads.

# (module pattern, role); "*" is one block index. Roles:
#   colwise          nn.Linear weight (out, in) sharded on dim 0 (output features); input replicated
#   rowwise          nn.Linear weight sharded on dim 1 (input features); output all-reduced
#                    (reduce-scattered on the sequence with SP)
#   vocab_embedding  nn.Embedding weight (V, h) sharded on dim 0; output all-reduced (SP: reduce-scattered)
#   head             column-parallel output layer; logits sharded on V with loss parallel
#   position         replicated; with SP its output is cut to this rank's sequence slice
#   norm             replicated; with SP: SequenceParallel (input and output sharded on the sequence)
#   gather_input     SP only: all-gather the sequence-sharded input before a column-parallel layer
PLAN: tuple[tuple[str, str], ...] = (
    ("tok_emb", "vocab_embedding"),
    ("pos_emb", "position"),
    ("blocks.*.ln1", "norm"),
    ("blocks.*.attn", "gather_input"),
    ("blocks.*.attn.q", "colwise"),
    ("blocks.*.attn.k", "colwise"),
    ("blocks.*.attn.v", "colwise"),
    ("blocks.*.attn.o", "rowwise"),
    ("blocks.*.ln2", "norm"),
    ("blocks.*.mlp", "gather_input"),
    ("blocks.*.mlp.fc1", "colwise"),
    ("blocks.*.mlp.fc2", "rowwise"),
    ("blocks.*.mlp.gate", "colwise"),
    ("blocks.*.mlp.up", "colwise"),
    ("blocks.*.mlp.down", "rowwise"),
    ("ln_f", "norm"),
    ("head", "head"),
)

# Which dim of a role's weight is sharded over tp (None: replicated).
SHARDED_DIM = {"colwise": 0, "rowwise": 1, "vocab_embedding": 0, "head": 0, "position": None, "norm": None,
               "gather_input": None}


def _regex(pattern: str) -> re.Pattern:
    return re.compile(re.escape(pattern).replace(r"\*", r"[^.]+") + r"\Z")


def role_of(module_name: str) -> str | None:
    """The plan's role for a module name (e.g. "blocks.3.attn.q" -> "colwise"), None if unplanned."""
    for pattern, role in PLAN:
        if _regex(pattern).match(module_name):
            return role
    return None


def param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the dense model in models/gpt.py, from its config alone (pure),
    in named_parameters() order (a tied head is the embedding: not listed twice)."""
    h, f, V, s = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.seq_len
    kv = (cfg.n_kv_heads or cfg.n_heads) * (h // cfg.n_heads)
    norm = ("weight", "bias") if cfg.norm == "layernorm" else ("weight",)
    linear = ("weight", "bias") if cfg.bias else ("weight",)
    mlp = ({"fc1": (f, h), "fc2": (h, f)} if cfg.mlp == "gelu" else {"gate": (f, h), "up": (f, h), "down": (h, f)})
    shapes: dict[str, tuple[int, ...]] = {"tok_emb.weight": (V, h)}
    if cfg.position == "learned":
        shapes["pos_emb.weight"] = (s, h)

    def add(prefix, out_in):
        for p in linear:
            shapes[f"{prefix}.{p}"] = out_in if p == "weight" else out_in[:1]

    for i in range(cfg.n_layers):
        b = f"blocks.{i}"
        shapes.update({f"{b}.ln1.{p}": (h,) for p in norm})
        for name, out_in in (("q", (h, h)), ("k", (kv, h)), ("v", (kv, h)), ("o", (h, h))):
            add(f"{b}.attn.{name}", out_in)
        shapes.update({f"{b}.ln2.{p}": (h,) for p in norm})
        for name, out_in in mlp.items():
            add(f"{b}.mlp.{name}", out_in)
    shapes.update({f"ln_f.{p}": (h,) for p in norm})
    if not cfg.tie_embeddings:
        shapes["head.weight"] = (V, h)
    return shapes


def sharded_dim(param_name: str) -> int | None:
    """The dim of this parameter split over tp (None: replicated). A column-parallel bias is split
    with the outputs; a row-parallel bias is replicated."""
    module, _, leaf = param_name.rpartition(".")
    role = role_of(module) or "norm"
    if leaf == "bias":
        return 0 if role == "colwise" else None
    return SHARDED_DIM[role]


def chunk_rows(d: int, parts: int, index: int) -> int:
    """Rows of a size-d dim that part `index` of `parts` holds under torch.chunk (DTensor Shard)."""
    c = math.ceil(d / parts)
    return min(c, max(0, d - index * c))


def local_param_numel(cfg, tp: int, tp_rank: int = 0) -> int:
    """Elements of the parameters one tp rank holds under this plan (dense model)."""
    total = 0
    for name, shape in param_shapes(cfg).items():
        dim = sharded_dim(name)
        n = math.prod(shape)
        total += n if dim is None else n // shape[dim] * chunk_rows(shape[dim], tp, tp_rank)
    return total


def parallel_styles(module_names, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """module name -> torch ParallelStyle for every planned module among `module_names` (a pipeline
    stage may lack the embeddings or the head; a MoE block has no mlp.fc1)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    sp = sequence_parallel
    between = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks (B, T, h)
    styles = {
        "colwise": ColwiseParallel,
        "rowwise": lambda: RowwiseParallel(output_layouts=between),
        "vocab_embedding": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        # loss parallel keeps the DTensor (B, T, V/t) sharded on V for the distributed cross-entropy
        "head": lambda: ColwiseParallel(input_layouts=between,
                                        output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                        use_local_output=not loss_parallel),
        # the (s, h) table is replicated; SP keeps this rank's rows of the sequence, (T/t, h)
        "position": lambda: PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)),
        "norm": SequenceParallel,
        "gather_input": lambda: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    }
    sp_only = ("position", "norm", "gather_input")
    names = set(module_names)
    out = {}
    for name in sorted(names):
        role = role_of(name)
        if role is None or (role in sp_only and not sp):
            continue
        if role == "gather_input" and name.endswith(".mlp") and not {f"{name}.fc1", f"{name}.gate"} & names:
            raise ValueError(f"{name} is not a dense MLP (MoE?): the tensor-parallel plan with sequence "
                             f"parallel covers dense MLPs only")
        out[name] = styles[role]()
    return out
