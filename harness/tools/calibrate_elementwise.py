"""The element-wise and attention part of `python -m harness.calibrate`: how fast one core runs the
operators between the GEMMs, measured on brigade's own model (`measure`); on a GPU the same figures
from the kernels' own time under torch.profiler (`measure_profiled`, harness/tools/calibrate_gpu.py).

On one CPU core the element-wise operators of a step are not bound by memory bandwidth: GELU's erf,
the loss's exp and log, LayerNorm's reductions run at 3-5 GB/s where the STREAM triad streams
13 GB/s (op by op, harness/tools/op_profile.py), so traffic.py's bytes over the triad's
bandwidth charged them about half their time. And the fused SDPA kernel runs at its own fraction
of peak, not at the GEMM curve's rate.

Method: model=small (the CPU demo model, fp32, micro-batch of 2 x 128 tokens) runs forward, the loss
brigade trains with (models/gpt.py) and backward, with its gradients dropped between rounds (so no
gradient accumulation, which the cost model charges apart at the triad's bandwidth), for `rounds`
rounds under OpProfile(timed=True), this thread's CPU time inside each operator:
    elementwise_GBps = the element-wise operators' bytes (inputs read, outputs written) over their
                       seconds and the views' (each view is an operator the step dispatches between
                       them): the median over rounds -> compute.elementwise_GBps, the bandwidth
                       harness/costmodel/compute.py divides a layer's and the head's traffic by.
    attention_efficiency.fp32 = the fused kernel's forward FLOPs as compute.py counts them (the causal
                       half of the core's forward) over the forward operator's seconds, as a fraction of
                       the profile's fp32 peak: the median over rounds;
    attention_backward_efficiency.fp32 = the same for its backward operator, whose FLOPs compute.py
                       counts as 2.5 forwards (the scores recomputed): a different kernel, timed apart.
The AdamW step and gradient accumulation stay at the triad's bandwidth (memory_bw_GBps): their
operators are plain lerp/mul/add passes that stream (AdamW measured at 13.7 GB/s of its 72 B per
parameter against a 13.2 GB/s triad).
"""
from __future__ import annotations

import statistics

from harness.collect.compute_classes import (
    ATTENTION_BACKWARD,
    ATTENTION_BACKWARD_OPS,
    ATTENTION_FORWARD,
    ATTENTION_FORWARD_OPS,
    kind_of,
)
from harness.config import compose_run
from harness.costmodel.inputs import Model
from harness.tools.device_timing import sig, sync

# Imports inside functions: torch and what imports it, which the parent process never loads.

MODEL = "small"
MICRO_BATCH = 2
SOURCE = ("model={model} fp32, micro-batch {mb}, forward + loss + backward under a TorchDispatchMode timing each "
          "aten op in this thread's CPU time (harness/tools/op_profile.py), median of {rounds} rounds: "
          "elementwise_GBps = element-wise ops' bytes / (their seconds + the views'); attention_efficiency.fp32 = "
          "the SDPA forward's counted FLOPs (compute.py: the causal half) / its seconds / fp32 peak, "
          "attention_backward_efficiency.fp32 the same for its backward (2.5 forwards of FLOPs) "
          "(harness/tools/calibrate_elementwise.py)")


def measure(rounds: int, peak_fp32_tflops: float) -> dict:
    """{elementwise_GBps, attention_efficiency: {fp32}, attention_backward_efficiency: {fp32}} of this core
    (module docstring)."""
    import torch

    from harness.tools.op_profile import OpProfile
    from models.gpt import build_model, cross_entropy

    torch.set_num_threads(1)
    cfg = compose_run([f"model={MODEL}"]).model
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_len), generator=torch.Generator().manual_seed(0))

    def step():
        cross_entropy(model(tokens), tokens).backward()
        model.zero_grad(set_to_none=True)

    step()  # the first step allocates and picks kernels
    core_forward = MICRO_BATCH * cfg.seq_len * Model.of(cfg).core_flops * cfg.n_layers
    elementwise, forward, backward = [], [], []
    flops, peak = 0.5 * core_forward, peak_fp32_tflops * 1e12  # the causal half of the core's forward
    for _ in range(rounds):
        with OpProfile(timed=True) as prof:
            step()
        s, by_op = prof.seconds, prof.seconds_by_op
        elementwise.append(prof.bytes["elementwise"] / max(s["elementwise"] + s["view"], 1e-9) / 1e9)
        if prof.ops["attention"]:
            forward.append(flops / max(by_op.get(ATTENTION_FORWARD, 0.0), 1e-9) / peak)
            backward.append(2.5 * flops / max(by_op.get(ATTENTION_BACKWARD, 0.0), 1e-9) / peak)
    out = {"elementwise_GBps": round(statistics.median(elementwise), 3)}
    if forward:
        out["attention_efficiency"] = {"fp32": round(statistics.median(forward), 4)}
        out["attention_backward_efficiency"] = {"fp32": round(statistics.median(backward), 4)}
    return out


def measure_profiled(dtype, peak_tflops: float, mode: dict, device) -> dict:
    """On a GPU (harness/tools/calibrate_gpu.py): {elementwise_GBps, attention_efficiency,
    attention_backward_efficiency} of brigade's own step (mode's model, blocks, micro-batch) under the
    dtype's autocast, from torch.profiler's own (self) kernel time per aten operator, the element-wise
    bytes from OpProfile over the same step; the attention keys only where the step ran a fused
    attention kernel. Any device: on a CPU the operators' own CPU time (the tests)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from harness.tools.op_profile import OpProfile
    from models.gpt import build_model, cross_entropy

    overrides = [f"model={mode['model']}", f"model.n_layers={mode['model_layers']}"]
    if mode["seq_len"]:
        overrides.append(f"model.seq_len={mode['seq_len']}")
    cfg = compose_run(overrides).model
    model = build_model(cfg, seed=0).to(device)
    tokens = torch.randint(0, cfg.vocab_size, (mode["micro_batch"], cfg.seq_len),
                           generator=torch.Generator().manual_seed(0)).to(device)

    def step():
        with torch.autocast(device.type, dtype=dtype):  # as brigade's forward_loss (strategies/base.py)
            loss = cross_entropy(model(tokens), tokens)
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # the first step allocates and picks kernels
    sync(device)
    with OpProfile() as ops:  # bytes moved, op by op (untimed: the mode's own Python would be timed)
        step()
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    core_forward = mode["micro_batch"] * cfg.seq_len * Model.of(cfg).core_flops * cfg.n_layers
    flops, peak = 0.5 * core_forward, peak_tflops * 1e12  # the causal half of the core's forward (compute.py)
    elementwise, forward, backward = [], [], []
    for _ in range(mode["model_rounds"]):
        with profile(activities=activities) as prof:
            step()
            sync(device)
        seconds = {"elementwise": 0.0, "forward": 0.0, "backward": 0.0}
        for ev in prof.key_averages():
            # kernel time on a GPU (named self_cuda_time_total before torch 2.4), CPU time on a CPU
            own_us = (getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0.0)
                      if cuda else ev.self_cpu_time_total)
            name = ev.key.split("::")[-1]
            if name in ATTENTION_FORWARD_OPS:
                seconds["forward"] += own_us * 1e-6
            elif name in ATTENTION_BACKWARD_OPS:
                seconds["backward"] += own_us * 1e-6
            elif kind_of(name) == "elementwise" and ev.key.startswith("aten::"):
                seconds["elementwise"] += own_us * 1e-6
        elementwise.append(ops.bytes["elementwise"] / max(seconds["elementwise"], 1e-9) / 1e9)
        if seconds["forward"] and seconds["backward"]:
            forward.append(flops / seconds["forward"] / peak)
            backward.append(2.5 * flops / seconds["backward"] / peak)
    out = {"elementwise_GBps": sig(statistics.median(elementwise))}
    if forward:
        out["attention_efficiency"] = sig(statistics.median(forward))
        out["attention_backward_efficiency"] = sig(statistics.median(backward))
    return out
