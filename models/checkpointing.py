"""Op-level selective activation checkpointing (`workload.activation_checkpointing=selective_op`).

torchtitan's selective AC, option "op" (pytorch/torchtitan torchtitan/parallelisms/parallelize_llama.py
at 9dec370, 2024-12-26, `_save_list` and `_custom_policy`), as brigade's blocks run it: each block is
checkpointed, and inside it the outputs of every other matmul (the 1st, 3rd, ...: q, v, then fc1 or
SwiGLU's gate and down) and of the fused attention kernel are saved; every other op (the other
matmuls, norms, RoPE, activations, casts) is recomputed in backward. The counter is per block and
per pass, so the recompute pass saves and replays the same ops. harness/costmodel/activations.py
counts what it keeps.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
# the fused attention kernels SDPA dispatches to (CUDA flash / memory-efficient / cuDNN, CPU flash)
SAVED_ATTENTION = tuple(getattr(_aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(_aten, name))


def _policy(counts: dict):
    def policy(ctx, func, *args, **kwargs):
        if func == _aten.mm.default:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            return CheckpointPolicy.MUST_SAVE if counts[key] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in SAVED_ATTENTION else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def selective_op_context():
    """context_fn for torch.utils.checkpoint.checkpoint: one fresh matmul counter per block call."""
    return create_selective_checkpoint_contexts(_policy(defaultdict(int)))
