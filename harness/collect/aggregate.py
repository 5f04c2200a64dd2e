"""Per-rank results (measurement.json) -> the record's `measured` object.

A step ends when its slowest rank is done, so the step time of step k is the max over ranks;
the statistics are over the timed steps. Memory is reported as the max over ranks plus the
per-rank list (what shows sharding and imbalance between pipeline stages).
"""
from __future__ import annotations

from harness import catalog, fingerprint
from harness.collect import stats
from harness.costmodel.flops import mfu_peak_tflops, model_flops_per_step

# master_bytes: a separate fp32 master copy (DeepSpeed's ZeRO optimizers hold one even in fp32); 0 elsewhere
MEMORY_KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "master_bytes", "model_states_bytes", "peak_mem_bytes",
               "host_peak_rss_bytes", "host_peak_rss_predicted_bytes")  # the host pair: at the end of setup


def aggregate(run, dims, measurement: dict) -> dict:
    if measurement.get("kind") == "dryrun":  # launcher=dryrun: memory only, no step was timed
        from harness.collect.dryrun import aggregate_dryrun

        return aggregate_dryrun(run, dims, measurement)
    ranks = sorted(measurement["ranks"], key=lambda r: r["rank"])
    steps = [max(ts) for ts in zip(*(r["step_times"] for r in ranks))]
    out = stats.step_stats(steps)
    out["steps_timed"] = len(steps)
    out["step_times_s"] = steps
    tokens = run.workload.global_batch_size * run.model.seq_len
    out["tokens_per_step"] = tokens
    out["tokens_per_s"] = tokens / out["step_time_s"]
    out.update(stats.throughput_ci(steps, tokens))
    out["tokens_per_s_per_device"] = out["tokens_per_s"] / dims.world_size
    flops = model_flops_per_step(run.model, run.workload.global_batch_size)
    out["model_flops_per_step"] = flops
    out["tflops_per_device"] = flops / out["step_time_s"] / dims.world_size / 1e12
    hw, key = run.hardware, catalog.PEAK_KEY[run.workload.precision]
    peak = mfu_peak_tflops(hw.device, dict(hw.peak_tflops), dict(hw.achievable_tflops), key)
    out["mfu_pct"] = 100 * out["tflops_per_device"] / peak if peak else None
    out["mfu_peak_tflops"] = peak  # from the profile hardware=<config.hardware.name>
    for key in MEMORY_KEYS:
        per_rank = [r["memory"].get(key, 0) for r in ranks]
        out[key] = max(per_rank)
        out[f"{key}_per_rank"] = per_rank
    for key in ("peak_mem_reserved_bytes", "device_mem_used_nvml_bytes"):  # CUDA only (harness/worker/measure.py)
        per_rank = [r["memory"][key] for r in ranks if key in r["memory"]]
        if per_rank:
            out[key], out[f"{key}_per_rank"] = max(per_rank), per_rank
    out["peak_mem_kind"] = ranks[0]["memory"].get("peak_mem_kind")
    out["losses"] = ranks[0]["losses"]
    out["warmup_steps"] = run.workload.warmup_steps
    out["num_microbatches"] = measurement["num_microbatches"]
    out["num_threads_per_rank"] = ranks[0].get("num_threads")
    for r in ranks:  # figures hooks add per rank (profiles, timelines) are merged by name
        for k, v in r.get("measured", {}).items():
            out.setdefault(k, v)
    out.update(_comm(ranks))
    return out


def _comm(ranks: list[dict]) -> dict:
    """The profiled window's communication figures (harness/worker/profiling.py), merged across ranks:
    shares mean over ranks, bytes max over ranks (trace_analysis.merge_ranks), A/B max per step."""
    from harness.collect.comm_merge import merge

    return merge(ranks)


def environment(ranks: list[dict]) -> dict:
    env = dict(ranks[0]["env"])
    env["hosts"] = sorted({r["env"]["hostname"] for r in ranks})
    env["num_hosts"] = len(env["hosts"])
    # Nodes: SLURM's node names where there are any (virtual nodes share a hostname), else hosts.
    node_of = [r["env"].get("slurm_node") or r["env"]["hostname"] for r in ranks]
    env["nodes"] = sorted(set(node_of))
    env["num_nodes"] = len(env["nodes"])
    env.pop("slurm_node", None)  # per rank, not per run: the list above holds them all
    for key in ("gpu_name", "gpu_count"):  # per node, in `gpus` (harness/fingerprint.py)
        env.pop(key, None)
    env.update(fingerprint.merge([r["env"] for r in ranks], node_of))
    return env
