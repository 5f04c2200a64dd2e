"""End-to-end tier: the `brigade` CLI as a user runs it, in a subprocess, with real torchrun ranks."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from tests.helpers import FAST, cli, records
from tests.wandb_file import summary_and_history

pytestmark = pytest.mark.slow


def test_sweep_over_three_configs_records_each_and_goes_on_past_an_invalid_one(tmp_path):
    # dp=3 cannot split a global batch of 8 into micro-batches of 2: invalid, and the sweep goes on.
    p = cli(["-m", *[o for o in FAST if not o.startswith("logger")], "logger=wandb", "strategy=ddp",
             "parallel.dp=1,2,3"], tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]  # an invalid run, none failed
    rows = records(tmp_path)
    assert [(r["dims"]["dp"], r["status"]) for r in rows] == [(1, "ok"), (2, "ok"), (3, "invalid")], rows
    assert "global_batch_size 8 not divisible by dp*micro_batch_size 6" in rows[2]["error"]
    for r in rows[:2]:
        m = r["measured"]
        assert m["steps_timed"] == 5 and len(m["losses"]) == 6 and m["step_time_s"] > 0
        # the statistics are those of the slowest rank's time per step, from every rank's raw clocks
        ranks = json.loads((Path(r["run_dir"]) / "measurement.json").read_text())["ranks"]
        per_step = [max(rank["step_times"][i] for rank in ranks) for i in range(5)]
        assert m["step_times_s"] == per_step and m["step_time_s"] == statistics.median(per_step)
        q = statistics.quantiles(per_step, n=10, method="inclusive")  # linear interpolation, as numpy's default
        assert (m["step_time_s_p10"], m["step_time_s_p90"]) == pytest.approx((q[0], q[8]), rel=1e-12)
        assert r["env"]["torch"].startswith("2.13") and r["env"]["world_size"] == r["dims"]["world_size"]
        assert not any(k.upper() == k for k in r["env"]), "no environment variables in a record"
        # one W&B offline run per ok run, under its run directory, with the summary logged
        runs = list(Path(r["run_dir"]).glob("wandb/offline-run-*/run-*.wandb"))
        assert len(runs) == 1, runs
        assert runs[0].name == f"run-{r['wandb']['id']}.wandb" and r["wandb"]["group"].startswith("adhoc-")
        summary, history = summary_and_history(runs[0])
        assert summary["measured/step_time_s"] == pytest.approx(m["step_time_s"])
        assert summary["status"] == "ok" and summary["run_id"] == r["run_id"]
        assert [h["loss"] for h in history if "loss" in h] == pytest.approx(m["losses"])  # then one scaling row
    assert rows[0]["wandb"]["group"] == rows[1]["wandb"]["group"]  # one invocation, one group
    assert "study adhoc: 3 runs" in p.stderr  # the end-of-sweep table


def test_unknown_strategy_in_a_sweep_is_an_invalid_record_listing_the_choices(tmp_path):
    p = cli(["-m", *FAST, "strategy=single,nosuch"], tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    rows = {r["strategy"]["name"] if isinstance(r["strategy"], dict) else r["strategy"]: r for r in records(tmp_path)}
    assert rows["single"]["status"] == "ok"
    assert rows["nosuch"]["status"] == "invalid"
    assert "nosuch" in rows["nosuch"]["error"] and "ddp" in rows["nosuch"]["error"]


def test_a_crashed_rank_is_a_failed_record_not_a_hang(tmp_path):
    p = cli([*FAST, "strategy=ddp", "parallel.dp=2", "fault=crash_rank1"], tmp_path)
    assert p.returncode == 1, p.stderr[-3000:]
    (r,) = records(tmp_path)
    # not a hang, whatever the load: a hang ends at launcher.timeout_s as status "timeout" (the test after this)
    assert r["status"] == "failed", r["error"]
    assert "rank 1: RuntimeError: fault injection" in r["error"]


@pytest.mark.heavy  # CI: the timeout path in tests/test_faults.py (a SIGSTOPped rank, no leftovers)
def test_a_hung_rank_is_killed_at_the_wall_clock_limit(tmp_path):
    p = cli([*FAST, "strategy=ddp", "parallel.dp=2", "fault=hang_rank1", "launcher.timeout_s=25"], tmp_path)
    assert p.returncode == 1, p.stderr[-3000:]
    (r,) = records(tmp_path)
    assert r["status"] == "timeout" and "launcher.timeout_s=25" in r["error"]
    import subprocess

    left = subprocess.run(["pgrep", "-f", f"harness.worker {r['run_dir']}"], capture_output=True, text=True)
    assert left.stdout.strip() == "", "ranks left behind after the timeout"


def test_single_run_without_multirun_ends_with_where_everything_is(tmp_path):
    # the same config twice (two invocations): two W&B runs that never collide, each its own ad-hoc group
    args = [*[o for o in FAST if not o.startswith("logger")], "logger=wandb", "strategy=single",
            "workload.activation_checkpointing=full"]
    outs = [cli(args, tmp_path) for _ in range(2)]
    for p in outs:
        assert p.returncode == 0, p.stderr[-3000:]
    first, second = records(tmp_path)
    assert first["status"] == second["status"] == "ok" and first["run_id"] == second["run_id"]
    err = outs[0].stderr
    # the run's own row, named by what sets it apart from the defaults, then the record, run dir and W&B run
    assert "single ac=full" in err and "tokens/s" in err and "states/rank" in err
    assert f"record: {tmp_path / 'adhoc.jsonl'} (run_id {first['run_id']})" in err
    assert f"run dir: {first['run_dir']}" in err and Path(first["run_dir"]).name.startswith("single-ac=full-")
    assert f"W&B: offline run 'single ac=full' (id {first['wandb']['id']}" in err and first["wandb"]["dir"] in err
    assert first["wandb"]["id"] != second["wandb"]["id"]
    assert first["wandb"]["group"] != second["wandb"]["group"] and first["wandb"]["group"].startswith("adhoc-")
