"""Benchmarks of the cost model (`make bench`): one prediction, and the planner's 1024-GPU search."""
from __future__ import annotations

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
