"""Pure tier: the published-validation set (docs/published_runs.yaml) and its command."""
from __future__ import annotations

import pytest

from harness.costmodel import published


def test_the_set_is_cited_split_and_large_enough():
    models, rows = published.load()
    assert len(rows) >= 40
    halves = {r["half"] for r in rows}
    assert halves == {"fitting", "held_out"}
    by_source = {}
    for r in rows:
        by_source.setdefault(r["source"], set()).add(r["half"])
        assert r["cite"] and r["model"] in models and r["published"] > 0
    assert all(len(h) == 1 for h in by_source.values()), "a source lies in one half only"


def test_megatron_convention_converts_tflops_to_tokens():
    """Narayanan et al. 2021 eq. 3: 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs per iteration of B sequences."""
    models, rows = published.load()
    row = next(r for r in rows if r["source"] == "narayanan2021_t1" and r["model"] == "gpt_1t")
    m = models["gpt_1t"]
    B, s, l, h, V = row["global_batch"], 2048, m["n_layers"], m["d_model"], m["vocab_size"]
    per_iteration = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    assert published.published_tokens_per_s_per_gpu(row, m) == pytest.approx(163e12 / (per_iteration / (B * s)))


def test_command_prints_rows_and_both_summaries(capsys):
    assert published.main(["--source", "korthikanti2022"]) == 0
    out = capsys.readouterr().out
    assert out.count("korthikanti2022 ") >= 9  # 8 rows + the per-source summary
    assert "held_out" in out and "median|err|%" in out


def test_no_published_run_is_predicted_out_of_memory():
    """Every row ran on its GPUs. MPT's rows fit once mapped to the loss llm-foundry ran (model.loss=chunked,
    docs/published_runs.yaml); with brigade's fp32 loss 25 of them were predicted over 80 GB."""
    results = published.run_all()
    assert [f"{r['source']}#{r['index']} {r['predicted_peak_mem_GiB']:.1f} GiB" for r in results
            if not r["fits_in_memory"]] == []


def test_every_row_maps_to_a_runnable_config():
    """Each row validates as a brigade config; nothing is skipped."""
    results = published.run_all()
    assert len(results) == len(published.load()[1])
    assert all(r["predicted_tokens_per_s_per_gpu"] > 0 for r in results)


def test_deepspeed_rows_run_as_the_2021_release_did():
    """Narayanan's ZeRO-3 rows ran a DeepSpeed that synchronised the device before every parameter
    gather (docs/published_runs.yaml): they map to overlap_comm=false, and nothing else does."""
    models, rows = published.load()
    for r in rows:
        has = "strategy.ds.overlap_comm=false" in published.overrides(r, models[r["model"]])
        assert has == (r["source"] == "narayanan2021_t2" and r.get("engine") == "deepspeed"), r


def test_composer_pure_rows_reduce_in_bf16():
    """The table's MP Mode PURE (bf16 gradient reduction) maps to comm_hook=bf16, DEFAULT to nothing."""
    models, rows = published.load()
    pure = [r for r in rows if r.get("mp_mode") == "PURE"]
    assert [(r["source"], r["model"]) for r in pure] == [("mpt_a100", "mpt_70b")] * 2
    for r in rows:
        assert ("strategy.comm_hook=bf16" in published.overrides(r, models[r["model"]])) == (r in pure)
