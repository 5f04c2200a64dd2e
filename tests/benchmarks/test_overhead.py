"""Benchmark (not a test): wall time of a brigade run against a bare torchrun DDP script that trains
the same model for the same steps. Reported as a ratio measured in one run (goal <= 1.10).

    make bench
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRESET, WARMUP, STEPS = "small", 3, 10


def _time(argv, env=None) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=REPO, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    return time.perf_counter() - t0


def test_harness_overhead_vs_bare_torchrun(benchmark, tmp_path):
    bare_argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 str(REPO / "tests/benchmarks/bare_ddp.py"), str(WARMUP + STEPS), PRESET]
    brigade_argv = [sys.executable, "-m", "harness", f"model={PRESET}", "strategy=ddp", "parallel.dp=2",
                    "logger=none", f"workload.warmup_steps={WARMUP}", f"workload.steps={STEPS}",
                    "workload.profile_steps=0", f"results_dir={tmp_path}"]
    bare: list[float] = []
    # Interleave the two so machine noise hits both alike; the bare run is timed in the setup.
    benchmark.pedantic(lambda: _time(brigade_argv), setup=lambda: bare.append(_time(bare_argv)),
                       rounds=3, iterations=1, warmup_rounds=0)
    brigade_s = benchmark.stats.stats.median
    bare_s = statistics.median(bare)
    benchmark.extra_info.update({"bare_torchrun_median_s": bare_s, "brigade_median_s": brigade_s,
                                 "overhead_ratio": brigade_s / bare_s, "goal": "<= 1.10"})
    print(f"\nbrigade {brigade_s:.2f} s vs bare torchrun {bare_s:.2f} s: ratio {brigade_s / bare_s:.3f} (goal <= 1.10)")
