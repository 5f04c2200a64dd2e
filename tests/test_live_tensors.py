"""One accounting of peak memory for real and dry runs (harness/worker/measure.py LiveTensors): a real
CPU run with workload.live_tensors=true counts its first two steps as a dry run counts its two fake
steps, so the real peak of each simulated rank equals the dry run's, in bytes, in the same step and
phase, with the same live bytes by kind. The families where they differ are listed in docs/memory.md
with the measured difference (gloo's asynchronous collectives and pipeline transfers; DDP and DeepSpeed
have no dry-run peak)."""
from __future__ import annotations

import pytest

from tests.helpers import run

BASE = ["model=llama_tiny", "workload.global_batch_size=8", "workload.micro_batch_size=2", "logger=none"]
REAL = ["workload.live_tensors=true", "workload.warmup_steps=2", "workload.steps=1", "workload.profile_steps=0"]
# each check costs a real and a dry run: three in CI, the rest in `make test-all`
CI = {"single", "fsdp", "hsdp"}
EQUAL = {
    "single": ["strategy=single"],
    "fsdp": ["strategy=fsdp", "parallel.dp=2"],
    "zero2": ["strategy=zero2", "parallel.dp=2"],
    "zero3": ["strategy=zero3", "parallel.dp=2"],
    "hsdp": ["strategy=fsdp", "parallel.dp=4", "parallel.dp_replicate=2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("family", [pytest.param(k, marks=[] if k in CI else [pytest.mark.heavy]) for k in EQUAL])
def test_a_real_run_peaks_where_and_as_high_as_its_dry_run(family, tmp_path):
    layout = [*BASE, *EQUAL[family]]
    real = run([*layout, *REAL], tmp_path)
    assert real["status"] == "ok", real["error"]
    dry = run([*layout, "launcher=dryrun", "study=dry"], tmp_path)
    assert dry["status"] == "ok", dry["error"]
    m, d = real["measured"], dry["measured"]
    assert "dryrun_step_error" not in d, d.get("dryrun_step_error")
    more = [m["live_peak_bytes_per_rank"][r] - dry_peak for r, dry_peak in zip(d["dryrun_ranks"], d["peak_mem_bytes_per_rank"])]
    if family != "single" and any(more):
        # gloo completes FSDP's reduce-scatters (and HSDP's all-reduces) on its own thread, the fake group
        # at once: on a loaded machine a collective's buffers can outlive their release in the dry run.
        # That is not guaranteed not to happen, so the real run may hold more, by at most one unit's
        # reduction in flight (its unsharded fp32 grads and their reduced copy; the root unit, embedding
        # and head, is the largest), and its peak is then elsewhere (docs/memory.md); exact otherwise.
        md = real["config"]["model"]
        unit = 4 * (2 * md["vocab_size"] * md["d_model"] + md["d_model"])
        assert all(0 <= x <= 2 * unit for x in more), more
        return
    assert more == [0] * len(more)
    # the dry run's worst rank, in the real run: the same step, phase and live bytes by kind (the real
    # run's worst can be a rank the dry run did not simulate, its peak moved by gloo's thread: docs/memory.md)
    at = m["live_peak_at_per_rank"][d["peak_rank"]]
    assert (at["step"], at["phase"]) == (d["peak_step"], d["peak_phase"])
    assert at["live_by_kind"] == d["peak_live_by_kind"]
    assert at["step"] == 2  # the optimizer state exists in the second step


def test_live_tensors_needs_two_warmup_steps(tmp_path):
    rec = run([*BASE, "strategy=single", "workload.live_tensors=true", "workload.warmup_steps=1"], tmp_path)
    assert rec["status"] == "invalid" and "warmup_steps 1 must be >= 2" in rec["error"]
