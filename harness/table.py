"""The results table printed at the end of a run or a study (rich)."""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

STATUS_STYLE = {"ok": "green", "invalid": "yellow", "failed": "red", "timeout": "red", "oom": "magenta"}


def human_bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _pair(measured, predicted, fmt) -> str:
    m = fmt(measured) if measured is not None else "-"
    if predicted is None:
        return m
    return f"{m} / {fmt(predicted)}"


def degrees(dims: dict) -> str:
    return " ".join(f"{k}{v}" for k, v in dims.items() if k != "world_size" and v > 1) or "1"


def results_table(records: list[dict], title: str) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold")
    for col, just in (("strategy", "left"), ("engine", "left"), ("degrees", "left"), ("world", "right"),
                      ("step s meas / pred", "right"), ("tokens/s", "right"), ("MFU %", "right"),
                      ("model states/rank meas / pred", "right"), ("status", "left")):
        t.add_column(col, justify=just)
    for r in records:
        m, p = r.get("measured") or {}, r.get("predicted") or {}
        status = r["status"]
        note = "" if status == "ok" else f" {escape((r.get('error') or '')[:70])}"
        t.add_row(r.get("strategy") or "?", (r.get("config") or {}).get("strategy", {}).get("engine", "?"),
                  degrees(r.get("dims") or {}), str((r.get("dims") or {}).get("world_size", "-")),
                  _pair(m.get("step_time_s"), p.get("step_time_s"), lambda x: f"{x:.3f}"),
                  f"{m['tokens_per_s']:.0f}" if m.get("tokens_per_s") else "-",
                  f"{m['mfu_pct']:.1f}" if m.get("mfu_pct") is not None else "-",
                  _pair(m.get("model_states_bytes"), p.get("model_states_bytes"), human_bytes),
                  f"[{STATUS_STYLE.get(status, 'white')}]{status}[/]{note}")
    return t


def print_table(records: list[dict], title: str, console: Console | None = None) -> None:
    (console or Console()).print(results_table(records, title))
