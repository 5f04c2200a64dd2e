"""The results table printed at the end of a run or a study (rich)."""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from harness.report.fmt import nbytes

STATUS_STYLE = {"ok": "green", "invalid": "yellow", "failed": "red", "timeout": "red", "oom": "magenta"}


def degrees(dims: dict) -> str:
    return " ".join(f"{k}{v}" for k, v in dims.items() if k != "world_size" and v > 1) or "1"


def strategy_label(r: dict) -> str:
    engine = (r.get("config") or {}).get("strategy", {}).get("engine", "torch")
    name = r.get("strategy") or "?"
    return f"{name} (ds)" if engine == "deepspeed" else str(name)


def results_table(records: list[dict], title: str) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold")
    for col in ("strategy", "degrees", "batch", "step s", "pred s", "tokens/s", "MFU %", "states/rank", "pred",
                "status"):
        t.add_column(col, justify="left" if col in ("strategy", "degrees", "status") else "right",
                     no_wrap=col != "status")
    for r in records:
        m, p = r.get("measured") or {}, r.get("predicted") or {}
        status = r["status"]
        note = "" if status == "ok" else f" {escape((r.get('error') or '')[:90])}"
        batch = (r.get("config") or {}).get("workload", {}).get("global_batch_size")  # tells weak from strong scaling
        t.add_row(strategy_label(r), degrees(r.get("dims") or {}), _fmt(batch, "{}"),
                  _fmt(m.get("step_time_s"), "{:.3f}"), _fmt(p.get("step_time_s"), "{:.3f}"),
                  _fmt(m.get("tokens_per_s"), "{:.0f}"), _fmt(m.get("mfu_pct"), "{:.1f}"),
                  nbytes(m.get("model_states_bytes"), "-"), nbytes(p.get("model_states_bytes"), "-"),
                  f"[{STATUS_STYLE.get(status, 'white')}]{status}[/]{note}")
    return t


def _fmt(x, spec: str) -> str:
    return "-" if x is None else spec.format(x)


def print_table(records: list[dict], title: str, console: Console | None = None) -> None:
    (console or Console()).print(results_table(records, title))
