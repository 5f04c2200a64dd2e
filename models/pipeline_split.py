"""Pipeline split points of the GPT model, as data: which layers each pipeline stage holds.

A stage is a contiguous run of transformer blocks. By default the layers are split evenly by count
(n_layers / num_stages each; harness/validate.py refuses a config where num_stages does not divide
n_layers). The pieces that are not blocks are placed by a fixed rule:

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
from dataclasses import dataclass


@dataclass(frozen=True)
class StageSplit:
    index: int  # stage index s in 0..num_stages-1
    layers: tuple[int, ...]  # block indices this stage owns (keys of GPT.blocks)
    embeddings: bool  # tok_emb + pos_emb live here (first stage)
    head: bool  # ln_f + head live here (last stage)


def even_split(n_layers: int, num_stages: int) -> list[StageSplit]:
    """Split the layers evenly by count: stage s holds layers [s*L/S, (s+1)*L/S)."""
    assert n_layers % num_stages == 0, (n_layers, num_stages)  # validate.py refuses this before launch
    per = n_layers // num_stages
    return [StageSplit(index=s, layers=tuple(range(s * per, (s + 1) * per)), embeddings=s == 0,
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
