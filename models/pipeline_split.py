"""Pipeline split points of the GPT model, as data: which layers each pipeline stage holds.

A stage is a contiguous run of transformer blocks. By default the layers are split as evenly as their
count allows: n_layers // num_stages each, and the first n_layers % num_stages stages one more (28
layers on 8 stages: 4 4 4 4 3 3 3 3; Llama 3 405B's 126 on 16: fourteen of 8, two of 7). The first stages
take the extra layers because the last one already carries the head and the loss. An explicit split
(strategy.stage_layers, one count per stage, e.g. [3, 4, 4, 4, 4, 4, 4, 1] to leave the head's stage
lighter) replaces the rule; harness/validate.py checks it adds up. Another runtime's rule, priced by the cost
model only (conf/runtime/): nanotron's compute-balanced split (compute_balanced_split). The pieces that are not blocks are
placed by a fixed rule:

    stage 0            : tok_emb + pos_emb (+ dropout) + its blocks     input: token ids (B, T)
    stage 1 .. S-2     : its blocks                                     input: hidden states (B, T, h)
    stage S-1 (last)   : its blocks + ln_f + head                       output: logits (B, T, V)

so every stage boundary carries one (B, T, h) activation tensor. The embeddings and the head are not
counted in the layer split (the head of a large-vocabulary model makes the last stage the heaviest:
see the per-rank model-state bytes of a pp run). With S == 1 the one stage is the whole model.

Stage index != pipeline rank: a schedule places stage s on a rank (`stages_of_rank` in
harness/catalog.py); this module only says what each stage index holds.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class StageSplit:
    index: int  # stage index s in 0..num_stages-1
    layers: tuple[int, ...]  # block indices this stage owns (keys of GPT.blocks)
    embeddings: bool  # tok_emb + pos_emb live here (first stage)
    head: bool  # ln_f + head live here (last stage)


@functools.lru_cache(maxsize=4096)  # the planner asks for the same few splits thousands of times
def stage_layer_counts(n_layers: int, num_stages: int, explicit: tuple = ()) -> tuple[int, ...]:
    """Blocks per stage: the explicit split where given, else the rule of the module docstring."""
    if explicit:
        assert len(explicit) == num_stages and sum(explicit) == n_layers, (explicit, num_stages, n_layers)
        return tuple(int(c) for c in explicit)
    per, extra = divmod(n_layers, num_stages)
    return tuple(per + (s < extra) for s in range(num_stages))


@functools.lru_cache(maxsize=4096)
def compute_balanced_split(n_layers: int, n_stages: int, layer_cost: float, head_cost: float) -> tuple:
    """nanotron's pipeline split (src/nanotron/models/base.py build_model; conf/runtime/nanotron.yaml): the
    blocks embedding, n_layers decoder layers, final norm, head, fp32 cast and loss, in that order, with
    estimated costs 0, layer_cost each, 0, head_cost, 0, 0; each block goes to the current stage, and the stage
    closes once the running sum of costs passes (stage + 1) / n_stages of the total. Returns (decoder layers
    per stage, the stage holding the final norm and head, the fp32 cast's, the loss's, the last stage holding
    a block). Stages after the head's hold only the cast, the loss, or nothing."""
    blocks = [0.0] + [layer_cost] * n_layers + [0.0, head_cost, 0.0, 0.0]
    total = layer_cost * n_layers + head_cost
    counts, stage, running, placed = [0] * n_stages, 0, 0.0, []
    for i, cost in enumerate(blocks):
        running += cost
        placed.append(stage)
        if 1 <= i <= n_layers:
            counts[stage] += 1
        if running > total * (stage + 1) / n_stages:
            stage += 1
    return tuple(counts), placed[n_layers + 2], placed[n_layers + 3], placed[-1], max(placed)


def nanotron_block_costs(h: int, d_ff: int, vocab: int) -> tuple[float, float]:
    """nanotron's estimate of a decoder layer's and the head's compute (LlamaForTraining.get_block_compute_costs,
    src/nanotron/models/llama.py): 4 n_heads d_head h + 3 d_ff h = 4 h^2 + 3 h d_ff, and V h."""
    V = vocab
    return 4.0 * h * h + 3.0 * h * d_ff, float(V * h)


def stage_splits(n_layers: int, num_stages: int, explicit: tuple = ()) -> list[StageSplit]:
    """Stage s holds the contiguous blocks after those of stages 0..s-1 (stage_layer_counts)."""
    counts = stage_layer_counts(n_layers, num_stages, explicit)
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return [StageSplit(index=s, layers=tuple(range(starts[s], starts[s] + counts[s])), embeddings=s == 0,
                       head=s == num_stages - 1) for s in range(num_stages)]


def stage_module(model, split: StageSplit):
    """A copy of `model` that keeps only what stage `split` owns; the others' modules are removed
    (set to None / deleted), so its parameters are exactly this stage's. Parameter names match the
    full model's (blocks keep their layer-index keys). `model` itself is left whole."""
    stage = copy.deepcopy(model)
    for key in [k for k in stage.blocks if int(k) not in split.layers]:
        del stage.blocks[key]
    if not split.embeddings:
        stage.tok_emb = stage.pos_emb = None
    if not split.head:
        stage.ln_f = stage.head = None
    return stage
