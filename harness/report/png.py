"""PNG versions of the key charts (matplotlib, Agg backend: no display needed), for docs and W&B.

Same series as the HTML page (harness.report.charts). Each function writes one file and returns its
path, or None when the study has no data for that chart.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from harness.config import MiB  # noqa: E402
from harness.report.charts import ACTION_COLOURS, AXIS_COLOURS, PART_COLOURS, STRATEGY_COLOURS  # noqa: E402

DPI = 110


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def scaling(series: dict | None, path: Path) -> Path | None:
    if not series:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, s in enumerate(series["series"]):
        c = STRATEGY_COLOURS[i % len(STRATEGY_COLOURS)]
        name = s["name"] if s["name"] == s["kind"] else f"{s['name']} ({s['kind']})"
        a.plot(s["ideal"]["devices"], s["ideal"]["tokens_per_s"], "--", color=c, lw=1)
        a.plot(s["devices"], s["tokens_per_s"], "o-", color=c, label=name)
        b.plot(s["devices"], [100 * e for e in s["efficiency"]], "o-", color=c, label=name)
        if s["fit"]:
            f = s["fit"]
            fit_name = f"{f['law']} f = {f['serial_fraction']:.3f}"
            a.plot(f["devices"], f["tokens_per_s"], ":", color=c, label=fit_name)
            b.plot(f["devices"], [100 * e for e in f["efficiency"]], ":", color=c, label=fit_name)
    ns = list(range(1, series["max_devices"] + 1))
    b.plot(ns, [100] * len(ns), "--", color="#888", label="ideal")
    a.set(title="Throughput vs devices (dashed: ideal)", xlabel="devices", ylabel="tokens/s")
    b.set(title="Scaling efficiency per series", xlabel="devices", ylabel="efficiency %")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_xticks(ns)
    return _save(fig, path)


def _measured_vs_predicted_bars(labels: list[str], stacks: dict, title: str, ylabel: str, path: Path) -> Path:
    """Two stacked bars per label, measured (solid) beside predicted (hatched).
    stacks: {side: [(name, colour, values per label)]}; a stack with no value is left out."""
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(labels) + 2), 4))
    width = 0.38
    drawn = False
    for k, (side, hatch) in enumerate((("measured", ""), ("predicted", "//"))):
        bottom = [0.0] * len(labels)
        xs = [i + (k - 0.5) * width for i in range(len(labels))]
        for name, colour, ys in stacks[side]:
            if not any(ys):
                continue
            ax.bar(xs, ys, width, bottom=bottom, color=colour, hatch=hatch, edgecolor="#333", linewidth=0.5,
                   label=f"{name} ({side})")
            bottom = [b + y for b, y in zip(bottom, ys)]
            drawn = True
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set(title=title, ylabel=ylabel)
    if drawn:
        ax.legend(fontsize=7, ncol=2)
    else:  # e.g. communication in a study of single-device runs: every value is 0
        ax.text(0.5, 0.5, "every value is 0 or not recorded", ha="center", va="center", transform=ax.transAxes)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def memory(series: dict | None, path: Path) -> Path | None:
    if not series:
        return None
    stacks = {side: [(part[:-6], PART_COLOURS[part], [v / MiB if v is not None else 0.0 for v in values])
                     for part, values in series[side].items() if any(v is not None for v in values)]
              for side in ("measured", "predicted")}
    return _measured_vs_predicted_bars(series["labels"], stacks,
                                       "Memory per device: measured (solid) vs predicted (hatched)",
                                       "MiB (max over ranks)", path)


def comm(series: dict | None, path: Path) -> Path | None:
    if not series:
        return None
    rows = series["rows"]
    stacks = {side: [(axis, AXIS_COLOURS.get(axis, AXIS_COLOURS["other"]),
                      [((r[side] or {}).get(axis) or 0.0) for r in rows]) for axis in series["axes"]]
              for side in ("measured", "predicted")}
    return _measured_vs_predicted_bars([r["label"] for r in rows], stacks,
                                       "Communication share of the step by axis", "% of step time", path)


def _gantt(ax, series: dict, title: str, unit: str) -> None:
    n = series["ranks"]
    idle = series["idle"]
    for r, s, d in zip(idle["rank"], idle["start"], idle["dur"]):
        ax.barh(n - 1 - r, d, left=s, color="#ccc", hatch="xx", edgecolor="#aaa", linewidth=0)
    for action, s in series["actions"].items():
        for r, start, d, text in zip(s["rank"], s["start"], s["dur"], s["text"]):
            ax.barh(n - 1 - r, d, left=start, color=ACTION_COLOURS[action], edgecolor="white", linewidth=0.5)
            if d > series["end"] / 60:
                ax.text(start + d / 2, n - 1 - r, text, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(n), series["labels"][::-1])
    ax.set(title=title, xlabel=unit)


def pipeline(predicted: dict | None, measured: dict | None, titles: tuple[str, str], path: Path) -> Path | None:
    panels = [(s, t, u) for s, t, u in ((predicted, titles[0], "time (F = 1 unit)"), (measured, titles[1], "ms"))
              if s]
    if not panels:
        return None
    n = max(s["ranks"] for s, _, _ in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.2 + 0.9 * n * len(panels)), squeeze=False)
    for ax, (s, t, u) in zip(axes[:, 0], panels):
        _gantt(ax, s, t, u)
    handles = [plt.Rectangle((0, 0), 1, 1, color=ACTION_COLOURS[a]) for a in ("F", "B", "W")]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="#ccc", hatch="xx", edgecolor="#aaa"))
    fig.legend(handles, ["forward", "backward", "weight grad", "idle (bubble)"], loc="upper right", fontsize=7,
               ncol=4)
    return _save(fig, path)
