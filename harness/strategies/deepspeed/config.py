"""The DeepSpeed JSON config, generated from brigade's RunConfig (pure: imports no torch, no deepspeed).

One Hydra config drives both engines, so the DeepSpeed config is derived, never hand-written:

    train_micro_batch_size_per_gpu = workload.micro_batch_size
    gradient_accumulation_steps    = num_microbatches          (per rank per optimizer step)
    train_batch_size               = micro * gas * dp          (= workload.global_batch_size)
    precision                      : fp32 -> none, bf16-mixed -> "bf16", fp16-mixed -> "fp16" (dynamic scale)
    zero_optimization              : stage + strategy.ds knobs + offload sections (strategy.offload)
    strategy.ds.extra              : merged last (deep merge), for anything without a field

The optimizer is never in the JSON: a config optimizer ("type": "AdamW") makes DeepSpeed JIT-compile
FusedAdam (~180 s on this CPU); the engine passes a client torch AdamW instead, and with offload
`zero_force_ds_cpu_optimizer: false` lets DeepSpeed accept it (else it insists on DeepSpeedCPUAdam,
a ~280 s compile unless prebuilt).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

from harness.rundir import write_atomic

# DeepSpeed's dynamic fp16 loss scaling defaults (loss_scale 0 = dynamic), stated so the JSON is explicit
FP16_SECTION = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                "hysteresis": 2, "min_loss_scale": 1}


def deep_merge(base: dict, extra: dict) -> dict:
    """`extra` over `base`, recursing into dicts (so extra={"zero_optimization": {"x": 1}} keeps the stage)."""
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def zero_section(run) -> dict:
    s, ds = run.strategy, run.strategy.ds
    # overlap_comm None: DeepSpeed's own default (True at stage 3), stated so the JSON says what ran
    overlap = ds.overlap_comm if ds.overlap_comm is not None else s.zero_stage == 3
    zero = {"stage": s.zero_stage,
            "overlap_comm": overlap,
            "contiguous_gradients": ds.contiguous_gradients,
            "reduce_scatter": ds.reduce_scatter,
            "reduce_bucket_size": ds.reduce_bucket_size,
            "allgather_bucket_size": ds.allgather_bucket_size}
    if s.zero_stage == 3:
        zero.update(stage3_param_persistence_threshold=ds.stage3_param_persistence_threshold,
                    stage3_prefetch_bucket_size=ds.stage3_prefetch_bucket_size,
                    stage3_max_live_parameters=ds.stage3_max_live_parameters,
                    stage3_max_reuse_distance=ds.stage3_max_reuse_distance)
    if s.offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = {"device": "cpu"}
    if s.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu"}
    return zero


def build(run, dp: int, num_microbatches: int) -> dict:
    """The DeepSpeed config dict for one run. `dp` is DeepSpeed's data-parallel size (world / pp)."""
    w, ds = run.workload, run.strategy.ds
    cfg = {
        "train_batch_size": w.micro_batch_size * num_microbatches * dp,
        "train_micro_batch_size_per_gpu": w.micro_batch_size,
        "gradient_accumulation_steps": num_microbatches,
        "gradient_clipping": 0.0,  # brigade's reference step does not clip
        "steps_per_print": 10**9,  # brigade records its own figures; keep DeepSpeed's log quiet
        "zero_optimization": zero_section(run),
        # the optimizer is always a client one (torch AdamW, or DeepSpeedCPUAdam with strategy.ds.cpu_adam):
        # with offload, DeepSpeed would otherwise refuse anything but DeepSpeedCPUAdam
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "wall_clock_breakdown": ds.wall_clock_breakdown,
    }
    if w.precision == "bf16-mixed":
        cfg["bf16"] = {"enabled": True}
    elif w.precision == "fp16-mixed":
        cfg["fp16"] = dict(FP16_SECTION)
    if ds.comms_logger:
        cfg["comms_logger"] = {"enabled": True, "verbose": False, "prof_all": True, "debug": False}
    return deep_merge(cfg, dict(ds.extra or {}))


def write(cfg: dict, run_dir) -> Path:
    path = Path(run_dir) / "deepspeed_config.json"
    write_atomic(path, json.dumps(cfg, indent=1, sort_keys=True))
    return path
