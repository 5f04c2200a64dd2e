"""Timing a device's work for `harness.calibrate` (harness/tools/calibrate_gpu.py, calibrate_collectives.py,
calibrate_elementwise.py): on a GPU from CUDA events around calls issued back to back (a training step
keeps the device's queue full; a synchronised call would time its launch, not its kernel), on a CPU from
the wall clock, so the same measuring code runs in the tests on this CPU."""
from __future__ import annotations

import time

# Imports inside functions: torch and what imports it, which the parent process never loads.


def sync(device) -> None:
    """Wait for the device to finish what was issued to it (nothing to wait for on a CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_for(fn, window_s: float, device) -> tuple[int, float]:
    """(calls, seconds) of fn called back to back for about window_s: on a GPU the seconds between two
    CUDA events around the calls, on a CPU the wall clock."""
    fn()  # a shape's first call picks its kernel and workspace: time the second
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return timed_calls(fn, max(1, min(100_000, int(window_s / max(time.perf_counter() - t0, 1e-7)))), device)


def timed_calls(fn, calls: int, device) -> tuple[int, float]:
    """(calls, seconds) of exactly `calls` calls of fn back to back (CUDA events on a GPU)."""
    import torch

    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return calls, start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return calls, time.perf_counter() - t0


def sig(x: float) -> float:
    """Four significant figures (a CPU in the tests measures TFLOP/s of 1e-3)."""
    return float(f"{x:.4g}")
