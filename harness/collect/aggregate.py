"""Per-rank results (measurement.json) -> the record's `measured` object.

A step ends when its slowest rank is done, so the step time of step k is the max over ranks;
the statistics are over the timed steps. Memory is reported as the max over ranks plus the
per-rank list (what shows sharding and imbalance between pipeline stages).
"""
from __future__ import annotations

import copy
import random
import statistics

from harness import catalog
from harness.collect import trace_analysis
from harness.costmodel.flops import mfu_peak_tflops, model_flops_per_step
from harness.run.record import Status, ratios

# Imports inside functions: torch and what imports it, which the parent process never loads;
# harness.collect.dryrun, which only a dry run needs.

# master_bytes: a separate fp32 master copy (DeepSpeed's ZeRO optimizers hold one even in fp32); 0 elsewhere
MEMORY_KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "master_bytes", "model_states_bytes", "peak_mem_bytes",
               "host_peak_rss_bytes", "host_peak_rss_predicted_bytes")  # the host pair: at the end of setup


def aggregate(run, dims, measurement: dict) -> dict:
    if measurement.get("kind") == "dryrun":  # launcher=dryrun: memory only, no step was timed
        from harness.collect.dryrun import aggregate_dryrun

        return aggregate_dryrun(run, dims, measurement)
    ranks = sorted(measurement["ranks"], key=lambda r: r["rank"])
    steps = [max(ts) for ts in zip(*(r["step_times"] for r in ranks))]
    out = step_stats(steps)
    out["steps_timed"] = len(steps)
    out["step_times_s"] = steps
    tokens = run.workload.global_batch_size * run.model.seq_len
    out["tokens_per_step"] = tokens
    out["tokens_per_s"] = tokens / out["step_time_s"]
    out.update(throughput_ci(steps, tokens))
    out["tokens_per_s_per_device"] = out["tokens_per_s"] / dims.world_size
    flops = model_flops_per_step(run.model, run.workload.global_batch_size)
    out["model_flops_per_step"] = flops
    out["tflops_per_device"] = flops / out["step_time_s"] / dims.world_size / 1e12
    hw, key = run.hardware, catalog.PEAK_KEY[run.workload.precision]
    peak = mfu_peak_tflops(hw.device, dict(hw.peak_tflops), dict(hw.achievable_tflops), key)
    out["mfu_pct"] = 100 * out["tflops_per_device"] / peak if peak else None
    out["mfu_peak_tflops"] = peak  # from the profile hardware=<config.hardware.name>
    out.update(mfu_warning(out["mfu_pct"]))
    for key in MEMORY_KEYS:
        per_rank = [r["memory"].get(key, 0) for r in ranks]
        out[key] = max(per_rank)
        out[f"{key}_per_rank"] = per_rank
    for key in ("peak_mem_reserved_bytes", "device_mem_used_nvml_bytes"):  # CUDA only (harness/worker/measure.py)
        per_rank = [r["memory"][key] for r in ranks if key in r["memory"]]
        if per_rank:
            out[key], out[f"{key}_per_rank"] = max(per_rank), per_rank
    out["peak_mem_kind"] = ranks[0]["memory"].get("peak_mem_kind")
    live = [r for r in ranks if "live_peak_bytes" in r["memory"]]
    if live:  # workload.live_tensors: the worst rank's live-storage peak and what was live then, per-rank peaks
        worst = max(live, key=lambda r: r["memory"]["live_peak_bytes"])
        out.update({k: v for k, v in worst["memory"].items() if k.startswith("live_peak_")})
        out["live_peak_rank"] = worst["rank"]
        out["live_peak_bytes_per_rank"] = [r["memory"].get("live_peak_bytes") for r in ranks]
        # where each rank peaked: ranks a dry run simulates as alike can differ in a real run where gloo
        # completes collectives on its own thread (docs/memory.md), so the worst rank alone is not enough
        out["live_peak_at_per_rank"] = [{k: r["memory"].get(f"live_peak_{k}") for k in ("step", "phase", "live_by_kind")}
                                        for r in ranks]
    out["losses"] = ranks[0]["losses"]
    out["warmup_steps"] = run.workload.warmup_steps
    out["num_microbatches"] = measurement["num_microbatches"]
    out["num_threads_per_rank"] = ranks[0].get("num_threads")
    for r in ranks:  # figures hooks add per rank (profiles, timelines) are merged by name
        for k, v in r.get("measured", {}).items():
            out.setdefault(k, v)
    out.update(_comm(ranks))
    return out


# MFU's denominator is a peak, so MFU above 100 % says the profile's rate is not one (a CPU profile calibrated
# under load that has since lifted, or on another machine of the kind): flagged, never capped.
MFU_EXCEEDED = "profile rate exceeded: recalibrate"


def mfu_warning(mfu_pct: float | None) -> dict:
    """{"mfu_warning": MFU_EXCEEDED} when MFU is above 100 %, else {}: the record's `measured.mfu_warning`."""
    return {"mfu_warning": MFU_EXCEEDED} if mfu_pct is not None and mfu_pct > 100 else {}


def _comm(ranks: list[dict]) -> dict:
    """The profiled window's communication figures (harness/worker/measure.py), merged across ranks:
    shares mean over ranks, bytes max over ranks (trace_analysis.merge_ranks), A/B max per step."""
    return merge(ranks)


# -- stats -----------------------------------------------------------------------------------------
# Step-time statistics: pure Python, so the parent process aggregates without importing torch.

def percentile(xs: list[float], q: float) -> float:
    """Linearly interpolated percentile, q in [0, 100] (numpy's default method)."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def step_stats(step_times: list[float]) -> dict[str, float]:
    return {"step_time_s": statistics.median(step_times),
            "step_time_s_p10": percentile(step_times, 10),
            "step_time_s_p90": percentile(step_times, 90),
            "step_time_s_mean": statistics.fmean(step_times),
            "step_time_s_std": statistics.pstdev(step_times)}


# -- noise: bootstrap confidence intervals (the model for a comparison is pyperf's and asv's) --------
# Resamples per interval. A fixed seed makes every interval a pure function of its samples: the same
# records always give the same table, report and `harness.compare` verdict.
BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 95.0
_SEED = 0x5EED


def _medians(groups: list[list[float]], rng, resamples: int) -> list[float]:
    """Two-level bootstrap of the pooled median: draw the groups (repeats) with replacement, then each
    drawn group's samples (steps) with replacement. Between-repeat drift (another job on the machine,
    a clock change between repeats) widens the interval, not only the scatter within one run."""
    out = []
    for _ in range(resamples):
        pool: list[float] = []
        for g in (groups[rng.randrange(len(groups))] for _ in groups):
            pool.extend(g[rng.randrange(len(g))] for _ in g)
        out.append(statistics.median(pool))
    return out


def median_ci(groups: list[list[float]], resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float, float]:
    """(median, lo, hi): the median of every sample pooled and its bootstrap 95 % interval.
    groups: one list of step times per repeat (one group: a run's own interval, over its steps)."""
    groups = [list(g) for g in groups if g]
    if not groups:
        raise ValueError("median_ci needs at least one sample")
    draws = _medians(groups, random.Random(_SEED), resamples)
    tail = (100 - CONFIDENCE) / 2
    return statistics.median([x for g in groups for x in g]), percentile(draws, tail), percentile(draws, 100 - tail)


def ratio_ci(a: list[list[float]], b: list[list[float]],
             resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float, float]:
    """(ratio, lo, hi): median(b) / median(a) and its bootstrap 95 % interval, a and b resampled
    independently (two studies are two independent sets of repeats)."""
    rng = random.Random(_SEED)
    da, db = _medians(a, rng, resamples), _medians(b, rng, resamples)
    ratios = [y / x for x, y in zip(da, db)]
    tail = (100 - CONFIDENCE) / 2
    point = statistics.median([x for g in b for x in g]) / statistics.median([x for g in a for x in g])
    return point, percentile(ratios, tail), percentile(ratios, 100 - tail)


def throughput_ci(groups_or_steps: list, tokens_per_step: float) -> dict:
    """The 95 % intervals of the median step time and of tokens/s (tokens per step / step time, so
    its bounds are the step interval's, swapped). Takes a run's step times or a list of repeats'."""
    groups = groups_or_steps if groups_or_steps and isinstance(groups_or_steps[0], list) else [groups_or_steps]
    _, lo, hi = median_ci(groups)
    return {"step_time_s_ci95": [lo, hi], "tokens_per_s_ci95": [tokens_per_step / hi, tokens_per_step / lo]}


# -- the fidelity study's goals (the ratios themselves: harness/run/record.py) ------------------------
# The goal on a 2-core CPU at world <= 2, after calibration: |ratio - 1| (or points) within these.
GOALS = {"step_time_s": 0.20, "model_states_bytes": 0.01, "comm_dp_bytes": 0.05, "comm_tp_bytes": 0.05,
         "comm_pp_bytes": 0.05, "comm_ep_bytes": 0.05, "bubble_pct_diff_points": 5.0}

def within_goal(fid: dict) -> dict[str, bool]:
    """Which of the study's goals this record meets (metrics it has only)."""
    out = {}
    for k, tol in GOALS.items():
        v = fid.get(k)
        if v is None:
            continue
        out[k] = abs(v) <= tol if k.endswith("_points") else abs(v - 1) <= tol
    return out


# -- comm merge ------------------------------------------------------------------------------------
# Every rank's profiled-window figures (harness/worker/measure.py) -> the record's measured keys.
#
# Pure Python (no torch), so the parent process aggregates a run without importing torch.

def ab_exposed(rank_abs: list[dict]) -> dict:
    """Per-rank A/B timings -> measured keys. A step ends when its slowest rank is done (max over
    ranks), then the median over pairs, as in the timed loop."""
    abs_ = [a for a in rank_abs if a]
    if not abs_ or not all(a.get("applicable") for a in abs_):
        return {"comm_exposed_ab_pct": None, "comm_ab_note": "no sync_disabled() for this strategy"} if abs_ else {}
    sync = statistics.median(max(ts) for ts in zip(*(a["sync_s"] for a in abs_)))
    nosync = statistics.median(max(ts) for ts in zip(*(a["nosync_s"] for a in abs_)))
    out = {"comm_ab_step_sync_s": sync, "comm_ab_step_nosync_s": nosync,
           "comm_ab_collectives_sync": max(a["sync_collectives"] for a in abs_),
           "comm_ab_collectives_nosync": max(a["nosync_collectives"] for a in abs_)}
    if out["comm_ab_collectives_sync"] and out["comm_ab_collectives_nosync"] >= out["comm_ab_collectives_sync"]:
        # The flight recorder saw as many collectives without sync: the switch did not take effect.
        return {**out, "comm_exposed_ab_pct": None, "comm_ab_note": "sync_disabled() did not remove collectives"}
    out["comm_exposed_ab_pct"] = 100 * (sync - nosync) / sync
    return out


def merge(ranks: list[dict]) -> dict:
    """Every rank's window figures -> the record's measured keys (harness/collect/aggregate.py)."""
    profiles = [r.get("comm_profile") for r in ranks if r.get("comm_profile")]
    if not profiles:
        return {}
    errors = [p["error"] for p in profiles if "error" in p]
    out = trace_analysis.merge_ranks([p for p in profiles if "error" not in p]) if not errors else {}
    if errors:
        out["comm_profile_error"] = errors[0]
    out.update(ab_exposed([r.get("comm_ab") for r in ranks if r.get("comm_ab")]))
    out["profile_traces"] = sorted(f"trace_rank{r['rank']}.json" for r in ranks if r.get("comm_profile"))
    return out


# -- repeats ---------------------------------------------------------------------------------------
# A config's statistics from its repeats (`repeats=N`): every repeat is its own record with the same
# run_id and `repeat: i`; what a table, report, index or comparison shows for the config is computed here.
#
#     key(record)            (run_id, repeat): what a resumed study looks for, one record per repeat
#     latest(records)        the latest record of each (run_id, repeat), in first-seen order
#     by_config(records)     run_id -> its repeats' latest records
#     compared_id(record)    what a comparison matches it by: its run_id, a slowed run its clean config's
#     config_record(repeats) one record for the config: the latest repeat's, its measured throughput
#                            replaced by the pooled median of every ok repeat's step times with a
#                            two-level bootstrap 95 % interval (harness/collect/aggregate.py)
#
# A record written before repeats existed has no `repeat` field: it is repeat 0.

def repeat_of(record: dict) -> int:
    return int(record.get("repeat") or 0)


def key(record: dict) -> tuple[str, int]:
    return record["run_id"], repeat_of(record)


def latest(records: list[dict]) -> list[dict]:
    """The latest record of each (run_id, repeat) (a re-run replaces an earlier attempt), first-seen order."""
    out: dict[tuple[str, int], dict] = {}
    for r in records:
        if isinstance(r, dict) and "run_id" in r:
            out.pop(key(r), None)
            out[key(r)] = r
    first = list(dict.fromkeys(key(r) for r in records if isinstance(r, dict) and "run_id" in r))
    return [out[k] for k in first]


def compared_id(record: dict) -> str:
    """The config a comparison matches the record by: its run_id, or for a run slowed on purpose
    (slow_step_pct) the clean config's (the record's slowed_on_purpose.clean_run_id)."""
    return (record.get("slowed_on_purpose") or {}).get("clean_run_id") or record["run_id"]


def by_config(records: list[dict]) -> dict[str, list[dict]]:
    """run_id -> the latest record of each of its repeats, by repeat; configs in first-seen order."""
    out: dict[str, list[dict]] = {}
    for r in latest(records):
        out.setdefault(r["run_id"], []).append(r)
    return {k: sorted(v, key=repeat_of) for k, v in out.items()}


def step_groups(repeats: list[dict]) -> list[list[float]]:
    """Each ok repeat's timed step times (the samples a config's interval is drawn from)."""
    return [list(r["measured"]["step_times_s"]) for r in repeats
            if r.get("status") == Status.OK and (r.get("measured") or {}).get("step_times_s")]


def config_record(repeats: list[dict]) -> dict:
    """One record standing for the config. With one repeat, that record untouched (its run interval is
    already in `measured`); with several, the latest one with throughput from all ok repeats pooled, and
    `measured.repeats_ok` / `repeats` saying how many there were."""
    ok = [r for r in repeats if r.get("status") == Status.OK]
    base = (ok or repeats)[-1]
    groups = step_groups(ok)
    if len(repeats) == 1 or not groups or not base["measured"].get("tokens_per_step"):
        return base
    out = copy.deepcopy(base)
    m, old = out["measured"], base["measured"]["step_time_s"]
    tokens = m["tokens_per_step"]
    step, *_ = median_ci(groups)
    scale = old / step  # per-device rates and MFU are proportional to 1 / step time
    m["step_time_s"] = step
    m["tokens_per_s"] = tokens / step
    for k in ("tokens_per_s_per_device", "tflops_per_device", "mfu_pct"):
        if isinstance(m.get(k), (int, float)):
            m[k] *= scale
    m.pop("mfu_warning", None)  # the pooled MFU's, not the latest repeat's
    m.update(mfu_warning(m.get("mfu_pct")))
    m.update(throughput_ci(groups, tokens))
    m["repeats_ok"] = len(groups)
    out["fidelity"] = ratios(m, out.get("predicted") or {})
    out["repeats"] = len(repeats)
    return out


def config_records(records: list[dict]) -> list[dict]:
    """One record per config (config_record of its repeats), configs in first-seen order."""
    return [config_record(v) for v in by_config(records).values()]
