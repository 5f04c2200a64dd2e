"""The cost model's element-wise traffic (harness/costmodel/traffic.py) against brigade's own block:
every aten op a block's forward and backward dispatches is counted, its tensor inputs read and its
outputs written once, except matmuls and attention kernels (timed as GEMMs, compute.py) and views
(no data moved). Pure CPU, one block, fp32."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from harness.config import compose_run
from harness.costmodel import traffic
from models.gpt import Block

COMPUTE = {"mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_flash_attention_for_cpu_backward"}
VIEWS = {"view", "_unsafe_view", "expand", "as_strided", "transpose", "permute", "unsqueeze", "slice", "select",
         "t", "detach", "alias", "split", "split_with_sizes", "squeeze", "unbind", "reshape"}


class ElementwiseBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        if name not in COMPUTE and name not in VIEWS:
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            self.by_op[name] = self.by_op.get(name, 0) + sum(t.numel() * t.element_size() for t in tensors)
        return out


def measured_bytes_per_token(model: str) -> tuple[float, dict]:
    cfg = compose_run([f"model={model}"]).model
    torch.manual_seed(0)
    block = Block(cfg)
    x = torch.randn(2, cfg.seq_len, cfg.d_model, requires_grad=True)
    with ElementwiseBytes() as counter:
        block(x).backward(torch.ones(2, cfg.seq_len, cfg.d_model))
    assert any(op in counter.by_op for op in ("native_layer_norm", "pow")), counter.by_op  # the norms were seen
    return sum(counter.by_op.values()) / x.shape[0] / x.shape[1], counter.by_op


@pytest.mark.parametrize("model", ["tiny", "llama_tiny"])
def test_elementwise_bytes_of_a_block_match_its_ops(model):
    """GPT's block (LayerNorm, GELU) and Llama's (RMSNorm, SwiGLU, RoPE, GQA): the count per token and
    layer, forward + backward, within 10 % of the bytes its aten ops move (measured 12-02: tiny 6292
    against 6912 elements, the backward's adds and GELU's gradient a little under twice the forward;
    llama_tiny 20728 against 20032, 3x GPT's count before RMSNorm, SwiGLU and RoPE were counted)."""
    measured, ops = measured_bytes_per_token(model)
    predicted = traffic.layer_bytes_per_token(compose_run([f"model={model}"]).model, 1, False, 4, 4, "none")
    assert predicted == pytest.approx(measured, rel=0.10), (predicted / 4, measured / 4, ops)
