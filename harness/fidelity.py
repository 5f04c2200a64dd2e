"""`python -m harness.fidelity results/<study>.jsonl ... [--best] [--repredict [hardware=<profile>]]`: a
study's measured/predicted ratios as a Markdown table, one row per config (the ratios themselves:
harness/collect/aggregate.py). Each config's latest ok record; with --best its fastest ok record over every
file given (the best of several passes of the same study, which is how a shared machine's noise is set
aside: the CPU fidelity goal is judged on the best of 3, docs/notes.md#cpu-calibrations). With three configs or more, the last line ranks them:
Spearman's rho of predicted against measured tokens/s (harness/tools/plan_check.py).

--repredict predicts every record again with this checkout's cost model, from the record's own config and
degrees, and with hardware=<profile> (a conf/hardware name, e.g. local/cpu_<hostname>) on that profile in
place of the recorded one: a cost-model change, or a machine's new calibration, checked against the
measurements already on disk without running anything again."""
from __future__ import annotations

import argparse
import copy
import dataclasses
import sys

from omegaconf import OmegaConf

from harness.collect.aggregate import within_goal
from harness.collect.compute_classes import CLASSES
from harness.config import compose_run, to_run_config
from harness.costmodel import predict
from harness.dims import ParallelDims
from harness.labels import labels
from harness.run.record import Status, ratios
from harness.run.results_file import latest_by_run_id, read
from harness.tools.plan_check import spearman

# -- the table ----------------------------------------------------------------------------------
COLUMNS = (("step_time_s", "step"), ("tokens_per_s", "tok/s"), ("model_states_bytes", "states"),
           ("comm_dp_bytes", "dp B"), ("comm_tp_bytes", "tp B"), ("comm_pp_bytes", "pp B"),
           ("comm_share_pct", "comm%"), ("bubble_pct_diff_points", "bubble pts"))


def fastest_by_run_id(records: list[dict]) -> dict[str, dict]:
    """Per run_id, the ok record with the shortest measured step."""
    out: dict[str, dict] = {}
    for r in records:
        if r["status"] == Status.OK and (r["run_id"] not in out or r["measured"]["step_time_s"]
                                    < out[r["run_id"]]["measured"]["step_time_s"]):
            out[r["run_id"]] = r
    return out


def shown(records: list[dict], best: bool = False) -> list[dict]:
    """The ok records the tables show: each config's latest, or with best its fastest."""
    chosen = fastest_by_run_id(records) if best else latest_by_run_id(records)
    return [r for r in chosen.values() if r["status"] == Status.OK]


def table(records: list[dict], best: bool = False) -> str:
    """Markdown table: one row per ok record (latest per run_id, or with best its fastest),
    measured/predicted per column, with measured and predicted step time beside the ratio; * marks a
    figure outside the goal."""
    rows = shown(records, best)
    head = ["config", "step s meas/pred"] + [name for _, name in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r, label in zip(rows, labels(rows)):
        fid = r.get("fidelity") or ratios(r.get("measured") or {}, r.get("predicted") or {})
        ok = within_goal(fid)
        m, p = r["measured"], r["predicted"]
        cells = [label, f"{m.get('step_time_s', 0):.3f} / {p.get('step_time_s', 0):.3f}"]
        for key, _ in COLUMNS:
            v = fid.get(key, "")
            if v is None:
                cells.append("pred 0")
            elif v == "":
                cells.append("")
            else:
                cells.append(f"{v:+.1f}" if key.endswith("_points") else f"{v:.3f}")
                if ok.get(key) is False:
                    cells[-1] += "*"
        lines.append("| " + " | ".join(cells) + " |")
    hw = sorted({(r.get("config") or {}).get("hardware", {}).get("name", "?") for r in rows})
    lines.append(f"\n{len(rows)} records{' (each the fastest of its config)' if best else ''}, hardware {', '.join(hw)}; ratio = measured/predicted; bubble: "
                 "measured - predicted in points; * outside the goal (step ±20%, states 1%, comm bytes 5%, "
                 "bubble 5 points)")
    return "\n".join(lines)


def compute_table(records: list[dict], best: bool = False) -> str:
    """Markdown table of the profiled step's compute by kind of work (harness/collect/compute_classes.py):
    per class measured / predicted seconds and each side's share of its compute; "" where no record was
    profiled. On a CPU the profiler slows small operators most, so the shares are the fairer figure."""
    rows = [r for r in shown(records, best) if "compute_gemm_time_s" in (r.get("measured") or {})]
    if not rows:
        return ""
    head = ["config", "compute s meas / pred"] + [f"{c} meas/pred (share % meas / pred)" for c in CLASSES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r, label in zip(rows, labels(rows)):
        m, p = r["measured"], r["predicted"]
        cells = [label, f"{m['compute_time_s']:.4f} / {p.get('compute_time_s', 0):.4f}"]
        for c in CLASSES:
            k = f"compute_{c}_time_s"
            mv, pv = m.get(k, 0.0), p.get(k, 0.0)
            ratio = f"{mv / pv:.2f}" if pv else "pred 0"
            share = lambda v, d: f"{100 * v / d['compute_time_s']:.0f}" if d.get("compute_time_s") else "-"  # noqa: E731
            cells.append(f"{ratio} ({share(mv, m)} / {share(pv, p)})")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("\ncompute by kind of work, from the profiled steps (rank mean); ratio = measured/predicted seconds")
    return "\n".join(lines)


def predict_again(records: list[dict], hardware: str | None = None) -> tuple[list[dict], list[str]]:
    """(the ok records with `predicted` and `fidelity` made again by this checkout's cost model, why the
    others could not be): each from the record's own config and degrees, on `hardware` (a conf/hardware
    profile name) instead of the recorded profile if given."""

    profile = dataclasses.asdict(compose_run([f"hardware={hardware}"]).hardware) if hardware else None
    out, errors = [], []
    for r in records:
        if r["status"] != Status.OK:
            continue
        r = copy.deepcopy(r)
        if profile is not None:
            r["config"]["hardware"] = profile
        try:
            r["predicted"] = predict(to_run_config(OmegaConf.create(r["config"])), ParallelDims(**r["dims"]))
        except Exception as e:  # a record of an older schema, or a config this checkout refuses
            errors.append(f"{r['run_id']}: {type(e).__name__}: {e}")
            continue
        r["fidelity"] = ratios(r["measured"], r["predicted"])
        out.append(r)
    return out, errors


def rank_line(records: list[dict], best: bool = False) -> str:
    """Spearman's rho of predicted against measured tokens/s over the configs the table shows ("" below 3)."""
    rows = [r for r in shown(records, best) if r["predicted"].get("tokens_per_s") and r["measured"].get("tokens_per_s")]
    if len(rows) < 3:
        return ""
    rho = spearman([r["predicted"]["tokens_per_s"] for r in rows], [r["measured"]["tokens_per_s"] for r in rows])
    return f"Spearman rho of predicted vs measured tokens/s over these {len(rows)} configs: {rho:.2f}"


def main(argv: list[str]) -> int:

    p = argparse.ArgumentParser(prog="python -m harness.fidelity", description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", help="results/<study>.jsonl files")
    p.add_argument("--best", action="store_true", help="each config's fastest ok record over every file")
    p.add_argument("--repredict", nargs="?", const="", metavar="hardware=PROFILE",
                   help="predict every record again with this checkout's cost model (on PROFILE if given)")
    args = p.parse_args(argv)
    records = [r for path in args.paths for r in read(path)]
    if args.repredict is not None:
        hardware = args.repredict.removeprefix("hardware=") or None
        records, errors = predict_again(records, hardware)
        for e in errors:
            print(f"not predicted again: {e}", file=sys.stderr)
        where = f"hardware={hardware}" if hardware else "each record's own hardware profile"
        print(f"predicted again by this checkout's cost model, on {where}\n")
    print(table(records, args.best))
    split = compute_table(records, args.best)
    if split:
        print("\n" + split)
    ranked = rank_line(records, args.best)
    if ranked:
        print("\n" + ranked)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
