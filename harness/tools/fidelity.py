"""`python -m harness.fidelity results/<study>.jsonl ...`: a study's measured/predicted ratios as a
Markdown table, one row per config (the ratios themselves: harness/collect/fidelity.py)."""
from __future__ import annotations

import sys

from harness.collect.fidelity import ratios, within_goal
from harness.labels import labels

# -- the table ----------------------------------------------------------------------------------
COLUMNS = (("step_time_s", "step"), ("tokens_per_s", "tok/s"), ("model_states_bytes", "states"),
           ("comm_dp_bytes", "dp B"), ("comm_tp_bytes", "tp B"), ("comm_pp_bytes", "pp B"),
           ("comm_share_pct", "comm%"), ("bubble_pct_diff_points", "bubble pts"))


def table(records: list[dict]) -> str:
    """Markdown table: one row per ok record (latest per run_id), measured/predicted per column,
    with measured and predicted step time beside the ratio; * marks a figure outside the goal."""
    from harness.run.record import latest_by_run_id

    rows = [r for r in latest_by_run_id(records).values() if r["status"] == "ok"]
    head = ["config", "step s meas/pred"] + [name for _, name in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r, label in zip(rows, labels(rows)):
        fid = r.get("fidelity") or ratios(r.get("measured") or {}, r.get("predicted") or {})
        ok = within_goal(fid)
        m, p = r["measured"], r["predicted"]
        cells = [label, f"{m.get('step_time_s', 0):.3f} / {p.get('step_time_s', 0):.3f}"]
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
    from harness.run.record import read

    if not argv:
        print("usage: python -m harness.fidelity <results/study.jsonl> ...", file=sys.stderr)
        return 2
    records = [r for path in argv for r in read(path)]
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
