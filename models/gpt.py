"""A GPT-style decoder, small enough to read top to bottom.

token + learned position embeddings -> n_layers pre-norm blocks (causal self-attention, GELU MLP or
MoE) -> final LayerNorm -> untied linear head. The head is untied (as in Llama / torchtitan) so a
pipeline can place the embedding on the first stage and the head on the last with no weight shared
across stages. Linear layers have no bias (so tensor-parallel sharding is exact and the parameter
count is 4h^2 + 2h*d_ff per block, plus 4h for the two LayerNorms).

Blocks live in a ModuleDict keyed by layer index, so a pipeline stage deletes the blocks it does
not own and keeps the others' names (state dicts match the full model key for key). `forward`
accepts hidden states instead of token ids when this stage has no embedding, and returns hidden
states when it has no head.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from models.layers import MLP
from models.moe import MoE


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float, attention: str):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)
        self.dropout = dropout
        self.attention = attention
        self.checkpoint_core = False  # selective recompute: recompute softmax(QK^T)V in backward
        self.context_parallel = None  # a core over a sequence split (harness/strategies/cp.py), or None

    def core(self, q, k, v):
        # q, k, v: (B, nh, T, hs)
        p = self.dropout if self.training else 0.0
        if self.context_parallel is not None:  # this rank's queries against every rank's keys
            return self.context_parallel(q, k, v, p, self.attention)
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, nh, T, T) materialised
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        att = F.dropout(att.masked_fill(~mask, float("-inf")).softmax(dim=-1), p)
        return att @ v

    def forward(self, x):
        B, T, _ = x.shape
        # view(B, T, -1, hs) rather than n_heads: under tensor parallel a rank holds n_heads/tp heads
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        if self.checkpoint_core and self.training:
            y = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            y = self.core(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, h_local)
        return F.dropout(self.o(y), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.dropout, cfg.attention)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        if cfg.n_experts:
            self.mlp = MoE(cfg)
        else:
            self.mlp = MLP(cfg.d_model, cfg.d_ff, cfg.dropout)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.checkpoint_blocks = False
        self.positions = None  # the token positions this rank holds under context parallel; None: 0..T-1
        self.apply(self._init)
        # GPT-2: scale the residual projections by 1/sqrt(2L) so the residual stream's variance holds
        for name, p in self.named_parameters():
            if name.endswith(("attn.o.weight", "fc2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def set_activation_checkpointing(self, mode: str) -> None:
        """none | selective (attention core recomputed) | full (each block recomputed)."""
        self.checkpoint_blocks = mode == "full"
        for block in self.blocks.values():
            block.attn.checkpoint_core = mode == "selective"

    def forward(self, x):
        """x: token ids (B, T) if this module has the embedding, else hidden states (B, T, h).
        Returns logits (B, T, V) if it has the head, else hidden states."""
        if self.tok_emb is not None:
            pos = self.positions if self.positions is not None else torch.arange(x.size(1), device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks.values():
            if self.checkpoint_blocks and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.head is not None:
            x = self.head(x)
        return x

    def aux_loss(self):
        """Sum of the MoE load-balancing losses of the last forward (0 for a dense model)."""
        losses = [b.mlp.aux_loss for b in self.blocks.values() if getattr(b.mlp, "aux_loss", None) is not None]
        return sum(losses) if losses else None


def build_model(cfg, seed: int) -> GPT:
    """Same seed -> same weights on every rank and in every strategy (the parity tests rely on it)."""
    torch.manual_seed(seed)
    return GPT(cfg)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every token of the micro-batch. logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
