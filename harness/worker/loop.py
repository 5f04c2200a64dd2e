"""The timed loop: the same for every strategy, read top to bottom like nanoGPT's bench.py.

    warm-up steps (excluded) -> timed steps (barrier before, device sync around) -> profiled steps

Every rank times every step; the step time reported is the slowest rank's (a step ends when the last
rank is done). The profiled window runs after the timed steps so the profiler's overhead
(1.3-3x on CPU) never distorts the timings.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from harness.worker import measure


def run_steps(strategy, run, dims, num_microbatches: int, device, progress=None, hooks=()) -> dict:
    w = run.workload
    rank = dist.get_rank()
    dp_rank = dims.coords(rank)["dp"]
    batch = lambda step: local_microbatches(step, run, dp_rank, dims.dp, num_microbatches, device)  # noqa: E731
    total = w.warmup_steps + w.steps
    clock = measure.Clock(device)
    losses, step_times, states = [], [], None

    measure.reset_peak_memory(device)
    # workload.live_tensors: the first two warm-up steps under the dry run's live-storage counter
    # (validate.py asks for two warm-up steps), so a real run's peak compares with a dry run's
    live = measure.LiveTensors(strategy.model, strategy.state_tensors()) if w.live_tensors else None
    for step in range(total):
        mbs = batch(step)  # built outside the timed region
        dist.barrier()  # start every rank's step together
        for h in hooks:
            h.before_step(step)
        if live is not None and step < 2:
            with live:
                loss = strategy.train_step(mbs)
            live.next_step()
        else:
            with clock:
                loss = strategy.train_step(mbs)
        for h in hooks:
            h.after_step(step)
        losses.append(loss.detach().float().reshape(()) if loss is not None else None)
        if step >= w.warmup_steps:
            step_times.append(clock.elapsed)
        if states is None:  # after the first step: params, grads and optimizer state all exist
            states = measure.model_state_bytes(strategy.state_tensors())
        if progress:
            progress(step + 1, total)

    profile = {}
    for h in hooks:  # e.g. the profiler window (issue: measurement), after and apart from timing
        profile.update(h.finish(strategy, batch, total) or {})
    live_peak = {f"live_{k}": v for k, v in live.summary().items()} if live is not None else {}
    return {"losses": _global_losses(strategy, losses, device), "step_times": step_times,
            "memory": {**states, **measure.peak_memory(device), **live_peak},
            "measured": strategy.extra_measurements(), **profile}


def _global_losses(strategy, losses, device) -> list[float]:
    """Mean over data-parallel replicas of each step's loss (one all-reduce, after timing)."""
    owner = strategy.loss_owner and losses[0] is not None
    vals = torch.stack([l if owner else torch.zeros((), device=device) for l in losses]).to(device)
    packed = torch.cat([vals, torch.tensor([1.0 if owner else 0.0], device=device)])
    dist.all_reduce(packed)
    return (packed[:-1] / packed[-1]).tolist()


# -- data ------------------------------------------------------------------------------------------
# Synthetic data: seeded, learnable token sequences, no downloads.
#
# Each sequence follows a fixed affine recurrence plus a little noise,
#     x[t+1] = (a * x[t] + b + noise[t]) mod V,   noise in [0, 4)
# so a model can learn it and the loss falls from ln(V) towards ln(4), as a user expects of training,
# while costing nothing to generate.
#
# The global batch of step k depends only on (seed, k): whatever the strategy and degrees, every run
# trains on the same tokens, so its losses can be compared with `single`. A rank takes its slice of
# the global batch by its data-parallel index, then cuts it into micro-batches.

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
