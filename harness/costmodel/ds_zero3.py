"""DeepSpeed ZeRO-3: which parameters it gathers per micro-batch, and which it keeps gathered.

DeepSpeed's parameter coordinator records the order in which modules fetch their parameters over one
forward + backward (its trace, complete from the third pass on) and, after a module's forward,
re-partitions its parameters only if they are not used again within `stage3_max_reuse_distance`
parameter elements (default 1e9; deepspeed/runtime/zero/partitioned_param_coordinator.py,
`__params_to_release`: it walks the trace from the next module on, adding up their elements, and
keeps every parameter it meets before the sum reaches the distance). Between a module's forward and
its backward lie the forward and the backward of every module after it, so

    kept from forward to backward  iff  2 x (elements of the modules after it) < reuse distance

and the backward gathers the rest again. Parameters of at most `stage3_param_persistence_threshold`
elements are never partitioned and never gathered (parameter_offload.py, mark_persistent_parameters).
Per micro-batch the dp axis therefore all-gathers (forward) + (released after forward) elements, not
the ZeRO paper's 2 x every parameter: a model smaller than half the distance (every CPU model here,
model=small: 10.5M elements) gathers each parameter once, and keeps all of them gathered from forward
to backward; a 175B model re-gathers all but its last ~0.5e9 elements (the head, ln_f).

The trace is models/gpt.py's module order (params.block_projections gives a block's projections).
"""
from __future__ import annotations

from functools import lru_cache

from harness.costmodel.params import block_projections


def _modules(shape: tuple) -> list[tuple[int, ...]]:
    """Each leaf module's parameter sizes, in the order the forward calls them (full, unpartitioned)."""
    L, h, _, d_ff, V, s, _, _, kv, mlp, norm, position, tie, bias = shape
    norm_params = (h, h) if norm == "layernorm" else (h,)

    def linear(out: int, inp: int) -> tuple[int, ...]:
        return (out * inp, out) if bias else (out * inp,)

    q, k, v, o, *mlp_mods = (linear(out, inp) for out, inp in block_projections(h, kv, d_ff, mlp))
    block = [norm_params, q, k, v, o, norm_params, *mlp_mods]
    out = [(V * h,)] + ([(s * h,)] if position == "learned" else [])
    out += block * L + [norm_params]
    if not tie:  # a tied head is the embedding's tensor: gathered with it, not a module of its own
        out.append((V * h,))
    return out


@lru_cache(maxsize=1024)
def gathered_elements(shape: tuple, reuse_distance: int, persistence_threshold: int) -> tuple[int, int, int]:
    """(elements gathered in forward, elements gathered again in backward, elements kept gathered from
    forward to backward) of one micro-batch, for the model of params.model_shape."""
    sizes = [sum(t for t in mod if t > persistence_threshold) for mod in _modules(shape)]
    after, forward, again, kept = sum(sizes), 0, 0, 0
    for n in sizes:
        after -= n
        forward += n
        if 2 * after < reuse_distance:
            kept += n
        else:
            again += n
    return forward, again, kept
