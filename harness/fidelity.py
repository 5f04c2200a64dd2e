"""Predicted vs measured: every record's `fidelity` object, and the fidelity study's table.

    fidelity[k]              = measured[k] / predicted[k]      for each k in KEYS both sides have
    fidelity[k_diff_points]  = measured[k] - predicted[k]      for the percentages in POINTS

A ratio of 1 is a perfect prediction; > 1 means the model under-predicts. Where the model predicts 0
and the run measured more, the ratio is None (no finite ratio: a missed term, shown as such).
Peak memory is compared only where the measurement is tensor memory (CUDA max_allocated, or a
tensor peak a strategy reports): the CPU fallback is process RSS (~220 MB of torch, allocator
caching), which a tensor-memory model cannot and should not predict.

    python -m harness.fidelity results/fidelity.jsonl     # the table of ratios of a study
"""
from __future__ import annotations

import sys

KEYS = ("step_time_s", "tokens_per_s", "model_states_bytes", "params_bytes", "grads_bytes", "optimizer_bytes",
        "peak_mem_bytes", "comm_share_pct", "comm_exposed_pct", "bubble_pct",
        "comm_dp_bytes", "comm_tp_bytes", "comm_pp_bytes", "comm_ep_bytes")
POINTS = ("comm_share_pct", "comm_exposed_pct", "bubble_pct")
# The goal on a 2-core CPU at world <= 2, after calibration: |ratio - 1| (or points) within these.
GOALS = {"step_time_s": 0.20, "model_states_bytes": 0.01, "comm_dp_bytes": 0.05, "comm_tp_bytes": 0.05,
         "comm_pp_bytes": 0.05, "comm_ep_bytes": 0.05, "bubble_pct_diff_points": 5.0}
RSS_KINDS = ("cpu_peak_rss",)


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def ratios(measured: dict, predicted: dict) -> dict:
    """measured/predicted for every metric both have (see the module docstring)."""
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


def within_goal(fid: dict) -> dict[str, bool]:
    """Which of the study's goals this record meets (metrics it has only)."""
    out = {}
    for k, tol in GOALS.items():
        v = fid.get(k)
        if v is None:
            continue
        out[k] = abs(v) <= tol if k.endswith("_points") else abs(v - 1) <= tol
    return out


# -- the table ----------------------------------------------------------------------------------
COLUMNS = (("step_time_s", "step"), ("tokens_per_s", "tok/s"), ("model_states_bytes", "states"),
           ("comm_dp_bytes", "dp B"), ("comm_tp_bytes", "tp B"), ("comm_pp_bytes", "pp B"),
           ("comm_share_pct", "comm%"), ("bubble_pct_diff_points", "bubble pts"))


def _label(r: dict) -> str:
    from harness.table import degrees

    c = r.get("config") or {}
    s = c.get("strategy") or {}
    extra = f" {s.get('schedule')}" if (r.get("dims") or {}).get("pp", 1) > 1 else ""
    eng = "ds-" if s.get("engine") == "deepspeed" else ""
    return f"{eng}{r['strategy']}{extra} {degrees(r.get('dims') or {})}"


def table(records: list[dict]) -> str:
    """Markdown table: one row per ok record (latest per run_id), measured/predicted per column,
    with measured and predicted step time beside the ratio; * marks a figure outside the goal."""
    from harness.record import latest_by_run_id

    rows = [r for r in latest_by_run_id(records).values() if r["status"] == "ok"]
    head = ["config", "step s meas/pred"] + [name for _, name in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        fid = r.get("fidelity") or ratios(r.get("measured") or {}, r.get("predicted") or {})
        ok = within_goal(fid)
        m, p = r["measured"], r["predicted"]
        cells = [_label(r), f"{m.get('step_time_s', 0):.3f} / {p.get('step_time_s', 0):.3f}"]
        for key, _ in COLUMNS:
            v = fid.get(key, "")
            if v is None:
                cells.append("pred 0")
            elif v == "":
                cells.append("")
            else:
                cells.append(f"{v:+.1f}" if key.endswith("_points") else f"{v:.3f}")
                if ok.get(key) is False:
                    cells[-1] += "*"
        lines.append("| " + " | ".join(cells) + " |")
    hw = sorted({(r.get("config") or {}).get("hardware", {}).get("name", "?") for r in rows})
    lines.append(f"\n{len(rows)} records, hardware {', '.join(hw)}; ratio = measured/predicted; bubble: "
                 "measured - predicted in points; * outside the goal (step ±20%, states 1%, comm bytes 5%, "
                 "bubble 5 points)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from harness.record import read

    if not argv:
        print("usage: python -m harness.fidelity <results/study.jsonl> ...", file=sys.stderr)
        return 2
    records = [r for path in argv for r in read(path)]
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
