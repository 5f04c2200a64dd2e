"""Context parallel (3d, `parallel.cp`): the sequence split over cp ranks, attention over the whole.

Load-balanced split (Llama 3 paper, section 3.3.2; Megatron's and torchtitan's): the T tokens are
cut into 2*cp chunks of c = T / (2 cp); cp rank i holds chunks i and 2cp-1-i, so under the causal
mask every rank does the same attention work (an early chunk attends to little, a late one to much).

Attention, per layer and micro-batch (B sequences, h_l = h / tp, e bytes per element): each rank
projects q, k, v of its 2c tokens, all-gathers k and v over the cp group (the Llama 3 method, not
ring attention: K/V are small beside Q for GQA and the gather overlaps nothing on CPU anyway), and
attends its queries to all T keys with the mask key_pos <= query_pos (the gathered keys are in rank
order, not position order, so the mask is built from positions, not as a triangle).
    forward : 2 all-gathers, (cp-1) * B * 2c * h_l * e bytes sent per rank each
    backward: 2 reduce-scatters of dK, dV (the all-gather's gradient), the same bytes each
    (activation checkpointing that re-runs attention re-gathers: 2 more all-gathers)
Everything else is per token: embeddings (at the rank's own positions), MLP, norms and the loss on
its 2c tokens. The loss is the mean over the rank's tokens; FSDP / DDP average gradients over
dp x cp (torchtitan's dp_shard_cp), which is the gradient of the mean over all tokens because every
rank holds the same number of tokens.

Why not torch's `context_parallel`: in torch 2.13 it swaps the CUDA SDPA kernels (flash, efficient,
cudnn) for ring attention; the CPU kernel (_scaled_dot_product_flash_attention_for_cpu) is not in
its table, so on gloo/CPU it would silently run unsplit attention (docs/notes.md#context-parallel).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_gather_tensor_autograd, wait_tensor

# Imports inside functions: the parts of torch, DeepSpeed and brigade that only some strategies, devices or
# modes use.


def local_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """The token positions cp rank `cp_rank` holds: chunks cp_rank and 2cp-1-cp_rank, in that order."""
    c = seq_len // (2 * cp)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c)
    second = torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c)
    return torch.cat([first, second])


class ContextParallelAttention:
    """Attention.core under context parallel: q of this rank's tokens, k / v gathered over cp."""

    def __init__(self, group, seq_len: int, cp: int, cp_rank: int, device):
        self.group = group
        q_pos = local_positions(seq_len, cp, cp_rank)
        k_pos = torch.cat([local_positions(seq_len, cp, r) for r in range(cp)])  # all-gather order
        self.mask = (k_pos[None, :] <= q_pos[:, None]).to(device)  # (2c, T): True = may attend
        self._bias: dict = {}  # dtype -> the mask as SDPA's additive bias (0 or -inf)

    def bias(self, dtype):
        """The mask as an additive bias in the queries' dtype, made once and shared by every layer. Given
        the boolean mask, SDPA converts it per call (aten.where) and keeps that (2c, T) copy for backward:
        one per layer and micro-batch in flight, 2 GiB on llama3_8b at s 8192, cp 2 (its dry run)."""
        if dtype not in self._bias:
            self._bias[dtype] = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill_(
                ~self.mask, float("-inf"))
        return self._bias[dtype]

    def __call__(self, q, k, v, dropout_p: float, attention: str):
        # q, k, v: (B, nh_local, 2c, hs) -> k, v: (B, nh_local, T, hs)
        k = wait_tensor(all_gather_tensor_autograd(k.contiguous(), 2, self.group))
        v = wait_tensor(all_gather_tensor_autograd(v.contiguous(), 2, self.group))
        if attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias(q.dtype), dropout_p=dropout_p)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, nh, 2c, T)
        att = F.dropout(att.masked_fill(~self.mask, float("-inf")).softmax(dim=-1), dropout_p)
        return att @ v


def cp_group(dims):
    """This rank's cp process group, made for the K/V exchange alone (every rank must call this, in
    the same order). Not mesh["cp"]: at dp = 1 torch may hand the dp x cp gradient group and the cp
    group out as one process group, and the profiled window could not tell FSDP's traffic from
    attention's (harness/worker/measure.py names a group's axis by identity)."""
    import torch.distributed as dist

    group, _ = dist.new_subgroups_by_enumeration(dims.groups("cp"))
    return group


def apply_context_parallel(module, group, run, dims, cp_rank: int, device):
    """Give every attention of `module` (a model or a pipeline stage) the cp core, and its
    embeddings (if it has them) this rank's positions."""
    core = ContextParallelAttention(group, run.model.seq_len, dims.cp, cp_rank, device)
    for block in module.blocks.values():
        block.attn.context_parallel = core
    module.positions = local_positions(run.model.seq_len, dims.cp, cp_rank).to(device)
    return module


def shard_sequence(microbatches, positions: torch.Tensor):
    """Each micro-batch's (inputs, targets) -> this rank's tokens of them (same positions for both:
    targets[t] is the token after inputs[t])."""
    return [(x[:, positions], y[:, positions]) for x, y in microbatches]
