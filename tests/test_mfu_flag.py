"""MFU above 100 % says the profile's rate is not a peak: the record carries `measured.mfu_warning` and the
results table marks the figure, from the ranks' figures (harness/collect/aggregate.py) and from a config's
pooled repeats alike."""
from __future__ import annotations

from rich.console import Console

from harness.collect import aggregate
from harness.config import as_dict, to_run_config
from harness.run.record import make_record
from harness.run.terminal import results_table
from harness.validate import validate
from tests.helpers import compose_config


def _run(tmp_path):
    run = to_run_config(compose_config(["model=tiny", "logger=none", "hardware=cpu_reference"], tmp_path))
    return run, validate(run)


def _measured(run, dims, step_s):
    """The ranks' measurement.json for one run whose every step took step_s."""
    rank = {"rank": 0, "step_times": [step_s] * 10, "memory": {"peak_mem_bytes": 1}, "losses": [3.0] * 10}
    return aggregate.aggregate(run, dims, {"ranks": [rank], "num_microbatches": 1})


def _at_peak(run, dims) -> float:
    """The step time at which MFU is exactly 100 % on this profile (one device)."""
    m = _measured(run, dims, 1.0)
    return m["model_flops_per_step"] / (m["mfu_peak_tflops"] * 1e12)


def _table(records) -> str:
    console = Console(width=300, record=True)
    console.print(results_table(records, "t", names=[f"run {i}" for i in range(len(records))]))
    return console.export_text()


def test_mfu_above_100_pct_is_flagged_in_the_record_and_the_table(tmp_path):
    run, dims = _run(tmp_path)
    at_peak = _at_peak(run, dims)
    fast, slow = _measured(run, dims, at_peak / 1.05), _measured(run, dims, at_peak / 0.95)
    assert fast["mfu_pct"] > 100 and fast["mfu_warning"] == "profile rate exceeded: recalibrate"
    assert slow["mfu_pct"] < 100 and "mfu_warning" not in slow
    records = [make_record(as_dict(run), run, dims, "ok", None, m, {}, {}) for m in (fast, slow)]
    text = _table(records)
    assert f"{fast['mfu_pct']:.1f} !" in text and f"{slow['mfu_pct']:.1f} !" not in text
    assert "MFU % marked !: above 100 %, profile rate exceeded: recalibrate" in text
    assert "hardware=cpu_reference" in text
    assert "marked !" not in _table(records[1:])


def test_a_configs_pooled_repeats_decide_its_flag(tmp_path):
    """The latest repeat ran above the profile's rate, the pooled median of three does not: no flag."""
    run, dims = _run(tmp_path)
    at_peak = _at_peak(run, dims)
    repeats = []
    for i, step in enumerate((at_peak / 0.9, at_peak / 0.9, at_peak / 1.05)):
        config = {**as_dict(run), "repeat": i}
        repeats.append(make_record(config, run, dims, "ok", None, _measured(run, dims, step), {}, {}))
    assert "mfu_warning" in repeats[-1]["measured"]
    pooled = aggregate.config_record(repeats)
    assert pooled["measured"]["mfu_pct"] < 100 and "mfu_warning" not in pooled["measured"]
