"""Pure tier: how sure a prediction is. The layout family key (harness/dims.py), the committed table of each
family's validation error (harness/costmodel/family_errors.json, python -m lab.family_errors --write), predict's
line and field, and plan's column and `unsure:` line."""
from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from harness import plan
from harness.config import compose_run
from harness.costmodel import family_errors
from harness.dims import family
from harness.predict import predict_overrides, summary
from lab import family_errors as family_table
from lab import playbook

GPU = ["hardware=h100_sxm", "workload.precision=bf16-mixed"]


@pytest.mark.parametrize("degrees, rpn, key", [
    ({"dp": 8}, 8, "dp in node"),
    ({"dp": 64}, 8, "dp across nodes"),
    ({"dp": 2, "tp": 4}, 8, "tp in node"),
    ({"dp": 8, "tp": 8}, 8, "tp across nodes"),  # TP in each node, data parallel across
    ({"dp": 2, "tp": 16}, 8, "tp>node across nodes"),  # the TP group itself spans nodes
    ({"dp": 4, "tp": 16, "pp": 2}, 8, "tp>node+pp across nodes"),
    ({"dp": 1, "tp": 2, "pp": 4}, 8, "tp+pp in node"),
    ({"dp": 8, "pp": 4, "ep": 4}, 8, "pp+ep across nodes"),
    ({"dp": 2, "cp": 2, "tp": 2}, 4, "tp+cp across nodes"),
    ({"dp": 2, "tp": 8}, 16, "tp in node"),  # a 16-GPU node holds it
])
def test_the_family_key(degrees, rpn, key):
    assert family(degrees, rpn) == key


def test_playbook_rows_are_keyed_by_the_same_function():
    row = next(r for r in playbook.load() if (r["dp"], r["tp"], r["pp"]) == (2, 16, 2))
    assert playbook.family(row) == family({"dp": 2, "tp": 16, "pp": 2}, playbook.GPUS_PER_NODE) == \
        "tp>node+pp across nodes"


def test_the_committed_table_is_what_lab_computes_now():
    assert family_errors.TABLE.read_text() == family_table.dumps(family_table.table()), \
        "harness/costmodel/family_errors.json is stale: python -m lab.playbook_doc (page and table)"


def test_run_top_k_finds_a_layout_within_10_pct_at_its_rank():
    def row(dp, pred, meas, fits=True, peak_gib=40):
        return {"dp": dp, "tp": 1, "pp": 1, "predicted_tokens_per_s_per_gpu": pred, "fits_in_memory": fits,
                "ran": meas is not None, "measured_tokens_per_s_per_gpu": meas, "family": "dp in node",
                "device": "cuda", "peak_mem_bytes": peak_gib * 1024**3, "device_memory_bytes": 80 * 1024**3}
    margins = {"families": {}, "memory_all": {"n": 1, "margin_pct": 10.0}}
    # dp8's two rows are one layout, run as its best predicted (which crashed, though its other row is the best);
    # dp4, second, measures within 10 % of that best
    group = [row(8, 100, None), row(8, 90, 120), row(4, 80, 110), row(2, 70, 100), row(1, 60, 10, fits=False)]
    assert family_table.found_at(group, margins) == 2
    assert family_table.found_at([row(8, 100, 50), row(4, 80, None), row(2, 200, 100, fits=False)], margins) is None
    # plan ranks no layout over the device's memory less the margin: 75 x 1.1 > 80, so dp8 is not run
    assert family_table.found_at([row(8, 100, 120, peak_gib=75), row(4, 80, 110)], margins) == 1


def test_predict_prints_and_returns_its_familys_error():
    out = predict_overrides(["model=gpt_7b", "strategy=3d", "parallel.dp=8", "parallel.tp=8", "parallel.pp=2",
                             "workload.global_batch_size=64", *GPU])
    assert out["family"] == "tp+pp across nodes"
    stored = json.loads(family_errors.TABLE.read_text())["families"]["tp+pp across nodes"]
    assert out["family_error"] == stored
    line = next(x for x in summary(out).splitlines() if x.startswith("  how sure"))
    assert f"p90 {stored['all']['p90_abs_err_pct']:.0f} %" in line and f"{stored['all']['n']} validation runs" in line
    cpu = predict_overrides(["model=small", "strategy=ddp", "parallel.dp=2"])
    assert cpu["family"] == "dp in node" and cpu["family_error"] is None
    assert family_errors.ON_CPU in summary(cpu)


def table_with(fam: str, p90: float) -> dict:
    entry = {"n": 50, "median_abs_err_pct": p90 / 2, "p90_abs_err_pct": p90, "geomean_ratio": 1.1}
    return {"families": {fam: {"all": entry, "playbook": entry, "published": {"n": 0}}},
            "memory_all": {"n": 0, "margin_pct": 0.0},
            "run_top": {"k": 3, "groups": 14, "groups_found": 14, "rule": "every group", "derivation": "", "per_group": {}}}


@pytest.mark.parametrize("p90, warned", [(family_errors.LARGE_P90_PCT + 1, True), (family_errors.LARGE_P90_PCT - 1, False)])
def test_plan_says_unsure_where_a_top_familys_stored_error_is_large(monkeypatch, capsys, p90, warned):
    args = ["model=gpt_7b", "plan.gpus=8", "plan.top_k=3", "workload.global_batch_size=64", *GPU]
    run = compose_run(args)
    cands, _ = plan.search(run, 8)
    fams = {plan.layout_family(c, 8) for c in cands[:3] + plan.plan_check.distinct_layouts(cands, 3)}
    stored = table_with(sorted(fams)[0], p90)
    for f in sorted(fams)[1:]:  # the other top families small
        stored["families"][f] = table_with(f, 1.0)["families"][f]
    monkeypatch.setattr(family_errors, "load", lambda: stored)
    wide = Console(width=1000, file=io.StringIO())
    wide.print(plan.table(cands, 3, run, {"gpus": 8}))
    assert "family error" in wide.file.getvalue() and f"(p90 of {sorted(fams)[0]}, 50 runs)" in wide.file.getvalue()
    assert plan.main(args) == 0
    unsure = [x for x in capsys.readouterr().out.splitlines() if x.startswith("unsure: ")]
    assert bool(unsure) == warned, unsure
    if warned:
        assert f"±{p90:.0f} % (p90 of {sorted(fams)[0]}, 50 runs)" in unsure[0] and "--run-top 3 " in unsure[0]


def test_a_family_no_validation_run_has_is_unsure_and_cpu_is_neither():
    assert family_errors.of("pp+ep+cp across nodes", "cuda") is None
    assert family_errors.large("pp+ep+cp across nodes", "cuda")
    assert not family_errors.large("pp+ep+cp across nodes", "cpu")
    assert family_errors.short("dp in node", "cpu") == "n/a on CPU"


def test_a_familys_memory_margin_is_how_far_its_runs_measured_above_the_prediction():
    """The p90 of measured / predicted peak - 1 over a family's runs that measured memory, none where every
    prediction was at least as large; a family with no such run takes all runs' margin; on CPU there is none."""
    low = [{"mem_ratio": 1 / (1 + k / 100)} for k in range(11)]  # measured 0-10 % above the prediction
    assert family_table.memory_margin(low) == {"n": 11, "margin_pct": 9.0}
    assert family_table.memory_margin([{"mem_ratio": 1.2}, {"mem_ratio": 1.0}])["margin_pct"] == 0.0
    stored = {"families": {"tp in node": {"memory": {"n": 11, "margin_pct": 9.0}}, "pp in node": {"memory": {"n": 0}}},
              "memory_all": {"n": 30, "margin_pct": 25.0}}
    assert family_errors.memory_margin("tp in node", "cuda", stored) == pytest.approx(0.09)
    assert family_errors.memory_margin("pp in node", "cuda", stored) == pytest.approx(0.25)
    assert family_errors.memory_margin("pp+ep+cp across nodes", "cuda", stored) == pytest.approx(0.25)
    assert family_errors.memory_margin("tp in node", "cpu", stored) == 0.0
    assert family_errors.memory_limit(80 * 1024**3, "tp in node", "cuda", stored) == pytest.approx(80 * 1024**3 / 1.09)


def test_plan_ranks_only_what_fits_with_its_familys_memory_margin(monkeypatch, capsys):
    """With every family's margin 0 the planner ranks what fits; with a margin, a layout whose predicted peak times
    1 + its family's margin exceeds the device is not ranked (counted apart), unless plan.memory_margin=false."""
    args = ["model=gpt_7b", "plan.gpus=8", "workload.global_batch_size=64", *GPU]
    committed = json.loads(family_errors.TABLE.read_text())
    monkeypatch.setattr(family_errors, "load", lambda: {**committed, "families": {}, "memory_all": {"n": 1, "margin_pct": 0.0}})
    every, counts = plan.search(compose_run(args), 8)
    assert counts["over_margin"] == 0
    margin = 0.25
    monkeypatch.setattr(family_errors, "load",
                        lambda: {**committed, "families": {}, "memory_all": {"n": 1, "margin_pct": 100 * margin}})
    kept, counts = plan.search(compose_run(args), 8)
    limit = 80 * 1024**3 / (1 + margin)
    assert [c.overrides() for c in kept] == [c.overrides() for c in every if c.pred["peak_mem_bytes"] <= limit]
    assert counts["over_margin"] == len(every) - len(kept) > 0
    off, _ = plan.search(compose_run(args + ["plan.memory_margin=false"]), 8)
    assert [c.overrides() for c in off] == [c.overrides() for c in every]
    assert plan.main(args + ["plan.top_k=1"]) == 0
    assert f"{counts['over_margin']} more fit only without it" in capsys.readouterr().out
