"""`python -m lab.playbook`: the cost model against a real sweep, good layouts and poor ones alike.

    python -m lab.playbook            # the summary per model, node count and layout family, then per group
    python -m lab.playbook --rows     # every row too
    python -m lab.playbook --json     # one JSON object per row, then the summary
    python -m lab.playbook_doc        # regenerate docs/playbook.md from it

The sweep: the development half (the 1B and 8B models) of the benchmark sweep behind Hugging Face's
Ultra-Scale Playbook (2025), nanotron on 1-64 nodes of 8 x H100 80GB SXM with AWS EFA between nodes, copied
into lab/playbook_dev_runs.csv (SOURCE below says where each figure comes from). Unlike the published set
(lab/published.py), it holds every layout the sweep tried: tensor parallelism across nodes, deep pipelines
at micro-batch 1, small models on 512 GPUs, and 614 runs that crashed or ran out of memory.

Each row is mapped as the runtime ran it (`overrides`): bf16 parameters with fp32 gradient accumulation and
fp32 master weights (brigade's strategy.low_precision_params), ZeRO-1 sharding the master weights and AdamW
state (the distributed optimizer, 3d data_parallel=zero1; zero1 with zero1_impl=distributed at tp = pp = 1),
ZeRO-0 sharding nothing (DDP), TP with sequence parallelism, 1F1B, hardware=h100_sxm on
hardware/fabric=efa_p5, the sequence, batch and model shape of the row. What brigade cannot express is
named in docs/playbook.md (NOT_EXPRESSED). Every ok row is predicted; every crashed row is checked for
"predicted not to fit" (or refused before launch, with the arithmetic). Per (model, node count) group the
layouts the planner ranks (`planned`: predicted to fit with their family's memory margin,
harness/costmodel/family_errors.py memory_limit) are ranked by predicted tokens/s as it ranks them: Spearman's rho against
the measured ranking, whether the pick measured within 10 % of the group's measured best, and the regret
(1 - the pick's measured tokens/s over the best's; a pick that crashed has regret 1).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

from harness import catalog, dims
from harness.costmodel import family_errors, predict
from harness.costmodel.inputs import Hardware, Model, StrategyKnobs
from harness.costmodel.layout import layout
from harness.costmodel.memory_peak import memory_peak
from harness.dims import ConfigError
from harness.tools.plan_check import WITHIN, spearman
from harness.validate import num_microbatches, validate
from lab.published import caching_compose
from lab.published_memory import quantile

DATA = Path(__file__).resolve().parent / "playbook_dev_runs.csv"
SOURCE = ("Hugging Face's Ultra-Scale Playbook (2025), benchmark sweep, development half: the 1B and 8B runs, read "
          "exactly from the hover text of the Playbook's interactive benchmark chart "
          "(assets/data/benchmarks/benchmarks_interactive.html, GitHub mirror vinjn/nanotron-ultrascale-playbook); "
          "runs made with nanotron's scripts/scaling_benchmarks.py (huggingface/nanotron, Dec 2024), base config "
          "examples/config_tiny_llama_bench.yaml, nanotron on torch with NCCL, flash attention, no torch.compile, "
          "CUDA_DEVICE_MAX_CONNECTIONS=1; 1-64 nodes of 8 x H100 80GB SXM, NVLink in a node, AWS EFA (p5) between "
          "nodes. tok_s_gpu: one training step (nanotron's iteration 3). mem_GB_rank0: rank 0's torch max reserved / "
          "1024^3 (the chart says max allocated or max reserved; nanotron's trainer resets the peaks after each early "
          "step's pipeline and reads them at step 3, where max allocated would hold no activations).")
# The sweep's runtime settings brigade's configuration cannot say; docs/playbook.md lists them.
NOT_EXPRESSED = (
    "nanotron's pipeline split balances an estimate of each block's compute (4h^2 + 3 h d_ff a decoder layer, V h "
    "the head) and can leave the head, the fp32 cast and the loss on ranks of their own, and stages without a "
    "decoder layer; brigade splits the layers as evenly as they allow, embeddings first, head and loss last",
    "tied embeddings at pp > 1: nanotron keeps a copy on the first and the last stage and all-reduces its "
    "gradient between them; brigade refuses tied embeddings at pp > 1, so these rows are mapped untied (the "
    "same bytes and FLOPs on each stage; the copies' gradient all-reduce is not priced)",
    "q, k and v as one merged column-parallel projection and gate and up as another (nanotron's Llama); brigade's "
    "model has separate projections (the same FLOPs in narrower GEMMs)",
    "20 rows whose gbs_seqs column (256) is not dp x mbs x grad_acc: they are mapped to the product, the batch "
    "their degrees and accumulation process and whose tokens nanotron's tokens/s counts",
)
TEXT_COLUMNS = ("model_label", "embeddings", "status")  # every other column is a number: FLOAT_COLUMNS, else an integer
FLOAT_COLUMNS = ("n_params_B", "mfu_pct_reported", "tok_s_gpu", "tok_s_total", "mem_GB_rank0")
GPUS_PER_NODE = 8  # p5.48xlarge (lab/playbook_dev_runs.csv's `nodes` = gpus / 8)
RAN = "ok"  # the sweep's status column: ok | crashed_or_oom (its own words, not a brigade run status); load's `ran`


def load(path: Path = DATA) -> list[dict]:
    """The sweep's rows with typed columns and their index in the file."""
    with path.open() as f:
        rows = list(csv.DictReader(f))
    out = []
    for i, r in enumerate(rows):
        row = {**r, "index": i, "ran": r["status"] == RAN}
        for k in r:
            if k in FLOAT_COLUMNS:
                row[k] = float(r[k]) if r[k] not in ("", None) else None
            elif k not in TEXT_COLUMNS:
                row[k] = int(r[k])
        out.append(row)
    return out


def family(row: dict) -> str:
    """The row's layout family, as predict and plan name it (harness/dims.py family)."""
    return dims.family({"dp": row["dp"], "tp": row["tp"], "pp": row["pp"]}, GPUS_PER_NODE)


def strategy_overrides(row: dict) -> list[str]:
    """The brigade strategy that runs the row's layout as nanotron did (module docstring)."""
    dp, tp, pp = row["dp"], row["tp"], row["pp"]
    zero = row["zero_stage"] if dp > 1 else 0  # nothing to shard over one replica
    name, knobs = catalog.strategy_for(dp, tp, pp, 1, zero)
    out = [f"strategy={name}", *(f"strategy.{k}={str(v).lower()}" for k, v in knobs.items()),
           "strategy.low_precision_params=true"]
    if catalog.strategy(name).state_sharding == "zero1_torch":  # plain zero1: the distributed optimizer, as 3d's data_parallel=zero1
        out.append("strategy.zero1_impl=distributed")
    if pp > 1:  # nanotron's p2p receives into a tensor per transfer (pipeline_parallel/p2p.py), as Megatron-LM's
        out += ["strategy.schedule=1f1b", "strategy.pp_recv_buffers=in_flight"]
    if tp > 1:
        out.append("strategy.sequence_parallel=true")
    return out


def overrides(row: dict) -> list[str]:
    tied = row["embeddings"] == "tied" and row["pp"] == 1  # NOT_EXPRESSED: tied at pp > 1 runs as two copies
    return ["hardware=h100_sxm", "hardware/fabric=efa_p5", "runtime=nanotron", "model=gpt_7b", f"model.name=playbook_{row['model_label']}",
            f"model.n_layers={row['layers']}", f"model.d_model={row['hidden']}", f"model.n_heads={row['heads']}",
            f"model.n_kv_heads={row['kv_heads']}", f"model.d_ff={row['ffn']}", f"model.vocab_size={row['vocab']}",
            f"model.seq_len={row['seq_len']}", "model.norm=rmsnorm", "model.mlp=swiglu", "model.position=rope",
            f"model.tie_embeddings={str(tied).lower()}", "model.dropout=0.0", "model.attention=sdpa",
            f"parallel.dp={row['dp']}", f"parallel.tp={row['tp']}", f"parallel.pp={row['pp']}",
            f"workload.global_batch_size={batch_sequences(row)}", f"workload.micro_batch_size={row['mbs']}",
            "workload.precision=bf16-mixed", "workload.activation_checkpointing=none", "logger=none",
            *strategy_overrides(row)]


def batch_sequences(row: dict) -> int:
    """Sequences per step as the run was configured: dp x mbs x grad_acc (nanotron's global batch, whose tokens
    its tokens/s counts). 20 rows' gbs_seqs column says 256 where this product differs (BATCH_MISMATCH)."""
    return row["dp"] * row["mbs"] * row["grad_acc"]


def rank0_peak_bytes(run, dims) -> float:
    """The peak of pipeline rank 0 (the rank the sweep's memory column reads): the cost model's peak with
    the first pp rank alone (harness/costmodel/memory_peak.py takes the worst of the ranks it is given)."""
    w = run.workload
    lo = layout(Model.of(run.model), Hardware.of(run.hardware), StrategyKnobs.of(run.strategy, run.runtime), dims.dp, dims.tp,
                dims.pp,
                dims.vpp, dims.ep, w.precision, run.launcher.nodes)
    first = replace(lo, ranks=[r for r in lo.ranks if r.pp_rank == 0])
    return memory_peak(first, w.micro_batch_size, num_microbatches(run, dims), w.activation_checkpointing).peak_bytes


def predict_row(row: dict, compose, extra: tuple = ()) -> dict:
    """The row's measured and predicted figures (predicted ones None where brigade refuses the layout)."""
    out = {"index": row["index"], "model": row["model_label"], "nodes": row["nodes"], "gpus": row["gpus"],
           "dp": row["dp"], "tp": row["tp"], "pp": row["pp"], "zero": row["zero_stage"], "mbs": row["mbs"],
           "grad_acc": row["grad_acc"], "status": row["status"], "ran": row["ran"], "family": family(row),
           "measured_tokens_per_s_per_gpu": row["tok_s_gpu"],
           "measured_mem_GiB": row["mem_GB_rank0"], "refused": None, "predicted_tokens_per_s_per_gpu": None,
           "fits_in_memory": None, "predicted_mem_GiB": None, "ratio": None, "mem_ratio": None,
           "peak_mem_bytes": None, "device_memory_bytes": None, "device": None}
    run = compose(overrides(row) + list(extra))
    try:
        dims = validate(run, torch_runs=False)  # nanotron's DDP x TP: predicted, not launched
    except ConfigError as e:
        return {**out, "refused": str(e)}
    pred = predict(run, dims)
    mem = rank0_peak_bytes(run, dims) / 1024**3
    out.update(predicted_tokens_per_s_per_gpu=pred["tokens_per_s_per_device"], fits_in_memory=pred["fits_in_memory"],
               predicted_mem_GiB=mem, step_time_s=pred["step_time_s"], peak_mem_bytes=pred["peak_mem_bytes"],
               device_memory_bytes=pred["device_memory_bytes"], device=run.hardware.device)
    if row["ran"]:
        out["ratio"] = pred["tokens_per_s_per_device"] / row["tok_s_gpu"]
        out["mem_ratio"] = mem / row["mem_GB_rank0"]
    return out


def run_all(rows: list[dict] | None = None, extra: tuple = ()) -> list[dict]:
    """Every row predicted; extra: overrides added to every row's (a runtime constant set aside, for its fit)."""
    compose = caching_compose()
    return [predict_row(r, compose, extra) for r in (load() if rows is None else rows)]


def _median_ratio_fit(rows: list[dict], key: str, lo: float, hi: float) -> float:
    """The value of the override `key` at which the rows' median ratio predicted / measured is 1 (bisection; the
    ratio falls as the value grows)."""
    def median_ratio(value: float) -> float:
        return quantile(sorted(r["ratio"] for r in run_all(rows, extra=(f"{key}={value}",))), 0.5)
    for _ in range(16):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if median_ratio(mid) > 1 else (lo, mid)
    return (lo + hi) / 2


def fit_tp_ring_step_remote_pp_us() -> tuple[float, int]:
    """conf/runtime/nanotron.yaml tp_ring_step_remote_pp_us, fitted on this development half: the rows with TP in a
    node and a pipeline whose sends cross nodes (pp > 1, 1 < tp <= 8, dp x tp >= 8) at micro-batch 1-2 on up to 8
    nodes (beyond, the multi-node pipeline regime of docs/playbook.md), the ring step time at which their median
    ratio predicted / measured is 1. Returns (microseconds, rows)."""
    rows = [r for r in load() if r["ran"] and r["pp"] > 1 and 1 < r["tp"] <= GPUS_PER_NODE
            and r["dp"] * r["tp"] >= GPUS_PER_NODE and r["mbs"] <= 2 and r["nodes"] <= 8]
    return _median_ratio_fit(rows, "runtime.tp_ring_step_remote_pp_us", 0.0, 2000.0), len(rows)


def fit_ring_step_latency_us(lo: float = 10.0, hi: float = 200.0) -> tuple[float, int]:
    """conf/hardware/fabric/efa_p5.yaml ring_step_latency_us, fitted on this development half: on the rows whose TP
    group spans nodes over EFA at micro-batch 1 or 2 (pp 1, tp 16-32: every layer's all-gathers and reduce-
    scatters are latency-bound, 1-2 MiB a rank), the latency per ring step at which the median ratio predicted /
    measured is 1 (bisection; the ratio falls as the latency grows). Returns (microseconds, rows)."""
    rows = [r for r in load() if r["ran"] and r["pp"] == 1 and r["tp"] > GPUS_PER_NODE and r["mbs"] <= 2]
    return _median_ratio_fit(rows, "hardware.fabric.ring_step_latency_us", lo, hi), len(rows)


def fit_host_layer_us() -> tuple[float, int]:
    """conf/runtime/nanotron.yaml host_layer_us, fitted on this development half: the rows whose micro-batch the
    host bounds are those with tensor parallelism in a node (pp 1, tp 2-8, 1-2 nodes: no network beyond the TP
    group's NVLink) whose predicted device time per micro-batch, compute and exposed TP collectives with no host
    term, is under half the measured; the fit is the median of their measured seconds per micro-batch per layer.
    Returns (microseconds, rows)."""
    rows = [r for r in load() if r["ran"] and r["pp"] == 1 and 1 < r["tp"] <= GPUS_PER_NODE and r["nodes"] <= 2]
    compose = caching_compose()
    per_layer = []
    for row in rows:
        run = compose(overrides(row) + ["runtime.host_layer_us=0"])
        pred = predict(run, validate(run, torch_runs=False))
        measured_s = batch_sequences(row) * row["seq_len"] / row["tok_s_gpu"] / row["gpus"] / row["grad_acc"]
        device_s = (pred["compute_time_s"] + pred["comm_tp_exposed_time_s"]) / row["grad_acc"]
        if device_s < measured_s / 2:
            per_layer.append(measured_s / row["layers"])
    return 1e6 * quantile(sorted(per_layer), 0.5), len(per_layer)


def fit_allocator_overhead() -> tuple[float, int]:
    """conf/runtime/nanotron.yaml allocator_overhead, fitted on this development half: the sweep's memory column is
    torch's max reserved (nanotron's trainer resets the peak statistics after each of the first steps' pipeline, so
    a max allocated read at step 3 would hold no activations, while the column grows with the micro-batch), the
    caching allocator's segments beyond the allocated peak. The fit is the fraction that makes the median ratio
    measured / predicted of the ok rows 1, predicted with no overhead. Returns (fraction, rows)."""
    ratios = sorted(r["mem_ratio"] for r in run_all(extra=("runtime.allocator_overhead=0",))
                    if r["mem_ratio"] is not None)
    return 1 / quantile(ratios, 0.5) - 1, len(ratios)


def layout_label(r: dict) -> str:
    return f"dp{r['dp']} tp{r['tp']} pp{r['pp']} zero{r['zero']} mbs{r['mbs']} acc{r['grad_acc']}"


def throughput_errors(rs: list[dict]) -> dict:
    """Median / p90 |error| and geometric mean ratio of the ok rows among rs (error = predicted / measured - 1)."""
    ok = [r for r in rs if r["ratio"] is not None]
    if not ok:
        return {"n": 0}
    errs = sorted(abs(r["ratio"] - 1) for r in ok)
    return {"n": len(ok), "median_abs_err_pct": 100 * quantile(errs, 0.5), "p90_abs_err_pct": 100 * quantile(errs, 0.9),
            "geomean_ratio": math.exp(sum(math.log(r["ratio"]) for r in ok) / len(ok)),
            "within_15_pct": sum(e <= 0.15 for e in errs)}


def planned(r: dict, margins: dict | None = None) -> bool:
    """Whether `plan` would rank the row's layout: its worst rank's predicted peak within the device's memory less
    its family's memory margin (harness/costmodel/family_errors.py memory_limit; margins: a table as
    lab/family_errors.py computes it, None: the committed one)."""
    return bool(r["fits_in_memory"]) and r["peak_mem_bytes"] <= family_errors.memory_limit(
        r["device_memory_bytes"], r["family"], r["device"], margins)


def group_verdict(rs: list[dict], margins: dict | None = None) -> dict:
    """One (model, node count) group as the planner would rank it (module docstring; margins as planned's)."""
    fit = [r for r in rs if planned(r, margins)]
    measured = [r["measured_tokens_per_s_per_gpu"] for r in rs if r["ran"]]
    if not fit or not measured:
        return {"n": len(rs), "n_ranked": len(fit), "pick": None}
    best = max(measured)
    pick = max(fit, key=lambda r: r["predicted_tokens_per_s_per_gpu"])
    got = pick["measured_tokens_per_s_per_gpu"] if pick["ran"] else 0.0
    ranked = [r for r in fit if r["ran"]]
    rho = (spearman([r["predicted_tokens_per_s_per_gpu"] for r in ranked],
                    [r["measured_tokens_per_s_per_gpu"] for r in ranked]) if len(ranked) > 1 else float("nan"))
    best_row = max((r for r in rs if r["ran"]), key=lambda r: r["measured_tokens_per_s_per_gpu"])
    # the measured best's place in the predicted ranking (a `plan --run-top K` with K at least this runs it)
    pick_rank = 1 + sum(r["predicted_tokens_per_s_per_gpu"] > best_row["predicted_tokens_per_s_per_gpu"] for r in fit)
    return {"n": len(rs), "n_ranked": len(ranked), "pick": layout_label(pick), "pick_ran": pick["ran"],
            "pick_measured": got, "best": layout_label(best_row), "best_measured": best,
            "within_10_pct": got >= (1 - WITHIN) * best, "regret": 1 - got / best, "rho": rho,
            "best_predicted_rank": pick_rank if planned(best_row, margins) else None}


def groups(results: list[dict], margins: dict | None = None) -> dict:
    """(model, nodes) -> group_verdict, in model then node order."""
    keys = sorted({(r["model"], r["nodes"]) for r in results}, key=lambda k: (k[0], k[1]))
    return {k: group_verdict([r for r in results if (r["model"], r["nodes"]) == k], margins) for k in keys}


def summary(results: list[dict], margins: dict | None = None) -> dict:
    """The figures the issue's done-when asks for, over the whole development half (margins as planned's)."""
    ok = [r for r in results if r["ran"]]
    crashed = [r for r in results if not r["ran"]]
    mem = sorted(abs(r["mem_ratio"] - 1) for r in ok if r["mem_ratio"] is not None)
    gs = [g for g in groups(results, margins).values() if g["pick"] is not None]
    regrets = sorted(g["regret"] for g in gs)
    return {
        "throughput": throughput_errors(ok),
        "throughput_unstalled": throughput_errors([r for r in ok if not stalled(r)]),
        "memory_median_abs_err_pct": 100 * quantile(mem, 0.5) if mem else None,
        "memory_p90_abs_err_pct": 100 * quantile(mem, 0.9) if mem else None,
        "ran": len(ok), "ok_predicted_to_fit": sum(bool(r["fits_in_memory"]) for r in ok),
        "crashed": len(crashed), "crashed_refused": sum(r["refused"] is not None for r in crashed),
        "crashed_predicted_not_to_fit": sum(r["fits_in_memory"] is False for r in crashed),
        # what the planner ranks: within the device's memory less the family's margin
        "ok_planned": sum(planned(r, margins) for r in ok if r["refused"] is None),
        "crashed_not_planned": sum(not planned(r, margins) for r in crashed if r["refused"] is None),
        "groups": len(gs), "groups_within_10_pct": sum(g["within_10_pct"] for g in gs),
        "median_regret_pct": 100 * quantile(regrets, 0.5) if regrets else None,
        "median_rho": quantile(sorted(g["rho"] for g in gs if not math.isnan(g["rho"])), 0.5),
    }


STALL_S_PER_MICROBATCH = 0.3  # an unexplained time per micro-batch this large marks a pipeline row as stalled
STALL_RATIO = 1.4  # ... when it also makes the row this many times slower than predicted


def stall_s_per_microbatch(r: dict) -> float:
    """The measured step's time beyond the predicted one, per micro-batch (predicted / measured tokens/s = measured
    / predicted step time)."""
    return r["step_time_s"] * (r["ratio"] - 1) / r["grad_acc"]


def stalled(r: dict) -> bool:
    return r["pp"] > 1 and r["ratio"] is not None and r["ratio"] > STALL_RATIO and stall_s_per_microbatch(r) >= STALL_S_PER_MICROBATCH


def pipeline_stalls(results: list[dict]) -> dict:
    """Per node count, the pipeline rows (pp > 1, ran) that show a stall (`stalled`): how many, and the share by
    the layout features that could decide it (ZeRO stage, model, micro-batch size, whether the pipeline's sends
    cross nodes, pp); the median stall per micro-batch at pp 2 and at pp >= 4. A feature that decided it would
    split a node count's rows into shares near 0 and 1."""
    rows = [r for r in results if r["ratio"] is not None and r["pp"] > 1]
    features = {"zero 0": lambda r: r["zero"] == 0, "zero 1": lambda r: r["zero"] == 1,
                "1B": lambda r: r["model"] == "1B", "8B": lambda r: r["model"] == "8B",
                "mbs 1": lambda r: r["mbs"] == 1, "mbs 2-8": lambda r: 2 <= r["mbs"] <= 8,
                "mbs >= 16": lambda r: r["mbs"] >= 16,
                "sends cross nodes": lambda r: r["dp"] * r["tp"] >= GPUS_PER_NODE,
                "pp 2": lambda r: r["pp"] == 2, "pp >= 4": lambda r: r["pp"] >= 4}
    out = {}
    for nodes in sorted({r["nodes"] for r in rows}):
        rs = [r for r in rows if r["nodes"] == nodes]
        share = {}
        for name, has in features.items():
            sub = [r for r in rs if has(r)]
            share[name] = (sum(map(stalled, sub)) / len(sub), len(sub)) if sub else None
        per_mb = {k: sorted(stall_s_per_microbatch(r) for r in rs if stalled(r) and pick(r["pp"]))
                  for k, pick in (("pp 2", lambda p: p == 2), ("pp >= 4", lambda p: p >= 4))}
        out[nodes] = {"rows": len(rs), "stalled": sum(map(stalled, rs)), "share": share,
                      "median_stall_s": {k: quantile(v, 0.5) if v else None for k, v in per_mb.items()}}
    return out


def families(results: list[dict]) -> dict:
    """(model, nodes, family) -> throughput_errors of its ok rows, where it has any."""
    keys = sorted({(r["model"], r["nodes"], r["family"]) for r in results if r["ratio"] is not None})
    return {k: throughput_errors([r for r in results if (r["model"], r["nodes"], r["family"]) == k]) for k in keys}


def print_report(results: list[dict], rows: bool) -> None:
    if rows:
        print(f"{'model':<5} {'nodes':>5} {'layout':<36} {'status':<15} {'measured':>9} {'predicted':>9} {'ratio':>6} "
              f"{'mem':>5} {'pred':>5}")
        for r in results:
            pred = r["predicted_tokens_per_s_per_gpu"]
            print(f"{r['model']:<5} {r['nodes']:>5} {layout_label(r):<36} {r['status']:<15} "
                  f"{r['measured_tokens_per_s_per_gpu'] or 0:>9.0f} {pred or 0:>9.0f} {r['ratio'] or 0:>6.2f} "
                  f"{r['measured_mem_GiB'] or 0:>5.1f} {r['predicted_mem_GiB'] or 0:>5.1f}"
                  + (f"  refused: {r['refused']}" if r["refused"] else "")
                  + ("  predicted OOM" if r["fits_in_memory"] is False else ""))
    print(f"\n{'model':<5} {'nodes':>5} {'family':<24} {'n':>4} {'median|err|%':>13} {'p90|err|%':>10} {'geomean':>8}")
    for (model, nodes, fam), s in families(results).items():
        print(f"{model:<5} {nodes:>5} {fam:<24} {s['n']:>4} {s['median_abs_err_pct']:>13.1f} "
              f"{s['p90_abs_err_pct']:>10.1f} "
              f"{s['geomean_ratio']:>8.2f}")
    print(f"\n{'model':<5} {'nodes':>5} {'rho':>5} {'within 10%':>10} {'regret%':>8}  pick -> measured / best measured")
    for (model, nodes), g in groups(results).items():
        if g["pick"] is None:
            print(f"{model:<5} {nodes:>5}  nothing predicted to fit")
            continue
        print(f"{model:<5} {nodes:>5} {g['rho']:>5.2f} {'yes' if g['within_10_pct'] else 'no':>10} {100 * g['regret']:>8.1f}  "
              f"{g['pick']} -> {g['pick_measured']:.0f} / {g['best_measured']:.0f} ({g['best']})")
    s = summary(results)
    t = s["throughput"]
    print(f"\nok rows: throughput median |error| {t['median_abs_err_pct']:.1f} %, p90 {t['p90_abs_err_pct']:.1f} % "
          f"({t['n']} rows); rank-0 memory median |error| {s['memory_median_abs_err_pct']:.1f} %; "
          f"{s['ok_predicted_to_fit']} of {s['ran']} ok rows predicted to fit; crashed rows: "
          f"{s['crashed_predicted_not_to_fit']} predicted not to fit + {s['crashed_refused']} refused of {s['crashed']}; "
          f"with the family memory margin plan keeps: {s['ok_planned']} ok rows ranked, {s['crashed_not_planned']} "
          f"crashed rows not; "
          f"groups: pick within 10 % in {s['groups_within_10_pct']} of {s['groups']}, median regret "
          f"{s['median_regret_pct']:.1f} %, median rho {s['median_rho']:.2f}")
    u = s["throughput_unstalled"]
    print(f"without the {t['n'] - u['n']} stalled pipeline rows (stalled): median |error| {u['median_abs_err_pct']:.1f} %, "
          f"p90 {u['p90_abs_err_pct']:.1f} % ({u['n']} rows)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.playbook", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", action="store_true", help="every row, before the summaries")
    p.add_argument("--json", action="store_true", help="one JSON object per row, then the summary")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    results = run_all()
    if args.json:
        for r in results:
            print(json.dumps(r))
        print(json.dumps(summary(results)))
    else:
        print_report(results, args.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
