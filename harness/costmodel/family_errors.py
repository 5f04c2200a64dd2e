"""How sure a prediction is: the validation error of its layout family (harness/dims.py `family`), as
family_errors.json holds it. `python -m lab.playbook_doc` (with docs/playbook.md; alone: `python -m
lab.family_errors --write`) generates that file from the sets in lab/ (the Playbook sweep's development half and
the published set's fitting half); the harness reads the committed file and never imports lab/. `predict` prints a config's family error and `plan` each layout's; where a top
layout's family error is large (LARGE_P90_PCT), `plan` says so and recommends `--run-top K` with the table's K.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

TABLE = Path(__file__).resolve().with_name("family_errors.json")
# A family's error is large when one prediction in ten misses by more than this (p90 of |predicted / measured - 1|).
# Chosen, not fitted: the p90 the cost model aims at over the Playbook sweep's development half as a whole (its
# median aim is 15 %), so a family over it misses that aim. A family with no validation run counts as large: nothing
# says how sure it is.
LARGE_P90_PCT = 40.0
# Every run of those sets is a GPU run: on a CPU profile a family's GPU error says nothing (python -m harness.fidelity
# measures this machine against the model instead).
ON_CPU = "n/a on CPU (the validation runs are GPU runs; python -m harness.fidelity measures this machine)"


@functools.lru_cache(maxsize=1)
def load() -> dict:
    return json.loads(TABLE.read_text())


def of(family: str, device: str) -> dict | None:
    """The family's entry: {"all": ..., "playbook": ..., "published": ...}, each rows, median and p90 |error| (%),
    geomean ratio; None where no validation run is of that family, or on a CPU device."""
    entry = load()["families"].get(family) if device != "cpu" else None
    return entry if entry and entry["all"]["n"] else None


def large(family: str, device: str) -> bool:
    entry = of(family, device)
    return device != "cpu" and (entry is None or entry["all"]["p90_abs_err_pct"] > LARGE_P90_PCT)


def short(family: str, device: str) -> str:
    """`±38 % (p90 of tp+pp across nodes, 120 runs)`: the plan table's column."""
    entry = of(family, device)
    if entry is None:
        return "n/a on CPU" if device == "cpu" else f"unknown (no run of {family})"
    a = entry["all"]
    return f"±{a['p90_abs_err_pct']:.0f} % (p90 of {family}, {a['n']} runs)"


def line(family: str, device: str) -> str:
    """The family's error in full, by set: predict's line."""
    entry = of(family, device)
    if device == "cpu":
        return ON_CPU
    if entry is None:
        return f"{family}: no validation run of this layout family; how far off tokens/s may be is unknown (large)"
    a = entry["all"]
    sets = ", ".join(f"{name} {s['n']}" for name, s in entry.items() if name != "all" and s["n"])
    return (f"{family}: tokens/s off by median {a['median_abs_err_pct']:.0f} %, p90 {a['p90_abs_err_pct']:.0f} %, "
            f"geomean predicted / measured {a['geomean_ratio']:.2f}, over the {a['n']} validation runs of this layout "
            f"family ({sets})" + (f"; large (p90 over {LARGE_P90_PCT:.0f} %)" if large(family, device) else ""))


def run_top() -> dict:
    """{"k", "rule", "groups", "groups_found", "derivation", "per_group"}: the K plan recommends, how it was found."""
    return load()["run_top"]
