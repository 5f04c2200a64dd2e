"""Published per-GPU memory against the cost model's peak (`python -m lab.published`).

A source that publishes memory says what it measured (`memory_metric` in lab/published_runs.yaml):

    max_reserved_GiB   torch.cuda's reserved_bytes.all.peak / 2**30: the caching allocator's segments,
                       the tensors' peak plus what the allocator holds beyond them

The cost model's peak (harness/costmodel/memory_peak.py) is the tensors' peak (model states, buffers,
unsharded FSDP state, activations, the largest transient) plus its named allocator term, the profile's
`compute.allocator_overhead` fraction of the tensors (0 where no measurement sources it). Compared with a
reserved peak it is the prediction of the reserved figure: like with like only as far as the allocator
term is measured, and each row prints both parts so the reader sees which.
"""
from __future__ import annotations

import math

COMPARED = {"max_reserved_GiB": "predicted tensors' peak + allocator term"}


def memory_fields(row: dict, pred: dict) -> dict:
    """The row's memory comparison (empty where its source publishes no memory)."""
    if "published_mem_GiB" not in row:
        return {}
    metric = row["memory_metric"]
    if metric not in COMPARED:
        raise ValueError(f"{row['source']} row {row['index']}: memory_metric {metric!r} is not one of "
                         f"{sorted(COMPARED)} (lab/published_memory.py)")
    alloc = pred["allocator_bytes"] / 1024**3
    compared = pred["peak_mem_bytes"] / 1024**3
    return {"memory_metric": metric, "published_mem_GiB": float(row["published_mem_GiB"]),
            "predicted_tensors_GiB": compared - alloc, "predicted_allocator_GiB": alloc,
            "predicted_mem_GiB": compared, "mem_ratio": compared / float(row["published_mem_GiB"])}


def error_summary(rs: list[dict], key: str, within: float) -> dict:
    """Median / p90 / worst |error| of the ratio `key` (predicted / published) over rows rs, its geometric
    mean and how many rows are within `within` (throughput and memory alike)."""
    errs = sorted(abs(r[key] - 1) for r in rs)
    worst = max(rs, key=lambda r: abs(r[key] - 1))
    return {"n": len(rs), "median_abs_err_pct": 100 * quantile(errs, 0.5),
            "p90_abs_err_pct": 100 * quantile(errs, 0.9), "worst_err_pct": 100 * (worst[key] - 1),
            "worst": f"{worst['source']}#{worst['index']} {worst['model']}",
            "geomean_ratio": math.exp(sum(math.log(r[key]) for r in rs) / len(rs)),
            f"within_{round(100 * within)}_pct": sum(abs(r[key] - 1) <= within for r in rs)}


def summarise_memory(results: list[dict]) -> dict | None:
    """The memory error summary over the rows that publish memory (None where none does)."""
    rs = [r for r in results if "mem_ratio" in r]
    return error_summary(rs, "mem_ratio", 0.10) if rs else None


def memory_groups(results: list[dict]) -> dict:
    """The memory summary per half and per source, over the groups with published memory."""
    names = ["fitting", "held_out"] + list(dict.fromkeys(r["source"] for r in results))
    out = {}
    for name in names:
        s = summarise_memory([r for r in results if name in (r["half"], r["source"])])
        if s is not None:
            out[name] = s
    return out


def print_memory(results: list[dict]) -> None:
    rows = [r for r in results if "mem_ratio" in r]
    if not rows:
        print("memory: no row here publishes per-GPU memory; OOM counts runs that ran but are predicted not to fit")
        return
    print("\nmemory (GiB per GPU): published vs " + "; ".join(f"{k}: {v}" for k, v in COMPARED.items()))
    print(f"{'source':<18} {'model':<9} {'layout':<46} {'metric':<17} {'published':>9} {'tensors':>8} "
          f"{'alloc':>6} {'predicted':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['source']:<18} {r['model']:<9} {r['layout']:<46} {r['memory_metric']:<17} "
              f"{r['published_mem_GiB']:>9.1f} {r['predicted_tensors_GiB']:>8.1f} {r['predicted_allocator_GiB']:>6.1f} "
              f"{r['predicted_mem_GiB']:>9.1f} {r['mem_ratio']:>6.2f}")
    print("\nmemory summary, error = predicted / published - 1")
    print(f"{'group':<20} {'n':>4} {'median|err|%':>13} {'p90|err|%':>10} {'worst%':>8} {'geomean':>8} {'<=10%':>6}  worst row")
    for name, s in memory_groups(results).items():
        print(f"{name:<20} {s['n']:>4} {s['median_abs_err_pct']:>13.1f} {s['p90_abs_err_pct']:>10.1f} "
              f"{s['worst_err_pct']:>+8.1f} {s['geomean_ratio']:>8.2f} {s['within_10_pct']:>6}  {s['worst']}")
    print("OOM (throughput summary) counts runs that ran but are predicted not to fit")


def quantile(sorted_xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = q * (len(sorted_xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)
