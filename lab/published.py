"""`python -m lab.published`: the cost model against published, measured GPU runs.

    python -m lab.published                  # the fitting half's rows, then the summaries
    python -m lab.published --source mpt_a100
    python -m lab.published --json           # one JSON object per row
    python -m lab.published --no-fabric      # every row on its profile's inter_node link
    python -m lab.published --half held_out  # a look at the held-out half: log it (docs/heldout_log.md)
    python -m lab.published_doc              # regenerate docs/validation.md from it

Reads lab/published_runs.yaml (each row cited there; docs/published.md explains the mapping), maps
every row into a brigade config (the same RunConfig `harness.predict` composes, through Hydra, with
the row's model shape, degrees, batch, precision, checkpointing and strategy), predicts it, and
prints published vs predicted tokens/s per GPU with the ratio predicted / published. The summary
gives, per half and per source: median |error|, p90 |error|, the worst row, the geometric mean ratio,
and how many runs that ran are predicted not to fit in device memory. Held-out rows are predicted only
when asked for by name (docs/validation.md#the-rule).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import yaml

from harness import catalog, dims
from harness.config import compose_run
from harness.costmodel import predict
from harness.validate import validate
from lab.published_memory import error_summary, memory_fields, memory_groups, print_memory

DATA = Path(__file__).resolve().parent / "published_runs.yaml"
LLAMA_KEYS = ("n_kv_heads", "norm", "mlp", "position", "rope_theta", "tie_embeddings", "bias")  # model fields a source may set


def load(path: Path = DATA) -> tuple[dict, list[dict]]:
    """(models, rows): each row a dict of its source's defaults, its columns and source facts."""
    doc = yaml.safe_load(path.read_text())
    rows = []
    for key, src in doc["sources"].items():
        for i, values in enumerate(src["rows"]):
            row = {**src.get("defaults", {}), **dict(zip(src["columns"], values))}
            if "sharding" in row:
                row["zero"] = src["zero_of_sharding"][row["sharding"]]
            row.update(source=key, index=i, half=src["half"], hardware=src["hardware"], metric=src["metric"],
                       precision=src["precision"], cite=src["cite"])
            if "fabric" in src:  # the source's cluster network (conf/hardware/fabric/), stated or `assumed:` there
                row["fabric"] = src["fabric"]
            if "hardware_overrides" in src:  # the source's cluster where it differs from the profile (its network)
                row["hardware_overrides"] = dict(src["hardware_overrides"])
            if "memory_metric" in src:  # what the source's memory column measured (published_memory.py)
                row["memory_metric"] = src["memory_metric"]
            rows.append(row)
    return doc["models"], rows


def published_tokens_per_s_per_gpu(row: dict, model: dict) -> float:
    """The row's published figure as tokens/s per GPU, under the source's own convention."""
    s, gbs, gpus = row["seq_len"], row["global_batch"], row["gpus"]
    if row["metric"] == "tokens_per_s_per_gpu":
        return float(row["published"])
    if row["metric"] == "step_time_s":
        return gbs * s / row["published"] / gpus
    if row["metric"] == "tflops_per_gpu":  # Narayanan et al. 2021 eq. 3 (counts the recompute forward)
        l, h, V = model["n_layers"], model["d_model"], model["vocab_size"]
        flops = 96 * gbs * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
        return row["published"] * 1e12 * gbs * s / flops
    if row["metric"] == "megatron_core_tflops_per_gpu":  # Megatron-LM's num_floating_point_operations (no recompute)
        l, h, V, a = model["n_layers"], model["d_model"], model["vocab_size"], model["n_heads"]
        kv, d_ff = model.get("n_kv_heads") or a, model.get("d_ff", 4 * h)
        gated = 1.5 if model.get("mlp") == "swiglu" else 1.0
        per_sequence = 12 * s * l * h * h * ((1 + kv / a + s / h) + d_ff / h * gated + V / (2 * l * h))
        return row["published"] * 1e12 * s / per_sequence
    raise ValueError(f"unknown metric {row['metric']!r} in {row['source']} row {row['index']}")


# Megatron-Core's overlap flags a row may carry, as brigade's strategy knobs of the same name
MEGATRON_OVERLAPS = ("tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather")


def strategy_overrides(row: dict) -> list[str]:
    """The brigade strategy that runs this row's layout (harness/catalog.py, as the planner picks it)."""
    tp, pp = row["tp"], row["pp"]
    name, knobs = catalog.strategy_for(row["gpus"] // (tp * pp), tp, pp, 1, row.get("zero", 0))
    out = [f"strategy={name}", *(f"strategy.{k}={str(v).lower()}" for k, v in knobs.items())]
    if row.get("engine", "torch") != "torch":  # DeepSpeed's own defaults, not brigade's CPU-sized buckets
        out += [f"strategy.engine={row['engine']}", "strategy.ds.reduce_bucket_size=500000000",
                "strategy.ds.stage3_param_persistence_threshold=100000"]
        if "ds_overlap_comm" in row:  # the DeepSpeed version the source ran (lab/published_runs.yaml)
            out.append(f"strategy.ds.overlap_comm={str(bool(row['ds_overlap_comm'])).lower()}")
    if pp > 1:
        out.append(f"strategy.schedule={row['schedule']}")
    if tp > 1:
        out.append(f"strategy.sequence_parallel={str(bool(row.get('sequence_parallel', False))).lower()}")
    if row.get("mp_mode") == "PURE":  # Composer's FSDP PURE reduces gradients in bf16 (lab/published_runs.yaml)
        out.append("strategy.comm_hook=bf16")
    if "fsdp_accumulate" in row:
        out.append(f"strategy.fsdp_accumulate={row['fsdp_accumulate']}")
    if "zero1_impl" in row and catalog.strategy(name).state_sharding == "zero1_torch":  # 3d's data_parallel=zero1 is it already
        out.append(f"strategy.zero1_impl={row['zero1_impl']}")
    if row.get("low_precision_params") and row.get("engine", "torch") == "torch":  # Megatron-LM's --bf16 (lab/published_runs.yaml)
        out.append("strategy.low_precision_params=true")
    if pp > 1 and "pp_recv_buffers" in row:  # the source's pipeline runtime (lab/published_runs.yaml)
        out.append(f"strategy.pp_recv_buffers={row['pp_recv_buffers']}")
    if "bucket_cap_mb" in row:  # the gradient buckets the source's engine used (lab/published_runs.yaml)
        out.append(f"strategy.bucket_cap_mb={row['bucket_cap_mb']}")
    for knob in MEGATRON_OVERLAPS:  # Megatron-Core's overlaps, where the source names them (docs/published.md)
        if knob in row and (knob != "tp_comm_overlap" or tp > 1):
            out.append(f"strategy.{knob}={str(bool(row[knob])).lower()}")
    return out


def overrides(row: dict, model: dict) -> list[str]:
    tp, pp = row["tp"], row["pp"]
    dp = row["gpus"] // (tp * pp)
    out = [f"hardware={row['hardware']}", *(f"hardware.{k}={v}" for k, v in row.get("hardware_overrides", {}).items()),
           *([f"hardware/fabric={row['fabric']}"] if row.get("fabric") else []),
           "model=gpt_7b", f"model.name={row['model']}",
           f"model.n_layers={model['n_layers']}", f"model.d_model={model['d_model']}",
           f"model.n_heads={model['n_heads']}", f"model.d_ff={model.get('d_ff', 4 * model['d_model'])}",
           f"model.vocab_size={model['vocab_size']}", f"model.seq_len={row['seq_len']}",
           f"model.dropout={row.get('dropout', 0.0)}", f"model.attention={row.get('attention', 'sdpa')}",
           f"model.loss={row.get('loss', 'fp32')}",
           f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp_replicate={row.get('dp_replicate', 1)}",
           f"workload.global_batch_size={row['global_batch']}",
           f"workload.micro_batch_size={row['micro_batch_size']}", f"workload.precision={row['precision']}",
           f"workload.activation_checkpointing={row['activation_checkpointing']}", "logger=none"]
    out += [f"model.{k}={str(model[k]).lower() if isinstance(model[k], bool) else model[k]}"
            for k in LLAMA_KEYS if k in model]  # the GPT defaults where absent
    if "compile" in row:  # recorded as run; the cost model has no term for it
        out.append(f"workload.compile={str(bool(row['compile'])).lower()}")
    return out + strategy_overrides(row)


def predict_row(row: dict, model: dict, compose) -> dict:
    """Published and predicted figures for one row (compose: overrides -> RunConfig)."""
    run = compose(overrides(row, model))
    pred = predict(run, validate(run, torch_runs=False))  # Megatron's DDP x TP: predicted, not launched
    published = published_tokens_per_s_per_gpu(row, model)
    predicted = pred["tokens_per_s_per_device"]
    return {"source": row["source"], "index": row["index"], "half": row["half"], "model": row["model"],
            "layout": layout_label(row), "published_tokens_per_s_per_gpu": published,
            "predicted_tokens_per_s_per_gpu": predicted, "ratio": predicted / published,
            "predicted_peak_mem_GiB": pred["peak_mem_bytes"] / 1024**3,
            "device_memory_GiB": pred["device_memory_bytes"] / 1024**3,
            "fits_in_memory": pred["fits_in_memory"], "predicted_mfu_pct": pred["mfu_pct"],
            "fabric": row.get("fabric") or "inter_node", "placement": placement_label(row, run),
            "family": dims.family({"dp": row["gpus"] // (row["tp"] * row["pp"]), "tp": row["tp"], "pp": row["pp"]},
                                  run.hardware.devices_per_node),
            **memory_fields(row, pred)}


def placement_label(row: dict, run) -> str:
    """crosses nodes | in node: whether the row's GPUs span more than one node of its hardware."""
    return "crosses nodes" if row["gpus"] > run.hardware.devices_per_node else "in node"


def layout_label(row: dict) -> str:
    tp, pp = row["tp"], row["pp"]
    dp = row["gpus"] // (tp * pp)
    strat = row.get("sharding") or f"zero{row.get('zero', 0)} {row.get('engine', 'torch')}"
    sp = " sp" if row.get("sequence_parallel") and row["tp"] > 1 else ""
    hsdp = f" hsdp{row['dp_replicate']}x{dp // row['dp_replicate']}" if row.get("dp_replicate", 1) > 1 else ""
    return (f"{strat} dp{dp}{hsdp} tp{tp} pp{pp}{sp} s{row['seq_len']} mb{row['micro_batch_size']} "
            f"gbs{row['global_batch']} {row['activation_checkpointing']}{' compile' if row.get('compile') else ''}")


def caching_compose():
    """compose_run per distinct (hardware, strategy, runtime) once; the rest of a row is replaced in place."""
    cache: dict = {}

    def compose(ovr: list[str]):
        fixed = [o for o in ovr if o.startswith(("hardware", "strategy", "runtime"))]
        key = tuple(fixed)
        if key not in cache:
            cache[key] = compose_run(fixed + ["model=gpt_7b", "logger=none"])
        run = cache[key]
        vals = dict(o.split("=", 1) for o in ovr if not o.startswith(("hardware", "strategy", "runtime", "model=", "logger=")))
        m = replace(run.model, **{k[6:]: _typed(getattr(run.model, k[6:]), v) for k, v in vals.items()
                                  if k.startswith("model.")})
        p = replace(run.parallel, **{k[9:]: int(v) for k, v in vals.items() if k.startswith("parallel.")})
        w = replace(run.workload, **{k[9:]: _typed(getattr(run.workload, k[9:]), v) for k, v in vals.items()
                                     if k.startswith("workload.")})
        return replace(run, model=m, parallel=p, workload=w)
    return compose


def _typed(current, value: str):
    if isinstance(current, bool):
        return value.lower() == "true"
    if current is None:  # Optional[int] fields (model.n_kv_heads)
        return int(value) if value.lstrip("-").isdigit() else value
    return type(current)(value) if not isinstance(current, str) else value


def summarise(results: list[dict]) -> dict:
    """Median / p90 / worst |error| of throughput and the out-of-memory count, per group."""
    return {**error_summary(results, "ratio", 0.15), "predicted_oom": sum(not r["fits_in_memory"] for r in results)}


def run_all(half: str = "fitting", source: str | None = None, fabrics: bool = True) -> list[dict]:
    """Published against predicted for the rows of one half (held_out: a look, docs/heldout_log.md)."""
    models, rows = load()
    if not fabrics:  # every row on its profile's inter_node link: the comparison without fabric profiles
        rows = [{**r, "fabric": None} for r in rows]
    compose = caching_compose()
    return [predict_row(r, models[r["model"]], compose) for r in rows
            if r["half"] == half and (source is None or r["source"] == source)]


def print_report(results: list[dict]) -> None:
    print(f"{'source':<18} {'model':<9} {'layout':<46} {'published':>10} {'predicted':>10} {'ratio':>6} "
          f"{'mem GiB':>9}")
    for r in results:
        oom = " OOM" if not r["fits_in_memory"] else ""
        print(f"{r['source']:<18} {r['model']:<9} {r['layout']:<46} {r['published_tokens_per_s_per_gpu']:>10.0f} "
              f"{r['predicted_tokens_per_s_per_gpu']:>10.0f} {r['ratio']:>6.2f} "
              f"{r['predicted_peak_mem_GiB']:>5.0f}/{r['device_memory_GiB']:.0f}{oom}")
    print("\nthroughput (tokens/s per GPU), error = predicted / published - 1")
    print(f"{'group':<28} {'n':>4} {'median|err|%':>13} {'p90|err|%':>10} {'worst%':>8} {'geomean':>8} "
          f"{'<=15%':>6} {'OOM':>4}  worst row")
    groups = [(h, [r for r in results if r["half"] == h]) for h in ("fitting", "held_out")]
    groups += [(s, [r for r in results if r["source"] == s]) for s in dict.fromkeys(r["source"] for r in results)]
    groups += [(f"{f} {p}", [r for r in results if r["fabric"] == f and r["placement"] == p])
               for f in dict.fromkeys(r["fabric"] for r in results) for p in ("in node", "crosses nodes")]
    for name, rs in groups:
        if rs:
            s = summarise(rs)
            print(f"{name:<28} {s['n']:>4} {s['median_abs_err_pct']:>13.1f} {s['p90_abs_err_pct']:>10.1f} "
                  f"{s['worst_err_pct']:>+8.1f} {s['geomean_ratio']:>8.2f} {s['within_15_pct']:>6} "
                  f"{s['predicted_oom']:>4}  {s['worst']}")
    print_memory(results)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.published", description=__doc__.split("\n\n")[0])
    p.add_argument("--half", choices=("fitting", "held_out"), default="fitting",
                   help="held_out is a look: log what was seen and decided in docs/heldout_log.md")
    p.add_argument("--source")
    p.add_argument("--json", action="store_true", help="one JSON object per row, then the summaries")
    p.add_argument("--no-fabric", action="store_true", help="ignore the sources' fabric: the profile's inter_node link")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    results = run_all(args.half, args.source, not args.no_fabric)
    if args.json:
        for r in results:
            print(json.dumps(r))
        print(json.dumps({h: summarise([r for r in results if r["half"] == h])
                          for h in ("fitting", "held_out") if any(r["half"] == h for r in results)}))
        print(json.dumps({"fabric": {f"{f} {p}": summarise(rs) for f in dict.fromkeys(r["fabric"] for r in results)
                                     for p in ("in node", "crosses nodes")
                                     if (rs := [r for r in results if r["fabric"] == f and r["placement"] == p])}}))
        print(json.dumps({"memory": memory_groups(results)}))
    else:
        print_report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
