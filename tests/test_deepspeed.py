"""The DeepSpeed engine: generated config, ZeRO 0-3 and ZeRO-3 with optimizer offload on 2 gloo
processes against the single-process reference, exact per-rank model-state bytes against the cost
model, refusals before launch, and no DeepSpeed op ever JIT-compiled."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest

from harness.strategies.deepspeed import config as ds_config
from harness.validate import prebuilt_ops
from tests.helpers import DEVICES, assert_losses_match, compose_config, device_overrides, run

STRATEGY_OF_STAGE = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}
ADAM_STEP_BYTES = 4  # AdamW's 0-d fp32 `step`: one per parameter it steps (one flat partition under ZeRO)


@contextlib.contextmanager
def no_jit_builds(tmp_path: Path):
    """Every op torch's cpp_extension JIT-builds lands in TORCH_EXTENSIONS_DIR: point the ranks at an
    empty one and require it to stay empty (a DeepSpeed that starts compiling fails here)."""
    ext = tmp_path / "torch_extensions"
    old = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(ext)  # launch/local.py hands os.environ to the ranks
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCH_EXTENSIONS_DIR", None)
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = old
    built = sorted(str(p.relative_to(ext)) for p in ext.rglob("*")) if ext.exists() else []
    assert not built, f"DeepSpeed JIT-compiled an op during the run: {built}"


def run_deepspeed(overrides: list[str], tmp_path: Path) -> dict:
    """One DeepSpeed run that must succeed without compiling anything; its record."""
    with no_jit_builds(tmp_path):
        rec = run(["strategy.engine=deepspeed", *overrides], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    ops = rec["measured"]["deepspeed"]["ops_loaded"]  # every op DeepSpeed loaded in the ranks
    assert "jit" not in ops.values(), f"ops built at run time: {ops}"
    return rec


def generated_config(rec: dict) -> dict:
    return json.loads((Path(rec["run_dir"]) / "deepspeed_config.json").read_text())


def expected_states(n4: int, stage: int) -> dict[str, int]:
    """What DeepSpeed holds per rank at dp=2 in fp32 for a model of n4 = 4N parameter bytes
    (tiny: every tensor has an even size, so no partition padding): docs/notes.md#deepspeed-master."""
    half = n4 // 2
    return {0: {"params_bytes": n4, "master_bytes": 0, "grads_bytes": n4},
            1: {"params_bytes": n4, "master_bytes": half, "grads_bytes": half},
            2: {"params_bytes": n4, "master_bytes": half, "grads_bytes": half},
            3: {"params_bytes": half, "master_bytes": half, "grads_bytes": half}}[stage]


# Extra switches folded into the stage runs (DeepSpeed init costs seconds: one run checks several things).
EXTRA = {1: ["strategy.ds.wall_clock_breakdown=true", "strategy.ds.comms_logger=true"],
         3: ["+strategy.ds.extra.zero_optimization.stage3_max_live_parameters=123456789"]}


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_matches_single_with_predicted_bytes(tmp_path, single_reference, stage, device):
    ref = single_reference(*device_overrides(device))
    rec = run_deepspeed([f"strategy={STRATEGY_OF_STAGE[stage]}", "parallel.dp=2", *EXTRA.get(stage, []),
                         "workload.profile_steps=1", *device_overrides(device)], tmp_path)
    m, p, r = rec["measured"], rec["predicted"], ref["measured"]
    assert_losses_match(m["losses"], r["losses"])

    # the generated DeepSpeed config: accumulation = micro-batches per rank, client optimizer only
    cfg = generated_config(rec)
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["train_batch_size"]) == (2, 2, 8)
    assert cfg["zero_optimization"]["stage"] == stage and "optimizer" not in cfg
    assert cfg["zero_force_ds_cpu_optimizer"] is False and cfg["zero_optimization"]["reduce_bucket_size"] == 5_000_000
    assert cfg["zero_optimization"]["overlap_comm"] is (stage == 3)  # DeepSpeed's default, made explicit

    # exact bytes per rank: measured == predicted, and both == the layout computed from single's params
    n4 = r["params_bytes"]
    for key, value in expected_states(n4, stage).items():
        assert m[f"{key}_per_rank"] == p[f"{key}_per_rank"] == [value, value], key
    opt = r["optimizer_bytes"] if stage == 0 else n4 + ADAM_STEP_BYTES  # Adam moments on the 1/2 partition
    assert m["optimizer_bytes_per_rank"] == p["optimizer_bytes_per_rank"] == [opt, opt]
    assert m["model_states_bytes_per_rank"] == p["model_states_bytes_per_rank"]
    assert abs(m["model_states_bytes"] - p["model_states_bytes"]) <= 0.01 * p["model_states_bytes"]
    # the ZeRO paper's ideal beside it (fp32: 4 + 4 + 8 bytes per parameter, sharded by stage)
    per_param = {0: 16, 1: 4 + 4 + 4, 2: 4 + 2 + 4, 3: 2 + 2 + 4}[stage]
    assert p["model_states_bytes_ideal"] == n4 // 4 * per_param

    ds = m["deepspeed"]
    assert ds["zero_stage"] == stage
    if stage == 1:  # DeepSpeed's own timers and comms logger, beside brigade's figures
        assert {"fwd_ms", "bwd_ms", "step_ms"} <= set(ds["timers_ms"]) and ds["timers_ms"]["fwd_ms"] > 0
        calls = [s for op, sizes in ds["comms"].items() if op != "steps_covered" for s in sizes.values()]
        assert calls and all(c["count"] > 0 and c["latency_ms_mean"] > 0 for c in calls)
        assert m["step_time_s"] > 0
    else:
        assert "timers_ms" not in ds and "comms" not in ds
    # the dp collectives' bytes as the profiled step's trace saw them: at stage 3 DeepSpeed keeps tiny's params
    # gathered from forward to backward (within stage3_max_reuse_distance), so each is gathered once
    # per micro-batch, not twice (harness/costmodel/ds_zero3.py)
    assert m["comm_dp_bytes"] == pytest.approx(p["comm_dp_bytes"], rel=0.05)
    if stage == 3:  # strategy.ds.extra is merged last, into the generated sections
        assert cfg["zero_optimization"]["stage3_max_live_parameters"] == 123456789
        assert cfg["zero_optimization"]["stage3_max_reuse_distance"] == 1_000_000_000
        assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 0


@pytest.mark.slow
def test_zero3_optimizer_offload_matches_single(tmp_path, single_reference):
    """ZeRO-3 with the optimizer in host memory, stepped by a client torch AdamW (no DeepSpeedCPUAdam)."""
    ref = single_reference()
    rec = run_deepspeed(["strategy=zero3", "parallel.dp=2", "strategy.offload=optimizer"], tmp_path)
    m, n4 = rec["measured"], ref["measured"]["params_bytes"]
    assert_losses_match(m["losses"], ref["measured"]["losses"])
    assert generated_config(rec)["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    # on the device: the param partition only; master, its grads and AdamW live in host memory
    assert m["model_states_bytes_per_rank"] == rec["predicted"]["model_states_bytes_per_rank"] == [n4 // 2] * 2
    assert m["deepspeed"]["offloaded_bytes"] == {"master_bytes": n4 // 2, "grads_bytes": n4 // 2,
                                                 "optimizer_bytes": n4 + ADAM_STEP_BYTES}


# -- before launch (no processes) ------------------------------------------------------------------

def refusal(overrides: list[str], tmp_path) -> str:
    rec = run(overrides, tmp_path)
    assert rec["status"] == "invalid", rec
    assert not (Path(tmp_path) / "runs").exists()  # refused before any run directory or process
    return rec["error"]


@pytest.mark.parametrize("overrides, reason", [
    (["strategy=zero2", "strategy.offload=optimizer"], "needs strategy.engine=deepspeed"),
    (["strategy=ddp", "strategy.engine=deepspeed", "strategy.offload=optimizer"],
     "needs ZeRO stage >= 1 (got 0): stage 0 has no ZeRO optimizer"),
    (["strategy=zero2", "strategy.engine=deepspeed", "strategy.offload=optimizer+params"],
     "needs ZeRO stage >= 3 (got 2): only stage 3 partitions the parameters"),
    (["strategy=zero2", "strategy.engine=deepspeed", "strategy.ds.cpu_adam=true"],
     "cpu_adam=true steps the optimizer on the host: it needs strategy.offload"),
])
def test_offload_refusals(tmp_path, overrides, reason):
    assert reason in refusal(["parallel.dp=2", *overrides], tmp_path)


def test_cpu_adam_without_prebuilt_op_is_refused(tmp_path):
    if prebuilt_ops().get("cpu_adam"):
        pytest.skip("this DeepSpeed install has cpu_adam prebuilt: DeepSpeedCPUAdam would load without a build")
    error = refusal(["strategy=zero2", "strategy.engine=deepspeed", "parallel.dp=2", "strategy.offload=optimizer",
                     "strategy.ds.cpu_adam=true"], tmp_path)
    assert "no prebuilt cpu_adam op: it would JIT-compile DeepSpeedCPUAdam" in error


# -- the generated config (pure) -------------------------------------------------------------------

def run_config(*overrides: str):
    from harness.config import to_run_config

    return to_run_config(compose_config(["model=tiny", *overrides], Path("/nonexistent")))


def test_generated_config_sections():
    run_ = run_config("strategy=zero3", "strategy.engine=deepspeed", "parallel.dp=2", "workload.precision=bf16-mixed",
                      "strategy.offload=optimizer+params", "strategy.ds.overlap_comm=true",
                      "+strategy.ds.extra.bf16.immediate_grad_update=false", "+strategy.ds.extra.steps_per_print=7")
    cfg = ds_config.build(run_, dp=2, num_microbatches=2)
    assert cfg["bf16"] == {"enabled": True, "immediate_grad_update": False} and "fp16" not in cfg
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3 and zero["overlap_comm"] is True and zero["contiguous_gradients"] is True
    assert zero["offload_optimizer"] == zero["offload_param"] == {"device": "cpu"}
    assert cfg["steps_per_print"] == 7 and cfg["wall_clock_breakdown"] is False and "comms_logger" not in cfg

    fp32 = ds_config.build(run_config("strategy=zero1", "strategy.engine=deepspeed", "parallel.dp=2",
                                      "workload.global_batch_size=16"), dp=2, num_microbatches=4)
    assert "bf16" not in fp32 and "fp16" not in fp32
    assert (fp32["train_batch_size"], fp32["gradient_accumulation_steps"]) == (16, 4)
    assert "offload_optimizer" not in fp32["zero_optimization"]
    assert "stage3_param_persistence_threshold" not in fp32["zero_optimization"]  # stage 3 knobs at stage 3 only
