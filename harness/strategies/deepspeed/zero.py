"""DeepSpeed ZeRO (strategy.engine=deepspeed with ddp = ZeRO-0, zero1, zero2, zero3; optional offload).

What DeepSpeed holds per rank, for N parameters at dp ranks, fp32 (measured here: docs/notes.md):

    stage 0: params N, grads N, Adam 2N                      grads all-reduced (ring, 2(dp-1)/dp x 4N bytes)
    stage 1: params N, fp32 master N/dp, grads N/dp, Adam 2N/dp   grads reduced at the boundary,
    stage 2: same as 1, grads reduce-scattered in buckets during backward   updated params all-gathered
    stage 3: params N/dp (persistence threshold 0), master N/dp, grads N/dp, Adam 2N/dp; params
             all-gathered before each layer's forward and backward, grads reduce-scattered

The fp32 master partition exists even in fp32 runs: the ZeRO optimizer always steps a separate flat
fp32 copy of this rank's partition and copies it back into the module's (bit16) params.
The engine itself (setup, step, the capture of model-state bytes) is engine.py.
"""
from __future__ import annotations

from harness.strategies.deepspeed.engine import DeepSpeedStrategy

STRATEGY = DeepSpeedStrategy
