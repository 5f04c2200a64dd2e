"""The record: what one run leaves behind, whatever happened, as one JSON object (its fields and units:
results/README.md). Its schema version, the closed set of statuses, its run_id (which config it is)
and how one is made (make_record: config, environment, measured, predicted, fidelity).

Where records go and how they are read back is harness/run/results_file.py; the environment's git and
host part is harness/collect/environment.py; W&B logging is harness/run/wandb_log.py.
"""
from __future__ import annotations

import functools
import hashlib
import json
import time
from enum import StrEnum
from pathlib import Path

from omegaconf import OmegaConf

from harness import catalog
from harness.collect.environment import parent_env
from harness.config import ADHOC_STUDY, NON_SEMANTIC_KEYS, RENAMED, RunConfig, flatten, renamed

SCHEMA_VERSION = 1


class Status(StrEnum):
    """A record's status: the one list of them (results/README.md says what each means)."""
    OK = "ok"
    INVALID = "invalid"  # refused before launch
    FAILED = "failed"
    TIMEOUT = "timeout"
    OOM = "oom"
    DIVERGED = "diverged"  # ran to the end with a non-finite loss
    INTERRUPTED = "interrupted"  # brigade got SIGTERM/SIGINT/SIGHUP


FAILURES = frozenset({Status.FAILED, Status.TIMEOUT, Status.OOM, Status.DIVERGED})  # launched, not ok: exit 1
UNFINISHED = frozenset({Status.INVALID, Status.INTERRUPTED})  # never ran to an end: a resumed study runs them


def run_id(config: dict) -> str:
    """Hash of the resolved config, less the fields that do not change what is measured and less
    the values equal to the schema's defaults, so that adding a field with a default to the schema
    keeps every existing run_id (a resumed study still finds its done runs)."""
    defaults = _hashed_names(_schema_defaults())
    flat = _hashed_names({**_retired_keys(config), **renamed(flatten(config))})
    semantic = {k: v for k, v in flat.items()
                if k.split(".")[0] not in NON_SEMANTIC_KEYS and defaults.get(k, _ABSENT) != v}
    if (config.get("launcher") or {}).get("name") == "dryrun":  # measures bytes, not a run: never the same record
        semantic["launcher.name"] = "dryrun"
    return hashlib.sha256(json.dumps(semantic, sort_keys=True, default=str).encode()).hexdigest()[:12]


def slowed_on_purpose(config: dict) -> dict | None:
    """A record's `slowed_on_purpose`: the slowdown (slow_step_pct) and the run_id of the same config run
    clean, which `harness.compare` and the index match it against; None for a clean run."""
    pct = config.get("slow_step_pct")
    return {"slow_step_pct": pct, "clean_run_id": run_id({**config, "slow_step_pct": 0.0})} if pct else None


def _hashed_names(flat: dict) -> dict:
    """A renamed key under the name run_ids were first hashed with (harness/config.py: RENAMED)."""
    old_of = {new: old for old, new in RENAMED.items()}
    return {old_of.get(k, k): v for k, v in flat.items() if k not in RENAMED}


_ABSENT = object()
# Schema fields that left the config for harness/catalog.py, with their old defaults: a config is
# hashed as the old schema would have hashed it, so studies recorded before keep resuming.
_RETIRED_DEFAULTS = {"strategy.axes": ["dp"], "strategy.impl": ""}


def _retired_keys(config: dict) -> dict:
    old = catalog.SCHEMA_1_STRATEGY_FIELDS.get((config.get("strategy") or {}).get("name"))
    if old is None or "axes" in config["strategy"]:
        return {}
    return {k: v for k, v in zip(("strategy.axes", "strategy.impl"), old) if v != _RETIRED_DEFAULTS[k]}


@functools.lru_cache(maxsize=1)
def _schema_defaults() -> dict:

    return flatten(OmegaConf.to_container(OmegaConf.structured(RunConfig), throw_on_missing=False))


def make_record(config: dict, run, dims, status: str, error: str | None,
                measured: dict | None = None, predicted: dict | None = None, env: dict | None = None,
                run_dir: Path | None = None, wall_s: float | None = None) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id(config),
        "repeat": int(config.get("repeat") or 0),  # repeats=N: the same run_id N times (harness/collect/aggregate.py)
        "study": config.get("study", ADHOC_STUDY),
        "strategy": (config.get("strategy") or {}).get("name"),
        "dims": dims.as_dict() if dims else None,
        "status": Status(status).value,  # a plain str, as read back from the file
        "error": error,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": wall_s,
        "run_dir": str(run_dir) if run_dir else None,
        "config": config,
        **({"slowed_on_purpose": slowed} if (slowed := slowed_on_purpose(config)) else {}),
        "env": {**parent_env(), **(env or {}), "world_size": dims.world_size if dims else None},
        "measured": measured or {},
        "predicted": predicted or {},
        # measured/predicted for every metric both have (ratios, below); W&B logs fidelity/*
        "fidelity": ratios(measured or {}, predicted or {}) if status == Status.OK else {},
    }


# -- fidelity ------------------------------------------------------------------------------------
# Predicted vs measured: every record's `fidelity` object.
#
#     fidelity[k]              = measured[k] / predicted[k]      for each k in KEYS both sides have
#     fidelity[k_diff_points]  = measured[k] - predicted[k]      for the percentages in POINTS
#
# A ratio of 1 is a perfect prediction; > 1 means the model under-predicts. Where the model predicts 0
# and the run measured more, the ratio is None (no finite ratio: a missed term, shown as such).
# Peak memory is compared only where the measurement is tensor memory (CUDA max_allocated, or a
# tensor peak a strategy reports): the CPU fallback is process RSS (~220 MB of torch, allocator
# caching), which a tensor-memory model cannot and should not predict.
# The table of a study's ratios: `python -m harness.fidelity results/<study>.jsonl` (harness/fidelity.py).

KEYS = ("step_time_s", "tokens_per_s", "model_states_bytes", "params_bytes", "grads_bytes", "optimizer_bytes",
        "peak_mem_bytes", "comm_share_pct", "comm_exposed_pct", "bubble_pct",
        "comm_dp_bytes", "comm_tp_bytes", "comm_pp_bytes", "comm_ep_bytes",
        # a profiled step's compute by kind of work (harness/collect/compute_classes.py)
        "compute_time_s", "compute_gemm_time_s", "compute_attention_time_s", "compute_elementwise_time_s",
        "compute_optimizer_time_s")
POINTS = ("comm_share_pct", "comm_exposed_pct", "bubble_pct")
RSS_KINDS = ("cpu_peak_rss",)


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def ratios(measured: dict, predicted: dict) -> dict:
    """measured/predicted for every metric both have (the comment above)."""
    out: dict = {}
    for k in KEYS:
        m, p = measured.get(k), predicted.get(k)
        if not (_num(m) and _num(p)):
            continue
        if k == "peak_mem_bytes" and measured.get("peak_mem_kind") in RSS_KINDS:
            continue
        if p:
            out[k] = m / p
        elif m:
            out[k] = None
        if k in POINTS:
            out[f"{k}_diff_points"] = m - p
    return out
