"""Records as a pandas DataFrame: one row per record, nested fields flattened with dots.

    >>> from harness.results import load
    >>> df = load("results/scaling.jsonl")
    >>> df[["label", "dims.dp", "measured.tokens_per_s", "predicted.tokens_per_s"]]

Columns are the record's own keys (`run_id`, `status`, `config.workload.global_batch_size`,
`measured.step_time_s`, `predicted.step_time_s`, `fidelity.step_time_s`, ...; results/README.md says
what each means), plus `label` (the run named by what sets it apart from the others, as in the table
and the report). Lists (`measured.step_times_s`, `measured.losses`) stay one cell each. `latest=True`
keeps the latest record per run_id and repeat, as the report does (a re-run replaces the earlier attempt).
"""
from __future__ import annotations

from pathlib import Path

from harness.collect.aggregate import key as repeat_key
from harness.config import flatten
from harness.labels import labels
from harness.run import results_file

# Imports inside functions: pandas (only for harness.results).


def load(path: str | Path, latest: bool = True):
    """Read <results_dir>/<study>.jsonl (or several, a directory of them) into one flat DataFrame."""
    import pandas as pd

    path = Path(path)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files or not all(f.exists() for f in files):
        raise FileNotFoundError(f"no records at {path} (a <study>.jsonl file or a directory of them)")
    records = [r for f in files for r in results_file.read(f) if isinstance(r, dict) and "run_id" in r]
    if latest:  # per study: two studies may run the same config
        keep = {(r.get("study"), *repeat_key(r)): r for r in records}  # each repeat (repeats=N) its own row
        records = [r for r in records if keep[(r.get("study"), *repeat_key(r))] is r]
    rows = [{"label": lab, **{k: (None if v == {} else v) for k, v in flatten(r).items()}}
            for lab, r in zip(labels(records), records)]
    return pd.DataFrame(rows)
