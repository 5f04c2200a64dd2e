"""Plotly figures of the report's chart series (harness.report.charts), as JSON strings for the page."""
from __future__ import annotations

import plotly.graph_objects as go
import plotly.io as pio

from harness.config import MiB
from harness.report.charts import ACTION_COLOURS, AXIS_COLOURS, KIND_COLOURS, PART_COLOURS, STRATEGY_COLOURS

LAYOUT = dict(template="plotly_white", margin=dict(l=60, r=20, t=50, b=50), height=360,
              font=dict(family="system-ui, -apple-system, Segoe UI, sans-serif", size=12),
              legend=dict(orientation="h", y=-0.2))
ACTION_NAMES = {"F": "forward", "B": "backward", "W": "weight grad"}


def to_json(fig: go.Figure) -> str:
    return pio.to_json(fig, validate=False, pretty=False)


def scaling(series: dict) -> tuple[go.Figure, go.Figure]:
    """Throughput and efficiency vs devices: one colour per series, its ideal line dashed, its fitted
    law dotted."""
    tput, eff = go.Figure(), go.Figure()
    for i, s in enumerate(series["series"]):
        colour = STRATEGY_COLOURS[i % len(STRATEGY_COLOURS)]
        name = s["name"] if s["name"] == s["kind"] else f"{s['name']} ({s['kind']})"
        tput.add_trace(go.Scatter(x=s["ideal"]["devices"], y=s["ideal"]["tokens_per_s"], mode="lines",
                                  name=f"{name}: ideal", line=dict(dash="dash", color=colour, width=1)))
        tput.add_trace(go.Scatter(x=s["devices"], y=s["tokens_per_s"], mode="lines+markers", name=name,
                                  text=s["labels"], hovertemplate="%{text}<br>%{y:.0f} tokens/s<extra></extra>",
                                  line=dict(color=colour), marker=dict(size=9)))
        eff.add_trace(go.Scatter(x=s["devices"], y=[100 * e for e in s["efficiency"]], mode="lines+markers",
                                 name=name, text=s["labels"], hovertemplate="%{text}<br>%{y:.1f} %<extra></extra>",
                                 line=dict(color=colour), marker=dict(size=9)))
        if s["fit"]:
            f = s["fit"]
            fit_name = f"{s['name']}: {f['law']} fit, f = {f['serial_fraction']:.3f}"
            tput.add_trace(go.Scatter(x=f["devices"], y=f["tokens_per_s"], mode="lines", name=fit_name,
                                      line=dict(dash="dot", color=colour)))
            eff.add_trace(go.Scatter(x=f["devices"], y=[100 * e for e in f["efficiency"]], mode="lines",
                                     name=fit_name, line=dict(dash="dot", color=colour)))
    ns = list(range(1, series["max_devices"] + 1))
    eff.add_trace(go.Scatter(x=ns, y=[100.0] * len(ns), mode="lines", name="ideal (100 %)",
                             line=dict(dash="dash", color="#888")))
    tput.update_layout(**LAYOUT, title="Throughput vs devices, per series", xaxis_title="devices (world size)",
                       yaxis_title="tokens/s")
    eff.update_layout(**LAYOUT, title="Scaling efficiency vs devices, per series (each against its smallest run)",
                      xaxis_title="devices (world size)", yaxis_title="efficiency %")
    for fig in (tput, eff):
        fig.update_xaxes(dtick=1)
    return tput, eff


def paired_stacks(labels: list[str], stacks: dict, title: str, yaxis_title: str, hover: str) -> go.Figure:
    """Two stacked bars per label, measured (solid) beside predicted (hatched); stacks: {side: [(name,
    colour, values per label)]}, a stack with no value left out; hover formats a value (%{y:...})."""
    fig = go.Figure()
    for side, pattern in (("measured", ""), ("predicted", "/")):
        base = [0.0] * len(labels)
        for name, colour, ys in stacks[side]:
            if not any(ys):
                continue
            fig.add_trace(go.Bar(x=labels, y=ys, base=base[:], offsetgroup=side, name=f"{name} ({side})",
                                 legendgroup=side, marker=dict(color=colour, pattern_shape=pattern,
                                                               line=dict(width=0.5, color="#333")),
                                 hovertemplate="%{x}<br>" + f"{side} {name}: {hover}<extra></extra>"))
            base = [b + y for b, y in zip(base, ys)]
    fig.update_layout(**LAYOUT, barmode="group", title=title, yaxis_title=yaxis_title)
    return fig


def memory(series: dict) -> go.Figure:
    stacks = {side: [(part[:-6], PART_COLOURS[part], [v / MiB if v is not None else 0.0 for v in values])
                     for part, values in series[side].items()] for side in ("measured", "predicted")}
    return paired_stacks(series["labels"], stacks, "Memory per device: measured (solid) vs predicted (hatched)",
                         "MiB (max over ranks)", "%{y:.2f} MiB")


def comm(series: dict) -> go.Figure:
    rows = series["rows"]
    stacks = {side: [(axis, AXIS_COLOURS.get(axis, AXIS_COLOURS["other"]), [((r[side] or {}).get(axis) or 0.0)
                                                                             for r in rows]) for axis in series["axes"]]
              for side in ("measured", "predicted")}
    return paired_stacks([r["label"] for r in rows], stacks,
                         "Communication share of the step by axis: measured (solid) vs predicted (hatched)",
                         "% of step time", "%{y:.1f}% of step")


def compute(series: dict) -> go.Figure:
    rows = series["rows"]
    stacks = {side: [(kind, KIND_COLOURS[kind], [((r[side] or {}).get(kind) or 0.0) for r in rows])
                     for kind in series["kinds"]] for side in ("measured", "predicted")}
    return paired_stacks([r["label"] for r in rows], stacks,
                         "Compute by kind of work: measured (solid) vs predicted (hatched)",
                         "% of compute time", "%{y:.1f}% of compute")


def gantt(series: dict, title: str, unit: str) -> go.Figure:
    fig = go.Figure()
    rows = series["labels"]
    idle = series["idle"]
    if idle["rank"]:
        fig.add_trace(go.Bar(y=[rows[r] for r in idle["rank"]], x=idle["dur"], base=idle["start"],
                             orientation="h", name="idle (bubble)", marker=dict(color=ACTION_COLOURS["idle"],
                                                                                pattern_shape="x"),
                             hovertemplate="idle %{x:.3g} " + unit + "<extra></extra>"))
    for action, s in series["actions"].items():
        fig.add_trace(go.Bar(y=[rows[r] for r in s["rank"]], x=s["dur"], base=s["start"], orientation="h",
                             name=ACTION_NAMES[action], text=s["text"], textposition="inside",
                             insidetextanchor="middle", marker=dict(color=ACTION_COLOURS[action],
                                                                    line=dict(width=0.5, color="#fff")),
                             hovertemplate=ACTION_NAMES[action] + " of micro-batch %{text}<br>"
                             "%{base:.3g} - %{x:.3g} " + unit + "<extra></extra>"))
    # legend above the plot: below it, it would collide with the axis title of a short chart
    fig.update_layout(**{**LAYOUT, "height": 150 + 45 * series["ranks"], "margin": dict(l=60, r=20, t=80, b=45),
                         "legend": dict(orientation="h", y=1.0, yanchor="bottom", x=1, xanchor="right")},
                      barmode="overlay", title=dict(text=title, y=0.97, yanchor="top"), xaxis_title=unit, bargap=0.25)
    fig.update_yaxes(categoryorder="array", categoryarray=rows[::-1])
    return fig
