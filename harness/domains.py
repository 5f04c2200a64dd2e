"""Each config field's domain, checked before any rule that divides by it or any launch.

A field out of its domain (micro_batch_size=0, dropout=2.0, lr=nan, seq_len=-1) is refused with
every offending field named at once; validate() runs this first, so no later rule and no cost-model
formula ever sees a zero divisor, a negative size or a non-finite float. Pure (no torch).
"""
from __future__ import annotations

import math

from harness.config import CONF_DIR
from harness.dims import ConfigError


def _int_at_least(lo: int, hi: float = math.inf):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _real(lo: float, hi: float = math.inf, lo_open: bool = False, hi_open: bool = False):
    def ok(v):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            return False
        return (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    return ok


def _one_of(*choices):
    return lambda v: v in choices


SIZE, COUNT = (_int_at_least(1), ">= 1"), (_int_at_least(0), ">= 0")
# The cost model keeps per-rank lists: 65536 ranks take it a few seconds, more would stall a sweep.
MAX_WORLD = 65536
DEGREE = (_int_at_least(1, MAX_WORLD), f"in 1..{MAX_WORLD}")
POSITIVE, NON_NEGATIVE = (_real(0, lo_open=True), "> 0 and finite"), (_real(0), ">= 0 and finite")

DOMAINS = {
    "model.n_layers": SIZE, "model.d_model": SIZE, "model.n_heads": SIZE, "model.d_ff": SIZE,
    "model.vocab_size": SIZE, "model.seq_len": SIZE, "model.n_experts": COUNT, "model.top_k": SIZE,
    "model.dropout": (_real(0, 1, hi_open=True), "in [0, 1)"),
    "model.capacity_factor": NON_NEGATIVE, "model.aux_loss_coef": NON_NEGATIVE, "model.rope_theta": POSITIVE,
    "model.n_kv_heads": (lambda v: v is None or _int_at_least(1)(v), "null or >= 1"),
    "model.loss_chunk_tokens": SIZE,
    "parallel.dp": DEGREE, "parallel.tp": DEGREE, "parallel.pp": DEGREE, "parallel.vpp": DEGREE,
    "parallel.ep": DEGREE, "parallel.cp": DEGREE, "parallel.dp_replicate": DEGREE,
    "workload.global_batch_size": SIZE, "workload.micro_batch_size": SIZE,
    "workload.num_microbatches": (lambda v: v is None or _int_at_least(1)(v), "null or >= 1"),
    "workload.warmup_steps": COUNT, "workload.steps": SIZE, "workload.profile_steps": COUNT,
    "workload.seed": (_int_at_least(0, 2**63 - 1), "in [0, 2**63)"),
    "workload.lr": POSITIVE, "workload.weight_decay": NON_NEGATIVE,
    "strategy.zero_stage": (_int_at_least(0, 3), "0, 1, 2 or 3"), "strategy.bucket_cap_mb": POSITIVE,
    "strategy.powersgd_rank": SIZE, "strategy.ds.reduce_bucket_size": SIZE,
    "strategy.ds.allgather_bucket_size": SIZE, "strategy.ds.stage3_param_persistence_threshold": COUNT,
    "strategy.ds.stage3_prefetch_bucket_size": COUNT, "strategy.ds.stage3_max_live_parameters": SIZE,
    "hardware.device": (_one_of("cpu", "cuda"), "cpu or cuda"), "hardware.devices_per_node": SIZE,
    "hardware.memory_GiB": POSITIVE, "hardware.memory_bw_GBps": NON_NEGATIVE,
    "hardware.intra_node.bus_bw_GBps": POSITIVE, "hardware.intra_node.latency_us": NON_NEGATIVE,
    "hardware.inter_node.bus_bw_GBps": POSITIVE, "hardware.inter_node.latency_us": NON_NEGATIVE,
    "hardware.intra_node.ring_hop_latency_us": NON_NEGATIVE, "hardware.inter_node.ring_hop_latency_us": NON_NEGATIVE,
    "hardware.intra_node.tree_hop_latency_us": NON_NEGATIVE, "hardware.inter_node.tree_hop_latency_us": NON_NEGATIVE,
    "launcher.nodes": DEGREE, "launcher.nproc_per_node": (_int_at_least(0, MAX_WORLD), f"in 0..{MAX_WORLD}"), "launcher.timeout_s": POSITIVE,
    "launcher.master_port": (_int_at_least(0, 65535), "0 (a free port) or 1-65535"),
    "launcher.cpus_per_task": SIZE, "launcher.gpus_per_node": COUNT, "launcher.time_min": SIZE,
    "launcher.array_parallelism": SIZE,
    "repeats": SIZE, "repeat": COUNT, "slow_step_pct": NON_NEGATIVE,
    "logger.name": (_one_of("wandb", "none"), "wandb or none"),
    "logger.mode": (_one_of("offline", "online", "disabled"), "offline, online or disabled"),
    "plan.gpus": SIZE, "plan.top_k": SIZE, "plan.run_top": COUNT,
    "plan.run_top_by": (_one_of("degrees", "variant"), "degrees or variant"),
    "rerun": (_one_of("none", "failed", "all"), "none, failed or all"),
    "fault": (_one_of("none", "crash_rank1", "hang_rank1", "oom_rank1"), "none, crash_rank1, hang_rank1 or oom_rank1"),
}


def _get(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check_domains(run) -> None:
    """Raise ConfigError naming every field outside its domain (all at once, so one fix suffices)."""
    bad = [f"{path}={_get(run, path)!r} (must be {want})" for path, (ok, want) in DOMAINS.items()
           if not ok(_get(run, path))]
    for table in ("peak_tflops", "achievable_tflops"):
        bad += [f"hardware.{table}.{k}={v!r} (must be > 0 and finite)"
                for k, v in getattr(run.hardware, table).items() if not POSITIVE[0](v)]
    p = run.parallel
    if not bad and p.dp * p.tp * p.pp * p.cp > MAX_WORLD:
        bad.append(f"dp {p.dp} * tp {p.tp} * pp {p.pp} * cp {p.cp} = {p.dp * p.tp * p.pp * p.cp} ranks "
                   f"(must be <= {MAX_WORLD})")
    launchers = sorted(p.stem for p in (CONF_DIR / "launcher").glob("*.yaml"))
    if run.launcher.name not in launchers:
        bad.append(f"launcher.name={run.launcher.name!r} (must be one of: {', '.join(launchers)})")
    if bad:
        raise ConfigError(f"out of range: {'; '.join(bad)}")
