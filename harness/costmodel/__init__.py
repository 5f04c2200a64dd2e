"""The cost model: analytic predictions for a config, under the same names as the measured figures.

Pure Python: it imports no torch, so `python -m harness.predict` and the planner start fast and run
anywhere. One formula per function, each citing its source:

    params.py       parameter inventory and placement under TP / PP / EP
    memory.py       model-state bytes per engine (one function per state_sharding) and the ZeRO paper's ideal
    activations.py  activation bytes (Korthikanti et al. 2022; brigade's own constants)
    flops.py        model / hardware FLOPs (Megatron convention)
    traffic.py      bytes of the memory-bound work (element-wise ops, gradient accumulation, AdamW)
    comm.py         bytes per axis with nccl-tests bus factors, α-β times
    pipeline.py     bubble (GPipe / 1F1B / interleaved / zero-bubble), by the catalog's bubble kind
    schedule.py     the pipeline schedule simulator (the Gantt chart a schedule predicts)
    inputs.py       model, hardware and strategy reduced to numbers once
    layout.py       placement, per-rank model states, per-token costs and links of one parallel layout
    dp_comm.py      the dp axis' collectives per engine and accumulation mode, and how each overlaps
    compute.py      one micro-batch's time: GEMMs by shape, attention, element-wise work
    step_time.py    compute, bubble, comm per axis and the exposed part of it
    memory_peak.py  the worst rank's peak memory
    estimate.py     the assembled prediction; predict_figures.py the figures only predict adds
    published.py    the cost model against published GPU runs (lab/published_runs.yaml)
    hsdp_cp.py      HSDP (dp_replicate) and context parallel (cp) over the base estimate

What a strategy or schedule is (its axes, state sharding, stage placement) is harness/catalog.py.

Per rank means the maximum over ranks; `*_per_rank` lists give every rank, in harness/dims.py's rank
order, where ranks differ.
"""
from harness.costmodel.flops import model_flops_per_step  # noqa: F401
from harness.validate import num_microbatches

# Imports inside functions: harness.costmodel, harness.costmodel.estimate, harness.costmodel.inputs, which
# would make an import cycle at the top.


def predict(run, dims) -> dict:
    """Predicted figures for one config (RunConfig, ParallelDims), under the same names as the measured ones."""
    from harness.costmodel import hsdp_cp
    from harness.costmodel.estimate import evaluate
    from harness.costmodel.inputs import Hardware, Model, StrategyKnobs

    w = run.workload
    m = num_microbatches(run, dims)
    hw, st = Hardware.of(run.hardware), StrategyKnobs.of(run.strategy, run.runtime)

    def at(dp: int, mb: float = w.micro_batch_size) -> dict:  # the base estimate at data degree dp (HSDP, cp:
        # harness/costmodel/hsdp_cp.py)
        return evaluate(Model.of(run.model), hw, st, dp, dims.tp, dims.pp, dims.vpp, dims.ep, mb, m,
                        w.precision, w.activation_checkpointing, nodes=run.launcher.nodes, detail=True,
                        weight_decay=w.weight_decay)
    out = at(hsdp_cp.base_data_degree(dims, False))
    shard = at(hsdp_cp.base_data_degree(dims, True)) if dims.dp_replicate > 1 else None
    local = at(hsdp_cp.base_data_degree(dims, dims.dp_replicate > 1), w.micro_batch_size / dims.cp) if dims.cp > 1 else None
    out = hsdp_cp.adjust(out, shard, run.model, w, run.strategy.fsdp_accumulate, dims, hw, m, local)
    out["hardware"] = run.hardware.name
    return out
