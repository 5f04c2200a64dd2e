"""Small HTML building blocks shared by the report's sections, and the collector of plotly figures."""
from __future__ import annotations

import itertools

from harness.labels import esc, ratio, ratio_class


class Figures:
    """Collects plotly figures (JSON) by id; a section places `div(...)` where the chart goes and
    the page's script draws it when it becomes visible (plotly sizes itself wrongly when hidden)."""

    def __init__(self):
        self.items: dict[str, str] = {}
        self._ids = itertools.count()

    def div(self, fig_json: str, name: str, css: str = "plot") -> str:
        fid = f"fig-{name}-{next(self._ids)}"
        self.items[fid] = fig_json
        return f'<div class="{css}" id="{fid}" data-fig="{fid}"></div>'


def table(headers: list[str], rows: list[list[str]], css: str = "", attrs: str = "") -> str:
    """rows hold HTML (already escaped); headers are escaped here."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(c if c.startswith("<td") else f"<td>{c}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f'<table class="{css}" {attrs}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def pair_cell(measured, predicted, formatter, key: str = "", warning: str | None = None) -> str:
    """A table cell: measured / predicted, with the ratio coloured (within 10% green, 50% amber); a warning
    on the measured figure (e.g. measured.mfu_warning) is marked "!" beside it and spelled out on hover."""
    r = ratio(measured, predicted)
    m, p = formatter(measured), formatter(predicted, none="not predicted")
    ratio_txt = f"{r:.2f}x" if r is not None else "-"
    data = f' data-key="{esc(key)}"' if key else ""
    flag = f' <span class="warn" title="{esc(warning)}">! {esc(warning)}</span>' if warning else ""
    return (f'<td class="pair"{data}><span class="meas">{esc(m)}{flag}</span>'
            f'<span class="pred">pred {esc(p)}</span>'
            f'<span class="ratio {ratio_class(r)}" title="measured / predicted">{esc(ratio_txt)}</span></td>')


def kv(rows: list[tuple[str, str]], css: str = "kv") -> str:
    return f'<dl class="{css}">' + "".join(f"<dt>{esc(k)}</dt><dd>{v}</dd>" for k, v in rows) + "</dl>"


def notice(text: str, command: str | None = None) -> str:
    cmd = f'<pre class="cmd"><code>{esc(command)}</code></pre>' if command else ""
    return f'<div class="notice"><p>{esc(text)}</p>{cmd}</div>'


def explain(sentences: list[str]) -> str:
    """The plain-language explanation of a mode: sentences already escaped / with inline markup."""
    return '<div class="explain">' + "".join(f"<p>{s}</p>" for s in sentences if s) + "</div>"


def num_span(text: str, key: str) -> str:
    """A number a test (or a reader's script) can find by its key."""
    return f'<b class="num" data-key="{esc(key)}">{esc(text)}</b>'


def selector(mode: str, runs: list, panels: list[str]) -> str:
    """Run picker for a mode with several candidate runs; one panel visible at a time."""
    if len(panels) == 1:
        return f'<div class="run-panel" data-mode="{mode}" data-index="0">{panels[0]}</div>'
    opts = "".join(f'<option value="{i}">{esc(r.label)} ({esc(r.status)})</option>' for i, r in enumerate(runs))
    body = "".join(f'<div class="run-panel" data-mode="{mode}" data-index="{i}"{"" if i == 0 else " hidden"}>{p}</div>'
                   for i, p in enumerate(panels))
    return (f'<label class="picker">config: <select class="run-select" data-mode="{mode}">{opts}</select></label>'
            f"{body}")
