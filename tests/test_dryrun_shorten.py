"""A dry run's pipeline step shortened to the micro-batches that decide its peak
(harness/strategies/pp_shorten.py): for every schedule, the shortened dry run's peak, step and phase
equal the full dry run's on every simulated rank; GPipe and looped BFS, which hold every micro-batch
until its backward, run whole. Which schedules shorten, and to how few micro-batches, is read from
torch's own action lists."""
from __future__ import annotations

import types

import pytest

from harness.strategies import pp_shorten
from tests.helpers import run

# 16 micro-batches of two sequences a step on each pipeline
BASE = ["launcher=dryrun", "model=llama_tiny", "workload.global_batch_size=32", "workload.micro_batch_size=2",
        "logger=none"]
LAYOUTS = {s: ["strategy=pp", "parallel.pp=2", f"strategy.schedule={s}", *(["parallel.vpp=2"] if v else [])]
           for s, v in (("gpipe", False), ("1f1b", False), ("interleaved_1f1b", True), ("looped_bfs", True),
                        ("interleaved_zero_bubble", True), ("zbv_zero_bubble", True), ("dualpipev", True))}
LAYOUTS["3d 1f1b"] = ["strategy=3d", "parallel.dp=2", "parallel.tp=2", "parallel.pp=2"]  # FSDP and TP in the stages
LAYOUTS["1f1b pp4"] = ["strategy=pp", "parallel.pp=4", "strategy.schedule=1f1b"]
HOLD_ALL = {"gpipe", "looped_bfs"}
CI = {"1f1b", "interleaved_1f1b", "dualpipev", "3d 1f1b"}  # each check costs two dry runs: the rest in make test-all


@pytest.mark.slow
@pytest.mark.parametrize("family", [pytest.param(k, marks=[] if k in CI else [pytest.mark.heavy]) for k in LAYOUTS])
def test_a_shortened_dry_run_peaks_as_high_when_and_where_the_full_one_does(family, tmp_path):
    short = run([*BASE, *LAYOUTS[family], "study=short"], tmp_path)
    full = run([*BASE, *LAYOUTS[family], "launcher.shorten=false", "study=full"], tmp_path)
    for rec in (short, full):
        assert rec["status"] == "ok", rec["error"]
        assert "dryrun_step_error" not in rec["measured"] and "dryrun_not_periodic" not in rec["measured"]
    s, f = short["measured"], full["measured"]
    assert s["dryrun_ranks"] == f["dryrun_ranks"]
    assert s["peak_mem_bytes_per_rank"] == f["peak_mem_bytes_per_rank"]
    assert [s[k] for k in ("peak_rank", "peak_step", "peak_phase", "peak_op")] == \
           [f[k] for k in ("peak_rank", "peak_step", "peak_phase", "peak_op")]
    assert f["dryrun_shortened"] == [None] * len(f["dryrun_ranks"])
    if family in HOLD_ALL:
        assert s["dryrun_shortened"] == [None] * len(s["dryrun_ranks"])
    else:
        simulated = [x["simulated_microbatches"] for x in s["dryrun_shortened"]]
        assert all(n < s["num_microbatches"] for n in simulated), simulated


def _torch_order(schedule: str, pp: int, m: int, rank: int) -> list | None:
    """torch 2.13's action list of one rank, computed as its schedules' __init__ does from the sizes alone
    (`_get_pipeline_order` and `_calculate_single_rank_operations` read no stage); None where torch
    refuses m micro-batches."""
    import torch.distributed.pipelining.schedules as S

    single = {"gpipe": S.ScheduleGPipe, "1f1b": S.Schedule1F1B}
    multi = {"interleaved_1f1b": S.ScheduleInterleaved1F1B, "looped_bfs": S.ScheduleLoopedBFS,
             "interleaved_zero_bubble": S.ScheduleInterleavedZeroBubble, "zbv_zero_bubble": S.ScheduleZBVZeroBubble,
             "dualpipev": S.ScheduleDualPipeV}
    if schedule in single:
        if schedule == "1f1b" and m < pp:
            return None
        order = single[schedule]._get_pipeline_order(types.SimpleNamespace(_num_stages=pp, _n_microbatches=m))
    else:
        rounds = max(1, m // pp)
        if m % rounds or (schedule == "dualpipev" and m < 2 * pp):
            return None
        ns = types.SimpleNamespace(pp_group_size=pp, n_local_stages=2, _n_microbatches=m, num_stages=2 * pp,
                                   number_of_rounds=rounds, microbatches_per_round=m // rounds, _stages=[None, None])
        order = {rank: multi[schedule]._calculate_single_rank_operations(ns, rank)}
    return pp_shorten.local_order(types.SimpleNamespace(pipeline_order=order), rank, m)


@pytest.mark.parametrize("schedule", [s for s in LAYOUTS if " " not in s])
def test_which_schedules_shorten_and_to_how_few_microbatches(schedule):
    """Every schedule but GPipe and looped BFS shortens every step of 32 pp micro-batches, to a number that
    does not grow with the step: at most COPIES + 3 rounds of the pipeline's stages."""
    for pp in (2, 4, 8):
        chunks = pp * (1 if schedule in ("gpipe", "1f1b") else 2)
        for m in (8 * pp, 32 * pp):
            for rank in range(pp):
                full = _torch_order(schedule, pp, m, rank)
                splice = pp_shorten.find_splice(full, m, lambda n, pp=pp, rank=rank: _torch_order(schedule, pp, n, rank),
                                                (pp_shorten.COPIES + 3) * chunks)
                if schedule in HOLD_ALL:
                    assert splice is None, (pp, m, rank)
                    continue
                assert splice is not None and splice.microbatches <= (pp_shorten.COPIES + 3) * chunks, (pp, m, rank)
                # the full order is the short one with the copies inserted and the rest moved on
                at, b, q, t = splice.at, splice.period, splice.shift, splice.copies
                short = list(splice.order)
                inserted = [(k, s, mb + j * q) for j in range(1, t + 1) for k, s, mb in short[at - b:at]]
                moved = [(k, s, mb + m - splice.microbatches) for k, s, mb in short[at:]]
                assert short[:at] + inserted + moved == full, (pp, m, rank)
