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


@dataclass(slots=True)
class MemoryPeak:
    rank: object  # layout.PipelineRank with the highest peak
    activations_bytes: float
    comm_buffer_bytes: float
    fsdp_unsharded_bytes: float
    transient_bytes: float
    allocator_bytes: float
    grads_bytes: float = 0.0  # the gradients alive at the peak (module docstring)
    phase: str = "loss"  # loss | end of backward

    @property
    def peak_bytes(self) -> float:
        r = self.rank
        return (r.model_states_bytes - r.grads_bytes + self.grads_bytes + self.comm_buffer_bytes
                + self.fsdp_unsharded_bytes + self.activations_bytes + self.transient_bytes + self.allocator_bytes)


def rank_activation_bytes(lo, rank, mb: int, m: int, ckpt: str, rest: bool = False) -> float:
    """Activations a pipeline rank holds at its peak: its layers x micro-batches in flight, the head x the
    last stage's micro-batches in flight (activations.last_stage_in_flight), its stages' boundary
    tensors (stage_boundary_bytes) and deferred weight passes' captures. rest: at the end of its first
    backward, when one micro-batch in flight fewer is left."""
    pt, pl = lo.per_token, lo.place
    layers = rank.layers * pt.layer_activation_bytes[ckpt] * mb
    head = pt.head_activation_bytes * mb if rank.last else 0.0
    if pl.pp == 1:
        return 0.0 if rest else layers + head
    head_flight = act.last_stage_in_flight(lo.strategy.schedule, pl.pp, pl.vpp, m)
    # the largest of the rank's possible peaks: chunks held (each a 1/vpp micro-batch, whole until its
    # weight pass: at llama3_70b a deferred chunk's dry run holds all of it), `deferred` of them keeping
    # their weight pass's captured gradients
    return max(layers * (held / pl.vpp - rest) + head * (head_flight - rest)
               + stage_boundary_bytes(lo, rank, mb, m, held / pl.vpp) + deferred * weight_pass_capture_bytes(lo, rank, mb)
               for held, deferred in act.split_backward_front(lo.strategy.schedule, pl.pp, pl.vpp, m, rank.pp_rank))


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


def stage_boundary_bytes(lo, rank, mb: int, m: int, flight: float) -> float:
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
        return logits + one * not_last * (flight + 1)
    return logits + one * (not_last * (flight + m) + not_first * max(m - flight, 0.0))


def fsdp_held_bytes(lo, rank, m: int, accumulated: bool) -> float:
    """FSDP's unsharded state beyond the shards; `accumulated`: after a backward of this step, with
    gradient accumulation (the unsharded grads and, resharding after forward, the params kept)."""
    st = lo.strategy
    if st.ds_reuse and lo.place.dp > 1:  # DeepSpeed ZeRO-3 keeps these gathered from forward to backward
        return catalog.PRECISION_BYTES[lo.precision] * ds_zero3.gathered_elements(lo.model.shape, *st.ds_reuse)[2]
    if st.family != "sharded" or lo.place.dp <= 1:
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


def transient_bytes(lo, rank, mb: int, ckpt: str) -> float:
    pt = lo.per_token
    if rank.last:
        out = pt.logits_bytes * mb + act.loss_chunk_bytes(pt.loss, pt.loss_chunk_tokens, mb * lo.model.s, lo.model.V)
    else:
        out = 0.0
    if lo.strategy.family == "sharded" and lo.place.dp > 1:
        out = max(out, 3 * lo.fsdp_block_bytes)  # this unit's and the prefetched unit's params + its grads
    if ckpt == "full":
        out = max(out, pt.layer_activation_bytes["none"] * mb)  # one block while it is recomputed
    elif ckpt == "selective_op":  # what one block's recompute materialises beyond what it kept
        out = max(out, (pt.layer_activation_bytes["none"] - pt.layer_activation_bytes[ckpt]) * mb)
    return out


def backward_end_transient_bytes(lo, rank, mb: int, ckpt: str) -> float:
    """What the end of backward holds beyond the gradients and the held state. FSDP: the unit being
    reduced, its gathered params and their unsharded grads in the reduce dtype (FSDP2 casts before it
    reduce-scatters), the next unit's params gathered ahead, and the root unit's grads, unsharded until
    its own reduce-scatter ends the backward. Recompute: one block's activations while it reruns."""
    out = 0.0
    if lo.strategy.family == "sharded" and lo.place.dp > 1:
        e = lo.per_token.unsharded_elem_bytes
        block = lo.fsdp_block_bytes / e
        out = block * (2 * e + unsharded_grad_elem_bytes(lo.strategy)) + root_numel(lo, rank) * e
    pt = lo.per_token
    if ckpt == "full":
        out += pt.layer_activation_bytes["none"] * mb
    elif ckpt == "selective_op":
        out += (pt.layer_activation_bytes["none"] - pt.layer_activation_bytes[ckpt]) * mb
    return out


def memory_peak(lo, mb: int, m: int, ckpt: str) -> MemoryPeak:
    """The rank whose model states + activations are largest, with its buffers and transients."""
    worst, worst_total, worst_acts = None, -1.0, 0.0
    for rank in lo.ranks:
        acts = rank_activation_bytes(lo, rank, mb, m, ckpt)
        if rank.model_states_bytes + acts > worst_total:
            worst, worst_total, worst_acts = rank, rank.model_states_bytes + acts, acts
    st = lo.strategy
    buffers = (mem.comm_buffer_bytes(st.family, st.zero_stage, worst.grads_bytes, 0, st.ds_buckets,
                                     4 if lo.precision == "fp32" else 2, worst.numel)
               if lo.place.dp > 1 and (st.uses_ddp or st.family == "deepspeed") else 0)
    live = grads_live_at_loss(lo, worst, m)
    held, held_end = fsdp_held_bytes(lo, worst, m, live), fsdp_held_bytes(lo, worst, m, True)
    transient = transient_bytes(lo, worst, mb, ckpt)
    grads = grads_at_loss_bytes(lo, worst, m) if live else 0.0
    worst_acts += autocast_copies_bytes(lo, worst, m)
    loss_phase = held + grads + worst_acts + transient
    # the end of a backward: a pipeline rank still holds its other micro-batches in flight
    rest = rank_activation_bytes(lo, worst, mb, m, ckpt, rest=True) + autocast_copies_bytes(lo, worst, m, rest=True)
    transient_end = backward_end_transient_bytes(lo, worst, mb, ckpt)
    backward_end = held_end + worst.grads_bytes + rest + transient_end
    if backward_end > loss_phase:
        peak = MemoryPeak(worst, rest, buffers, held_end, transient_end, 0.0, worst.grads_bytes, "end of backward")
    else:
        peak = MemoryPeak(worst, worst_acts, buffers, held, transient, 0.0, grads, "loss")
    peak.allocator_bytes = lo.hw.allocator_overhead * peak.peak_bytes
    return peak


def autocast_copies_bytes(lo, rank, m: int, rest: bool = False) -> float:
    """autocast's 2-byte copy of every matmul weight, saved for backward by the matmul that used it: one
    set per micro-batch in flight (tests/test_memory_peak.py counts them on one block; a dry run of a
    pipeline stage holds one set per micro-batch in flight). None where the engine casts the params."""
    if not lo.strategy.autocast or lo.precision == "fp32":
        return 0.0
    md, pl = lo.model, lo.place
    weights = rank.layers * params.local_block_numel(md.shape, pl.tp, pl.ep)
    if rank.last and not md.shape[12]:  # an untied head's weight (a tied one is the embedding's, not cast)
        weights += md.V * md.h / pl.tp
    return 2 * weights * ((act.in_flight(lo.strategy.schedule, pl.pp, pl.vpp, m, rank.pp_rank) if pl.pp > 1 else 1.0) - rest)


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
    if lo.strategy.family == "deepspeed":
        return True
    pl = lo.place
    if pl.pp == 1 and pl.vpp == 1:
        return m > 1
    return act.in_flight(lo.strategy.schedule, pl.pp, pl.vpp, m, rank.pp_rank) < m
