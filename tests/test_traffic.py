"""The cost model's element-wise traffic (harness/costmodel/traffic.py) against brigade's own block:
every aten op a block's forward and backward dispatches is counted, its tensor inputs read and its
outputs written once, except matmuls and attention kernels (timed as GEMMs, compute.py) and views
(no data moved). Pure CPU, one block, fp32."""
from __future__ import annotations

import pytest
import torch

from harness.config import compose_run
from harness.costmodel import traffic
from harness.tools.op_profile import OpProfile
from models.gpt import Block


def measured_bytes_per_token(model: str) -> tuple[float, dict]:
    cfg = compose_run([f"model={model}"]).model
    torch.manual_seed(0)
    block = Block(cfg)
    x = torch.randn(2, cfg.seq_len, cfg.d_model, requires_grad=True)
    with OpProfile() as counter:
        block(x).backward(torch.ones(2, cfg.seq_len, cfg.d_model))
    assert any(op in counter.by_op for op in ("native_layer_norm", "pow")), counter.by_op  # the norms were seen
    return counter.bytes["elementwise"] / x.shape[0] / x.shape[1], counter.by_op


@pytest.mark.parametrize("model", ["tiny", "llama_tiny"])
def test_elementwise_bytes_of_a_block_match_its_ops(model):
    """GPT's block (LayerNorm, GELU) and Llama's (RMSNorm, SwiGLU, RoPE, GQA): the count per token and
    layer, forward + backward, within 10 % of the bytes its aten ops move (measured: tiny 6292
    against 6912 elements, the backward's adds and GELU's gradient a little under twice the forward;
    llama_tiny 20728 against 20032, 3x GPT's count before RMSNorm, SwiGLU and RoPE were counted)."""
    measured, ops = measured_bytes_per_token(model)
    predicted = traffic.layer_bytes_per_token(compose_run([f"model={model}"]).model, 1, False, 4, 4, "none")
    assert predicted == pytest.approx(measured, rel=0.10), (predicted / 4, measured / 4, ops)
