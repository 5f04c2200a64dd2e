"""The report's charts as data: each function returns the series of one chart, which `figures` turns
into plotly figures (the HTML page) and `png` into matplotlib images (docs, W&B), so both show the
same numbers.
"""
from __future__ import annotations

from harness.collect.compute_classes import CLASSES
from harness.costmodel.schedule import idle_intervals
from harness.dims import COMM_AXES
from harness.report import scaling
from harness.report.study import MEMORY_PARTS, Study
from harness.run.record import Status

ACTION_COLOURS = {"F": "#4e79a7", "B": "#f28e2b", "W": "#b07aa1", "idle": "rgba(160,160,160,0.35)"}
PART_COLOURS = {"params_bytes": "#4e79a7", "grads_bytes": "#f28e2b", "optimizer_bytes": "#59a14f",
                "activations_bytes": "#e15759"}
AXIS_COLOURS = {"dp": "#4e79a7", "tp": "#e15759", "pp": "#59a14f", "ep": "#b07aa1", "other": "#9c9c9c"}
KIND_COLOURS = {"attention": "#b07aa1", "gemm": "#4e79a7", "optimizer": "#59a14f", "elementwise": "#edc948"}
STRATEGY_COLOURS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
                    "#9c755f", "#bab0ac"]


def scaling_series(study: Study) -> dict | None:
    """Per series (report/scaling.py): the measured points, the ideal line from its baseline, and the
    fitted law's curve; None when no series has two device counts."""
    found = scaling.series(study)
    if not found:
        return None
    out = {"series": []}
    for s in found:
        per_device = s.baseline_tokens_per_s_per_device
        ns = [p.devices for p in s.points]
        row = {"name": s.name, "kind": s.kind, "baseline_label": s.baseline_label,
               "devices": ns, "tokens_per_s": [p.tokens_per_s for p in s.points],
               "speedup": [p.speedup for p in s.points], "efficiency": [p.efficiency for p in s.points],
               "karp_flatt": [p.karp_flatt for p in s.points], "run_id": [p.run_id for p in s.points],
               "labels": [p.label for p in s.points],
               "ideal": {"devices": [ns[0], ns[-1]], "tokens_per_s": [per_device * ns[0], per_device * ns[-1]]},
               "fit": None}
        if s.fit is not None:
            f = s.fit
            fine = [ns[0] + i * (ns[-1] - ns[0]) / 60 for i in range(61)]
            row["fit"] = {"law": f.law, "serial_fraction": f.serial_fraction, "rms_residual": f.rms_residual,
                          "n_points": f.n_points, "devices": fine,
                          "tokens_per_s": [per_device * f.speedup(n) for n in fine],
                          "efficiency": [f.speedup(n) / n for n in fine]}
        out["series"].append(row)
    out["max_devices"] = max(n for row in out["series"] for n in row["devices"])
    return out


def memory_series(study: Study) -> dict | None:
    """Per run with any memory figure: the four parts, measured (max over ranks) and predicted."""
    runs = [r for r in study.runs if r.status != Status.INVALID and (r.m("model_states_bytes") or r.p("model_states_bytes"))]
    if not runs:
        return None
    out = {"labels": [r.label for r in runs], "measured": {}, "predicted": {}}
    for part in MEMORY_PARTS:
        out["measured"][part] = [r.m(part) for r in runs]
        out["predicted"][part] = [r.p(part) for r in runs]
    return out


def compute_series(study: Study) -> dict | None:
    """Per ok run: its compute by kind of work (harness/collect/compute_classes.py) as % of that side's
    compute, measured (profiled steps; None where the run was not profiled) and predicted."""
    rows = []
    for r in study.ok_runs:
        sides = {}
        for side, get in (("measured", r.m), ("predicted", r.p)):
            total, parts = get("compute_time_s"), {c: get(f"compute_{c}_time_s") for c in CLASSES}
            sides[side] = ({c: 100 * v / total for c, v in parts.items()}
                           if total and all(v is not None for v in parts.values()) else None)
            sides[f"{side}_s"] = total if sides[side] else None
        if sides["measured"] or sides["predicted"]:
            rows.append({"label": r.label, **sides})
    return {"rows": rows, "kinds": list(CLASSES)} if rows else None


def comm_series(study: Study) -> dict | None:
    """Per run: comm share of the step by axis, measured and predicted (None where absent)."""
    runs = [r for r in study.ok_runs]
    rows = []
    for r in runs:
        meas, pred = r.comm_share_by_axis(), r.predicted_comm_share_by_axis()
        m_total, p_total = r.m("comm_share_pct"), r.p("comm_share_pct")
        if meas is None and m_total is not None:
            meas = {"all axes": m_total}
        if pred is None and p_total is not None:
            pred = {"all axes": p_total}
        if meas is None and pred is None:
            continue
        rows.append({"label": r.label, "measured": meas, "predicted": pred, "measured_total": m_total,
                     "predicted_total": p_total, "exposed": r.m("comm_exposed_pct")})
    if not rows:
        return None
    keys = []
    for row in rows:
        for d in (row["measured"], row["predicted"]):
            for k in (d or {}):
                if k not in keys:
                    keys.append(k)
    keys.sort(key=lambda k: (COMM_AXES.index(k) if k in COMM_AXES else len(COMM_AXES), k))
    return {"rows": rows, "axes": keys}


def gantt_series(events: list[dict], ranks: int, end: float, unit: float = 1.0,
                 labels: list[str] | None = None) -> dict:
    """Bars per action (F/B/W) and idle intervals, one row per rank; times multiplied by `unit`;
    `labels` names the rows (default "rank r")."""
    out = {a: {"rank": [], "start": [], "dur": [], "text": []} for a in ("F", "B", "W")}
    for e in events:
        a = e["action"] if e["action"] in out else "B"
        s = out[a]
        s["rank"].append(e["rank"])
        s["start"].append(e["start_s"] * unit)
        s["dur"].append((e["end_s"] - e["start_s"]) * unit)
        s["text"].append(str(e["mb"]))
    idle = {"rank": [], "start": [], "dur": []}
    for g in idle_intervals(events, ranks, end):
        idle["rank"].append(g["rank"])
        idle["start"].append(g["start_s"] * unit)
        idle["dur"].append((g["end_s"] - g["start_s"]) * unit)
    labels = labels or [f"rank {r}" for r in range(ranks)]
    return {"actions": {a: v for a, v in out.items() if v["rank"]}, "idle": idle, "ranks": ranks, "end": end * unit,
            "labels": labels}


def measured_gantt(timelines: list[dict]) -> dict | None:
    """The measured timeline files of one pipeline step -> gantt series in milliseconds, plus the
    bubble of each rank (1 - busy / step time, the measurement's own definition)."""
    events, ranks, end = [], 0, 0.0
    bubbles, stages = [], {}
    for t in timelines:
        r = int(t.get("rank", len(bubbles)))
        ranks = max(ranks, r + 1)
        stages[r] = t.get("stages") or sorted({e.get("stage") for e in t["events"]})
        step = t.get("step_time_s") or max((e["end_s"] for e in t["events"]), default=0.0)
        end = max(end, step)
        busy = 0.0
        for e in t["events"]:
            try:
                events.append({"rank": r, "stage": e["stage"], "mb": e["mb"], "action": e["action"],
                               "start_s": float(e["start_s"]), "end_s": float(e["end_s"])})
                busy += float(e["end_s"]) - float(e["start_s"])
            except (KeyError, TypeError, ValueError):
                continue
        bubbles.append(100.0 * (1 - busy / step) if step else None)
    if not events:
        return None
    labels = [f"rank {r} (stage {', '.join(map(str, stages[r]))})" if r in stages else f"rank {r}"
              for r in range(ranks)]
    series = gantt_series(events, ranks, end, unit=1e3, labels=labels)
    series["bubble_pct_per_rank"] = bubbles
    return series
