"""Which aten operators are GEMMs, fused attention or views: the kinds the cost model charges each its
own way (harness/costmodel/compute.py). Pure (no torch): harness/tools/op_profile.py sorts dispatched
operators by it, harness/collect/compute_classes.py a profiled trace's operators."""
from __future__ import annotations

GEMM = frozenset({"mm", "addmm", "bmm"})
ATTENTION_FORWARD = "_scaled_dot_product_flash_attention_for_cpu"
ATTENTION_BACKWARD = ATTENTION_FORWARD + "_backward"
# the fused kernels SDPA picks on a GPU (FlashAttention, memory-efficient, cuDNN), and the CPU's; on a
# GPU the first two launch their kernels from an inner aten op (_flash_attention_forward, ...), which
# torch.profiler, unlike this dispatch mode, sees apart (harness/tools/calibrate_gpu.py adds up both)
_SDPA = (ATTENTION_FORWARD, "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
         "_scaled_dot_product_cudnn_attention")
ATTENTION_FORWARD_OPS = frozenset(_SDPA + ("_flash_attention_forward", "_flash_attention_forward_no_dropout_inplace",
                                           "_efficient_attention_forward"))
ATTENTION_BACKWARD_OPS = frozenset(tuple(f"{name}_backward" for name in _SDPA)
                                   + ("_flash_attention_backward", "_efficient_attention_backward"))
ATTENTION = ATTENTION_FORWARD_OPS | ATTENTION_BACKWARD_OPS
VIEWS = frozenset({"view", "_unsafe_view", "expand", "as_strided", "transpose", "permute", "unsqueeze", "slice",
                   "select", "t", "detach", "alias", "split", "split_with_sizes", "squeeze", "unbind", "reshape"})
KINDS = ("gemm", "attention", "view", "elementwise")


def kind_of(name: str) -> str:
    if name in GEMM:
        return "gemm"
    if name in ATTENTION:
        return "attention"
    return "view" if name in VIEWS else "elementwise"
