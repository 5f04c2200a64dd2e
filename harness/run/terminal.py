"""What the parent prints on the terminal: one line per ended run and the results table."""
from __future__ import annotations

import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from harness.collect.aggregate import MFU_EXCEEDED, config_records
from harness.config import GiB
from harness.labels import ci_text, labels, nbytes
from harness.run.record import Status

# Wide enough for the results table when output goes to a file or CI log (80 columns otherwise).
console = Console(stderr=True, width=None if sys.stderr.isatty() else 140)


def print_summary(record: dict, label: str) -> None:
    """One line per ended run: its status, what it was, and its figures or its error."""
    m = record.get("measured") or {}
    if record["status"] != Status.OK:
        detail = escape(" ".join((record.get("error") or "").split())[:300])
    elif m.get("kind") == "dryrun":  # launcher=dryrun: memory only (harness/collect/dryrun.py)
        p = record.get("predicted") or {}
        ranks = m["dryrun_ranks"]
        shown = f"{ranks}" if len(ranks) <= 8 else f"[{ranks[0]} ... {ranks[-1]}]"
        stands_for = sum(m.get("dryrun_rank_stands_for") or [1] * len(ranks))
        detail = (f"dry run of {len(ranks)} rank(s) {shown} standing for {stands_for} of {m['world_size']}: model states {m['model_states_bytes'] / GiB:.2f} GiB "
                  f"(predicted {p.get('model_states_bytes', 0) / GiB:.2f}), peak {m.get('peak_mem_bytes', 0) / GiB:.2f} "
                  f"GiB (predicted {p.get('peak_mem_bytes', 0) / GiB:.2f}) per rank")
    else:
        detail = f"step {m['step_time_s']:.3f} s, {m['tokens_per_s']:.0f} tokens/s"
    style = STATUS_STYLE[record["status"]]
    console.print(f"[{style}]{record['status']:>7}[/] {escape(label)} [dim]{record['run_id']}[/] {detail}")


STATUS_STYLE = {Status.OK: "green", Status.INVALID: "yellow", Status.FAILED: "red", Status.TIMEOUT: "red",
                Status.OOM: "magenta", Status.DIVERGED: "red", Status.INTERRUPTED: "red"}


def results_table(records: list[dict], title: str, names: list[str] | None = None) -> Table:
    """names: what to call each run (default: labels that tell the records apart, one row per config). A
    config run several times (repeats=N) is one row: its repeats' pooled median and 95 % interval."""
    if names is None:
        records = config_records(records)
    t = Table(title=title, title_justify="left", header_style="bold")
    for col in ("run", "batch", "step s", "pred s", "tokens/s", "95% CI", "n", "MFU %", "states/rank", "pred",
                "status"):
        t.add_column(col, justify="left" if col in ("run", "status") else "right", no_wrap=col != "status")
    for r, label in zip(records, names or labels(records)):
        m, p = r.get("measured") or {}, r.get("predicted") or {}
        status = r["status"]
        note = "" if status == Status.OK else f" {escape((r.get('error') or '')[:90])}"
        batch = (r.get("config") or {}).get("workload", {}).get("global_batch_size")  # tells weak from strong scaling
        t.add_row(escape(label), _fmt(batch, "{}"),
                  _fmt(m.get("step_time_s"), "{:.3f}"), _fmt(p.get("step_time_s"), "{:.3f}"),
                  _fmt(m.get("tokens_per_s"), "{:.0f}"), ci_text(m.get("tokens_per_s_ci95")),
                  str(r.get("repeats", 1)), _mfu(m),
                  nbytes(m.get("model_states_bytes"), "-"), nbytes(p.get("model_states_bytes"), "-"),
                  f"[{STATUS_STYLE[status]}]{status}[/]{note}")
    exceeded = sorted({str(((r.get("config") or {}).get("hardware") or {}).get("name")) for r in records
                       if (r.get("measured") or {}).get("mfu_warning")})
    if exceeded:
        t.caption = (f"MFU % marked !: above 100 %, {MFU_EXCEEDED} (python -m harness.calibrate; the profile: "
                     f"hardware={', '.join(exceeded)})")
        t.caption_justify = "left"
    return t


def _mfu(m: dict) -> str:
    """MFU %, marked when it exceeds the profile's rate (measured.mfu_warning)."""
    return _fmt(m.get("mfu_pct"), "{:.1f}") + (" [yellow]![/]" if m.get("mfu_warning") else "")


def _fmt(x, spec: str) -> str:
    return "-" if x is None else spec.format(x)


def print_table(records: list[dict], title: str, console: Console | None = None, names: list[str] | None = None) -> None:
    (console or Console()).print(results_table(records, title, names))
