"""Benchmarks of the cost model (`make bench`): one prediction, and the planner's searches: gpt_70b on 1024
GPUs, llama3_70b on 1024 and on 16,384 (configs priced per second, with the load average beside it)."""
from __future__ import annotations

import os

import pytest

from harness.config import compose_run
from harness.costmodel import predict
from harness.plan import search
from harness.validate import validate


def test_bench_predict(benchmark):
    run = compose_run(["model=gpt_70b", "hardware=h100_sxm", "strategy=3d", "parallel.dp=16", "parallel.tp=8",
                       "parallel.pp=8", "workload.global_batch_size=1024", "workload.micro_batch_size=1",
                       "workload.precision=bf16-mixed"])
    dims = validate(run)
    out = benchmark(predict, run, dims)
    assert out["step_time_s"] > 0


def test_bench_plan_search_1024_gpus(benchmark):
    run = compose_run(["model=gpt_70b", "hardware=h100_sxm", "workload.global_batch_size=2048",
                       "workload.precision=bf16-mixed"])
    cands, counts = benchmark(search, run, 1024)
    benchmark.extra_info["configs_per_s"] = counts["evaluated"] / counts["seconds"]
    assert counts["evaluated"] > 1000 and cands


@pytest.mark.parametrize("gpus", [1024, 16384])
def test_bench_plan_search_llama3_70b(benchmark, gpus):
    run = compose_run(["model=llama3_70b", "hardware=h100_sxm", "workload.global_batch_size=2048",
                       "workload.precision=bf16-mixed"])
    before = os.getloadavg()[0]
    cands, counts = benchmark(search, run, gpus)
    rate = counts["evaluated"] / counts["seconds"]
    benchmark.extra_info.update({"configs_per_s": rate, "load_before": before, "load_after": os.getloadavg()[0]})
    print(f"\nllama3_70b on {gpus} GPUs: {counts['evaluated']} configs in {counts['seconds']:.2f} s, {rate:.0f} configs/s "
          f"(load {before:.2f} before, {os.getloadavg()[0]:.2f} after)")
    assert counts["evaluated"] > 1000 and cands
