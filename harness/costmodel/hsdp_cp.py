"""Cost-model terms for HSDP (dp_replicate), context parallel (cp) and their placement: small
functions over the base estimate (estimate.py), which knows dp, tp, pp and ep only.

How a layout maps onto the base estimate (per rank, exact where the base is exact):
  - the gradient-sync group of cp is dp x cp (FSDP / DDP / distributed optimizer reduce over it),
    so model states and dp traffic are the base's at data degree dp * cp;
  - HSDP shards over dp_shard (x cp): states and the shard group's all-gathers / reduce-scatters
    are the base's at data degree dp_shard * cp; the replicas add hsdp_replicate_bytes;
  - everything per token (FLOPs, tp all-reduces, pp sends) runs on s / cp tokens of each sequence:
    the base's figures / cp. Attention FLOPs are unchanged in total: the load-balanced chunks
    (harness/strategies/cp.py) give every rank 1/cp of the causal work;
  - memory is the base's at mb / cp sequences a micro-batch (`local`): its per-token terms
    (activations, the logits and loss) are linear in the sequences a rank holds, and attention's keep
    their dependence on the whole s, as a rank's queries attend to all s keys; its model states, FSDP's
    gathered units and autocast's weight copies do not depend on tokens. Plus cp's mask, (s / cp) x s,
    made once and shared by every layer: SDPA's additive bias in the compute dtype (else a boolean).
Time of the added collectives: α-β (comm.time_s) on the link their placement gives (ranks of a
group within one node: intra). HSDP's replica all-reduces overlap the backward on a GPU
(replicate_exposed_s), exposed in full on a CPU; cp's are exposed in full, as estimate.py treats tp.
"""
from __future__ import annotations

from harness.catalog import PRECISION_BYTES
from harness.costmodel import comm
from harness.costmodel.estimate import overlap_interference_s
from harness.costmodel.memory_peak import peak_terms

PER_TOKEN = ("compute_time_s", "matmul_time_s", "bubble_time_s", "comm_tp_bytes",
             "comm_tp_time_s", "comm_pp_bytes", "comm_pp_time_s", "compute_gemm_time_s", "compute_attention_time_s",
             "compute_elementwise_time_s", "compute_optimizer_time_s")


STATES = ("params_bytes", "grads_bytes", "optimizer_bytes", "master_bytes", "model_states_bytes")
# what HSDP's shard group holds decides the peak too (its states, FSDP's gathered units and buffers)
MEMORY = ("fsdp_unsharded_bytes", "transient_bytes", "comm_buffer_bytes", "allocator_bytes", "peak_mem_bytes",
          "peak_mem_terms", "peak_mem_phase", "peak_mem_pp_rank", "grads_at_peak_bytes", "memory_headroom_bytes",
          "fits_in_memory")
# what a cp rank's tokens decide (module docstring): taken from the base at mb / cp sequences
CP_MEMORY = ("activations_bytes", *MEMORY)
_STATES_MEMORY = tuple((key, f"{key}_per_rank") for key in STATES + MEMORY)


def shard_rank(dims, rank: int) -> int:
    """A world rank's index in the estimate at data degree dp_shard * cp (HSDP): its replica dropped."""
    c = dims.coords(rank)
    return (c["pp"] * dims.dp_shard * dims.cp + c["dp_shard"] * dims.cp + c["cp"]) * dims.tp + c["tp"]


def base_data_degree(dims, hsdp_sharded: bool) -> int:
    """The data degree the base estimate runs at for this layout (see the module docstring)."""
    return (dims.dp_shard if hsdp_sharded else dims.dp) * dims.cp


def cp_comm_bytes(mb: int, m: int, seq_len: int, d_model: int, tp: int, cp: int, layers: int, precision: str,
                  ckpt: str) -> tuple[float, int]:
    """(bytes one rank sends on the cp axis per step, collective calls). Per layer and micro-batch:
    K and V all-gathered forward, their grads reduce-scattered backward, each (cp-1) x the local
    (mb, s/cp, h/tp) tensor (nccl-tests bus bytes); checkpointing that re-runs attention gathers again."""
    if cp <= 1:
        return 0.0, 0
    local = mb * (seq_len // cp) * (d_model // tp) * PRECISION_BYTES[precision]
    per_layer = 4 + (2 if ckpt in ("selective", "full") else 0)
    calls = m * layers * per_layer
    return calls * (cp - 1) * local, calls


def hsdp_replicate_bytes(grad_shard_bytes: float, replicate: int, reductions: int) -> float:
    """Bytes one rank sends on the dp_replicate axis per step: the reduce-scattered fp32 grad shard
    all-reduced over the R replicas (FSDP2 HSDP), 2(R-1)/R of it, `reductions` times (1 per step,
    or m with fsdp_accumulate=sharded)."""
    return reductions * comm.volume("all_reduce", replicate, grad_shard_bytes)


def replicate_exposed_s(rep_s: float, shard: dict, calls: int, can_overlap: bool) -> float:
    """What of the replicas' all-reduces no compute hides. FSDP all-reduces each unit's reduce-scattered
    gradient shard over the replicas right after that reduce-scatter, during the rest of the backward
    (torch FSDP1 _post_backward_hook -> _reduce_grad, FSDP2 foreach_reduce: both per unit, on the
    reduction stream), so it queues behind the shard group's collectives in the backward window: exposed
    = the last unit's all-reduce + what the shard group's dp traffic and it together leave beyond the
    backward (2/3 of the micro-batches' compute, as step_time.py's backward_each), less what the shard
    group's traffic left exposed there already. On a CPU nothing hides (step_time.py): exposed in full."""
    if not can_overlap:
        return rep_s
    window = (shard["compute_time_s"] - shard["optimizer_time_s"]) * 2 / 3
    dp_s = shard["comm_dp_time_s"]
    return min(rep_s, max(0.0, dp_s + rep_s - window) - max(0.0, dp_s - window) + rep_s / max(1, calls))


def _link(hw, coll: str, n: int, stride: int, ranks_per_node: int):
    return comm.collective_link(hw, coll, n, stride, ranks_per_node)


def adjust(out: dict, shard: dict | None, md, w, fsdp_accumulate: str, dims, hw, m: int,
           local: dict | None = None) -> dict:
    """The base prediction `out` (at data degree dp * cp) -> this layout's. `shard`: the base at
    dp_shard * cp for HSDP (its model states and shard-group traffic), else None. `local` (cp > 1): the
    base at mb / cp sequences a micro-batch and the data degree whose states the layout holds (dp_shard
    * cp with HSDP): its memory is a cp rank's. `md` is the model config, `w` the workload
    (micro_batch_size, precision, activation_checkpointing): predict passes the run's, the planner its
    candidate's."""
    cp = dims.cp
    if cp > 1 and local is None:
        raise ValueError("context parallel needs the base estimate at mb / cp sequences (`local`)")
    if shard is not None:  # HSDP: states and the shard group's traffic are the shard group's
        ranks = None  # rank r of the world is rank shard_rank(r) of the shard group's estimate (same rank order)
        for key, per_rank in _STATES_MEMORY:
            if key in shard:
                out[key] = shard[key]
            if isinstance(shard.get(per_rank), list):
                ranks = ranks or [shard_rank(dims, r) for r in range(dims.world_size)]
                out[per_rank] = [shard[per_rank][i] for i in ranks]
        # the shard group's dp collectives replace the whole group's: their time, and what of it shows
        extra_dp_s = shard["comm_dp_time_s"] - out["comm_dp_time_s"]
        extra_dp_exposed_s = shard["comm_dp_exposed_time_s"] - out["comm_dp_exposed_time_s"]
        out["comm_dp_bytes"], out["comm_dp_time_s"] = shard["comm_dp_bytes"], shard["comm_dp_time_s"]
        out["comm_dp_exposed_time_s"] = shard["comm_dp_exposed_time_s"]
        reductions = m if fsdp_accumulate == "sharded" else 1
        rep_bytes = hsdp_replicate_bytes(shard["grads_bytes_most"], dims.dp_replicate, reductions)
        rpn = out.get("ranks_per_node", dims.world_size)
        link = _link(hw, "all_reduce", dims.dp_replicate, dims.dp_shard * cp * dims.tp, rpn)
        units = md.n_layers // dims.pp + 1  # one all-reduce per FSDP unit and reduction
        rep_s = reductions * units * link.alpha_s + rep_bytes / link.bw_Bps
        rep_exposed_s = replicate_exposed_s(rep_s, shard, reductions * units, hw.device != "cpu")
        out["comm_dp_replicate_bytes"], out["comm_dp_replicate_time_s"] = rep_bytes, rep_s
        out["comm_dp_replicate_exposed_time_s"] = rep_exposed_s
        # the compute under the shard group's and the replicas' overlapped collectives (estimate.py)
        interference_s = overlap_interference_s(hw, shard["comm_time_s"] - shard["comm_exposed_time_s"]
                                                + rep_s - rep_exposed_s, shard["compute_time_s"])
        extra_interference_s = interference_s - out["comm_interference_time_s"]
        out["comm_interference_time_s"] = interference_s
        out["step_time_s"] += extra_dp_exposed_s + rep_exposed_s + extra_interference_s
        out["comm_time_s"] += extra_dp_s + rep_s
        out["comm_exposed_time_s"] += extra_dp_exposed_s + rep_exposed_s
    if cp > 1:
        old = {k: out.get(k) for k in ("matmul_time_s", "bubble_time_s", "comm_tp_time_s", "comm_pp_time_s")}
        for key in PER_TOKEN:
            if isinstance(out.get(key), (int, float)):
                out[key] = out[key] / cp
        # the mask, held once: SDPA's additive bias in the compute dtype, the other attentions' boolean mask
        mask_bytes = (md.seq_len // cp) * md.seq_len * (PRECISION_BYTES[w.precision] if md.attention == "sdpa" else 1)
        for key in CP_MEMORY:
            if key in local:
                out[key] = local[key]
            if isinstance(local.get(f"{key}_per_rank"), list):
                out[f"{key}_per_rank"] = list(local[f"{key}_per_rank"])
        if isinstance(out.get("activations_bytes_per_rank"), list):
            out["activations_bytes_per_rank"] = [a + mask_bytes for a in out["activations_bytes_per_rank"]]
        out["activations_bytes"] += mask_bytes
        terms = {k: v for k, v in out["peak_mem_terms"].items() if k != "allocator"}
        out["peak_mem_terms"] = peak_terms({**terms, "cp_mask": mask_bytes}, hw.allocator_overhead)
        out["allocator_bytes"] = out["peak_mem_terms"].get("allocator", 0)
        out["peak_mem_bytes"] = sum(out["peak_mem_terms"].values())
        out["memory_headroom_bytes"] = hw.memory_bytes - out["peak_mem_bytes"]
        out["fits_in_memory"] = out["peak_mem_bytes"] <= hw.memory_bytes
        saved = sum((v or 0.0) for v in old.values()) * (1 - 1 / cp)
        cp_bytes, calls = cp_comm_bytes(w.micro_batch_size, m, md.seq_len, md.d_model, dims.tp, cp,
                                        md.n_layers // dims.pp, w.precision, w.activation_checkpointing)
        rpn = out.get("ranks_per_node", dims.world_size)
        link = _link(hw, "all_gather", cp, dims.tp, rpn)
        cp_s = calls * link.alpha_s + cp_bytes / link.bw_Bps
        out["comm_cp_bytes"], out["comm_cp_time_s"] = cp_bytes, cp_s
        out["step_time_s"] += cp_s - saved
        out["comm_time_s"] += cp_s
        out["comm_exposed_time_s"] += cp_s
    out.setdefault("comm_cp_bytes", 0.0)
    out.setdefault("comm_dp_replicate_bytes", 0.0)
    tokens = w.micro_batch_size * m * dims.dp * md.seq_len
    out["tokens_per_s"] = tokens / out["step_time_s"]
    out["tokens_per_s_per_device"] = out["tokens_per_s"] / dims.world_size
    return out
