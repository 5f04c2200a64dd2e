"""A profiled step's compute split by kind of work: the measured twin of the cost model's compute terms.

Pure Python (no torch), like trace_analysis.py, which calls it with the step's compute intervals.

    attention    the fused attention kernels (FlashAttention, memory-efficient, cuDNN SDPA) and their
                 backward; on CPU the SDPA operators          <-> predicted compute_attention_time_s
    gemm         cuBLAS / CUTLASS GEMM kernels (ampere_*gemm*, sm90_xmma_*, nvjet_*, split-K reduce);
                 on CPU the matmul operators (linear, mm, addmm, bmm and their backward nodes)
                                                              <-> compute_gemm_time_s
    optimizer    what runs inside torch's `Optimizer.step#...` annotation: on CPU the operators, on CUDA
                 the kernels launched from it (matched by the profiler's correlation id)
                                                              <-> compute_optimizer_time_s
    elementwise  every other compute interval: norms, activations, residual adds, the loss, casts,
                 gradient accumulation, FSDP's copies         <-> compute_elementwise_time_s

Each instant of the step's compute union goes to one class, in the order above (an attention operator
that calls a GEMM inside is attention; a GEMM inside the optimizer's window is a GEMM), so the four add
up to the profiled `compute_time_s`. Why it matters: the cost model's GPU terms (the GEMM table, the
attention kernel's fraction of peak, the element-wise bandwidth) were fitted or cited one by one; a
profiled GPU step says which of them is off (docs/published.md#what-is-left). CPU caveat: the
profiler slows small operators more than large ones (docs/notes.md#profiler-cost), so on a CPU the
shares are fairer than the seconds; a CUDA kernel's duration is the device's, not the profiler's.
Eager attention (model.attention=eager) runs its QK^T and AV as batched GEMMs: measured as gemm, where
the model counts them as attention.
"""
from __future__ import annotations

import functools
import re

# -- op kinds --------------------------------------------------------------------------------------
# Which aten operators are GEMMs, fused attention or views: the kinds the cost model charges each its
# own way (harness/costmodel/compute.py). Pure (no torch): harness/tools/op_profile.py sorts dispatched
# operators by it, harness/collect/compute_classes.py a profiled trace's operators.

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


# -- compute classes -------------------------------------------------------------------------------

CLASSES = ("attention", "gemm", "optimizer", "elementwise")
KEYS = tuple(f"compute_{c}_time_s" for c in CLASSES)

_ATTENTION_KERNEL = re.compile(r"flash|fmha|attention|attn|sdpa", re.IGNORECASE)
# cuBLAS (ampere_*gemm*, sm80/sm90_xmma_gemm_*, Hopper's nvjet_*, gemv, split-K reduce), CUTLASS, and
# torch.compile's GEMM templates (triton_tem_fused_mm_0, ..._addmm_1, ..._bmm_2); not FBGEMM's embedding,
# quantisation and permutation kernels (fbgemm_gpu::, its argument types in split_embedding_* kernels)
_GEMM_KERNEL = re.compile(r"(?<!fb)gemm|gemv|nvjet|xmma|wgmma|s16816|s1688|splitkreduce|cutlass|triton_tem_fused_\w*mm",
                          re.IGNORECASE)
# CPU: the aten operators the op kinds above name, and the outer operators and autograd nodes a trace nests
# them in (aten::linear -> aten::addmm; `evaluate_function: MmBackward0` -> aten::mm)
_ATTENTION_OP = re.compile("|".join([rf"^aten::{n}$" for n in sorted(ATTENTION)]
                                    + [r"^aten::scaled_dot_product_attention$", r"ScaledDotProduct\w*Backward"]))
_GEMM_OP = re.compile("|".join([rf"^aten::{n}$" for n in sorted(GEMM)]
                               + [r"^aten::(linear|matmul)$", r"\b(Mm|Addmm|Bmm)Backward"]))
_OPTIMIZER = re.compile(r"^Optimizer\.step#")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def span(evs) -> list:
    """The union of events' [ts, ts + dur) intervals."""
    return union((e["ts"], e["ts"] + e["dur"]) for e in evs)


def optimizer_window(events: list[dict]) -> list:
    """The host intervals of torch's optimizer-step annotations (any thread)."""
    return span([e for e in events if _OPTIMIZER.match(e.get("name", "")) and e.get("cat") != "gpu_user_annotation"])


def _launched_inside(kernels: list[dict], events: list[dict], window: list) -> list[dict]:
    """The kernels whose launch call (same correlation id) started inside the host window."""
    if not window:
        return []
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {})}
    starts = [s for s, _ in window]
    out = []
    for k in kernels:
        ts = launches.get(k.get("args", {}).get("correlation"))
        if ts is None:
            continue
        i = _last_start_before(starts, ts)
        if i >= 0 and ts < window[i][1]:
            out.append(k)
    return out


def _last_start_before(starts: list[float], ts: float) -> int:
    lo, hi = 0, len(starts)
    while lo < hi:
        mid = (lo + hi) // 2
        if starts[mid] <= ts:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@functools.cache  # a step launches the same few hundred kernels, with names of thousands of characters
def kernel_class(name: str) -> str:
    """attention, gemm or elementwise by a CUDA kernel's name (the optimizer's are found by launch site)."""
    if _ATTENTION_KERNEL.search(name):
        return "attention"
    return "gemm" if _GEMM_KERNEL.search(name) else "elementwise"


def split(compute: list, compute_ev: list[dict], events: list[dict], cuda: bool) -> dict[str, float]:
    """Microseconds of the compute union `compute` (already clipped to the steps) per class."""
    if cuda:
        attention = [e for e in compute_ev if kernel_class(e["name"]) == "attention"]
        gemm = [e for e in compute_ev if kernel_class(e["name"]) == "gemm"]
        optimizer = span(_launched_inside(compute_ev, events, optimizer_window(events)))
    else:
        attention = [e for e in compute_ev if _ATTENTION_OP.search(e["name"])]
        gemm = [e for e in compute_ev if _GEMM_OP.search(e["name"])]
        optimizer = optimizer_window(events)
    left, out = compute, {}
    for name, ivs in (("attention", span(attention)), ("gemm", span(gemm)), ("optimizer", optimizer)):
        mine = intersect(left, ivs)
        out[name] = length(mine)
        left = subtract(left, mine)
    out["elementwise"] = length(left)
    return out


TOP_KERNELS = 8


def top_kernels(compute_ev: list[dict], steps: list, n_steps: int) -> list[dict]:
    """CUDA: the kernels that took the most device time in the steps, per step, each with its kind: which
    attention backend ran (FlashAttention, memory-efficient, cuDNN) and which GEMM kernels, so a device's
    figures can be matched with the runs they are compared with."""
    total: dict = {}
    for e in compute_ev:
        inside = length(intersect([(e["ts"], e["ts"] + e["dur"])], steps))
        if inside > 0:
            t, c = total.get(e["name"], (0.0, 0))
            total[e["name"]] = (t + inside, c + 1)
    ranked = sorted(total.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    return [{"name": name[:160], "kind": kernel_class(name), "time_s": t / n_steps / 1e6, "count": c / n_steps}
            for name, (t, c) in ranked]


# -- intervals -------------------------------------------------------------------------------------
# Interval algebra on (start, end) pairs: the unions, intersections and differences the
# communication share is measured with (trace_analysis.py). Pure.

def union(ivs) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(ivs):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(ivs) -> float:
    return sum(e - s for s, e in ivs)


def subtract(a, b) -> list[tuple[float, float]]:
    """a minus b (both unions)."""
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def intersect(a, b) -> list[tuple[float, float]]:
    """Intersection of two unions (each sorted and disjoint)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out
