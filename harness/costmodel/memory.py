"""Model-state memory per rank: what each engine actually holds, and the ZeRO paper's ideal.

Ideal (Rajbhandari et al. 2020, "ZeRO", section 3 and Figure 1), Ψ = parameters a rank owns after
TP/PP/EP, N = data-parallel degree:
    mixed precision: 2Ψ params + 2Ψ grads + KΨ optimizer, K = 12 (fp32 master, momentum, variance)
    fp32:            4Ψ params + 4Ψ grads + 8Ψ optimizer (momentum, variance; no master copy)
    stage 1 divides the optimizer by N, stage 2 also the grads, stage 3 also the params.

What the engines hold (one function per state_sharding, named as harness/catalog.py names them; measured = exact local tensor bytes after a step,
params / grads / optimizer state, see harness/worker/measure.py):
  replicated  single, ddp, tp, pp, ep, 3d with data_parallel=ddp: torch autocast keeps fp32 params, so
              4 B params + 4 B grads + AdamW's exp_avg and exp_avg_sq (8 B) per parameter plus a 0-d
              fp32 `step` tensor (4 B) per parameter tensor, whatever the precision. With
              strategy.low_precision_params (Megatron-LM's bf16 module, priced only): 2 B params, an fp32
              main copy (4 B, master_bytes) and fp32 main grads.
  distributed the distributed optimizer (zero1_impl=distributed, 3d data_parallel=zero1): whole params and
              grads, an even flat 1/dp slice of fp32 master + AdamW per rank (function below).
  zero1_torch torch ZeroRedundancyOptimizer: params and grads whole; whole parameters are assigned
              to ranks greedily, largest first, each to the rank with the fewest elements so far
              (ties: lowest rank), so optimizer bytes differ between ranks.
  sharded     FSDP2 fully_shard (fsdp, zero2, zero3, 3d with data_parallel=fsdp): every parameter is
              split on dim 0 in torch.chunk pieces of ceil(dim0/N) rows (the last ranks may hold
              fewer or none); grads and optimizer state follow the same split. Rank 0 holds the most.
  deepspeed   DeepSpeed ZeRO 0-3 with a client torch AdamW. Stage 0: as replicate. Stages 1/2:
              params whole, a flat fp32 master partition of ceil(Ψ/2N)*2 elements (even in fp32 runs),
              the gradient partition and AdamW state on that partition (one step tensor). Stage 3:
              each param's partition ceil(numel/N) (params at or under
              stage3_param_persistence_threshold stay whole), fp32 master, grads and AdamW on it.
              The master partition is reported as master_bytes (as the DeepSpeed strategy measures
              it), apart from optimizer_bytes; model_states_bytes is the sum of all four. (The
              paper's K = 12 counts the master as optimizer state: model_states_bytes_ideal.)
Expert tensors (kind "expert") are replicated over dp/ep ranks, so they shard over dp/ep.
"""
from __future__ import annotations

import heapq
from functools import lru_cache

from harness import catalog
from harness.costmodel.params import n_tensors, numel


def state_sharding(strategy) -> str:
    """How this strategy config holds its model states (harness/catalog.py: state_sharding)."""
    return catalog.state_sharding(strategy.name, strategy.engine, strategy.zero_stage, strategy.data_parallel,
                                  getattr(strategy, "zero1_impl", "torch_zero"))


def _chunk(dim0: int, n: int, rank: int) -> int:
    """Rows of a dim-0 torch.chunk piece on `rank` (FSDP2's _chunk_with_empty)."""
    size = -(-dim0 // n)
    return max(0, min(size, dim0 - rank * size))


def _shard_degree(kind: str, dp: int, ep: int) -> int:
    return dp // ep if kind == "expert" else dp


def _shard_index(kind: str, dp_rank: int, ep: int) -> int:
    return dp_rank // ep if kind == "expert" else dp_rank  # ep is innermost within dp


# -- one function per state_sharding: (groups, dp, ep, precision, knobs, dp_ranks) -> [(params, grads, opt, master)] bytes

def replicate(groups, dp, ep, precision, knobs, dp_ranks):
    """torch autocast: fp32 params and grads. knobs (True,): Megatron-LM's bf16 module under DDP
    (Float16OptimizerWithFloat16Params; priced, not run): bf16 params, fp32 main grads in DDP's buffer
    (bf16 accumulates and all-reduces them in fp32), an fp32 main copy of every param in the optimizer.
    That buffer is contiguous and all-reduced in place, so no bucket copies beside it (Megatron-LM's
    arguments.py turns on accumulate_allreduce_grads_in_fp32 for bf16, and megatron/model/distributed.py
    DistributedDataParallel asserts use_contiguous_buffers with it), where torch's DDP keeps them."""
    n = numel(groups)
    if knobs and knobs[0]:
        one = (2 * n, 4 * n, 8 * n + 4 * n_tensors(groups), 4 * n)
        return [one for _ in dp_ranks]
    one = (4 * n, 4 * n, 8 * n + 4 * n_tensors(groups), 0)
    return [one for _ in dp_ranks]


def zero1_torch(groups, dp, ep, precision, knobs, dp_ranks):
    n = numel(groups)
    sizes = sorted((d0 * r for c, d0, r, _ in groups for _ in range(c)), reverse=True)
    load = [[0, 0] for _ in range(dp)]  # elements, tensors per rank
    heap = [(0, r) for r in range(dp)]  # (elements so far, rank): ties -> lowest rank, as _get_min_index
    for size in sizes:
        elems, r = heapq.heappop(heap)
        load[r][0] += size
        load[r][1] += 1
        heapq.heappush(heap, (elems + size, r))
    return [(4 * n, 4 * n, 8 * load[d][0] + 4 * load[d][1], 0) for d in dp_ranks]


def fsdp(groups, dp, ep, precision, knobs, dp_ranks):
    out = []
    for d in dp_ranks:
        local = sum(c * _chunk(d0, _shard_degree(k, dp, ep), _shard_index(k, d, ep)) * r for c, d0, r, k in groups)
        out.append((4 * local, 4 * local, 8 * local + 4 * n_tensors(groups), 0))
    return out


def deepspeed(groups, dp, ep, precision, knobs, dp_ranks):
    # (the deepspeed engine) knobs may carry strategy.offload third: ZeRO-Offload keeps the
    # master, its grads and AdamW (optimizer) and also the param partition (optimizer+params) in
    # host memory; the engine reports those under measured.deepspeed.offloaded_bytes, not here.
    stage, threshold, *rest = knobs
    host = {"optimizer": (1, 2, 3), "optimizer+params": (0, 1, 2, 3)}.get(rest[0] if rest else "none", ())
    return [tuple(0 if i in host else b for i, b in enumerate(one))
            for one in _deepspeed_resident(groups, dp, ep, precision, stage, threshold, dp_ranks)]


def _deepspeed_resident(groups, dp, ep, precision, stage, threshold, dp_ranks):
    e = catalog.PRECISION_BYTES[precision]
    n = numel(groups)
    if stage == 0:
        if precision == "fp32":
            return replicate(groups, dp, ep, precision, (stage, threshold), dp_ranks)
        # BF16_Optimizer / FP16 optimizer: 16-bit params and grads, fp32 master and its grads, AdamW
        one = (e * n, e * n + 4 * n, 8 * n + 4, 4 * n)
        return [one for _ in dp_ranks]
    if stage in (1, 2):
        # (the deepspeed engine) MoE: DeepSpeed keeps one flat buffer per optimizer param group
        # (split_params_into_different_moe_groups_for_optimizer: dense, experts); the expert group is
        # partitioned over the expert-data-parallel group (dp/ep ranks), not dp, and each group has
        # its own AdamW step tensor. Each buffer is padded to nccl_start_alignment_factor (2) * its ranks.
        part, n_groups = 0, 0
        for kind in ("dense", "expert"):
            n_kind = sum(c * d0 * r for c, d0, r, k in groups if k == kind)
            if n_kind:
                shard = _shard_degree(kind, dp, ep)
                part += -(-n_kind // (2 * shard)) * 2 * shard // shard
                n_groups += 1
        one = (e * n, 4 * part, 8 * part + 4 * n_groups, 4 * part)
        return [one for _ in dp_ranks]
    part = sum(c * (d0 * r if d0 * r <= threshold else -(-(d0 * r) // dp)) for c, d0, r, _ in groups)
    one = (e * part, 4 * part, 8 * part + 4, 4 * part)
    return [one for _ in dp_ranks]


def distributed(groups, dp, ep, precision, knobs, dp_ranks):
    """The distributed optimizer (harness/strategies/distributed_optimizer.py): params and grads whole,
    one flat buffer of n elements split evenly, s = ceil(n / dp) each: an fp32 master slice (4 s),
    AdamW's moments on it (8 s) and one step tensor. knobs (True,): low-precision params (2 B each)
    and a persistent fp32 gradient buffer of dp * s elements in place of the fp32 grads."""
    n = numel(groups)
    s = -(-n // dp)
    if knobs and knobs[0]:
        return [(2 * n, 4 * dp * s, 8 * s + 4, 4 * s) for _ in dp_ranks]
    return [(4 * n, 4 * n, 8 * s + 4, 4 * s) for _ in dp_ranks]


FAMILIES = {"replicated": replicate, "zero1_torch": zero1_torch, "distributed": distributed, "sharded": fsdp, "deepspeed": deepspeed}


@lru_cache(maxsize=65536)
def model_states(fam: str, groups: tuple, dp: int, ep: int, precision: str, knobs: tuple,
                 all_ranks: bool) -> tuple:
    """Per dp rank (params, grads, optimizer, master) bytes; only dp rank 0 unless all_ranks, except
    ZeroRedundancyOptimizer whose most loaded rank is not known in advance."""
    ranks = range(dp) if all_ranks or fam == "zero1_torch" else (0,)
    return tuple(FAMILIES[fam](groups, dp, ep, precision, knobs, ranks))


def ideal_model_states(psi: int, dp: int, zero_stage: int, precision: str) -> int:
    """The ZeRO paper's bytes per device for Ψ parameters at stage `zero_stage` over dp ranks."""
    p, g, o = (4, 4, 8) if precision == "fp32" else (2, 2, 12)
    if zero_stage >= 1:
        o /= dp
    if zero_stage >= 2:
        g /= dp
    if zero_stage >= 3:
        p /= dp
    return round(psi * (p + g + o))


def comm_buffer_bytes(fam: str, zero_stage: int, grads_bytes: int, bucket_cap_mb: float, ds_knobs,
                      elem_bytes: int = 4, numel: float = float("inf")) -> int:
    """Persistent buffers the engine keeps besides the model states.
    DDP's reducer (gradient_as_bucket_view=False) keeps flat bucket copies of every gradient;
    DeepSpeed keeps a reduce bucket of reduce_bucket_size elements in the engine's dtype (`elem_bytes`:
    its parameters', 2 under bf16 and fp16), and under stage 3 up to its prefetch bucket of gathered
    parameters, no more than the rank's `numel` (measured against dry runs: tests/test_dryrun_deepspeed.py)."""
    if fam in ("replicated", "zero1_torch"):
        return grads_bytes
    if fam == "deepspeed" and ds_knobs is not None:
        return elem_bytes * (ds_knobs[0] + (min(ds_knobs[1], ds_knobs[2], numel) if zero_stage == 3 else 0))
    return 0
