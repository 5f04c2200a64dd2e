"""`plan --run-top K`'s verdict: the planner's ranking of the layouts it ran against the measured one.

After the sweep, each launched candidate is matched to its record (same strategy and knobs, degrees,
schedule, micro-batch size and checkpointing; runs that failed have none) and the two rankings by tokens/s are compared with Spearman's
rank correlation (ties get their mean rank; rho = Pearson's r of the ranks), plus whether the
layout predicted best is within 10 % of the measured best.
"""
from __future__ import annotations

from harness.run.record import Status

WITHIN = 0.10  # the predicted best counts as right if it measures within 10 % of the measured best


def layout_key(c, by: str = "degrees") -> tuple:
    """What makes two candidates the same layout: by "degrees" the parallel degrees (dp, HSDP's dp_replicate,
    tp, pp, ep); by "variant" also the strategy, its knobs, vpp and the schedule (micro-batching and
    checkpointing aside)."""
    if by == "degrees":
        return (c.dp, c.dp_replicate, c.tp, c.pp, c.ep)
    return (c.strategy, tuple(sorted(c.knobs.items())), c.dp, c.dp_replicate, c.tp, c.pp, c.vpp, c.ep, c.schedule if c.pp > 1 else "")


def distinct_layouts(cands: list, k: int, by: str = "degrees") -> list:
    """The best candidate of each of the k best distinct layouts (layout_key), best first. By degrees, the
    runs compare the layouts a user chooses between (DP against TP against PP against 3D), each as the
    planner would run it; by variant, the best k can be one layout's schedules and ZeRO stages, predicted
    within a few per cent of each other (model=small on 4 CPU ranks: six within 6 %), which one
    machine's run-to-run noise (±10 %) ranks at random."""
    out, seen = [], set()
    for c in cands:
        key = layout_key(c, by)
        if key not in seen:
            seen.add(key)
            out.append(c)
            if len(out) == k:
                break
    return out


def ranks(xs: list[float]) -> list[float]:
    """1 = the largest; ties share their mean rank."""
    order = sorted(range(len(xs)), key=lambda i: -xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for t in range(i, j + 1):
            out[order[t]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def matches(c, r: dict) -> bool:
    """Whether record r ran candidate c: strategy, its knobs, degrees, schedule, micro-batch, checkpointing."""
    cfg = r["config"]
    s, p, w = cfg["strategy"], cfg["parallel"], cfg["workload"]
    knobs = {"sequence_parallel": False, **c.knobs}
    return ((s["name"], p["dp"], p.get("dp_replicate", 1), p["tp"], p["pp"], p.get("vpp", 1), p.get("ep", 1),
             w["micro_batch_size"], w["activation_checkpointing"])
            == (c.strategy, c.dp, c.dp_replicate, c.tp, c.pp, c.vpp, c.ep, c.mb, c.ckpt)
            and (c.pp == 1 or s.get("schedule") == c.schedule) and all(s.get(k) == v for k, v in knobs.items()))


def compare(launched: list, records: list[dict]) -> dict:
    """Rows (layout, predicted, measured tokens/s, ranks), rho and the best-within-10 % verdict."""
    ok = [r for r in records if r.get("status") == Status.OK]
    rows = []
    for c in launched:
        r = next((r for r in reversed(ok) if matches(c, r)), None)  # the latest record of that config
        if r is not None:
            rows.append({"layout": " ".join(c.overrides()), "predicted": r["predicted"]["tokens_per_s"],
                         "measured": r["measured"]["tokens_per_s"]})
    if len(rows) < 2:
        return {"rows": rows, "rho": float("nan"), "best_within_10pct": None}
    pred_rank, meas_rank = ranks([x["predicted"] for x in rows]), ranks([x["measured"] for x in rows])
    for x, a, b in zip(rows, pred_rank, meas_rank):
        x["predicted_rank"], x["measured_rank"] = a, b
    best_pred = max(rows, key=lambda x: x["predicted"])
    best_meas = max(x["measured"] for x in rows)
    return {"rows": rows, "rho": spearman([x["predicted"] for x in rows], [x["measured"] for x in rows]),
            "best_within_10pct": best_pred["measured"] >= (1 - WITHIN) * best_meas}


def report(result: dict) -> str:
    lines = [f"{'pred #':>6} {'meas #':>6} {'predicted tok/s':>16} {'measured tok/s':>15}  layout"]
    for x in sorted(result["rows"], key=lambda x: x.get("predicted_rank", 0)):
        lines.append(f"{x.get('predicted_rank', 0):>6.1f} {x.get('measured_rank', 0):>6.1f} {x['predicted']:>16,.0f} "
                     f"{x['measured']:>15,.0f}  {x['layout']}")
    verdict = {True: "yes", False: "no", None: "n/a"}[result["best_within_10pct"]]
    lines.append(f"Spearman rho (predicted vs measured rank, {len(result['rows'])} layouts): {result['rho']:.2f}; "
                 f"predicted best within 10 % of the measured best: {verdict}")
    return "\n".join(lines)
