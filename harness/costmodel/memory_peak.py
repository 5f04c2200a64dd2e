"""Peak device memory of the worst rank for one micro-batching and checkpointing mode.

    peak = model states at the peak (memory.py) + persistent communication buffers + unsharded FSDP
           state held across passes + max(the loss phase, the end of backward)
         + the allocator's overhead on all of it (a named fraction of the profile; 0 where unmeasured)
    loss phase       activations in flight (activations.py), autocast's bf16 weight copies (one set per
                     micro-batch in flight) + the largest transient, with last step's gradients only
                     where they live then (below)
    end of backward  the gradients + FSDP's gathered units + a pipeline rank's other micro-batches in
                     flight (one fewer than at the loss) and its stage-boundary tensors
Gradients: every torch strategy frees them at the step's start (zero_grad(set_to_none)) and backward
makes them again, so at the loss of the step's only micro-batch none exist; they do with gradient
accumulation (m > 1) and in DeepSpeed, whose gradient partitions are the engine's buffers. A pipeline
rank holds its most micro-batches at its first backward, before any gradient exists; it holds as many
again with gradients only where a forward follows that backward, i.e. where fewer than all m are in
flight (1F1B with m > pp - rank; never under GPipe, which runs every forward first).
Transients: the loss's gradients (and chunked's fp32 chunk buffer) at the loss; an FSDP unit's
gathered params, the prefetched next unit's and its unsharded grads (3 units); one block's
activations while full recompute reruns it.
FSDP: the root unit (embeddings, final norm, head) keeps its params gathered from forward to backward
(harness/strategies/fsdp.py, reshard_after_forward=None for the root). Accumulation:
fsdp_accumulate=unsharded keeps every block's grads unsharded in the reduce dtype (fp32 under
bf16-mixed: twice the gathered params' bytes) and, resharding after forward, its params gathered
between micro-batches; sharded reduce-scatters each micro-batch's grads and
reshards, so nothing is held between micro-batches.
"""
from __future__ import annotations

from dataclasses import dataclass

from harness import catalog
from harness.costmodel import activations as act
from harness.costmodel import ds_zero3, params
from harness.costmodel import memory as mem

# The terms of a predicted peak, in the order `python -m harness.predict` prints them: key -> what it is.
# A peak's terms are whole bytes on one rank at one moment and add up to its peak exactly.
TERMS = {
    "params": "parameters",
    "master": "fp32 master copy of the parameters (the optimizer's)",
    "optimizer": "optimizer state (AdamW's moments and step)",
    "grads": "gradients alive at the peak",
    "half_grads": "16-bit gradients backward made, added to the fp32 buffer once it ends (runtime.grad_accumulation)",
    "comm_buffers": "gradient communication buffers (DDP's bucket copies, DeepSpeed's buckets)",
    "fsdp_held": "unsharded parameters and gradients held across passes (FSDP; DeepSpeed ZeRO-3's kept gathered)",
    "layer_activations": "activations the layers keep for backward, every micro-batch in flight",
    "head_activations": "the last stage's final norm, head and loss activations",
    "autocast_copies": "autocast's 16-bit weight copies, one set per micro-batch in flight",
    "stage_outputs": "pipeline stage outputs kept for their micro-batch's backward",
    "logits": "the last stage's logits, kept until their micro-batch's backward",
    "weight_pass_captures": "output gradients captured for deferred weight passes (split backward)",
    "pp_recv_buffers": "pipeline receive buffers (torch's stages: one per micro-batch of the step each way; "
                       "pp_recv_buffers=in_flight, Megatron's: one at a time)",
    "cp_mask": "context parallel's attention mask",
    "transient_loss": "transient: the loss's gradients (chunked: and its fp32 chunk)",
    "transient_fsdp": "transient: FSDP's gathered units (the one running, the next prefetched, its gradients)",
    "transient_fsdp_reduce": "transient: FSDP's unit being reduced (its gathered parameters, its gradients in the "
                             "reduce dtype), the next unit gathered ahead, the root unit's gradients",
    "transient_recompute": "transient: one block's activations (and autocast's weight copies) while recompute reruns it",
    "transient_autocast_cache": "transient: autocast's cached weight copies through a forward of checkpointed blocks",
    "allocator": "the caching allocator's overhead (runtime.allocator_overhead, else hardware compute.allocator_overhead)",
}
STATE_TERMS = ("params", "master", "optimizer", "grads")
CHECKPOINTED_BLOCKS = ("full", "selective_op")  # modes that checkpoint whole blocks (models/gpt.py)
# what autograd keeps for backward (activations_bytes): every activation term but the receive buffers
ACTIVATION_TERMS = ("layer_activations", "head_activations", "autocast_copies", "stage_outputs", "logits",
                    "weight_pass_captures", "cp_mask")
TRANSIENT_TERMS = ("transient_loss", "transient_fsdp", "transient_fsdp_reduce", "transient_recompute",
                   "transient_autocast_cache")


@dataclass(slots=True)
class MemoryPeak:
    rank: object  # layout.PipelineRank with the highest peak
    phase: str  # loss | end of backward
    terms: dict  # TERMS key -> whole bytes at the peak, in TERMS' order; zero terms left out
    activations_most: float = 0.0  # the most any rank's activations reach (activations_at_most)

    @property
    def peak_bytes(self) -> int:
        return sum(self.terms.values())

    def bytes_of(self, keys) -> int:
        terms = self.terms
        return sum([terms[k] for k in keys if k in terms])

    @property
    def grads_bytes(self) -> int:
        return self.terms.get("grads", 0)


def peak_terms(parts: dict, allocator_overhead: float) -> dict:
    """The named parts of a peak (bytes, any order) as TERMS: whole bytes, in TERMS' order, zeros left out,
    with the allocator's overhead on their sum."""
    terms = {k: round(parts[k]) for k in TERMS if parts.get(k)}
    if allocator_overhead:
        terms["allocator"] = round(allocator_overhead * sum(terms.values()))
    return terms


def rank_activation_terms(lo, rank, mb: int, m: int, ckpt: str, rest: bool = False) -> dict:
    """Activations a pipeline rank holds at its peak, by term: its layers x micro-batches in flight, the
    head x the last stage's micro-batches in flight (activations.last_stage_in_flight), its stages'
    boundary tensors (stage_boundary_terms) and deferred weight passes' captures. rest: at the end of its
    first backward, when one micro-batch in flight fewer is left."""
    pt, pl = lo.per_token, lo.place
    layers = rank.layers * pt.layer_activation_bytes[ckpt] * mb
    head = pt.head_activation_bytes * mb if rank.last else 0.0
    if pl.pp == 1:
        return {} if rest else {"layer_activations": layers, "head_activations": head}
    head_flight = act.last_stage_in_flight(lo.strategy.schedule, pl.pp, pl.vpp, m)
    # the largest of the rank's possible peaks: chunks held (each a 1/vpp micro-batch, whole until its
    # weight pass: at llama3_70b a deferred chunk's dry run holds all of it), `deferred` of them keeping
    # their weight pass's captured gradients
    best, most, cache = {}, -1.0, lo.gemm_cache
    for held, deferred in act.split_backward_front(lo.strategy.schedule, pl.pp, pl.vpp, m, rank.pp_rank):
        key = ("stage_boundary", rank.pp_rank, mb, m, held)  # no checkpointing in these: once for every mode
        if key not in cache:
            cache[key] = stage_boundary_terms(lo, rank, mb, m, held / pl.vpp)
        capture = 0.0
        if deferred:
            if (ckey := ("weight_pass_capture", rank.pp_rank, mb)) not in cache:
                cache[ckey] = weight_pass_capture_bytes(lo, rank, mb)
            capture = deferred * cache[ckey]
        terms = {"layer_activations": layers * (held / pl.vpp - rest), "head_activations": head * (head_flight - rest),
                 **cache[key], "weight_pass_captures": capture}
        if (total := sum(terms.values())) > most:
            best, most = terms, total
    return best


def activations_at_most(lo, rank, mb: int, m: int, ckpt: str) -> float:
    """What autograd keeps for backward on a rank when it holds its most micro-batches (its loss phase):
    the activation terms (ACTIVATION_TERMS: the receive buffers are the pipeline's, not autograd's) and
    autocast's weight copies. `activations_bytes` and its per-rank list."""
    return _autograd_bytes(lo, rank, m, ckpt, rank_activation_terms(lo, rank, mb, m, ckpt))


def _autograd_bytes(lo, rank, m: int, ckpt: str, terms: dict) -> float:
    return sum(v for k, v in terms.items() if k in ACTIVATION_TERMS) + autocast_copies_bytes(lo, rank, m, ckpt)


def weight_pass_capture_bytes(lo, rank, mb: int) -> float:
    """What one deferred weight pass keeps beyond its chunk's activations: the gradient its input pass
    captured at every weight's consumer (torch 2.13's stage_backward_input), per layer and token the
    outputs of q, k, v, o and the MLP's matrices (local widths: a column-parallel output / tp, a
    row-parallel one whole; the matmul's dtype) and of the two norms (the residual dtype), for one stage
    chunk's layers. The head's, and a MoE block's experts beyond its dense twin, are not counted."""
    md, pl, pt = lo.model, lo.place, lo.per_token
    _, h, _, d_ff, _, _, _, _, kv, mlp = md.shape[:10]
    widths = sum(out if row else out / pl.tp
                 for i, (out, inp) in enumerate(params.block_projections(h, kv, d_ff, mlp))
                 for row in [i == 3 or (i > 3 and inp == d_ff)])
    norms = 2 * h / (pl.tp if lo.strategy.sp else 1)
    per_layer = mb * md.s * (widths * pt.act_elem_bytes + norms * pt.residual_elem_bytes)
    return rank.layers / len(rank.stages) * per_layer


def stage_boundary_terms(lo, rank, mb: int, m: int, flight: float) -> dict:
    """What torch's pipeline stages hold at their edges, a residual-stream tensor (mb, s, h) each: a
    stage's output of every micro-batch in flight (kept for its backward; the next stage's input, so no
    layer counts it; the last stage's output is the logits, (mb, s, V / tp) in the matmul's dtype, which
    no loss term counts but chunked's: it goes at the micro-batch's backward, so one is held but where every
    forward runs first), and a receive buffer per micro-batch of the step, made when the
    schedule starts: for the output's gradient on every stage but the last, for the input on every
    stage but the first, of which those in flight are the first layer's saved input already
    (torch 2.13 pipelining/stage.py, _create_grad_recv_info and _create_act_recv_info). Megatron-LM's
    p2p (strategy.pp_recv_buffers=in_flight) receives into a tensor per transfer: the inputs in flight,
    and one output gradient at a time."""
    pl, st = lo.place, lo.strategy
    one = mb * lo.model.s * lo.model.h * lo.per_token.residual_elem_bytes / (pl.tp if st.sp else 1)
    not_last = sum(1 for i in rank.stages if i != pl.n_stages - 1)
    not_first = sum(1 for i in rank.stages if i != 0)
    logits = 0.0
    if rank.last and lo.per_token.loss != "chunked":
        first = catalog.schedule(st.schedule).order in ("all_forward_first", "breadth_first")
        logits = (m if first else 1) * mb * lo.model.s * lo.model.V / pl.tp * lo.per_token.act_elem_bytes
    if st.pp_recv_buffers == "in_flight":
        recv = one * not_last
    else:
        recv = one * (not_last * m + not_first * max(m - flight, 0.0))
    return {"stage_outputs": one * not_last * flight, "logits": logits, "pp_recv_buffers": recv}


def fsdp_held_bytes(lo, rank, m: int, accumulated: bool) -> float:
    """FSDP's unsharded state beyond the shards; `accumulated`: after a backward of this step, with
    gradient accumulation (the unsharded grads and, resharding after forward, the params kept)."""
    st = lo.strategy
    if st.ds_reuse and lo.place.dp > 1:  # DeepSpeed ZeRO-3 keeps these gathered from forward to backward
        return catalog.PRECISION_BYTES[lo.precision] * ds_zero3.gathered_elements(lo.model.shape, *st.ds_reuse)[2]
    if st.state_sharding != "sharded" or lo.place.dp <= 1:
        return 0.0
    full = lo.per_token.unsharded_elem_bytes * rank.numel
    root = root_numel(lo, rank)
    # zero2: every unit forward to backward; else the root unit
    held = lo.per_token.unsharded_elem_bytes * root if st.reshard_after_forward else full - rank.params_bytes
    if accumulated and m > 1 and st.fsdp_accumulate != "sharded":  # the grads whole in the reduce dtype, in place of the shards
        held += (unsharded_grad_elem_bytes(st) * rank.numel - rank.grads_bytes
                 + ((full - rank.params_bytes) if st.reshard_after_forward else 0))
    return held


def root_numel(lo, rank) -> float:
    """The elements of a rank's FSDP root unit: what it holds outside its blocks (embeddings, ln_f, head)."""
    return rank.numel - rank.layers * params.local_block_numel(lo.model.shape, lo.place.tp, lo.place.ep)


def unsharded_grad_elem_bytes(st) -> int:
    """FSDP2 accumulates a block's unsharded grads between micro-batches in its MixedPrecisionPolicy's
    reduce dtype (each micro-batch's bf16 grads are cast and added; torch 2.13's FSDPParam
    to_accumulated_grad_if_needed): fp32, or bf16 with comm_hook=bf16 (harness/strategies/fsdp.py)."""
    return 2 if st.comm_hook == "bf16" else 4


def transient_terms(lo, rank, mb: int, ckpt: str) -> dict:
    """The largest transient at the loss, by what it is (one term: they come one after another)."""
    pt = lo.per_token
    candidates = {}
    if rank.last:
        candidates["transient_loss"] = (pt.logits_bytes * mb
                                        + act.loss_chunk_bytes(pt.loss, pt.loss_chunk_tokens, mb * lo.model.s, lo.model.V))
    if lo.strategy.state_sharding == "sharded" and lo.place.dp > 1:
        candidates["transient_fsdp"] = 3 * lo.fsdp_block_bytes  # this unit's and the prefetched unit's params + its grads
    if recompute := recompute_block_bytes(lo, mb, ckpt):
        candidates["transient_recompute"] = recompute
        if cache := autocast_cache_bytes(lo, rank.layers):  # the forward's casts, gone before any recompute
            candidates["transient_autocast_cache"] = cache
    if not candidates:
        return {}
    key = max(candidates, key=candidates.get)
    return {key: candidates[key]}


def recompute_block_bytes(lo, mb: int, ckpt: str) -> float:
    """What one block's recompute materialises beyond what it kept: all of `none`'s activations under full
    recompute, what selective_op did not keep under it, and autocast's copies of its weights; 0 otherwise."""
    pt = lo.per_token
    if ckpt == "full":
        return pt.layer_activation_bytes["none"] * mb + autocast_cache_bytes(lo, 1)
    if ckpt == "selective_op":
        return (pt.layer_activation_bytes["none"] - pt.layer_activation_bytes[ckpt]) * mb + autocast_cache_bytes(lo, 1)
    return 0.0


def backward_end_transient_terms(lo, rank, mb: int, ckpt: str) -> dict:
    """What the end of backward holds beyond the gradients and the held state. FSDP: the unit being
    reduced, its gathered params and their unsharded grads in the reduce dtype (FSDP2 casts before it
    reduce-scatters), the next unit's params gathered ahead, and the root unit's grads, unsharded until
    its own reduce-scatter ends the backward. Recompute: one block's activations while it reruns."""
    out = {}
    if lo.strategy.state_sharding == "sharded" and lo.place.dp > 1:
        e = lo.per_token.unsharded_elem_bytes
        block = lo.fsdp_block_bytes / e
        out["transient_fsdp_reduce"] = block * (2 * e + unsharded_grad_elem_bytes(lo.strategy)) + root_numel(lo, rank) * e
    out["transient_recompute"] = recompute_block_bytes(lo, mb, ckpt)
    return out


class RankActivations:
    """What memory_peak needs of one pp rank for (mb, m, ckpt) beyond its model states: its activation terms
    at its most micro-batches in flight, their sum, what autograd keeps then, autocast's copies, whether
    gradients are live then, and (asked for the worst rank only) the same at the end of its first backward
    and the transients of both phases. None of it depends on the dp degree beyond whether dp > 1 (the
    layout's per-token costs, stages, schedule and FSDP unit sizes do not), so layouts that differ in dp
    only share it (rank_activations)."""
    __slots__ = ("lo", "rank", "mb", "m", "ckpt", "terms", "total", "autograd", "autocast", "live", "_rest",
                 "_transients")

    def __init__(self, lo, rank, mb: int, m: int, ckpt: str):
        self.lo, self.rank, self.mb, self.m, self.ckpt = lo, rank, mb, m, ckpt
        self.terms = rank_activation_terms(lo, rank, mb, m, ckpt)
        self.total = sum(self.terms.values())
        self.autocast = autocast_copies_bytes(lo, rank, m, ckpt)
        self.autograd = sum(v for k, v in self.terms.items() if k in ACTIVATION_TERMS) + self.autocast
        self.live = grads_live_at_loss(lo, rank, m)
        self._rest, self._transients = None, {}

    def rest(self) -> tuple[dict, float]:
        """(activation terms, autocast's copies) at the end of the rank's first backward."""
        if self._rest is None:
            self._rest = (rank_activation_terms(self.lo, self.rank, self.mb, self.m, self.ckpt, rest=True),
                          autocast_copies_bytes(self.lo, self.rank, self.m, self.ckpt, rest=True))
        return self._rest

    def transients(self, lo) -> tuple[dict, dict]:
        """(transient_terms, backward_end_transient_terms) of the rank in layout lo (lo or one differing in dp only)."""
        sharded = lo.place.dp > 1
        if sharded not in self._transients:
            self._transients[sharded] = (transient_terms(lo, self.rank, self.mb, self.ckpt),
                                         backward_end_transient_terms(lo, self.rank, self.mb, self.ckpt))
        return self._transients[sharded]


def rank_activations(lo, mb: int, m: int, ckpt: str) -> tuple:
    """RankActivations of every rank in lo.ranks, in its order: memory_peak's `acts` for lo and for every
    layout that differs from it in dp only."""
    return tuple(RankActivations(lo, rank, mb, m, ckpt) for rank in lo.ranks)


# what rounding each term to whole bytes (peak_terms) can take off a peak, with room to spare
ROUNDING_BYTES = len(TERMS)


def memory_peak(lo, mb: int, m: int, ckpt: str, acts: tuple | None = None,
                over: float | None = None) -> MemoryPeak | None:
    """The rank whose model states + activations are largest, with its buffers and transients, at the
    larger of its two phases (module docstring). acts: rank_activations(lo', mb, m, ckpt) of a layout lo'
    that differs from lo in dp only, where the caller has it (the planner's HSDP shard groups).
    over: a memory limit (bytes); None where the peak is over it for certain before its other terms are
    priced: the loss phase's parameters, master copy, optimizer state, held FSDP state and activations
    alone exceed it, every other term of that phase and the allocator's are >= 0, and the peak's phase
    is the larger of the two."""
    acts = acts or rank_activations(lo, mb, m, ckpt)
    worst, worst_total, worst_a, most = None, -1.0, None, 0.0
    for rank, a in zip(lo.ranks, acts, strict=True):
        if a.rank.pp_rank != rank.pp_rank or a.mb != mb or a.m != m or a.ckpt != ckpt:
            raise ValueError(f"activations of pp rank {a.rank.pp_rank} (mb {a.mb}, m {a.m}, {a.ckpt}) given for "
                             f"pp rank {rank.pp_rank} (mb {mb}, m {m}, {ckpt})")
        most = max(most, a.autograd)
        if (total := rank.model_states_bytes + a.total) > worst_total:
            worst, worst_total, worst_a = rank, total, a
    st, rt = lo.strategy, lo.strategy.runtime
    overhead = lo.hw.allocator_overhead if rt.allocator_overhead is None else rt.allocator_overhead
    states = {"params": worst.params_bytes, "master": worst.master_bytes, "optimizer": worst.optimizer_bytes}
    # Megatron-LM's DDP (low_precision_params) all-reduces its contiguous fp32 grad buffer in place: no copies
    if lo.place.dp > 1 and ((st.uses_ddp and not st.low_precision_params) or st.state_sharding == "deepspeed"):
        states["comm_buffers"] = mem.comm_buffer_bytes(st.state_sharding, st.zero_stage, worst.grads_bytes, 0, st.ds_buckets,
                                                       4 if lo.precision == "fp32" else 2, worst.numel)
    elif lo.place.dp > 1 and st.low_precision_params and st.state_sharding == "replicated" and rt.ddp_grad_buckets == "bf16":
        states["comm_buffers"] = catalog.PRECISION_BYTES[lo.precision] * worst.numel  # torch DDP's reducer, 16-bit
    live = worst_a.live
    held = fsdp_held_bytes(lo, worst, m, live)
    if over is not None and overhead >= 0 and (states["params"] + states["master"] + states["optimizer"] + held + worst_a.total
                             - ROUNDING_BYTES > over):
        return None
    at_loss, at_end = worst_a.transients(lo)
    loss = {"grads": grads_at_loss_bytes(lo, worst, m) if live else 0.0,
            "fsdp_held": held, **worst_a.terms,
            "autocast_copies": worst_a.autocast, **at_loss}
    # the end of a backward: a pipeline rank still holds its other micro-batches in flight
    rest_terms, rest_autocast = worst_a.rest()
    end = {"grads": worst.grads_bytes, "fsdp_held": fsdp_held_bytes(lo, worst, m, True), **rest_terms,
           "autocast_copies": rest_autocast, **at_end}
    if st.low_precision_params and rt.grad_accumulation == "after_backward":
        end["half_grads"] = catalog.PRECISION_BYTES[lo.precision] * worst.numel
    phase, parts = ("end of backward", end) if sum(end.values()) > sum(loss.values()) else ("loss", loss)
    return MemoryPeak(worst, phase, peak_terms({**states, **parts}, overhead), most)


def autocast_copies_bytes(lo, rank, m: int, ckpt: str, rest: bool = False) -> float:
    """autocast's 2-byte copy of every matmul weight, saved for backward by the matmul that used it: one
    set per micro-batch in flight (tests/test_memory_peak.py counts them on one block; a dry run of a
    pipeline stage holds one set per micro-batch in flight). None where the engine casts the params.
    Checkpointed blocks (full, selective_op) save none: their copies live in autocast's cache through a
    forward only (autocast_cache_bytes) and come back one block at a time in its recompute; the head is
    never checkpointed."""
    if not lo.strategy.autocast or lo.precision == "fp32":
        return 0.0
    md, pl = lo.model, lo.place
    weights = 0.0 if ckpt in CHECKPOINTED_BLOCKS else rank.layers * params.local_block_numel(md.shape, pl.tp, pl.ep)
    if rank.last and not md.shape[12]:  # an untied head's weight (a tied one is the embedding's, not cast)
        weights += md.V * md.h / pl.tp
    return 2 * weights * ((act.in_flight(lo.strategy.schedule, pl.pp, pl.vpp, m, rank.pp_rank) if pl.pp > 1 else 1.0) - rest)


def autocast_cache_bytes(lo, blocks: int) -> float:
    """What autocast's cache holds of `blocks` checkpointed blocks: torch caches the cast of every weight
    (a leaf that needs grad) until its outermost autocast region ends, a stage's forward (harness/strategies/
    pipeline_timeline.py) or the model's forward and loss (base.forward_loss). A checkpointed forward saves
    none of them, so they are a transient of the forward; a block's recompute casts its own again and keeps
    them to its backward. 0 where nothing is checkpointed or autocast casts nothing."""
    if not lo.strategy.autocast or lo.precision == "fp32":
        return 0.0
    return 2 * blocks * params.local_block_numel(lo.model.shape, lo.place.tp, lo.place.ep)


def grads_at_loss_bytes(lo, rank, m: int) -> float:
    """The gradients a rank holds when it holds its most activations, where they live then: all of
    them, but under DualPipeV, whose ranks reach their most chunks in flight (after the forward of an
    overlapped pair) before their first stage chunk has run a backward (torch 2.13's order; tests): the
    other chunk's only."""
    if catalog.schedule(lo.strategy.schedule).in_flight != "dualpipe_v":
        return rank.grads_bytes
    pl = lo.place
    first = min(rank.stages)
    numel = (params.stage_layer_counts(lo.model.shape[0], pl.n_stages, lo.strategy.stage_layers)[first]
             * params.local_block_numel(lo.model.shape, pl.tp, pl.ep))
    if first == 0:
        numel += lo.model.V * lo.model.h / pl.tp  # the embedding
    return rank.grads_bytes * (1 - numel / rank.numel)


def grads_live_at_loss(lo, rank, m: int) -> bool:
    """Whether gradients exist when `rank` holds its most activations (module docstring)."""
    if lo.strategy.state_sharding == "deepspeed":
        return True
    if lo.strategy.low_precision_params and lo.strategy.runtime.grad_accumulation == "after_backward":
        return True  # the runtime's fp32 grad buffer is made, zeroed, once and kept (runtime.grad_accumulation)
    pl = lo.place
    if pl.pp == 1 and pl.vpp == 1:
        return m > 1
    return act.in_flight(lo.strategy.schedule, pl.pp, pl.vpp, m, rank.pp_rank) < m
