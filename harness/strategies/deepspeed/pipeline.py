"""DeepSpeed's pipeline (pp > 1 on strategy.engine=deepspeed, ZeRO 0/1).

A DeepSpeed PipelineModule over the same model's layers [embedding, block 0..L-1, final norm +
head], split by block count (partition "type:Block"), driven by `engine.train_batch` over an
iterator of this rank's micro-batches (DeepSpeed's 1F1B schedule; activations and their gradients
go point-to-point between neighbouring stages).
"""
from __future__ import annotations

import torch

from harness.strategies.deepspeed.engine import DeepSpeedStrategy


class DeepSpeedPipeline(DeepSpeedStrategy):
    def build_module(self, model):
        from deepspeed.pipe import PipelineModule

        layers = [Embedding(model), *model.blocks.values(), Head(model)]
        full = self.run.workload.activation_checkpointing == "full"
        return PipelineModule(layers=layers, num_stages=self.dims.pp, loss_fn=self.loss_fn, partition_method="type:Block",
                              activation_checkpoint_interval=1 if full else 0)

    def train_step(self, microbatches):
        # DeepSpeed's pipeline engine pulls gradient_accumulation_steps micro-batches from the iterator:
        # the first stage the inputs, the last the targets; it steps the optimizer once at the end.
        self.engine.train_batch(data_iter=iter(microbatches))
        self._close_capture()
        if not self.engine.is_last_stage():
            return None
        return self.engine.dp_group_loss  # this replica's mean over its micro-batches (before the dp average)

    def gpt_name(self, name):
        # PipelineModule names layer k of [Embedding, block 0..L-1, Head] "<k>."
        k, rest = name.split(".", 1)
        k, n_layers = int(k), self.run.model.n_layers
        return rest if k in (0, n_layers + 1) else f"blocks.{k - 1}.{rest}"


class Embedding(torch.nn.Module):
    """The first pipeline layer: token + position embeddings of the GPT (the same modules, so the same weights)."""

    def __init__(self, gpt):
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop = gpt.tok_emb, gpt.pos_emb, gpt.drop

    def forward(self, tokens):
        pos = torch.arange(tokens.size(1), device=tokens.device)
        return self.drop(self.tok_emb(tokens) + self.pos_emb(pos))


class Head(torch.nn.Module):
    """The last pipeline layer: final LayerNorm and the (untied) output projection."""

    def __init__(self, gpt):
        super().__init__()
        self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x):
        return self.head(self.ln_f(x))


STRATEGY = DeepSpeedPipeline
