"""Synthetic data: seeded, learnable token sequences, no downloads.

Each sequence follows a fixed affine recurrence plus a little noise,
    x[t+1] = (a * x[t] + b + noise[t]) mod V,   noise in [0, 4)
so a model can learn it and the loss falls from ln(V) towards ln(4), as a user expects of training,
while costing nothing to generate.

The global batch of step k depends only on (seed, k): whatever the strategy and degrees, every run
trains on the same tokens, so its losses can be compared with `single`. A rank takes its slice of
the global batch by its data-parallel index, then cuts it into micro-batches.
"""
from __future__ import annotations

import torch


def global_batch(step: int, seed: int, global_batch_size: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """(global_batch_size, seq_len + 1) int64 tokens: inputs are [:, :-1], targets [:, 1:]."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    noise = torch.randint(0, 4, (global_batch_size, seq_len), generator=g)
    tokens = torch.empty(global_batch_size, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab_size, (global_batch_size,), generator=g)
    for t in range(seq_len):  # (B,) per position: ~1 ms for the demo's batch
        tokens[:, t + 1] = (31 * tokens[:, t] + 7 + noise[:, t]) % vocab_size
    return tokens


def local_microbatches(step: int, run, dp_rank: int, dp: int, num_microbatches: int, device) -> list[tuple]:
    """This dp rank's micro-batches for one step: a list of (inputs, targets), each (micro_batch, seq_len)."""
    w, m = run.workload, run.model
    tokens = global_batch(step, w.seed, w.global_batch_size, m.seq_len, m.vocab_size)
    per_rank = w.global_batch_size // dp
    mine = tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank].to(device)
    return [(mb[:, :-1], mb[:, 1:]) for mb in mine.chunk(num_microbatches)]
