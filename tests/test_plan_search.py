"""The planner's shortcuts change nothing: with them (what no replica count changes shared among a layout's HSDP
variants, configs rejected once their peak is certain to exceed the device's memory) the search returns the
same ranked list, with the same predictions to the last bit, and the same counts as pricing every config on
its own, in full."""
from __future__ import annotations

import pytest

from harness.config import compose_run
from harness.plan import search

CASES = {
    # most configs over memory at 1024 GPUs, most HSDP variants at 16,384; a pipeline-heavy 405B
    "llama3_70b_1024": (["model=llama3_70b", "hardware=h100_sxm", "workload.global_batch_size=2048",
                         "workload.precision=bf16-mixed"], 1024),
    "llama3_70b_16384": (["model=llama3_70b", "hardware=h100_sxm", "workload.global_batch_size=2048",
                          "workload.precision=bf16-mixed"], 16384),
    "llama3_405b_16384": (["model=llama3_405b", "hardware=h100_sxm", "workload.global_batch_size=2048",
                           "workload.precision=bf16-mixed"], 16384),
    # experts (ep), a CPU profile (time-sharing ranks, fp32), a tied GPT-2 head
    "moe_tiny_cpu_8": (["model=moe_tiny", "hardware=cpu_calibrated", "workload.global_batch_size=16"], 8),
    "small_cpu_8": (["model=small", "hardware=cpu_calibrated"], 8),
    "llama3_8b_64": (["model=llama3_8b", "hardware=h100_sxm", "workload.global_batch_size=256",
                      "workload.precision=bf16-mixed"], 64),
}


def rows(cands):
    return [(c.strategy, c.schedule, c.dp, c.dp_replicate, c.tp, c.pp, c.vpp, c.ep, c.zero, c.mb, c.m, c.ckpt,
             sorted(c.knobs.items()), c.crosses, c.pred) for c in cands]


@pytest.mark.parametrize("case", list(CASES))
def test_shortcuts_return_the_exhaustive_search(case):
    overrides, gpus = CASES[case]
    run = compose_run(overrides)
    fast, fast_counts = search(run, gpus)
    full, full_counts = search(run, gpus, shortcuts=False)
    assert fast and len(fast) == len(full)
    assert rows(fast) == rows(full)  # the same order and every figure equal (floats compared exactly)
    assert {k: fast_counts[k] for k in ("evaluated", "over_memory")} == \
        {k: full_counts[k] for k in ("evaluated", "over_memory")}
    assert fast_counts["over_memory"] > 0 or "cpu" in case  # the GPU cases reject configs
