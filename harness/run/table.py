"""The results table printed at the end of a run or a study (rich); runs named by harness/labels.py.
A config run several times (repeats=N) is one row: its repeats' pooled median and 95 % interval."""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from harness.collect.repeats import config_records
from harness.labels import labels
from harness.report.fmt import ci_text, nbytes

STATUS_STYLE = {"ok": "green", "invalid": "yellow", "failed": "red", "timeout": "red", "oom": "magenta"}


def results_table(records: list[dict], title: str, names: list[str] | None = None) -> Table:
    """names: what to call each run (default: labels that tell the records apart, one row per config)."""
    if names is None:
        records = config_records(records)
    t = Table(title=title, title_justify="left", header_style="bold")
    for col in ("run", "batch", "step s", "pred s", "tokens/s", "95% CI", "n", "MFU %", "states/rank", "pred", "status"):
        t.add_column(col, justify="left" if col in ("run", "status") else "right", no_wrap=col != "status")
    for r, label in zip(records, names or labels(records)):
        m, p = r.get("measured") or {}, r.get("predicted") or {}
        status = r["status"]
        note = "" if status == "ok" else f" {escape((r.get('error') or '')[:90])}"
        batch = (r.get("config") or {}).get("workload", {}).get("global_batch_size")  # tells weak from strong scaling
        t.add_row(escape(label), _fmt(batch, "{}"),
                  _fmt(m.get("step_time_s"), "{:.3f}"), _fmt(p.get("step_time_s"), "{:.3f}"),
                  _fmt(m.get("tokens_per_s"), "{:.0f}"), ci_text(m.get("tokens_per_s_ci95")),
                  str(r.get("repeats", 1)), _fmt(m.get("mfu_pct"), "{:.1f}"),
                  nbytes(m.get("model_states_bytes"), "-"), nbytes(p.get("model_states_bytes"), "-"),
                  f"[{STATUS_STYLE.get(status, 'white')}]{status}[/]{note}")
    return t


def _fmt(x, spec: str) -> str:
    return "-" if x is None else spec.format(x)


def print_table(records: list[dict], title: str, console: Console | None = None, names: list[str] | None = None) -> None:
    (console or Console()).print(results_table(records, title, names))
