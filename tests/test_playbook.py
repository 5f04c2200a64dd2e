"""Pure tier: the Playbook sweep's development half (lab/playbook.py) and its generated page docs/playbook.md."""
from __future__ import annotations

import math

import pytest

from lab import playbook, playbook_doc


@pytest.fixture(scope="module")
def results():
    return playbook.run_all()


def test_the_development_half_is_whole_and_only_it():
    rows = playbook.load()
    assert len(rows) == 1641
    assert {r["model_label"] for r in rows} == {"1B", "8B"}
    assert sum(r["ran"] for r in rows) == 1027
    # the batch column says 256 everywhere; 20 rows' degrees and accumulation process another (NOT_EXPRESSED)
    assert {r["gbs_seqs"] for r in rows} == {256}
    assert sum(playbook.batch_sequences(r) != 256 for r in rows) == 20
    for r in rows:
        assert r["gpus"] == r["dp"] * r["tp"] * r["pp"] == 8 * r["nodes"]
        assert r["ran"] or r["status"] == "crashed_or_oom"
        assert (r["tok_s_gpu"] > 0) == r["ran"]


def test_rows_map_to_the_runtime_as_it_ran():
    """ZeRO-1 shards master and AdamW (the distributed optimizer), ZeRO-0 nothing; bf16 params, fp32 master and
    gradients; sequence parallel with tp; 1F1B; EFA between p5 nodes; tied embeddings only where one stage holds both."""
    rows = playbook.load()
    compose = __import__("lab.published", fromlist=["caching_compose"]).caching_compose()
    by = {(r["model_label"], r["dp"], r["tp"], r["pp"], r["zero_stage"]): r for r in rows}
    run = compose(playbook.overrides(by[("1B", 16, 4, 2, 1)]))
    s = run.strategy
    assert (s.name, s.data_parallel, s.low_precision_params, s.sequence_parallel, s.schedule) == \
        ("3d", "zero1", True, True, "1f1b")
    assert run.hardware.fabric["name"] == "efa_p5" and run.model.tie_embeddings is False
    assert compose(playbook.overrides(by[("1B", 8, 1, 1, 0)])).model.tie_embeddings is True
    plain = compose(playbook.overrides(by[("1B", 8, 1, 1, 1)])).strategy
    assert (plain.name, plain.zero1_impl) == ("zero1", "distributed")
    assert compose(playbook.overrides(by[("8B", 2, 4, 1, 0)])).strategy.data_parallel == "ddp"


def test_every_ok_row_is_predicted_and_every_crashed_row_checked(results):
    ok = [r for r in results if r["ran"]]
    # nanotron's split leaves 1B's pp 16 rank 15 without a block: refused (65 of those 66 runs crashed, one ran)
    refused = [r for r in ok if r["refused"] is not None]
    assert [(r["model"], r["pp"]) for r in refused] == [("1B", 16)] and "without a block" in refused[0]["refused"]
    assert all(r["predicted_tokens_per_s_per_gpu"] > 0 and r["mem_ratio"] > 0 for r in ok if r not in refused)
    for r in results:
        if not r["ran"]:  # checked: refused with the arithmetic, or a fit verdict
            assert (r["refused"] is None) == (r["fits_in_memory"] is not None)


GIB = 1024**3
MARGINS = {"families": {"tp in node": {"memory": {"n": 10, "margin_pct": 10.0}}},
           "memory_all": {"n": 100, "margin_pct": 20.0}}  # a stored table's memory margins (lab/family_errors.py)


def row(pred, meas, fits=True, ran=True, peak_gib=40.0, fam="tp in node"):
    """A group's row as predict_row gives it, on an 80 GiB GPU."""
    return {"predicted_tokens_per_s_per_gpu": pred, "measured_tokens_per_s_per_gpu": meas if ran else None,
            "fits_in_memory": fits, "ran": ran, "dp": 1, "tp": 1, "pp": 1, "zero": 0, "mbs": 1,
            "grad_acc": int(pred), "family": fam, "device": "cuda", "peak_mem_bytes": peak_gib * GIB,
            "device_memory_bytes": 80 * GIB}


def test_a_group_verdict_is_the_planners_pick_among_what_fits():
    g = playbook.group_verdict([row(30, 0, ran=False), row(20, 80), row(10, 100), row(40, 120, fits=False)], MARGINS)
    # the pick is the fastest predicted that fits (it crashed: regret 1); the measured best (predicted OOM) has no rank
    assert (g["pick_ran"], g["regret"], g["within_10_pct"], g["best_predicted_rank"]) == (False, 1.0, False, None)
    g = playbook.group_verdict([row(20, 95), row(10, 100), row(5, 50)], MARGINS)
    assert g["within_10_pct"] and g["regret"] == pytest.approx(0.05) and g["best_predicted_rank"] == 2
    assert g["rho"] == pytest.approx(0.5)
    assert math.isnan(playbook.group_verdict([row(20, 95)], MARGINS)["rho"])


@pytest.mark.parametrize("peak_gib, fam, ranked", [
    (72.0, "tp in node", True),  # 72 x 1.10 = 79.2 GiB: fits with its family's margin
    (73.0, "tp in node", False),  # 73 x 1.10 = 80.3 GiB: fits, but not with the margin
    (66.0, "pp in node", True),  # a family with no memory run takes every run's margin: 66 x 1.20 = 79.2
    (67.0, "pp in node", False),  # 67 x 1.20 = 80.4
])
def test_the_planner_ranks_what_fits_with_its_familys_memory_margin(peak_gib, fam, ranked):
    """A layout predicted to fit, but within its family's memory error of the device's memory, is not the pick: the
    one the planner ranks next is (plan's rule, harness/costmodel/family_errors.py memory_limit)."""
    edge = row(30, None, ran=False, peak_gib=peak_gib, fam=fam)  # the fastest predicted, at the memory's edge
    assert playbook.planned(edge, MARGINS) == ranked
    g = playbook.group_verdict([edge, row(20, 95), row(10, 100)], MARGINS)
    assert (g["pick_ran"], g["within_10_pct"]) == ((False, False) if ranked else (True, True))


def test_playbook_page_is_generated():
    assert playbook_doc.DOC.read_text() == playbook_doc.playbook_doc(), \
        "docs/playbook.md is stale: python -m lab.playbook_doc"


def test_host_layer_us_is_its_fit_on_the_development_half():
    from harness.config import compose_run
    fitted, rows = playbook.fit_host_layer_us()
    assert rows >= 5
    assert compose_run(["runtime=nanotron"]).runtime.host_layer_us == round(fitted)


def test_ring_step_latency_us_is_its_fit_on_the_development_half():
    from harness.config import compose_run
    fitted, rows = playbook.fit_ring_step_latency_us()
    assert rows >= 30
    profile = compose_run(["hardware=h100_sxm", "hardware/fabric=efa_p5"]).hardware.fabric
    assert profile["ring_step_latency_us"] == pytest.approx(fitted, abs=0.05)


def test_tp_ring_step_remote_pp_us_is_its_fit_on_the_development_half():
    from harness.config import compose_run
    fitted, rows = playbook.fit_tp_ring_step_remote_pp_us()
    assert rows >= 50
    assert compose_run(["runtime=nanotron"]).runtime.tp_ring_step_remote_pp_us == pytest.approx(fitted, abs=0.05)


def test_a_pipeline_stall_is_a_large_unexplained_time_per_micro_batch():
    """stalled: pp > 1, over STALL_RATIO slower than predicted, and at least STALL_S_PER_MICROBATCH beyond the
    predicted step per micro-batch (measured step = predicted step x predicted / measured tokens/s)."""
    row = {"pp": 2, "ratio": 3.0, "step_time_s": 1.0, "grad_acc": 4}  # 2 s more over 4 micro-batches: 0.5 s each
    assert playbook.stall_s_per_microbatch(row) == pytest.approx(0.5)
    assert playbook.stalled(row)
    assert not playbook.stalled({**row, "pp": 1})
    assert not playbook.stalled({**row, "grad_acc": 8})  # 0.25 s a micro-batch
    assert not playbook.stalled({**row, "ratio": 1.3, "step_time_s": 10.0})  # 0.75 s each, but only 1.3x
    assert not playbook.stalled({**row, "ratio": None})
def test_allocator_overhead_is_its_fit_on_the_development_half():
    from harness.config import compose_run
    fitted, rows = playbook.fit_allocator_overhead()
    assert rows >= 1000
    assert compose_run(["runtime=nanotron"]).runtime.allocator_overhead == pytest.approx(fitted, abs=0.005)


def test_nanotron_memory_keys_move_only_their_terms():
    """runtime=nanotron's memory keys, each set back to brigade's value: the column-parallel inputs kept as the
    sequence shard shrink the layers' activations under TP; the fp32 accumulator after backward adds the 16-bit
    grads at the end of a backward and keeps the fp32 buffer at every loss; DDP's bf16 buckets are there only at
    dp > 1 without ZeRO; the allocator's share is its fraction of the rest."""
    from harness.validate import validate
    from lab.published import caching_compose
    compose = caching_compose()
    row = next(r for r in playbook.load() if r["ran"] and r["tp"] == 8 and r["pp"] == 1 and r["dp"] == 2
               and r["zero_stage"] == 0)

    def peak(*extra):
        run = compose(playbook.overrides(row) + list(extra))
        return playbook.rank0_peak_bytes(run, validate(run, torch_runs=False))
    base = peak("runtime.allocator_overhead=0")
    assert peak("runtime.allocator_overhead=0", "runtime.tp_saved_inputs=gathered") > base
    assert peak("runtime.allocator_overhead=0", "runtime.ddp_grad_buckets=none") < base
    assert peak() == pytest.approx(base * 1.19, rel=1e-6)
