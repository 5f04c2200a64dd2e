"""How sure a prediction is: the validation error of its layout family (harness/dims.py `family`), as
family_errors.json holds it. `python -m lab.playbook_doc` (with docs/playbook.md; alone: `python -m
lab.family_errors --write`) generates that file from the sets in lab/ (the Playbook sweep's development half and
the published set's fitting half); the harness reads the committed file and never imports lab/. `predict` prints a config's family error and `plan` each layout's; where a top
layout's family error is large (LARGE_P90_PCT), `plan` says so and recommends `--run-top K` with the table's K.

The same table holds each family's memory margin: how far its validation runs' measured peak exceeded the predicted
one (the p90 of measured / predicted - 1). A planner that ranked a layout whose predicted peak is just under the
device's memory would recommend what runs out of memory about as often as its family's predictions run low, so
`plan` (and the group verdicts of lab/playbook.py, which score it) ranks only the layouts whose predicted peak fits
`memory_limit`: the device's memory less that margin. `predict` still says whether the peak itself fits.
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


def memory_margin(family: str, device: str, table: dict | None = None) -> float:
    """The fraction the family's predicted peak may be low by (module docstring): its rows' margin, else every
    family's (`memory_all`) where it has no memory row; 0 on a CPU device (the validation runs are GPU runs).
    table: a table as lab/family_errors.py computes it (None: the committed one)."""
    if device == "cpu":
        return 0.0
    t = load() if table is None else table
    entry = (t["families"].get(family) or {}).get("memory")
    return (entry if entry and entry["n"] else t["memory_all"])["margin_pct"] / 100


def memory_limit(memory_bytes: float, family: str, device: str, table: dict | None = None) -> float:
    """The largest predicted peak `plan` ranks on a device of memory_bytes: peak x (1 + margin) <= the device."""
    return memory_bytes / (1 + memory_margin(family, device, table))


def run_top() -> dict:
    """{"k", "rule", "groups", "groups_found", "derivation", "per_group"}: the K plan recommends, how it was found."""
    return load()["run_top"]
