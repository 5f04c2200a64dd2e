"""Layers shared by the dense model (models/gpt.py) and the MoE layer (models/moe.py), which both
build MLPs; kept apart so neither model module imports the other.

The Llama-family options live here as small factories keyed on the model config:
    model.norm      layernorm (weight + bias, GPT-2) | rmsnorm (weight only, Zhang & Sennrich 2019)
    model.mlp       gelu: fc2(gelu(fc1 x))           | swiglu: down(silu(gate x) * up x) (Shazeer 2020)
    model.position  learned (a table in models/gpt.py) | rope: `apply_rope` below (Su et al. 2021)
Norms use eps 1e-5 (torch's LayerNorm default and Llama's rms_norm_eps).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

NORM_EPS = 1e-5


class MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float, bias: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff, bias=bias)
        self.fc2 = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = dropout

    def forward(self, x):
        return F.dropout(self.fc2(F.gelu(self.fc1(x))), self.dropout, self.training)


class SwiGLU(nn.Module):
    """Llama's MLP: three (d_model x d_ff) matrices; gate and up are column-parallel, down row-parallel
    (models/tp_plan.py). silu and the product are element-wise, so under tensor parallel each rank
    computes its d_ff/t slice with no communication between the matmuls."""

    def __init__(self, d_model: int, d_ff: int, dropout: float, bias: bool = False):
        super().__init__()
        self.gate = nn.Linear(d_model, d_ff, bias=bias)
        self.up = nn.Linear(d_model, d_ff, bias=bias)
        self.down = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = dropout

    def forward(self, x):
        return F.dropout(self.down(F.silu(self.gate(x)) * self.up(x)), self.dropout, self.training)


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm computed and saved as CUDA's fused kernel does (torch's `_fused_rms_norm`): fp32 inside,
    and for backward only the input, the weight and the fp32 rstd per row. On CPU torch runs RMSNorm as
    composite ops that keep fp32 copies of a bf16 input (4 bytes more per element, twice per norm);
    this keeps CPU runs and dry runs (fake tensors on CPU) holding what a GPU holds."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # the kernel's accumulation type
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * weight).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xhat, g = x.to(rstd.dtype) * rstd, grad.to(rstd.dtype)
        gx = g * weight
        dx = rstd * (gx - xhat * (gx * xhat).mean(-1, keepdim=True))
        dweight = (g * xhat).sum(dim=tuple(range(g.dim() - 1)))
        return dx.to(x.dtype), dweight.to(weight.dtype), None


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm on CUDA (its fused kernel); elsewhere the same arithmetic and saved tensors
    (_FusedRMSNorm). Where input and weight dtypes differ CUDA falls back to the composite too."""

    def forward(self, x):
        if x.device.type == "cuda" or self.weight is None or self.weight.dtype != x.dtype:
            return super().forward(x)
        return _FusedRMSNorm.apply(x, self.weight, self.eps)


MLPS = {"gelu": MLP, "swiglu": SwiGLU}
NORMS = {"layernorm": lambda h: nn.LayerNorm(h, eps=NORM_EPS), "rmsnorm": lambda h: RMSNorm(h, eps=NORM_EPS)}


def make_mlp(cfg) -> nn.Module:
    return MLPS[cfg.mlp](cfg.d_model, cfg.d_ff, cfg.dropout, cfg.bias)


def make_norm(cfg) -> nn.Module:
    return NORMS[cfg.norm](cfg.d_model)


def apply_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of x (B, n_heads_local, T, head_dim), positions 0..T-1.

    Pairs (x[..., i], x[..., i + hd/2]) are rotated by angle t * theta^(-2i/hd) (the "rotate half"
    layout of GPT-NeoX / Hugging Face Llama). The angles are computed here from T, so the model has
    no buffer to materialise and the same code runs on tensor-parallel shards (whole heads per rank)."""
    hd, T = x.size(-1), x.size(-2)
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    angles = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), inv_freq)  # (T, hd/2)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
