"""`python -m harness.compare A.jsonl B.jsonl [--threshold PCT]`: did B get slower than A, and is it real?

Runs are matched by config (run_id: the config less what does not change what is measured; never the
environment), so a study rerun after a torch, NCCL or driver upgrade, on another cluster or on a new
commit compares run for run; a run slowed on purpose (slow_step_pct, its own run_id) is matched with the
clean config it slows, and said to be. For each config:

    tokens/s of A and B       median and bootstrap 95 % interval over the config's repeats and steps
    ratio B/A                 with its own bootstrap 95 % interval (A and B resampled independently)
    verdict                   with MIN_REPEATS ok repeats a side or more: slower when the whole interval
                              lies below 1 - PCT/100, faster above 1 + PCT/100, same otherwise (within
                              noise, or within the threshold); with fewer, `same (not enough repeats to
                              tell)` and the repeats it needs, as one run's steps say nothing of run-to-run
                              variance, the largest noise on a shared machine
    memory                    peak and model-state bytes, any change in exact bytes

then what differs between the two environments (harness/collect/aggregate.py), and the configs only one side
ran. Exit status: 1 if any config is slower (a CI job can gate on it), 0 otherwise, 2 for bad input.
The model is pyperf's compare_to and asv's regression check; the noise model (the bootstrap, repeats) is
harness/collect/aggregate.py.
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from harness.collect import aggregate
from harness.collect.environment import COMPARED
from harness.labels import ci_text, labels, nbytes
from harness.run import results_file
from harness.run.record import Status

DEFAULT_THRESHOLD_PCT = 5.0
MEMORY_KEYS = ("peak_mem_bytes", "model_states_bytes")

# A verdict needs run-to-run variance inside its interval, so repeats on both sides. Were nothing changed,
# every ordering of the 2n repeats' levels would be equally likely, and the chance that all n of B's land
# slower than all n of A's is 1/C(2n, n): 1/2 at one repeat a side, 1/6 at two, 1/20 at three. At three a
# side the two-level bootstrap's interval spans about the extreme repeats (harness/collect/aggregate.py), so
# noise alone says `slower` only through such an ordering, beyond the threshold as well: at most the 5 %
# the 95 % interval leaves to chance. asv's statistics.is_different trusts its rank test only where the
# least p-value it can return, 1/C(n + m, min(n, m)), is under its threshold, for the same reason.
MIN_REPEATS = next(n for n in itertools.count(1) if math.comb(2 * n, n) * (100 - aggregate.CONFIDENCE) >= 100)
NOT_ENOUGH_REPEATS = "not enough repeats to tell"


def verdict(lo: float, hi: float, threshold_pct: float) -> str:
    """slower / faster when the ratio's whole 95 % interval lies beyond the threshold, else same."""
    t = threshold_pct / 100
    if hi < 1 - t:
        return "slower"
    if lo > 1 + t:
        return "faster"
    return "same"


def pairs(a: dict[str, list[dict]], b: dict[str, list[dict]]) -> list[tuple[str | None, str | None]]:
    """(A's run_id, B's run_id) of each config either side ran, None on the side that lacks it: the same
    run_id, else a run slowed on purpose beside the clean config it slows (aggregate.compared_id); A's
    order, then B's own."""
    match = {i: aggregate.compared_id(side[i][-1]) for side in (a, b) for i in side}
    out, taken = [], set()
    for i in a:
        j = i if i in b else next((j for j in b if j not in a and j not in taken and match[j] == match[i]), None)
        taken.add(j)
        out.append((i, j))
    return out + [(None, j) for j in b if j not in a and j not in taken]


@dataclass
class Row:
    run_id: str
    label: str
    a: dict | None  # the config's record on each side (aggregate.config_record)
    b: dict | None
    ratio: tuple[float, float, float] | None = None  # tokens/s B/A, lo, hi
    verdict: str = ""  # slower | faster | same | "" (not comparable: see note)
    note: str = ""
    repeats_ok: tuple[int, int] = (0, 0)  # A's and B's ok repeats with step times
    why_same: str = ""  # NOT_ENOUGH_REPEATS where the verdict is `same` for want of repeats
    memory: list[str] = field(default_factory=list)  # "peak_mem_bytes 1,234 -> 1,240 B (+6 B)"


def compare_configs(a: dict[str, list[dict]], b: dict[str, list[dict]], threshold_pct: float) -> list[Row]:
    """A row per config either side ran (A's order, then B's own); a and b: aggregate.by_config."""
    ids = pairs(a, b)
    shown = [aggregate.config_record(a[i] if i else b[j]) for i, j in ids]
    rows = []
    for (i, j), label in zip(ids, labels(shown)):
        ra, rb = (aggregate.config_record(side[k]) if k else None for side, k in ((a, i), (b, j)))
        row = Row(i or j, label, ra, rb)
        rows.append(row)
        if ra is None or rb is None:
            row.note = f"only in {'A' if rb is None else 'B'}"
            continue
        ga, gb = aggregate.step_groups(a[i]), aggregate.step_groups(b[j])
        if not ga or not gb:
            row.note = f"not comparable: A {ra['status']}, B {rb['status']}"
            continue
        # tokens per step is the config's, so tokens/s B/A = median step A / median step B
        row.ratio = aggregate.ratio_ci(gb, ga)
        row.repeats_ok = (len(ga), len(gb))
        if min(row.repeats_ok) < MIN_REPEATS:
            row.verdict, row.why_same = "same", NOT_ENOUGH_REPEATS
        else:
            row.verdict = verdict(row.ratio[1], row.ratio[2], threshold_pct)
        for k in MEMORY_KEYS:
            x, y = ra["measured"].get(k), rb["measured"].get(k)
            if x != y:
                diff = f" ({y - x:+,} B)" if isinstance(x, int) and isinstance(y, int) else ""
                row.memory.append(f"{k} {nbytes(x, '-')} -> {nbytes(y, '-')}{diff}")
    return rows


def needs(row: Row) -> str:
    """What a row without enough repeats lacks, and the command that fills it in."""
    (na, nb), plural = row.repeats_ok, lambda n: "repeat" if n == 1 else "repeats"
    return (f"A has {na} ok {plural(na)}, B {nb}; a verdict needs {MIN_REPEATS} a side: run each study again with "
            f"repeats={MIN_REPEATS} (a resumed study runs only the repeats it lacks)")


def env_differences(a: list[dict], b: list[dict]) -> list[tuple[str, str, str]]:
    """(field, A's values, B's values) for every fingerprint field whose values differ between the sides."""
    def values(records, key):
        seen = dict.fromkeys(str((r.get("env") or {}).get(key)) for r in records if r.get("status") == Status.OK)
        return ", ".join(seen) or "-"

    out = []
    for key in COMPARED:
        va, vb = values(a, key), values(b, key)
        if va != vb:
            out.append((key, va, vb))
    return out


def _read(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"no records file at {path}")
    records = aggregate.latest(results_file.read(path))
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.compare", description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="the baseline records file (<results_dir>/<study>.jsonl)")
    ap.add_argument("b", type=Path, help="the records file to compare with it")
    ap.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD_PCT,
                    help="a change smaller than this %% of tokens/s is `same` (default %(default)s)")
    args = ap.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 160, highlight=False)
    if not 0 <= args.threshold < 100:
        console.print(f"--threshold {args.threshold}: a percentage of tokens/s in [0, 100)")
        return 2
    try:
        a, b = _read(args.a), _read(args.b)
    except (OSError, ValueError) as e:
        console.print(escape(str(e)))
        return 2
    rows = compare_configs(aggregate.by_config(a), aggregate.by_config(b), args.threshold)
    t = Table(title=f"{args.b} vs {args.a} (threshold {args.threshold:g} %)", title_justify="left",
              header_style="bold")
    for col in ("run", "A tokens/s", "A 95% CI", "n", "B tokens/s", "B 95% CI", "n", "B/A", "B/A 95% CI", "verdict"):
        t.add_column(col, justify="left" if col in ("run", "verdict") else "right")
    style = {"slower": "red", "faster": "green", "same": "white"}
    for r in rows:
        side = []
        for x in (r.a, r.b):
            m = (x or {}).get("measured") or {}
            side += [f"{m['tokens_per_s']:,.0f}" if m.get("tokens_per_s") else "-",
                     ci_text(m.get("tokens_per_s_ci95")), str(x.get("repeats", 1)) if x else "-"]
        ratio = ("-", "-") if r.ratio is None else (f"{r.ratio[0]:.3f}", f"{r.ratio[1]:.3f}-{r.ratio[2]:.3f}")
        said = f"{r.verdict} ({r.why_same})" if r.why_same else r.verdict
        v = f"[{style[r.verdict]}]{said}[/]" if r.verdict else f"[yellow]{escape(r.note)}[/]"
        t.add_row(escape(r.label), *side, *ratio, v)
    console.print(t)
    for r in rows:
        for line in r.memory:
            console.print(f"memory changed: {escape(r.label)}: {escape(line)}")
    diffs = env_differences(a, b)
    for key, va, vb in diffs:
        console.print(f"environment differs: {key}: A {escape(va)} | B {escape(vb)}")
    if not diffs:
        console.print(f"environment: the same in {', '.join(COMPARED)}")
    for r in rows:
        if r.note.startswith("only in"):
            console.print(f"{r.note}: {escape(r.label)} ({r.run_id})")
    for r in rows:
        slowed = [f"{side} {x['slowed_on_purpose']['slow_step_pct']:g} %" for side, x in (("A", r.a), ("B", r.b))
                  if x and x.get("slowed_on_purpose")]
        if slowed:
            console.print(f"slowed on purpose (slow_step_pct): {escape(r.label)}: {', '.join(slowed)}")
    for r in rows:
        if r.why_same:
            console.print(f"{r.why_same}: {escape(r.label)}: {needs(r)}")
    slower = [r for r in rows if r.verdict == "slower"]
    counts = {v: sum(r.verdict == v for r in rows) for v in ("slower", "faster", "same")}
    untold = sum(bool(r.why_same) for r in rows)
    same = f"{counts['same']} same" + (f" ({untold} {NOT_ENOUGH_REPEATS})" if untold else "")
    console.print(f"{counts['slower']} slower, {counts['faster']} faster, {same}, "
                  f"{len(rows) - sum(counts.values())} not compared; exit {1 if slower else 0}")
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())
