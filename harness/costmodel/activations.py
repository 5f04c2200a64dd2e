"""Activation memory: what autograd keeps between forward and backward, per rank.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", eqs. 1-5):
bytes per transformer layer and micro-batch, 2-byte activations, dropout masks (1 byte), attention
scores materialised:
    no parallelism               s*b*h*(34 + 5*a*s/h)
    tensor parallel t            s*b*h*(10 + 24/t + 5*a*s/(h*t))
    tensor + sequence parallel   s*b*h*(34 + 5*a*s/h) / t
    selective recompute          drops the 5*a*s/h term;  full recompute keeps 2*s*b*h
That is brigade's model with model.dropout > 0 and model.attention = eager or fused_softmax (Megatron's
kernel: it saves the softmax output, the dropout mask and the dropout output, 5 a s bytes per token in
2-byte activations, as eager does), used as is in that case.

brigade's default (SDPA, dropout 0, torch autocast) keeps less. Derived tensor by tensor from
models/gpt.py (E = b*s*h elements, F = b*s*d_ff, r = 4-byte residual/LayerNorm dtype, e = matmul
output dtype: 4 in fp32, 2 under bf16/fp16 autocast):
    ln1 input (residual)               r*E        ln1 mean, rstd      8*b*s
    q,k,v input (ln1 output)           r*E in fp32; 3 separate 2-byte casts under autocast (6E)
    q, k, v (saved by SDPA)            3*e*E/t    SDPA output         e*E/t  (= o's input, a view)
    SDPA logsumexp (fp32)              4*b*a*s/t  (no (s, s) score matrix is stored)
    ln2 input, stats                   r*E, 8*b*s
    fc1 input (ln2 output)             r*E in fp32, 2E under autocast
    GELU input, fc2 input              2*e*F/t
  fp32, d_ff = 4h: 64*E bytes per layer (16 elements per b*s*h, Korthikanti's 32 at 2 bytes
  without the two dropout masks); bf16-mixed: 40*E. Replicated terms (LN inputs/outputs) divide by t
  only under sequence parallel, and even then the all-gathered fc1/q/k/v inputs stay whole (DTensor
  saves the gathered input; Megatron re-gathers it in backward, brigade does not).
  Eager attention adds the softmax output a*s^2*b (fp32 under autocast, plus the 2-byte cast the
  AV matmul saves) and o's input copy; dropout > 0 adds masks (1 byte) and dropout outputs.
  Llama options (measured tensor by tensor with saved_tensors_hooks on one llama_tiny block, fp32):
    GQA: SDPA (enable_gqa) saves the unexpanded k, v: q, k, v = e*E*(1 + 2*kv/h)/t.
    SwiGLU: gate output (silu's input), silu output, up output, their product (down's input):
      4*e*F/t instead of GELU's 2; under autocast the gate and up matmuls cast the input once each.
    RMSNorm: input r*E and rstd 4*b*s, what CUDA's fused kernel (torch's _fused_rms_norm) saves, against
      LayerNorm's input and mean, rstd. torch's CPU RMSNorm is composite and keeps fp32 copies instead;
      models/layers.py runs the kernel's arithmetic and saved set on every device but CUDA, so CPU runs
      and dry runs hold the GPU's bytes (tests/test_memory_peak.py).
    RoPE: cos and sin (s, head_dim) in e bytes for q and for k: 4*s*hd*e per micro-batch, not per
      sequence; charged per sequence here (the planner scales every term with the micro-batch),
      which overcounts it by b for b > 1, at most 4*s*hd*e*(b-1) bytes per layer (tiny beside E).
  Selective recompute (checkpointed attention core) drops the core's internals (scores, logsumexp);
  full recompute keeps each block's input (r*E, /t under SP) plus one block's activations while
  it is recomputed.
  selective_op (models/gpt.py, torchtitan's op policy; SDPA, dense, no biases) keeps each
  block's input r*E/rep and the outputs of the 1st, 3rd, ... matmul and of the attention kernel:
  q e*E/t, v e*E*kv/(h t), fc1 or gate e*F/t, SwiGLU's down e*E (a row-parallel matmul's local output
  is whole), the kernel's output e*E/t and logsumexp 4*b*a*s/t; while one block is recomputed, what
  `none` keeps beyond that (memory_peak.py).
Last stage: ln_f input r*E, head input, and what the loss (models/gpt.py, `model.loss`) keeps.
  Per token, e the logits' dtype (4 in fp32, 2 under bf16/fp16), c = model.loss_chunk_tokens:
    fp32     held forward -> backward: the log_softmax output 4*V/t (fp32); at the loss: its gradient
             and the logits' gradient, fp32, 8*V/t. 12*V/t in all.
    chunked  held: the logits e*V + one fp32 log-sum-exp (4); at the loss: the logits' gradient e*V
             + one chunk's fp32 working copy 4*V*min(c, b*s) (per micro-batch, not per token).
             2*e*V per token + 4*V*c. Logits are whole (V, not V/t): chunked refuses loss_parallel.
  Measured on CPU (tests/test_loss.py: peak of the live storages created from the logits through
  backward, N = 1024 tokens, V = 4096), in N*V bytes: fp32 12.0 (fp32 or bf16 logits); chunked
  c = 128: 8.5 (fp32 logits), 4.5 (bf16); c = N: 12.0, 8.0. That is 2*e + 4*c/N, as above.

Micro-batches in flight per pipeline rank (what multiplies one micro-batch's activations):
    no pipeline: 1 (gradient accumulation frees each micro-batch in its backward)
    GPipe, looped BFS: m;  1F1B: min(m, p - r);  interleaved (Narayanan et al. 2021 warm-up):
    (2(p-r-1) + (v-1)p + 1)/v rank-layers, Korthikanti's p*(1 + (p-1)/(p*v)) on the first rank;
    torch's split-backward schedules run a micro-batch's input pass with retain_graph=True and free its
    graph at its deferred weight pass, so a stage chunk is held from its forward to its weight pass;
    counted on torch 2.13's own orders (tests/test_memory_peak.py), in chunks of 1/v:
    interleaved zero bubble: ((v-1)*q + min(p, q))/v on every rank, q = m / max(1, m // p) the
    micro-batches of a round (p for m a multiple of p); ZB-V: min(m + 1 + r, 2p, 2m)/2;
    DualPipeV (m >= 2p): p + 1/2, and p where fewer than 2p - r micro-batches arrive.
    A deferred weight pass also keeps the output gradients its input pass captured for it, so a rank can
    peak with fewer chunks and more of them deferred (split_backward_front).
"""
from __future__ import annotations

from functools import lru_cache

from harness import catalog
from harness.costmodel.params import kv_dim, option


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """Korthikanti et al. 2022, eqs. 1-5: bytes per layer per micro-batch (2-byte activations)."""
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    attn = 0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return s * b * h * (34 + attn) / t
    return s * b * h * (10 + 24 / t + attn / t)


def brigade_layer_bytes(s: int, b: int, h: int, a: int, d_ff: int, t: int, sp: bool, precision: str,
                        attention: str, dropout: float, recompute: str, top_k: int = 1, n_experts: int = 0,
                        autocast: bool = True, kv: int | None = None, mlp: str = "gelu", norm: str = "layernorm",
                        rope: bool = False, sharded_inputs: bool = False) -> float:
    """Bytes one block of models/gpt.py keeps for backward, one micro-batch (see module docstring).
    autocast=False: the engine casts the parameters instead (FSDP2 MixedPrecisionPolicy, DeepSpeed
    bf16/fp16), so the residual stream and LayerNorms run in the low precision and no per-matmul
    input casts exist. sharded_inputs: under sequence parallelism the column-parallel matmuls keep their
    input as each rank's sequence shard and gather it again in backward (a runtime's choice: nanotron's
    tp_recompute_allgather, conf/runtime/), not the gathered input."""
    E, F = b * s * h, b * s * d_ff
    e = 4 if precision == "fp32" else 2
    r = 4 if autocast else e
    rep = t if sp else 1  # replicated terms shard only under sequence parallel
    if recompute == "full":
        return r * E / rep
    k = top_k if n_experts else 1
    kv = h if kv is None else kv
    swiglu = mlp == "swiglu"
    if recompute == "selective_op":  # block input + q, v, fc1/gate, (down) outputs + the kernel's output, lse
        return r * E / rep + e * E * (2 + kv / h) / t + e * F / t + (e * E if swiglu else 0) + 4 * b * a * s / t
    if norm == "rmsnorm":
        ln = 2 * (r * E + 4 * b * s) / rep  # ln1, ln2: input and fp32 rstd (the fused kernel's saved set)
    else:
        ln = 2 * (r * E + 8 * b * s) / rep  # ln1, ln2 inputs + mean/rstd
    # inputs of the q/k/v and fc1 (gate, up) matmuls: one fp32 tensor each, or one 2-byte cast per matmul
    mlp_in = 2 if swiglu else 1
    mm_in = (r * E + r * E * k) if (e == 4 or not autocast) else (3 * e * E + mlp_in * e * E * k)
    if sharded_inputs and sp:
        mm_in /= t
    qkv_out = e * E * (1 + 2 * kv / h) / t
    if rope:
        qkv_out += 4 * s * (h // a) * e
    core_out = e * E / t
    core = 0.0
    if recompute != "selective":
        if attention == "sdpa":
            core = 4 * b * a * s / t  # logsumexp
        else:
            scores = b * a * s * s / t
            # softmax output (fp32 under autocast) + the 2-byte cast the AV matmul saves
            core = (4 * scores + (0 if e == 4 else e * scores)) if autocast else e * scores
            if dropout > 0:
                core += scores * (1 + e)  # mask + dropout output
    if attention != "sdpa":
        core_out += e * E / t  # transpose + reshape copies the AV output: o saves the copy
    mlp = (4 if swiglu else 2) * e * F * k / t  # GELU input, fc2 input (SwiGLU: gate, silu, up, product)
    router = (4 * b * s * n_experts + 8 * b * s * k) if n_experts else 0  # router logits + routing indices
    masks = 2 * E / rep if dropout > 0 else 0  # after o and after fc2
    return ln + mm_in + qkv_out + core_out + core + mlp + router + masks


def layer_bytes(m, b: int, t: int, sp: bool, precision: str, recompute: str, autocast: bool = True,
                sharded_inputs: bool = False) -> float:
    """Per-layer activation bytes for the model that runs: Korthikanti's constants where they apply
    (dropout > 0 with eager attention), brigade's derived ones otherwise."""
    if m.dropout > 0 and m.attention != "sdpa" and not m.n_experts:
        return korthikanti_layer_bytes(m.seq_len, b, m.d_model, m.n_heads, t, sp, recompute)
    return brigade_layer_bytes(m.seq_len, b, m.d_model, m.n_heads, m.d_ff, t, sp, precision, m.attention,
                               m.dropout, recompute, m.top_k, m.n_experts, autocast, kv_dim(m), option(m, "mlp"),
                               option(m, "norm"), option(m, "position") == "rope", sharded_inputs)


def head_bytes(s: int, b: int, h: int, V: int, t: int, head_sharded: bool, loss: str = "fp32", e: int = 4) -> float:
    """Last stage: ln_f input and output (fp32) + what the loss keeps until backward (module docstring)."""
    if loss == "chunked":
        return 2 * 4 * b * s * h + b * s * (e * V + 4)  # logits (whole: no loss_parallel) + fp32 lse
    return 2 * 4 * b * s * h + 4 * b * s * V / (t if head_sharded else 1)


def loss_grad_bytes(s: int, V: int, t: int, loss: str = "fp32", e: int = 4) -> float:
    """One sequence's transient at the loss (module docstring): fp32 grads of the log_softmax and the
    logits over V/t, or chunked's logits' gradient in their dtype (its chunk buffer: loss_chunk_bytes)."""
    return e * s * V if loss == "chunked" else 8 * s * V / t


def loss_chunk_bytes(loss: str, chunk_tokens: int, tokens: int, V: int) -> float:
    """chunked: the one fp32 (c, V) working copy, c = min(chunk, the micro-batch's tokens); 0 for fp32."""
    return 4 * V * min(chunk_tokens, tokens) if loss == "chunked" else 0.0


@lru_cache(maxsize=65536)  # pure, and the planner asks for the same few thousand
def in_flight(schedule: str, pp: int, vpp: int, m: int, pp_rank: int) -> float:
    """Micro-batches whose activations pipeline rank `pp_rank` holds at its peak, in units of one
    micro-batch through all the layers that rank holds."""
    if pp == 1 and vpp == 1:
        return 1.0
    return IN_FLIGHT[catalog.schedule(schedule).in_flight](pp, vpp, m, pp_rank)


def _interleaved_in_flight(pp: int, vpp: int, m: int, pp_rank: int) -> float:
    chunks = 2 * (pp - pp_rank - 1) + (vpp - 1) * pp + 1
    return min(chunks, m * vpp) / vpp


def _zero_bubble_looped_in_flight(pp: int, vpp: int, m: int, pp_rank: int) -> float:
    q = m / max(1, m // pp)  # torch's micro-batches per round
    return ((vpp - 1) * q + min(pp, q)) / vpp


# by the catalog's `in_flight` kind of a schedule: f(pp, vpp, m, pp_rank), see the module docstring
IN_FLIGHT = {
    "all": lambda pp, vpp, m, r: float(m),
    "one_f_one_b": lambda pp, vpp, m, r: float(min(m, pp - r)),
    "interleaved": _interleaved_in_flight,
    "zero_bubble_looped": _zero_bubble_looped_in_flight,
    "zbv": lambda pp, vpp, m, r: min(m + 1 + r, 2 * pp, 2 * m) / 2,
    "dualpipe_v": lambda pp, vpp, m, r: min(float(m), pp + (0.5 if r >= 2 * pp - m else 0.0)),
}
# the last stage's micro-batches whose head and loss internals (the log-softmax) are held: one where each
# backward follows its forward closely, and under a split backward, whose input pass frees them (the
# deferred weight pass keeps the layers', split_backward_front); every micro-batch under GPipe and looped BFS
LAST_STAGE_IN_FLIGHT = {"all": lambda pp, vpp, m: float(m)}


@lru_cache(maxsize=65536)  # pure, and the planner asks for the same few thousand
def split_backward_front(schedule: str, pp: int, vpp: int, m: int, pp_rank: int) -> tuple:
    """The (stage chunks held, weight passes deferred) pairs at which rank `pp_rank` can peak: a chunk is
    held from its forward to its weight pass, and a deferred one (its input pass run, its weight pass
    not) also keeps its captured output gradients, so more deferred passes can outweigh a chunk fewer.
    The Pareto front of torch 2.13's action lists (tests/test_memory_peak.py), in chunks of 1/v:
    interleaved zero bubble holds its most with r + 1 deferred; ZB-V also peaks with p + r held, 2r + 1
    of them deferred (m >= 2p - 1; between p and 2p - 1 micro-batches only its most held is priced);
    DualPipeV with 2p + 1 held and none deferred, 2p and one, or p and r + 1. Other schedules: their
    micro-batches in flight, none deferred."""
    r, most = pp_rank, round(in_flight(schedule, pp, vpp, m, pp_rank) * vpp)
    kind = catalog.schedule(schedule).in_flight
    if kind == "zero_bubble_looped":
        points = ((most, min(r + 1, vpp * m)),)
    elif kind == "zbv":
        points = ((most, 1),) + (((pp + r, 2 * r + 1),) if r and m >= 2 * pp - 1 else ())
    elif kind == "dualpipe_v":
        points = (((pp, r + 1),) if r else ()) + (((2 * pp, 1),) if r < pp - 1 else ()) + ((most, 0),)
    else:
        return ((most, 0),)
    return tuple(p for p in points if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in points))


@lru_cache(maxsize=65536)  # pure, and the planner asks for the same few thousand
def last_stage_in_flight(schedule: str, pp: int, vpp: int, m: int) -> float:
    """Micro-batches whose head activations the last stage holds at its rank's peak."""
    if pp == 1 and vpp == 1:
        return 1.0
    kind = catalog.schedule(schedule).in_flight
    return LAST_STAGE_IN_FLIGHT[kind](pp, vpp, m) if kind in LAST_STAGE_IN_FLIGHT else 1.0
