"""`python -m lab.family_errors [--write]`: how sure a prediction is, per layout family, from the sets in lab/.

    python -m lab.family_errors            # the table as it stands, beside the committed one
    python -m lab.family_errors --write    # write harness/costmodel/family_errors.json (predict and plan read it)
    python -m lab.playbook_doc             # the same file, with docs/playbook.md, from one pass

Each validation row that has a prediction and a measurement is put in its layout family (harness/dims.py
`family`: which of tp, pp, cp, ep are over 1, tp spanning nodes, in node or across nodes): the Playbook
sweep's development half (lab/playbook.py: the rows that ran and that brigade predicts) and the published
set's fitting half (lab/published.py; the held-out half is never read here, docs/validation.md#the-rule).
Per family, per set and both together: rows, median and p90 of |predicted / measured - 1|, and the geometric
mean of predicted / measured. Per family too, over the rows of both sets that measured memory, its memory margin
(`memory`): how far the measured peak exceeded the predicted one in all but one run in ten (MARGIN_QUANTILE of
measured / predicted - 1, none where the prediction was at least as large), and the same over every family's rows
(`memory_all`) for a family with no memory row. `plan` ranks only the layouts whose predicted peak plus their
family's margin fits the device (harness/costmodel/family_errors.py memory_limit), and so do the group verdicts of
lab/playbook.py and `run_top_k` here.

`run_top_k`: per (model, node count) group of the development half, the K at which `plan --run-top K` would
have run a layout that measured within 10 % of the group's measured best (plan_check.WITHIN): the group's
layouts predicted to fit, best predicted first, one per distinct degrees (dp, tp, pp) as plan's run-top takes
them (plan_check.distinct_layouts, by degrees), each as its best predicted row of the sweep; a row that crashed
measures nothing. K is the largest of the groups' (every group found); where some group is found by no K, the
smallest K that finds 90 % of the groups. The harness never imports lab/: predict and plan read the committed
table, and tests/test_family_errors.py checks that it is what this module computes now.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from harness.costmodel import family_errors as committed
from harness.tools.plan_check import WITHIN
from lab import playbook, published
from lab.published_memory import quantile

SETS = ("playbook", "published")
COVER = 0.9  # the share of groups the fallback K finds, where some group is found by no K
# The memory margin's quantile of measured / predicted peak - 1: chosen, not fitted, the p90 by which every error here
# is judged (family_errors.LARGE_P90_PCT): a layout the planner ranks would have fitted in 9 of 10 validation runs
# of its family whose prediction was as far below the measurement as any of them.
MARGIN_QUANTILE = 0.9


def stats(rows: list[dict]) -> dict:
    """Rows, median / p90 |error| (%) and geomean ratio of rows with a `ratio` (predicted / measured), rounded as the
    table stores them."""
    s = playbook.throughput_errors(rows)
    if not s["n"]:
        return {"n": 0}
    return {"n": s["n"], "median_abs_err_pct": round(s["median_abs_err_pct"], 1),
            "p90_abs_err_pct": round(s["p90_abs_err_pct"], 1), "geomean_ratio": round(s["geomean_ratio"], 3)}


def memory_margin(rows: list[dict]) -> dict:
    """Rows and margin (%) of the rows with a `mem_ratio` (predicted / measured peak): MARGIN_QUANTILE of measured /
    predicted - 1, floored at 0 (module docstring)."""
    under = sorted(1 / r["mem_ratio"] - 1 for r in rows if r.get("mem_ratio") is not None)
    return {"n": len(under), "margin_pct": round(max(0.0, 100 * quantile(under, MARGIN_QUANTILE)), 1) if under else None}


def validation_rows(play: list[dict], pub: list[dict]) -> dict:
    """set -> its rows that have a prediction and a measurement: the Playbook rows that ran, the published fitting half."""
    return {"playbook": [r for r in play if r["ratio"] is not None],
            "published": [r for r in pub if r["half"] == "fitting"]}


def by_family(play: list[dict], pub: list[dict]) -> dict:
    """family -> {"all": stats, "playbook": stats, "published": stats, "memory": memory_margin}, families in name
    order."""
    rows = validation_rows(play, pub)
    fams = sorted({r["family"] for rs in rows.values() for r in rs})
    return {f: {"all": stats([r for s in SETS for r in rows[s] if r["family"] == f]),
                **{s: stats([r for r in rows[s] if r["family"] == f]) for s in SETS},
                "memory": memory_margin([r for s in SETS for r in rows[s] if r["family"] == f])} for f in fams}


def found_at(rs: list[dict], margins: dict | None = None) -> int | None:
    """The K of one group (module docstring): None where no K finds a layout within WITHIN of the measured best.
    margins: the memory margins plan would read (a table's `families` and `memory_all`; None: the committed table)."""
    best = max(r["measured_tokens_per_s_per_gpu"] for r in rs if r["ran"])
    seen: set = set()
    for r in sorted((r for r in rs if playbook.planned(r, margins)), key=lambda r: -r["predicted_tokens_per_s_per_gpu"]):
        key = (r["dp"], r["tp"], r["pp"])
        if key in seen:
            continue
        seen.add(key)
        if r["ran"] and r["measured_tokens_per_s_per_gpu"] >= (1 - WITHIN) * best:
            return len(seen)
    return None


def run_top_k(play: list[dict], margins: dict | None = None) -> dict:
    """The K plan recommends with `--run-top` and how it was derived (module docstring); margins as found_at's."""
    keys = sorted({(r["model"], r["nodes"]) for r in play if r["ran"]})
    ks = {k: found_at([r for r in play if (r["model"], r["nodes"]) == k], margins) for k in keys}
    found = sorted(v for v in ks.values() if v is not None)
    need = math.ceil(COVER * len(ks))
    every = len(found) == len(ks)
    k = found[-1] if every else (found[need - 1] if len(found) >= need else None)
    covered = sum(v is not None and v <= k for v in ks.values()) if k else 0
    return {"k": k, "groups": len(ks), "groups_found": covered,
            "rule": "every group" if every else f"{COVER:.0%} of the groups",
            "derivation": f"the smallest K at which plan --run-top K (distinct dp, tp, pp, each its best predicted "
                          f"row) runs a layout measuring within {100 * WITHIN:.0f} % of the measured best, in "
                          f"{'every' if every else f'{COVER:.0%} of the'} (model, node count) group of the Playbook "
                          f"sweep's development half ({covered} of {len(ks)})",
            "per_group": {f"{m} on {n} node{'s' if n > 1 else ''}": v for (m, n), v in ks.items()}}


def table(play: list[dict] | None = None, pub: list[dict] | None = None) -> dict:
    """What harness/costmodel/family_errors.json holds, computed now."""
    play = playbook.run_all() if play is None else play
    pub = published.run_all("fitting") if pub is None else pub
    margins = {"families": by_family(play, pub),
               "memory_all": memory_margin([r for rs in validation_rows(play, pub).values() for r in rs])}
    return {"generated_by": "python -m lab.playbook_doc (with docs/playbook.md) or python -m lab.family_errors --write",
            "error": "|predicted / measured - 1| of tokens/s per device; geomean_ratio: predicted / measured",
            "memory": f"margin_pct: the p{100 * MARGIN_QUANTILE:.0f} of measured / predicted peak memory - 1 (%), 0 "
                      "where the prediction was at least as large, over the family's rows that measured memory "
                      "(Playbook: rank 0's; published: the worst rank's); memory_all: over every family's",
            "sets": {"playbook": "lab/playbook.py: the Playbook sweep's development half, the rows that ran, predicted",
                     "published": "lab/published.py: the published set's fitting half"},
            **margins, "run_top": run_top_k(play, margins)}


def dumps(t: dict) -> str:
    return json.dumps(t, indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.family_errors", description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help=f"write {committed.TABLE}")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    t = table()
    if args.write:
        committed.TABLE.write_text(dumps(t))
        print(f"wrote {committed.TABLE}")
    print(f"{'family':<26} {'runs':>5} {'median|err|%':>13} {'p90|err|%':>10} {'geomean':>8}  by set")
    for f, v in t["families"].items():
        a = v["all"]
        sets = ", ".join(f"{s} {v[s]['n']}" for s in SETS if v[s]["n"])
        print(f"{f:<26} {a['n']:>5} {a['median_abs_err_pct']:>13.1f} {a['p90_abs_err_pct']:>10.1f} "
              f"{a['geomean_ratio']:>8.3f}  {sets}")
    k = t["run_top"]
    print(f"\n--run-top {k['k']}: {k['derivation']}\n  per group: {k['per_group']}")
    if not args.write and committed.TABLE.exists() and committed.TABLE.read_text() != dumps(t):
        print(f"\n{committed.TABLE} is stale: python -m lab.playbook_doc (page and table)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
