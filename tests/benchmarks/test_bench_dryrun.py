"""Benchmarks of dry runs at the scale users plan for (`make bench`): the wall time of a whole
`brigade launcher=dryrun` run, start-up to record, with the load average (1 min) before and after
beside it: the time depends on the cores free. Reported, never asserted.

    llama3_70b 3d dp32 tp8 pp4, global batch 1024 (32 micro-batches a pipeline)   1,024 ranks
    llama3_405b 3d dp128 tp8 pp16, global batch 2048, sequence 8192               16,384 ranks

Each prints its roles, the micro-batches each simulated rank ran, and the prediction against the peak.
And the planner confirming its best five layouts for Llama 3 405B on 16,384 H100s by dry runs
(`python -m harness.plan ... --dryrun-top 5`), start to end.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO

LAYOUTS = {
    "llama3_70b_1024_gbs1024": ["model=llama3_70b", "strategy=3d", "parallel.dp=32", "parallel.tp=8", "parallel.pp=4",
                                "workload.global_batch_size=1024"],
    "llama3_405b_16384": ["model=llama3_405b", "strategy=3d", "parallel.dp=128", "parallel.tp=8", "parallel.pp=16",
                          "workload.global_batch_size=2048"],
}
COMMON = ["launcher=dryrun", "hardware=h100_sxm", "workload.precision=bf16-mixed", "workload.micro_batch_size=1",
          "logger=none", "launcher.timeout_s=3600"]


def _timed(argv: list[str], timeout_s: int):
    """(wall seconds, load average before, after, the finished process) of one command from the repository."""
    before = os.getloadavg()[0]
    t0 = time.monotonic()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    return time.monotonic() - t0, before, os.getloadavg()[0], done


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bench_dryrun(benchmark, name, tmp_path):
    argv = [sys.executable, "-m", "harness", *COMMON, *LAYOUTS[name], f"results_dir={tmp_path}"]
    wall, before, after, done = benchmark.pedantic(_timed, (argv, 3700), rounds=1, iterations=1)
    (rec,) = [json.loads(line) for line in Path(tmp_path, "adhoc.jsonl").read_text().splitlines()]
    assert rec["status"] == "ok", (rec["error"], done.stdout[-2000:])
    m, p = rec["measured"], rec["predicted"]
    simulated = [(x or {}).get("simulated_microbatches", m["num_microbatches"]) for x in m["dryrun_shortened"]]
    benchmark.extra_info.update({"wall_s": wall, "load_before": before, "load_after": after,
                                 "roles": len(m["dryrun_ranks"]), "ranks": m["world_size"],
                                 "roles_derived": sum(x is not None for x in m["dryrun_derived"]),
                                 "microbatches_simulated": simulated, "peak_GiB": m["peak_mem_bytes"] / 2**30,
                                 "predicted_GiB": p["peak_mem_bytes"] / 2**30})
    derived = sum(x is not None for x in m["dryrun_derived"])
    print(f"\n{name}: ok in {wall:.0f} s (load {before:.2f} before, {after:.2f} after); {len(m['dryrun_ranks'])} roles "
          f"for {m['world_size']} ranks, {len(m['dryrun_ranks']) - derived} simulated and {derived} derived; "
          f"micro-batches simulated {simulated} of {m['num_microbatches']}; peak "
          f"{m['peak_mem_bytes'] / 2**30:.2f} GiB, predicted {p['peak_mem_bytes'] / 2**30:.2f} "
          f"({p['peak_mem_bytes'] / m['peak_mem_bytes'] - 1:+.1%})")


PLAN_405B = ["model=llama3_405b", "hardware=h100_sxm", "plan.gpus=16384", "workload.global_batch_size=2048",
             "workload.precision=bf16-mixed", "logger=none"]


def test_bench_plan_dryrun_top5_405b_16384(benchmark, tmp_path):
    argv = [sys.executable, "-m", "harness.plan", *PLAN_405B, f"results_dir={tmp_path}", "--dryrun-top", "5"]
    wall, before, after, done = benchmark.pedantic(_timed, (argv, 7200), rounds=1, iterations=1)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    recs = [json.loads(line) for f in Path(tmp_path).glob("*.jsonl") for line in f.read_text().splitlines()]
    simulated = [sum(x is None for x in r["measured"]["dryrun_derived"]) for r in recs]
    benchmark.extra_info.update({"wall_s": wall, "load_before": before, "load_after": after,
                                 "layouts": len(recs), "roles_simulated": simulated})
    print(f"\nplan --dryrun-top 5, llama3_405b on 16384: {len(recs)} dry runs in {wall:.0f} s (load {before:.2f} "
          f"before, {after:.2f} after); roles simulated per layout {simulated} of "
          f"{[len(r['measured']['dryrun_ranks']) for r in recs]}")
    print("\n".join(done.stdout.splitlines()[-8:]))
