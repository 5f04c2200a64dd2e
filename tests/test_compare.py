"""Noise, repeats and comparisons: the bootstrap intervals (harness/collect/aggregate.py), a config's
statistics from its repeats (harness/collect/aggregate.py), and `python -m harness.compare`'s verdicts,
memory and environment differences, one-sided runs and exit status, on records made by make_record."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from harness.collect import aggregate
from harness.compare import MIN_REPEATS, NOT_ENOUGH_REPEATS, compare_configs, verdict
from harness.config import as_dict, to_run_config
from harness.run.record import make_record
from harness.validate import validate
from tests.helpers import REPO, compose_config


def test_the_bootstrap_interval_is_deterministic_and_holds_the_median():
    rng = random.Random(1)
    steps = [0.1 + rng.gauss(0, 0.005) for _ in range(20)]
    med, lo, hi = aggregate.median_ci([steps])
    assert lo <= med <= hi and (med, lo, hi) == aggregate.median_ci([steps])  # a pure function of the samples
    assert lo >= min(steps) and hi <= max(steps)
    one = aggregate.median_ci([[0.2] * 10])
    assert one == (0.2, 0.2, 0.2)


def test_drift_between_repeats_widens_a_configs_interval():
    """Three repeats each tight within itself but 10 % apart: the two-level bootstrap sees the drift;
    pooling the steps as if from one run would not."""
    rng = random.Random(2)
    repeats = [[base + rng.gauss(0, 0.001) for _ in range(10)] for base in (0.10, 0.11, 0.12)]
    _, lo, hi = aggregate.median_ci(repeats)
    _, lo_flat, hi_flat = aggregate.median_ci([[x for r in repeats for x in r]])
    assert hi - lo > 1.5 * (hi_flat - lo_flat)


def test_the_verdict_needs_the_whole_interval_beyond_the_threshold():
    assert verdict(0.80, 0.90, 5) == "slower"
    assert verdict(0.80, 0.96, 5) == "same"  # the interval reaches into the threshold: not proven
    assert verdict(0.97, 0.99, 5) == "same"  # real but smaller than the threshold
    assert verdict(1.06, 1.20, 5) == "faster"
    assert verdict(0.90, 1.10, 0) == "same"  # the interval holds 1: noise
    assert verdict(0.90, 0.99, 0) == "slower"


def _config(overrides, tmp_path):
    run = to_run_config(compose_config(["model=tiny", "logger=none", *overrides], tmp_path))
    return as_dict(run), run, validate(run)


def _record(tmp_path, overrides, repeat, steps, env=None, mem=1000, status="ok"):
    config, run, dims = _config([*overrides, f"repeat={repeat}"], tmp_path)
    tokens = run.workload.global_batch_size * run.model.seq_len
    measured = {"step_times_s": steps, "step_time_s": sorted(steps)[len(steps) // 2], "tokens_per_step": tokens,
                "tokens_per_s": tokens / sorted(steps)[len(steps) // 2], "peak_mem_bytes": mem,
                "model_states_bytes": 4096, **aggregate.throughput_ci(steps, tokens)} if status == "ok" else {}
    return make_record(config, run, dims, status, None if status == "ok" else "boom", measured, {}, env or {})


def _steps(rng, base, n=10, noise=0.02):
    return [base * (1 + rng.gauss(0, noise)) for _ in range(n)]


def test_repeats_share_a_run_id_and_pool_into_one_config_record(tmp_path):
    rng = random.Random(3)
    recs = [_record(tmp_path, ["strategy=single"], i, _steps(rng, 0.1)) for i in range(3)]
    assert len({r["run_id"] for r in recs}) == 1 and [r["repeat"] for r in recs] == [0, 1, 2]
    by = aggregate.by_config(recs + [recs[1]])  # a re-run of repeat 1 replaces it, not a 4th repeat
    assert list(by) == [recs[0]["run_id"]] and len(by[recs[0]["run_id"]]) == 3
    c = aggregate.config_record(by[recs[0]["run_id"]])
    pooled = [x for r in recs for x in r["measured"]["step_times_s"]]
    assert c["repeats"] == 3 and c["measured"]["repeats_ok"] == 3
    assert c["measured"]["step_time_s"] == pytest.approx(sorted(pooled)[14] / 2 + sorted(pooled)[15] / 2)
    lo, hi = c["measured"]["tokens_per_s_ci95"]
    assert lo <= c["measured"]["tokens_per_s"] <= hi


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _compare(a, b, *extra):
    return subprocess.run([sys.executable, "-m", "harness.compare", str(a), str(b), *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_compare_says_same_slower_and_faster_with_memory_environment_and_one_sided_runs(tmp_path):
    rng = random.Random(4)
    single, ddp, zero = ["strategy=single"], ["strategy=ddp", "parallel.dp=2"], ["strategy=zero1", "parallel.dp=2"]
    env_a, env_b = {"torch": "2.13.0", "cuda": None}, {"torch": "2.13.0", "cuda": "12.8"}
    a = [_record(tmp_path, cfg, i, _steps(rng, base), env_a)
         for i in range(3) for cfg, base in ((single, 0.10), (ddp, 0.08), (zero, 0.09))]
    # B: single the same, ddp 30 % slower per step, a new config (fsdp) only in B, zero1 missing
    b = [_record(tmp_path, cfg, i, _steps(rng, base), env_b, mem=mem)
         for i in range(3) for cfg, base, mem in ((single, 0.10, 1000), (ddp, 0.08 * 1.3, 1000),
                                                   (["strategy=fsdp", "parallel.dp=2"], 0.09, 1000))]
    b += [_record(tmp_path, single, 3, _steps(rng, 0.10), env_b, mem=1024)]  # a 4th repeat, more memory
    rows = {r.label: r for r in compare_configs(aggregate.by_config(a), aggregate.by_config(b), 5)}
    assert rows["single"].verdict == "same" and rows["ddp dp2"].verdict == "slower"
    assert rows["ddp dp2"].ratio[2] < 0.95 and rows["ddp dp2"].ratio[0] == pytest.approx(1 / 1.3, rel=0.05)
    assert rows["zero1 dp2"].note == "only in A" and rows["fsdp dp2"].note == "only in B"
    assert rows["single"].memory == ["peak_mem_bytes 1000 B -> 1.0 KiB (+24 B)"]

    p = _compare(_write(tmp_path / "a.jsonl", a), _write(tmp_path / "b.jsonl", b))
    assert p.returncode == 1, p.stdout + p.stderr
    out = " ".join(p.stdout.split())
    assert "environment differs: cuda: A None | B 12.8" in out
    assert "only in A: zero1 dp2" in out and "only in B: fsdp dp2" in out
    assert "memory changed: single: peak_mem_bytes" in out
    assert "1 slower, 0 faster, 1 same, 2 not compared; exit 1" in out
    # B against itself reversed: ddp is faster, nothing is slower, exit 0
    p = _compare(tmp_path / "b.jsonl", tmp_path / "a.jsonl")
    assert p.returncode == 0 and "0 slower, 1 faster, 1 same" in " ".join(p.stdout.split()), p.stdout
    # a threshold above the change: the same comparison passes
    p = _compare(tmp_path / "a.jsonl", tmp_path / "b.jsonl", "--threshold", "40")
    assert p.returncode == 0 and "0 slower, 0 faster, 2 same" in " ".join(p.stdout.split()), p.stdout


def test_single_repeat_studies_are_same_for_want_of_repeats_and_exit_0(tmp_path):
    """Two studies of the same configs, one repeat each, whose runs landed 10 % apart (another job on the
    machine during one of them): each run's steps are tight, so a bootstrap over steps alone would call it
    slower. One run per side says nothing of run-to-run variance: same, with the repeats it needs."""
    rng = random.Random(8)
    single, ddp = ["strategy=single"], ["strategy=ddp", "parallel.dp=2"]
    a = [_record(tmp_path, cfg, 0, _steps(rng, base, noise=0.002)) for cfg, base in ((single, 0.10), (ddp, 0.08))]
    b = [_record(tmp_path, cfg, 0, _steps(rng, base * 1.1, noise=0.002)) for cfg, base in ((single, 0.10), (ddp, 0.08))]
    rows = compare_configs(aggregate.by_config(a), aggregate.by_config(b), 5)
    assert all(r.ratio[2] < 0.95 for r in rows)  # the steps alone put the whole interval beyond the threshold
    assert [(r.verdict, r.why_same, r.repeats_ok) for r in rows] == [("same", NOT_ENOUGH_REPEATS, (1, 1))] * 2
    p = _compare(_write(tmp_path / "a.jsonl", a), _write(tmp_path / "b.jsonl", b))
    out = " ".join(p.stdout.split())
    assert p.returncode == 0, p.stdout + p.stderr
    assert "same (not enough repeats to tell)" in out
    assert (f"not enough repeats to tell: single: A has 1 ok repeat, B 1; a verdict needs {MIN_REPEATS} a side: run "
            f"each study again with repeats={MIN_REPEATS}") in out
    assert "0 slower, 0 faster, 2 same (2 not enough repeats to tell), 0 not compared; exit 0" in out


def test_a_verdict_needs_three_ok_repeats_on_each_side(tmp_path):
    """The 30 % slowdown that three repeats a side call slower is same with two on either side."""
    assert MIN_REPEATS == 3  # 1/C(6, 3) = 1/20: the first count whose all-one-way ordering is within 5 %
    rng = random.Random(9)
    a = [_record(tmp_path, ["strategy=single"], i, _steps(rng, 0.10)) for i in range(3)]
    b = [_record(tmp_path, ["strategy=single"], i, _steps(rng, 0.13)) for i in range(3)]
    failed = _record(tmp_path, ["strategy=single"], 2, [], status="failed")
    for sa, sb, want in ((a, b, ("slower", "")), (a[:2], b, ("same", NOT_ENOUGH_REPEATS)),
                         (a, [*b[:2], failed], ("same", NOT_ENOUGH_REPEATS))):  # a failed repeat is not a repeat
        row, = compare_configs(aggregate.by_config(sa), aggregate.by_config(sb), 5)
        assert (row.verdict, row.why_same) == want, (len(sa), len(sb), row)


def test_run_to_run_noise_beyond_the_threshold_is_rarely_called_slower_at_three_repeats():
    """Identical configs whose runs scatter 10 % from run to run (twice the 5 % threshold), each run's
    steps within 1 %: at three repeats a side the interval holds that scatter, and noise alone is called
    slower in at most 1 of C(6, 3) = 20 comparisons (the chance all three B runs land behind all three A)."""
    rng = random.Random(10)

    def study(repeats):
        return [[level * (1 + rng.gauss(0, 0.01)) for _ in range(10)]
                for level in (1 + rng.gauss(0, 0.10) for _ in range(repeats))]

    def slower(repeats, trials=200):
        return sum(verdict(*aggregate.ratio_ci(study(repeats), study(repeats), resamples=500)[1:], 5) == "slower"
                   for _ in range(trials))

    assert slower(MIN_REPEATS) <= 200 / 20
    assert slower(1) > 200 / 4  # one run a side: the steps' interval misses the scatter, and says slower often


def test_a_study_slowed_on_purpose_is_matched_with_the_clean_one_and_said_to_be(tmp_path):
    """The slowed records have their own run_id; compare pairs them with the clean config they slow."""
    rng = random.Random(11)
    a = [_record(tmp_path, ["strategy=single"], i, _steps(rng, 0.10)) for i in range(3)]
    b = [_record(tmp_path, ["strategy=single", "slow_step_pct=30"], i, _steps(rng, 0.13)) for i in range(3)]
    assert a[0]["run_id"] != b[0]["run_id"] == b[2]["run_id"]
    assert b[0]["slowed_on_purpose"]["clean_run_id"] == a[0]["run_id"]
    row, = compare_configs(aggregate.by_config(a), aggregate.by_config(b), 5)
    assert (row.label, row.verdict) == ("single", "slower")
    p = _compare(_write(tmp_path / "a.jsonl", a), _write(tmp_path / "b.jsonl", b))
    out = " ".join(p.stdout.split())
    assert p.returncode == 1 and "slowed on purpose (slow_step_pct): single: B 30 %" in out, p.stdout
    assert "1 slower, 0 faster, 0 same, 0 not compared; exit 1" in out
    # a study holding both the clean and the slowed config compares each with its own
    rows = compare_configs(aggregate.by_config(a), aggregate.by_config(a + b), 5)
    assert [(r.run_id, r.verdict) for r in rows] == [(a[0]["run_id"], "same"), (b[0]["run_id"], "")]


def test_compare_refuses_bad_input_with_exit_2(tmp_path):
    p = _compare(tmp_path / "none.jsonl", tmp_path / "none.jsonl")
    assert p.returncode == 2 and "no records file" in p.stdout
    _write(tmp_path / "a.jsonl", [_record(tmp_path, ["strategy=single"], 0, [0.1] * 5)])
    p = _compare(tmp_path / "a.jsonl", tmp_path / "a.jsonl", "--threshold", "-1")
    assert p.returncode == 2 and "--threshold -1" in p.stdout


def test_a_failed_side_is_listed_not_compared(tmp_path):
    rng = random.Random(5)
    a = [_record(tmp_path, ["strategy=single"], 0, _steps(rng, 0.1))]
    b = [_record(tmp_path, ["strategy=single"], 0, [], status="failed")]
    row, = compare_configs(aggregate.by_config(a), aggregate.by_config(b), 5)
    assert row.verdict == "" and row.note == "not comparable: A ok, B failed"


def test_wandb_defines_the_scaling_metrics_and_logs_the_intervals(tmp_path):
    """A real offline W&B run: step metrics against `step`, scaling/* against `devices`, the scaling axes
    in config and summary, and the tokens/s interval's bounds in the summary."""
    from omegaconf import OmegaConf

    from harness.run.wandb_log import SCALING_METRICS, log_record, run_identity
    from tests.wandb_file import records as wandb_records
    from tests.wandb_file import summary_and_history

    rng = random.Random(7)
    r = _record(tmp_path, ["strategy=ddp", "parallel.dp=2", "series=strong"], 0, _steps(rng, 0.1),
                {"git_commit": "abc123", "cluster": "vm"})
    r["measured"]["losses"] = [3.0] * 10
    logger = OmegaConf.create({"name": "wandb", "mode": "offline", "project": "brigade", "entity": None})
    ident = run_identity(r, tmp_path / "run", logger, "ddp dp2")
    assert log_record(r, ident, tmp_path / "run", logger, job_type="local") is None  # None: the W&B run exists
    import wandb

    wandb.teardown()  # the W&B service writes the run file behind the process: done when it is shut down
    path, = (tmp_path / "run").glob("wandb/offline-run-*/run-*.wandb")
    metrics = {(m.metric.name or m.metric.glob_name): m.metric.step_metric for m in wandb_records(path)
               if m.WhichOneof("record_type") == "metric" and m.metric.options.defined}
    assert metrics["loss"] == metrics["step_time_s"] == "step" and metrics["scaling/*"] == "devices"
    summary, history = summary_and_history(path)
    row = next(h for h in history if "devices" in h)
    assert "loss" not in row and row["_step"] == 10  # its own row, after the 10 steps
    has = {"tokens_per_s", "tokens_per_s_ci95_lo", "tokens_per_s_ci95_hi", "step_time_s", "model_states_bytes",
           "peak_mem_bytes"}  # what this record measured of SCALING_METRICS
    assert row["devices"] == 2 and {k[8:] for k in row if k.startswith("scaling/")} == has <= set(SCALING_METRICS)
    lo, hi = r["measured"]["tokens_per_s_ci95"]
    assert summary["measured/tokens_per_s_ci95_lo"] == pytest.approx(lo) and row["scaling/tokens_per_s_ci95_hi"] == pytest.approx(hi)
    assert (summary["axes/devices"], summary["axes/series"], summary["axes/commit"], summary["axes/cluster"]) == (
        2, "strong", "abc123", "vm")


FINGERPRINT = ("cuda", "nccl", "driver", "interconnect", "slurm_job_id", "slurm_partition", "slurm_cluster")


def test_the_fingerprint_is_a_value_or_a_reason_never_a_guess():
    """On any machine: every field read, or null with `unavailable.<field>` saying why."""
    from harness.collect.environment import host_fingerprint

    env = host_fingerprint()
    for k in FINGERPRINT:
        assert (env[k] is None) == (k in env["unavailable"]), (k, env[k], env["unavailable"])
    assert env["cluster"] and (env["slurm_cluster"] is None) == ("cluster" in env["unavailable"])


def test_the_fingerprint_holds_gpu_name_and_count_per_node():
    from harness.collect.environment import merge_fingerprints as merge

    ranks = [{"hostname": "n1", "gpu_name": "NVIDIA H100 80GB HBM3", "gpu_count": 8, "slurm_cluster": "c1",
              "unavailable": {}}] * 2 + [{"hostname": "n2", "gpu_name": "NVIDIA H100 80GB HBM3", "gpu_count": 4,
                                          "slurm_cluster": "c1", "unavailable": {}}]
    out = merge(ranks, ["n1", "n1", "n2"])
    assert out["gpus"] == {"n1": {"gpu_name": "NVIDIA H100 80GB HBM3", "gpu_count": 8},
                           "n2": {"gpu_name": "NVIDIA H100 80GB HBM3", "gpu_count": 4}}
    assert out["cluster"] == "c1" and "unavailable" not in out
