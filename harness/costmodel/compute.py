"""Compute time of one micro-batch on one pipeline rank: GEMMs by shape, the attention kernel, and
the element-wise work by bandwidth.

GEMM (M, N, K) in dtype of e bytes, on a profile with a `compute.gemm.<dtype>` curve:
    t = max(2MNK / (R * wave(M, N) * sat(I)),  e (MK + KN + MN) / B)
    R = the best sustained GEMM rate (a cited measurement, or `harness.calibrate`'s sweep), B = memory
    bandwidth: below the ridge point R/B a GEMM is memory-bound (Williams et al. 2009, "Roofline").
    sat(I) = I / (I + c R/B), I = 2MNK / (e (MK + KN + MN)) the GEMM's arithmetic intensity (FLOP/byte)
    and c = the curve's `half_ridge` (0: off): above the ridge point the rate saturates towards R, at
    half of it where I = c R/B. c = 1 is the additive roofline t = 2MNK/R + bytes/B (operand traffic
    not hidden under the math): one dimensionless constant, so the curve moves with each profile's
    datasheet ridge point (A100 131, H100 236 FLOP/byte) and a mid-size GEMM runs further below R
    on the device with the higher ridge.
    wave(M, N) = tiles / (ceil(tiles / units) * units), tiles = ceil(M/tm) ceil(N/tn): the last wave of
    output tiles leaves units idle (NVIDIA, "Matrix Multiplication Background User's Guide", tile and
    wave quantization), with the tile (tm, tn) and unit count (SMs) of the profile;
    or, for a measured sweep, R at the measured GEMM shapes nearest (M, N, K) in log space (`shapes`:
    [M, N, K, TFLOP/s]: `calibrate`'s sweep, harness/tools/calibrate_compute.py, or a cited table, H100's from
    OpenXLA, conf/hardware/h100_sxm.yaml), or of an older profile R(2MNK) interpolated
    in log FLOPs (`points`: [GEMM FLOPs, TFLOP/s] pairs).
Per transformer layer and micro-batch of T = b*s tokens on a tp shard (models/gpt.py: q, k, v, o and
the MLP's matrices, separate nn.Linear; k and v n_kv_heads x head_dim wide under GQA): forward (T, out/t, in) or (T, out, in/t); backward the input gradient
(T, in, out) and the weight gradient (out, in, T) per projection; full recompute runs the forward again.
Attention core (QK^T, AV): under model.attention=sdpa with a profile's `attention_efficiency` (a fused
causal kernel, e.g. FlashAttention), the causal half of flops.py's 4 s h per token runs forward at that
fraction of peak; its backward recomputes the scores from the saved logsumexp instead of reading them:
5 matmuls (QK^T again, dV, dP, dQ, dK) against the forward's 2, so forward + backward = 3.5 forwards of
FLOPs, the backward's 2.5 at `attention_backward_efficiency` (a different kernel, slower per FLOP than
the forward; absent: the forward's fraction, as on a CPU profile whose calibrate timed both together)
(Dao et al. 2022, FlashAttention, Algorithm 4; llm-foundry's benchmark README counts the same extra
recompute, "attention multiplier 5 instead of 4" with checkpointing); recomputing the forward
(selective or full checkpointing) adds 1. Eager attention (scores materialised) runs its batched GEMMs,
full count, forward + backward = 3 forwards, at the GEMM rate of (s, s, h/a) shapes. Element-wise work:
traffic.py's bytes / the element-wise bandwidth: B, or where calibrate measured it the rate brigade's
own element-wise operators reach on the device (compute.elementwise_GBps: on one CPU core GELU, the
loss and the norms are not bandwidth-bound, harness/tools/calibrate_elementwise.py).
A profile without a `compute.gemm` entry for the dtype keeps one rate for every FLOP (achievable_tflops).
Dispatch: each layer's ops_per_layer operators cost at least op_dispatch_us each (both measured by
`harness.calibrate` on a CPU; 0 on the GPU profiles, whose kernels launch asynchronously). With tp > 1
each DTensor operator adds its DTensor dispatch (compute.dtensor, harness/tools/calibrate_dtensor.py):
per micro-batch ops_per_layer x (op_us + op_us_per_melem x the micro-batch's tokens x d_model / 10^6) per layer, and ops_outside_layers x outside_op_us (embedding, head,
loss parallel) charged with the head to the last stage; per optimizer step the AdamW ops
(harness/costmodel/layout.py). FSDP2 (state_sharding sharded) adds its measured host work per block and
outside the blocks per micro-batch, and per optimizer step (compute.fsdp2, harness/tools/calibrate_fsdp.py).
All of it, like the GEMMs, divides by the placement's CPU slowdown.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from harness.costmodel.params import MLP_MATRICES, SELECTIVE_OP_RECOMPUTED, block_projections


@dataclass(slots=True)
class GemmCurve:
    max_flops: float  # FLOP/s of the best large GEMM
    tile_m: int = 0
    tile_n: int = 0
    units: int = 0
    points: tuple = ()  # ((log GEMM FLOPs, FLOP/s), ...) measured, sorted
    half_ridge: float = 0.0  # c: intensity of half saturation / the ridge point R/B (0: no saturation)
    shapes: tuple = ()  # ((log M, log N, log K, FLOP/s), ...) measured GEMMs
    _memo: dict = field(default_factory=dict, repr=False, compare=False)  # (M, N, K) -> rate from `shapes`: the planner asks for the same few shapes per model
    _times: dict | None = field(default=None, repr=False, compare=False)  # _shape_times' results on this curve's values

    @classmethod
    def of(cls, cfg, scale: float = 1.0) -> "GemmCurve":
        """From a profile's compute.gemm.<dtype>; every rate x scale (the profile's compute.clock_scale)."""
        cfg, unit = dict(cfg), 1e12 * scale
        pts = tuple(sorted((math.log(float(f)), float(r) * unit) for f, r in (cfg.get("points") or ())))
        tile = list(cfg.get("tile") or (0, 0))
        shapes = tuple((math.log(m), math.log(n), math.log(k), float(r) * unit) for m, n, k, r in (cfg.get("shapes") or ()))
        return cls(float(cfg["max_tflops"]) * unit, int(tile[0]), int(tile[1]), int(cfg.get("units", 0)), pts,
                   float(cfg.get("half_ridge", 0.0)), shapes)

    def rate(self, m: float, n: float, k: float) -> float:
        """FLOP/s of one (M, N, K) GEMM, before the memory-bound limit."""
        if self.shapes:
            key = (m, n, k)
            if key not in self._memo:
                self._memo[key] = _nearest_shapes(self.shapes, math.log(max(m, 1.0)), math.log(max(n, 1.0)), math.log(max(k, 1.0)))
            return self._memo[key]
        if self.points:
            return _interpolate(self.points, math.log(max(2 * m * n * k, 1.0)))
        if not self.units:
            return self.max_flops
        tiles = math.ceil(m / self.tile_m) * math.ceil(n / self.tile_n)
        return self.max_flops * tiles / (math.ceil(tiles / self.units) * self.units)


def _interpolate(points: tuple, x: float) -> float:
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def _nearest_shapes(shapes: tuple, x: float, y: float, z: float, k: int = 4) -> float:
    """The rate of a GEMM from the measured shapes nearest it in (log M, log N, log K): the measured rate
    itself at a measured shape, else the k nearest weighted by 1 / distance^2 (inverse-distance
    weighting, Shepard 1968)."""
    near = sorted(((x - a) ** 2 + (y - b) ** 2 + (z - c) ** 2, r) for a, b, c, r in shapes)[:k]
    if near[0][0] < 1e-12:
        return near[0][1]
    w = [1.0 / d for d, _ in near]
    return sum(wi * r for wi, (_, r) in zip(w, near)) / sum(w)


def gemm_time(curve: GemmCurve, m: float, n: float, k: float, elem_bytes: int, mem_bw: float, slowdown: float) -> float:
    flops, moved = 2 * m * n * k, elem_bytes * (m * k + k * n + m * n)
    rate = curve.rate(m, n, k) / slowdown
    if not mem_bw:
        return flops / rate
    if curve.half_ridge and not (curve.points or curve.shapes):  # saturation above the ridge point (module docstring)
        intensity = flops / moved
        rate *= intensity / (intensity + curve.half_ridge * (curve.max_flops / slowdown) / mem_bw)
    return max(flops / rate, moved / mem_bw)


def training_gemms(m: float, n: float, k: float) -> tuple:
    """A projection's forward (M, N, K), input gradient and weight gradient."""
    return ((m, n, k), (m, k, n), (n, k, m))


def layer_projections(md, tp: int, tokens: float) -> list:
    """Forward (M, N, K) of each projection of one dense layer's tp shard, in models/gpt.py's order:
    q (h, h), k and v (kv, h) with kv = n_kv_heads x head_dim (GQA), o (h, h), then the MLP's matrices
    (params.MLP_MATRICES: GELU fc1, fc2; SwiGLU gate, up, down), column-parallel in, row-parallel out."""
    mlp = md.shape[9]
    row_parallel = [False, False, False, True] + [d_ff_in == 1 for _, d_ff_in in MLP_MATRICES[mlp]]
    return [(tokens, out, k / tp) if row else (tokens, out / tp, k)
            for row, (out, k) in zip(row_parallel, block_projections(md.h, md.shape[8], md.d_ff, mlp))]


def layer_gemm_time(md, tp: int, tokens: float, curve: GemmCurve, e: int, mem_bw: float, slowdown: float) -> float:
    """Forward + backward GEMMs of one dense layer's tp shard for `tokens` tokens."""
    return sum(gemm_time(curve, *g, e, mem_bw, slowdown) for s in layer_projections(md, tp, tokens)
               for g in training_gemms(*s))


@dataclass(slots=True)
class LayerTimes:
    """Seconds per micro-batch of one layer of the layout's shard (per checkpointing mode) and of the
    head: compute (GEMMs, attention) and element-wise traffic apart. Parts of `layer` (and `head`), for
    the measured split's twin (harness/collect/compute_classes.py): `core` the attention core, `host` the
    operators' host work (dispatch, DTensor, FSDP2 hooks; CPU profiles), which a trace spreads over every
    operator, most of them element-wise."""
    layer: dict
    layer_traffic: dict
    head: float
    head_traffic: float
    core: dict
    host: dict
    head_host: float

    def rank_time(self, rank, ckpt: str) -> tuple[float, float]:
        """(compute, element-wise) seconds of one micro-batch on a pipeline rank."""
        return (rank.layers * self.layer[ckpt] + (self.head if rank.last else 0.0),
                rank.layers * self.layer_traffic[ckpt] + (self.head_traffic if rank.last else 0.0))

    def rank_parts(self, rank, ckpt: str) -> tuple[float, float]:
        """(attention core, host work) seconds of one micro-batch on a pipeline rank: parts of rank_time's first."""
        return rank.layers * self.core[ckpt], rank.layers * self.host[ckpt] + (self.head_host if rank.last else 0.0)


def microbatch_times(lo, mb: int) -> LayerTimes:
    """Layer and head times for a micro-batch of mb sequences (cached on the layout per mb, lo.mb_times)."""
    if mb in lo.mb_times:
        return lo.mb_times[mb]
    md, pt, pl = lo.model, lo.per_token, lo.place
    tokens = mb * md.s
    curve = lo.hw.gemm.get(lo.dtype)
    bw = lo.elem_bw
    if curve is None or md.E:  # one rate for every FLOP (MoE experts: no shape model yet)
        layer = {c: tokens * pt.layer_flops[c] / lo.matmul_rate for c in pt.layer_flops}
        head = tokens * pt.head_flops / lo.matmul_rate
        forward = tokens * md.core_flops / pl.tp / lo.matmul_rate  # layout.py's layer_flops count it 3x / 4x
        cores = {"none": 3 * forward, "selective": 4 * forward, "full": 4 * forward, "selective_op": 3 * forward}
    else:
        gemm, (core, core_forward), head, op_recompute = _shape_times(lo, tokens, curve)
        layer = {"none": gemm + core, "selective": gemm + core + core_forward,
                 "full": gemm * 4 / 3 + core + core_forward, "selective_op": gemm + core + op_recompute}
        cores = {"none": core, "selective": core + core_forward, "full": core + core_forward, "selective_op": core}
    # every operator pays the dispatch floor calibrate measured (CPU eager); full recompute reruns the forward
    dispatch = lo.hw.ops_per_layer * lo.hw.op_dispatch_s * pl.slowdown
    head_host = 0.0
    if pl.tp > 1:  # and a DTensor operator its DTensor dispatch; the head and loss parallel's on the last stage
        dt = lo.hw.dtensor.sp if lo.strategy.sp else lo.hw.dtensor
        dispatch += dt.ops_per_layer * dt.block_op_s(tokens * md.h) * pl.slowdown
        head_host += dt.ops_outside_layers * dt.outside_op_s * pl.slowdown
    if lo.strategy.state_sharding == "sharded":  # FSDP2's hooks and copies around each block (calibrate_fsdp.py)
        dispatch += lo.hw.fsdp2["block_s"] * pl.slowdown
        head_host += lo.hw.fsdp2["outside_s"] * pl.slowdown
    host = {c: dispatch * (4 / 3 if c in ("full", "selective_op") else 1) for c in layer}
    layer = {c: t + host[c] for c, t in layer.items()}
    traffic = {c: tokens * pt.layer_traffic_bytes[c] / bw if bw else 0.0 for c in layer}
    out = LayerTimes(layer, traffic, head + head_host, tokens * pt.head_traffic_bytes / bw if bw else 0.0, cores,
                     host, head_host)
    lo.mb_times[mb] = out
    return out


_SHAPE_TIMES: dict = {}  # a curve's values -> its _shape_times results: the planner meets the same (shape, tp,
# tokens) in many layouts, and predict builds its curves afresh for every config


def _shape_times(lo, tokens: float, curve: GemmCurve) -> tuple:
    """(one layer's GEMMs, its attention core, the head's GEMMs, the forward GEMMs selective_op recomputes)
    for `tokens` tokens, seconds."""
    md, pl, pt = lo.model, lo.place, lo.per_token
    cache = curve._times
    if cache is None:  # the curve's values hashed once, not per call (its measured points and shapes are many)
        if len(_SHAPE_TIMES) > 64:
            _SHAPE_TIMES.clear()
        cache = curve._times = _SHAPE_TIMES.setdefault((curve.max_flops, curve.tile_m, curve.tile_n, curve.units,
                                                        curve.points, curve.shapes, curve.half_ridge), {})
    key = (md.shape, md.cfg.attention, lo.hw.tensor_peak.get(lo.dtype), lo.hw.attention_efficiency.get(lo.dtype),
           lo.hw.attention_backward_efficiency.get(lo.dtype), pl.tp, tokens, pt.act_elem_bytes, lo.mem_bw, pl.slowdown)
    if key not in cache:
        if len(cache) > 65536:
            cache.clear()
        gemm = layer_gemm_time(md, pl.tp, tokens, curve, pt.act_elem_bytes, lo.mem_bw, pl.slowdown)
        head = sum(gemm_time(curve, *g, pt.act_elem_bytes, lo.mem_bw, pl.slowdown)
                   for g in training_gemms(tokens, md.V / pl.tp, md.h))
        recompute = sum(gemm_time(curve, *g, pt.act_elem_bytes, lo.mem_bw, pl.slowdown)
                        for g in layer_projections(md, pl.tp, tokens)[SELECTIVE_OP_RECOMPUTED])
        cache[key] = (gemm, _core_time(lo, tokens, curve), head, recompute)
    return cache[key]


def _core_time(lo, tokens: float, curve: GemmCurve) -> tuple[float, float]:
    """(forward + backward, forward) seconds of QK^T and AV on one layer's tp shard."""
    md, tp = lo.model, lo.place.tp
    forward = tokens * md.core_flops / tp
    eff = lo.hw.attention_efficiency.get(lo.dtype) if md.cfg.attention == "sdpa" else None
    if eff:  # a fused causal kernel computes only the unmasked half, and recomputes the scores in backward
        at_peak = 0.5 * forward / (lo.hw.tensor_peak[lo.dtype] / lo.place.slowdown)
        t = at_peak / float(eff)
        return t + 2.5 * at_peak / float(lo.hw.attention_backward_efficiency.get(lo.dtype, eff)), t
    t = forward / (curve.rate(tokens, md.s, md.h / md.a) / lo.place.slowdown)
    return 3 * t, t
