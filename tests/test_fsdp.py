"""fsdp / zero2 / zero3 on engine torch (FSDP2) on 2 processes: parity with single, exactly half the
model states per rank, the bf16 mixed-precision policy, and which module each engine runs."""
from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from tests.helpers import (
    DEVICES,
    assert_losses_match,
    assert_states_as_predicted,
    compose_config,
    device_overrides,
    run,
)

pytestmark = pytest.mark.slow


def fsdp_expected_bytes(model_cfg: dict, n: int) -> list[dict]:
    """Per dp rank: FSDP2 splits every parameter on dim 0 in torch.chunk pieces of c = ceil(d0/n)
    rows; rank r holds min(c, max(0, d0 - r*c)) rows (its storage is padded to c rows, but the
    local DTensor, which is what is counted, has only the rank's rows). Grads and AdamW moments
    follow the same split; AdamW's 0-d fp32 step counter exists on every rank for every tensor."""
    from models.gpt import build_model

    shapes = [tuple(p.shape) for p in build_model(OmegaConf.create(model_cfg), 0).parameters()]
    out = []
    for r in range(n):
        local = 0
        for shape in shapes:
            c = math.ceil(shape[0] / n)
            local += min(c, max(0, shape[0] - r * c)) * math.prod(shape[1:])
        out.append({"params_bytes": 4 * local, "grads_bytes": 4 * local,
                    "optimizer_bytes": 8 * local + 4 * len(shapes)})
    return out


def _check_half_of_single(rec: dict, ref: dict) -> None:
    m, r = rec["measured"], ref["measured"]
    expected = fsdp_expected_bytes(rec["config"]["model"], 2)
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert m[f"{key}_per_rank"] == [e[key] for e in expected], key
    # model=tiny: every dim 0 is even, so there is no padding and each rank holds exactly half
    n_tensors = (r["optimizer_bytes"] - 2 * r["params_bytes"]) // 4
    assert m["params_bytes_per_rank"] == [r["params_bytes"] // 2] * 2
    assert m["grads_bytes_per_rank"] == [r["grads_bytes"] // 2] * 2
    assert m["optimizer_bytes_per_rank"] == [(r["optimizer_bytes"] - 4 * n_tensors) // 2 + 4 * n_tensors] * 2
    assert_states_as_predicted(rec)  # the cost model's fsdp family, rank by rank


@pytest.mark.parametrize("device", DEVICES)
def test_fsdp_matches_single_with_half_the_model_states(device, tmp_path, single_reference):
    ref = single_reference(*device_overrides(device))
    # 2 micro-batches per rank (accumulation without resharding) and full activation checkpointing
    rec = run([*device_overrides(device), "strategy=fsdp", "parallel.dp=2", "workload.activation_checkpointing=full"],
              tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert rec["measured"]["num_microbatches"] == 2
    assert_losses_match(rec["measured"]["losses"], ref["measured"]["losses"])
    _check_half_of_single(rec, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_zero2_torch_keeps_params_from_forward_to_backward(device, tmp_path, single_reference):
    ref = single_reference(*device_overrides(device))
    rec = run([*device_overrides(device), "strategy=zero2", "parallel.dp=2"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert rec["config"]["strategy"]["reshard_after_forward"] is False
    assert_losses_match(rec["measured"]["losses"], ref["measured"]["losses"])
    _check_half_of_single(rec, ref)  # sharded at rest, like zero3; only the step's transient differs


@pytest.mark.parametrize("device", DEVICES)
def test_fsdp_bf16_mixed_policy_trains_with_fp32_shards(device, tmp_path, single_reference):
    ref = single_reference(*device_overrides(device))
    rec = run([*device_overrides(device), "strategy=fsdp", "parallel.dp=2", "workload.precision=bf16-mixed"],
              tmp_path)
    assert rec["status"] == "ok", rec["error"]
    losses, r = rec["measured"]["losses"], ref["measured"]["losses"]
    assert losses[-1] < losses[0], losses
    # bf16 keeps 8 significant bits (relative rounding 2^-8 = 3.9e-3) in every matmul: the loss
    # follows fp32's to a few times that, not to 1e-5
    assert max(abs(a - b) / b for a, b in zip(losses, r)) <= 2e-2, (losses, r)
    assert losses != r  # the policy is in effect: bf16 compute does not reproduce fp32's numbers
    _check_half_of_single(rec, ref)  # the sharded master params, grads and moments stay fp32


def test_zero_stages_compare_like_for_like_across_engines(tmp_path):
    from harness.catalog import module_of
    from harness.config import to_run_config

    def module_name(cfg):
        return module_of(cfg.name, cfg.engine)

    for name, stage, reshard in (("zero2", 2, False), ("zero3", 3, True), ("fsdp", 3, True)):
        torch_cfg = to_run_config(compose_config([f"strategy={name}"], tmp_path)).strategy
        assert (module_name(torch_cfg), torch_cfg.zero_stage, torch_cfg.reshard_after_forward) == (
            "harness.strategies.fsdp", stage, reshard)
        ds_cfg = to_run_config(compose_config([f"strategy={name}", "strategy.engine=deepspeed"], tmp_path)).strategy
        assert (module_name(ds_cfg), ds_cfg.zero_stage) == ("harness.strategies.deepspeed.zero", stage)
    z1 = to_run_config(compose_config(["strategy=zero1"], tmp_path)).strategy
    assert (module_name(z1), z1.zero_stage) == ("harness.strategies.zero1", 1)


def test_bf16_comm_hook_sets_fsdp_reduce_dtype():
    """strategy.comm_hook=bf16 is FSDP2's bf16 gradient reduction (Composer's PURE); the default stays fp32."""
    import torch

    from harness.strategies.fsdp import mixed_precision_policy

    assert mixed_precision_policy("bf16-mixed").reduce_dtype == torch.float32
    assert mixed_precision_policy("bf16-mixed", "bf16").reduce_dtype == torch.bfloat16
    assert mixed_precision_policy("fp32").reduce_dtype is None  # fp32 training keeps fp32 throughout
    assert mixed_precision_policy("fp32", "bf16").reduce_dtype == torch.bfloat16  # as DDP's bf16 hook
