"""A dry run's measurement (launch/dryrun.py) -> the record's `measured` object. Pure.

Only memory exists in a dry run: per simulated rank the exact local bytes of params, grads and
optimizer state (fake tensors of the real local shapes) and the peak of tensor memory in one training
step (LiveTensors). Figures are max over the simulated ranks, plus per-rank lists in the order of
`dryrun_ranks` (one rank per role; not every rank of the world); a middle pipeline rank derived from two
simulated ones (harness/strategies/pp_derive.py) has no wall time and says so in `dryrun_derived`; the
peak's phase and what was live then are the worst rank's (`peak_rank`), a simulated one (a derived rank's
peak lies between two simulated ones'). The host memory the simulation took: each child's peak PSS, the
children's peak total and the budget it was held within (`dryrun_memory_budget_bytes`).
"""
from __future__ import annotations

KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "master_bytes", "model_states_bytes", "peak_mem_bytes")


def aggregate_dryrun(run, dims, measurement: dict) -> dict:
    ranks = sorted(measurement["ranks"], key=lambda r: r["rank"])
    out: dict = {"kind": "dryrun", "dryrun_ranks": [r["rank"] for r in ranks],
                 "dryrun_rank_wall_s": [r["wall_s"] for r in ranks], "world_size": dims.world_size,
                 "dryrun_rank_stands_for": [r.get("stands_for", 1) for r in ranks],
                 "dryrun_shortened": [r.get("shortened") for r in ranks],
                 "dryrun_derived": [r.get("derived") for r in ranks],
                 "num_microbatches": measurement["num_microbatches"], "peak_mem_kind": None}
    for key in KEYS:
        per_rank = [r["memory"].get(key) for r in ranks]
        if any(v is not None for v in per_rank):
            out[key] = max(v for v in per_rank if v is not None)
            out[f"{key}_per_rank"] = per_rank
    peaks = [r for r in ranks if r["memory"].get("peak_mem_bytes") is not None]
    if peaks:  # what the worst simulated rank held at its peak, and when (harness/worker/measure.py LiveTensors)
        worst = max(peaks, key=lambda r: (r["memory"]["peak_mem_bytes"], "derived" not in r))
        out["peak_rank"] = worst["rank"]
        out.update({k: worst["memory"][k] for k in ("peak_step", "peak_phase", "peak_op", "peak_live_by_kind", "peak_live_by_op") if k in worst["memory"]})
    host = measurement.get("host") or {}  # the forked children's host memory (launch/dryrun.py Children)
    out.update({f"dryrun_{k}": v for k, v in host.items()})
    out["dryrun_rank_host_peak_pss_bytes"] = [r.get("host_peak_pss_bytes") for r in ranks]
    kinds = {r["memory"].get("peak_mem_kind") for r in ranks} - {None}
    out["peak_mem_kind"] = kinds.pop() if len(kinds) == 1 else None
    whole = {r["rank"]: r["not_periodic"] for r in ranks if r.get("not_periodic")}
    if whole:  # a shortened step whose copies did not repeat: the rank ran every micro-batch (pp_shorten)
        out["dryrun_not_periodic"] = whole
    if measurement.get("not_derived"):  # middle pipeline ranks simulated: their ends broke the rule (pp_derive)
        out["dryrun_not_derived"] = measurement["not_derived"]
    errors = {r["rank"]: r["measured"]["dryrun_step_error"] for r in ranks if "dryrun_step_error" in r.get("measured", {})}
    if errors:  # the step could not run on fake tensors there: states counted, no peak
        out["dryrun_step_error"] = errors
    return out
