"""The training loss: mean next-token cross-entropy over every token of a micro-batch, two ways
(config `model.loss`). N = B*T tokens, V the vocabulary, e the logits' dtype in bytes (the head's
output: 2 under bf16/fp16 autocast or a cast model, 4 in fp32), c = model.loss_chunk_tokens.

    fp32     F.cross_entropy(logits.float()). Autograd saves the (N, V) fp32 log-softmax from forward
             to backward (4 V bytes per token) and its backward writes fp32 gradients of the
             log-softmax and of its input (8 V per token) before casting back to the logits' dtype:
             about 12 V bytes per token at the loss.
    chunked  ChunkedCrossEntropy below. Forward saves the logits as they are (e V per token) and one
             fp32 log-sum-exp per token (4 B), computing it c tokens at a time; backward writes
             d loss / d logits = (softmax - one_hot) / N into one (N, V) tensor of the logits' dtype,
             c tokens at a time. Held at the loss: 2 e V per token + 4 c V for one chunk's fp32
             working copy (the only fp32 (c, V) buffer alive in either pass). The same math in fp32,
             so the loss and gradients equal fp32's to rounding; what llm-foundry's default
             `fused_crossentropy` (flash-attn's CrossEntropyLoss: logits, an fp32 lse per token and a
             gradient in the logits' dtype) holds, less its fused kernel's speed.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """model.loss=fp32: logits (B, T, V), targets (B, T) -> mean over the B*T tokens (fp32)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


class ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits (N, V) against targets (N,), c rows at a time (module docstring)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        n = logits.size(0)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)  # fp32 log-sum-exp per token
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for i in range(0, n, chunk):
            x, t = logits[i:i + chunk], targets[i:i + chunk]
            work = x.to(torch.float32, copy=True)  # the one (c, V) fp32 buffer (a copy even for fp32 logits)
            peak = work.amax(dim=-1, keepdim=True)
            lse[i:i + chunk] = work.sub_(peak).exp_().sum(dim=-1).log_() + peak.squeeze(-1)
            del work
            total += (lse[i:i + chunk] - x.gather(-1, t.unsqueeze(-1)).squeeze(-1).float()).sum()
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunk = chunk
        return total / n

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        n, chunk = logits.size(0), ctx.chunk
        scale = grad_out.float() / n
        grad = torch.empty_like(logits)  # d loss / d logits in the logits' dtype, as the head's backward takes it
        for i in range(0, n, chunk):
            t = targets[i:i + chunk]
            work = logits[i:i + chunk].to(torch.float32, copy=True)
            work.sub_(lse[i:i + chunk].unsqueeze(-1)).exp_()  # softmax
            work.scatter_add_(-1, t.unsqueeze(-1), torch.full_like(work[:, :1], -1.0))  # - one_hot
            grad[i:i + chunk].copy_(work.mul_(scale))
            del work
        return grad, None, None


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """model.loss=chunked: logits (B, T, V), targets (B, T) -> mean over the B*T tokens (fp32)."""
    if hasattr(logits, "placements"):  # harness/validate.py refuses this before launch
        raise ValueError("model.loss=chunked takes plain (B, T, V) logits, not vocabulary-sharded DTensors "
                         "(strategy.loss_parallel=true): use model.loss=fp32 or strategy.loss_parallel=false")
    return ChunkedCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(0, 1), chunk_tokens)


def loss_function(model_cfg):
    """The loss `model.loss` names, as f(logits (B, T, V), targets (B, T)) -> scalar mean."""
    name = model_cfg.loss
    if name == "fp32":
        return cross_entropy
    if name == "chunked":
        return functools.partial(chunked_cross_entropy, chunk_tokens=model_cfg.loss_chunk_tokens)
    raise ValueError(f"unknown model.loss '{name}'; available: {', '.join(LOSSES)}")


LOSSES = ("fp32", "chunked")  # harness/validate.py MODEL_OPTIONS["loss"] lists the same (tests/test_loss.py)
