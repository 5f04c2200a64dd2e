"""Memory-bound work: bytes the element-wise parts of a step move (roofline: time = bytes / bandwidth).

Matmul FLOPs (flops.py) are not the whole step: LayerNorms, residual adds, GELU, the loss, the
gradient accumulation and the optimizer step do almost no arithmetic per byte and are bound by the
device's memory bandwidth (Williams et al. 2009, "Roofline"). Counted from models/gpt.py and
torch.optim.AdamW, reads + writes, per token and layer (h = d_model, f = d_ff, elements):

  forward   ln1, ln2 (read h, write h each) 4h;  two residual adds (read 2h, write h) 6h;
            GELU (read f, write f) 2f;  eager attention also scales, masks and softmaxes the
            (a, s) scores (read + write each) 6as;  SDPA keeps its softmax in on-chip tiles.
            fused_softmax (Megatron-LM's FusedScaleMaskSoftmax; the scale rides on q, 2h): mask +
            softmax read and write the scores once, 2as, and with dropout its pass reads the probs and
            writes them and a 1-byte mask, 2.5as; backward: dropout's (grad, mask in, grad out) 2.5as,
            the softmax's (grad, output in, grad out) 3as: (2 + 2.5) + (2.5 + 3) = 10as with dropout,
            5as without, for forward + backward, counted as a third per pass below.
  backward  each op reads its saved input and the incoming gradient and writes one gradient, and the
            residual gradients are added: twice the forward's traffic.
  => 3 * (10h + 2f [+ 6as]) elements per layer and token; full recompute runs the forward again (4x).
  head      log_softmax + NLL read and write the V logits (2V), backward reads the saved output and
            the gradient and writes the logits' gradient (3V): 5V per token.
  Llama's options (models/layers.py) add, per token and layer, elements (forward, backward) measured op
            by op on brigade's own block (tests/test_traffic.py counts every aten op's reads and writes):
            rmsnorm: torch's F.rms_norm runs as pow, mean, add, rsqrt, mul, mul: 7 forward, 25 backward per
            element against LayerNorm's fused 2 and 4, so (+5, +21) h per norm; swiglu: silu (2) and the
            product (3) forward, their backward 3 + 6, against GELU's 2 and 4: (+3, +5) f; rope: x cos +
            rotate-half(x) sin on q and k: (10, 14) per element of q and k (h + kv).
LayerNorm and residual traffic uses the residual stream's dtype (fp32 under autocast), GELU and scores
the activation dtype. Under tensor parallel the sharded parts (GELU's f, the heads' scores, the
vocabulary) divide by t; the LayerNorm/residual parts only under sequence parallel.

  gradient accumulation: every micro-batch after the first adds into .grad: read 2, write 1 = 12 B
            per fp32 gradient element.
  AdamW (torch single-tensor path, the CPU default; the foreach/CUDA path makes the same passes), per
            parameter, fp32: exp_avg.lerp_(grad) 12 B; exp_avg_sq.mul_().addcmul_(grad, grad) 20 B;
            denom = sqrt / bias_correction + eps: 3 passes of 8 B = 24 B; param.addcdiv_(exp_avg,
            denom) 16 B  => 72 B; weight decay (param.mul_) adds 8 B.
"""
from __future__ import annotations

from harness.costmodel.params import kv_dim, option

ADAMW_BYTES_PER_PARAM = 72
ADAMW_DECAY_BYTES_PER_PARAM = 8
GRAD_ACCUMULATE_BYTES_PER_ELEM = 12


def layer_bytes_per_token(m, tp: int, sp: bool, e: int, e_res: int, recompute: str) -> float:
    """Element-wise bytes of one block, forward + backward (+ the recomputed forward), per token."""
    h, f, a, s = m.d_model, m.d_ff, m.n_heads, m.seq_len
    k = m.top_k if m.n_experts else 1
    rep = tp if sp else 1
    forward = 10 * h * e_res / rep + 2 * f * k * e / tp + _scores_per_pass(m) * a * s * e / tp
    rerun = recompute in ("full", "selective_op")  # selective_op reruns every element-wise op
    extra_fwd, extra_bwd = _llama_extra(m, h, f * k, tp, rep, e, e_res)
    return (4 if rerun else 3) * forward + (2 if rerun else 1) * extra_fwd + extra_bwd


# (forward, backward) elements per element of what each option works on (module docstring)
RMSNORM_EXTRA, SWIGLU_EXTRA, ROPE = (5, 21), (3, 5), (10, 14)


def _llama_extra(m, h: int, f: float, tp: int, rep: int, e: int, e_res: int) -> tuple[float, float]:
    """Element-wise bytes a Llama block moves beyond the GPT block counted above: (forward, backward)."""
    norm = RMSNORM_EXTRA if option(m, "norm") == "rmsnorm" else (0, 0)
    mlp = SWIGLU_EXTRA if option(m, "mlp") == "swiglu" else (0, 0)
    rope = ROPE if option(m, "position") == "rope" else (0, 0)
    if not (norm[0] or mlp[0] or rope[0]):
        return 0.0, 0.0
    qk = h + kv_dim(m)
    return tuple(2 * norm[i] * h * e_res / rep + mlp[i] * f * e / tp + rope[i] * qk * e / tp for i in (0, 1))


def _scores_per_pass(m) -> float:
    """Elements of the (a, s) scores moved per token and pass (module docstring)."""
    if m.attention == "eager":
        return 6.0
    if m.attention == "fused_softmax":
        return (10.0 if m.dropout > 0 else 5.0) / 3
    return 0.0


def head_bytes_per_token(m, tp: int) -> float:
    """The loss over V logits (fp32: the loss upcasts), forward + backward, per token."""
    return 5 * m.vocab_size * 4 / tp


def optimizer_bytes(elements: float, weight_decay: float) -> float:
    """AdamW's traffic for the parameter elements this rank updates."""
    return elements * (ADAMW_BYTES_PER_PARAM + (ADAMW_DECAY_BYTES_PER_PARAM if weight_decay else 0))
