"""Model FLOPs per optimizer step (Megatron convention).

Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters", eq. 3):
    F = 72 * B * s * L * h^2 * (1 + s/(6h) + V/(12*L*h))      (GELU MLP with d_ff = 4h, no recompute)
Convention: matmul FLOPs only (2 per multiply-add), full (not causally halved) attention
QK^T and AV, the logit layer counted, embeddings' lookups not counted, backward = 2x forward.
Generalised here to any d_ff, to MoE (top_k experts active per token) and to the Llama options.
Per layer, forward, with kv = n_kv_heads * head_dim (= h without grouped-query attention):
    projections q, o     : 4 * B*s * h^2
    projections k, v     : 4 * B*s * h * kv          (GQA: smaller k/v; q heads still attend over s)
    attention QK^T, AV   : 4 * B * s^2 * h           (per query head; GQA shares k/v, not the work)
    MLP                  : 2 * n_mlp * B*s * h * d_ff * (top_k if MoE else 1)   (+ router 2*B*s*h*E)
                           n_mlp = 2 (GELU: fc1, fc2) or 3 (SwiGLU: gate, up, down)
and the head 2 * B*s * h * V (tied or not). Not counted: element-wise work (norms, RoPE's rotation,
SiLU/GELU and the SwiGLU product, softmax), biases, embedding lookups. With d_ff = 4h, GELU and no
GQA this is exactly Megatron's formula (checked in tests).
"""
from __future__ import annotations

from harness.costmodel.params import MLP_MATRICES, SELECTIVE_OP_RECOMPUTED, block_projections, kv_dim, option


def layer_forward_flops_per_token(model) -> float:
    """One block, forward, per token: projections + attention (QK^T, AV) + MLP (+ router)."""
    h, s = model.d_model, model.seq_len
    active = model.top_k if model.n_experts else 1
    router = 2 * h * model.n_experts if model.n_experts else 0
    n_mlp = len(MLP_MATRICES[option(model, "mlp")])
    return 4 * h * h + 4 * h * kv_dim(model) + 4 * s * h + 2 * n_mlp * h * model.d_ff * active + router


def attention_core_flops_per_token(model) -> float:
    """QK^T and AV, forward, per token (what selective recompute runs again)."""
    return 4 * model.seq_len * model.d_model


def selective_op_recompute_flops_per_token(model) -> float:
    """Forward FLOPs of the projections selective_op recomputes (params.SELECTIVE_OP_RECOMPUTED), per token."""
    shapes = block_projections(model.d_model, kv_dim(model), model.d_ff, option(model, "mlp"))
    return sum(2 * out * k for out, k in shapes[SELECTIVE_OP_RECOMPUTED])


def head_forward_flops_per_token(model) -> float:
    return 2 * model.d_model * model.vocab_size


def forward_flops_per_token(model) -> float:
    return model.n_layers * layer_forward_flops_per_token(model) + head_forward_flops_per_token(model)


def model_flops_per_step(model, global_batch_size: int) -> float:
    """Model FLOPs of one optimizer step: forward + backward (2x forward), no recomputation."""
    return 3 * forward_flops_per_token(model) * global_batch_size * model.seq_len


def hardware_flops_per_step(model, global_batch_size: int, activation_checkpointing: str) -> float:
    """FLOPs the hardware executes: full recompute runs the forward twice (Megatron's 96 variant);
    selective recompute re-runs only the attention core (4 * B * s^2 * h per layer)."""
    tokens = global_batch_size * model.seq_len
    f = model_flops_per_step(model, global_batch_size)
    if activation_checkpointing == "full":
        return f + (forward_flops_per_token(model) - 2 * model.d_model * model.vocab_size) * tokens
    if activation_checkpointing == "selective":
        return f + model.n_layers * 4 * model.seq_len * model.d_model * tokens
    if activation_checkpointing == "selective_op":
        return f + model.n_layers * selective_op_recompute_flops_per_token(model) * tokens
    return f


def mfu_peak_tflops(device: str, peak: dict, achievable: dict, key: str) -> float | None:
    """MFU's denominator per device (any unit, the dicts' own): the datasheet dense peak on an
    accelerator (MFU's definition, Chowdhery et al. 2022, PaLM appendix B); on a CPU the matmul rate
    `harness.calibrate` measured on one core (the profile's achievable_tflops), because the CPU model
    varies between machines of one kind and one thread's matmul never reaches a datasheet FMA peak.
    The profile that holds the figure is the record's config.hardware.name."""
    if device == "cpu" and achievable.get(key):
        return achievable[key]
    return peak.get(key)

