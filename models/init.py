"""Materialise a meta-device model: allocate only this rank's shards, then initialise them so that
the full initial weights never depend on how the model is sharded.

Initialisation (GPT-2's, as models/gpt.py always used): Linear and Embedding weights ~ N(0, 0.02);
the residual projections (attn.o, fc2, down) ~ N(0, 0.02 / sqrt(2 L)) so the residual stream's
variance holds over depth; norm weights 1; biases 0.

Randomness, chosen so every sharding sees the same full tensor: the rows of parameter `name` are
cut into blocks of ROWS_PER_SEED rows, and block k is drawn whole from a CPU generator seeded by
hash(seed, name, k). A rank holding rows [o, o + n) of a (DTensor) shard draws only the blocks that
cover them and slices its columns, so it allocates its shard plus at most two partial blocks, never
the full parameter, and no rank talks to another. The local shard's global offset comes from
DTensor's own `compute_local_shape_and_global_offset` (it handles FSDP-over-TP `_StridedShard`).
DTensor's RNG tracker is not used: on a CPU mesh torch 2.13 does not support it
(`is_rng_supported_mesh` is False), and its Philox offsets would tie values to CUDA.

Tied parameters (model.tie_embeddings) share one Parameter; `to_empty` allocates one per module,
so ties are recorded before and restored after (`tied_names` / `retie`).
"""
from __future__ import annotations

import hashlib
import math

import torch
import torch.nn as nn

ROWS_PER_SEED = 256
INIT_STD = 0.02
RESIDUAL_PROJECTIONS = ("attn.o.weight", "fc2.weight", "down.weight")
NORMS = (nn.LayerNorm, nn.RMSNorm)


def _seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def tied_names(module: nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one Parameter (e.g. ["tok_emb.weight", "head.weight"])."""
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def retie(module: nn.Module, groups: list[list[str]]) -> None:
    """Make every name of each group point at the first name's Parameter again."""
    for first, *others in groups:
        p = module.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, p)


def _std(name: str, n_layers: int) -> float:
    return INIT_STD / math.sqrt(2 * n_layers) if name.endswith(RESIDUAL_PROJECTIONS) else INIT_STD


def _local_view(p: torch.Tensor):
    """(local tensor, global shape, global offset of the local tensor) of a plain or DTensor parameter."""
    if hasattr(p, "device_mesh"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = p.to_local()
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        assert tuple(shape) == tuple(local.shape), (shape, local.shape, p.placements)
        return local, tuple(p.shape), tuple(offset)
    return p, tuple(p.shape), (0,) * p.dim()


def normal_shard(name: str, seed: int, std: float, global_shape: tuple, offset: tuple, shape: tuple) -> torch.Tensor:
    """Rows [offset[0], offset[0] + shape[0]) x the other dims' slices of the full N(0, std) tensor
    that parameter `name` has under `seed`, drawing only the row blocks that cover them (CPU)."""
    rows = global_shape[0]
    first, last = offset[0], offset[0] + shape[0]
    blocks = []
    for k in range(first // ROWS_PER_SEED, (last - 1) // ROWS_PER_SEED + 1):
        n = min(ROWS_PER_SEED, rows - k * ROWS_PER_SEED)
        g = torch.Generator().manual_seed(_seed(seed, name, k))
        blocks.append(torch.randn((n, *global_shape[1:]), generator=g))
    out = torch.cat(blocks)[first - (first // ROWS_PER_SEED) * ROWS_PER_SEED:][: shape[0]]
    for dim in range(1, len(shape)):
        out = out.narrow(dim, offset[dim], shape[dim])
    return out * std


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, n_layers: int) -> None:
    """Fill every (local shard of every) parameter of `module` in place; names are the full model's
    (pipeline stages and FSDP keep them), so values match the whole model's element for element."""
    norm_params = {f"{m_name}.{p_name}".lstrip(".") for m_name, m in module.named_modules() if isinstance(m, NORMS)
                   for p_name, _ in m.named_parameters(recurse=False)}
    for name, p in module.named_parameters():
        local, global_shape, offset = _local_view(p)
        if local.numel() == 0:
            continue
        if name.endswith(".bias"):
            local.zero_()
        elif name in norm_params:
            local.fill_(1.0)
        else:
            local.copy_(normal_shard(name, seed, _std(name, n_layers), global_shape, offset, tuple(local.shape)))


def materialize(module: nn.Module, device, seed: int) -> nn.Module:
    """Allocate `module`'s local shards on `device` (it was built and sharded on meta) and initialise
    them. Call after tensor parallel / FSDP / the pipeline split and before DDP wraps the module."""
    from torch._subclasses.fake_tensor import is_fake

    ties = tied_names(module)
    module.to_empty(device=device)
    retie(module, ties)
    if not any(is_fake(p) for p in module.parameters()):  # a dry run's fake tensors hold no values
        init_parameters(module, seed, module.cfg.n_layers)
    return module
