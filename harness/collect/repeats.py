"""A config's statistics from its repeats (`repeats=N`): every repeat is its own record with the same
run_id and `repeat: i`; what a table, report, index or comparison shows for the config is computed here.

    key(record)            (run_id, repeat): what a resumed study looks for, one record per repeat
    latest(records)        the latest record of each (run_id, repeat), in first-seen order
    by_config(records)     run_id -> its repeats' latest records
    config_record(repeats) one record for the config: the latest repeat's, its measured throughput
                           replaced by the pooled median of every ok repeat's step times with a
                           two-level bootstrap 95 % interval (harness/collect/aggregate.py)

A record written before repeats existed has no `repeat` field: it is repeat 0.
"""
from __future__ import annotations

import copy

from harness.collect import aggregate
from harness.collect.aggregate import ratios


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


def by_config(records: list[dict]) -> dict[str, list[dict]]:
    """run_id -> the latest record of each of its repeats, by repeat; configs in first-seen order."""
    out: dict[str, list[dict]] = {}
    for r in latest(records):
        out.setdefault(r["run_id"], []).append(r)
    return {k: sorted(v, key=repeat_of) for k, v in out.items()}


def step_groups(repeats: list[dict]) -> list[list[float]]:
    """Each ok repeat's timed step times (the samples a config's interval is drawn from)."""
    return [list(r["measured"]["step_times_s"]) for r in repeats
            if r.get("status") == "ok" and (r.get("measured") or {}).get("step_times_s")]


def config_record(repeats: list[dict]) -> dict:
    """One record standing for the config. With one repeat, that record untouched (its run interval is
    already in `measured`); with several, the latest one with throughput from all ok repeats pooled, and
    `measured.repeats_ok` / `repeats` saying how many there were."""
    ok = [r for r in repeats if r.get("status") == "ok"]
    base = (ok or repeats)[-1]
    groups = step_groups(ok)
    if len(repeats) == 1 or not groups or not base["measured"].get("tokens_per_step"):
        return base
    out = copy.deepcopy(base)
    m, old = out["measured"], base["measured"]["step_time_s"]
    tokens = m["tokens_per_step"]
    step, *_ = aggregate.median_ci(groups)
    scale = old / step  # per-device rates and MFU are proportional to 1 / step time
    m["step_time_s"] = step
    m["tokens_per_s"] = tokens / step
    for k in ("tokens_per_s_per_device", "tflops_per_device", "mfu_pct"):
        if isinstance(m.get(k), (int, float)):
            m[k] *= scale
    m.update(aggregate.throughput_ci(groups, tokens))
    m["repeats_ok"] = len(groups)
    out["fidelity"] = ratios(m, out.get("predicted") or {})
    out["repeats"] = len(repeats)
    return out


def config_records(records: list[dict]) -> list[dict]:
    """One record per config (config_record of its repeats), configs in first-seen order."""
    return [config_record(v) for v in by_config(records).values()]
