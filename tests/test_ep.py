"""Multi-process tier: expert parallel MoE (experts sharded over ep, all-to-all on gloo) matches the
single-process MoE, holds exactly n_experts/ep experts per rank, and logs the expert load."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import DEVICES, assert_losses_match, assert_states_as_predicted, device_overrides, run
from tests.test_moe import moe_tiny_state_bytes

pytestmark = pytest.mark.slow

TOKENS_PER_STEP = 8 * 64  # workload.global_batch_size * moe_tiny seq_len
TOP_K, N_EXPERTS, N_LAYERS = 2, 8, 4


def on(device: str, world: int) -> list[str]:
    """Overrides for a device; a CUDA run needs one GPU per rank."""
    if device == "cuda" and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs (one per rank), found {torch.cuda.device_count()}")
    return device_overrides(device)


def check_expert_load(rec: dict) -> dict:
    w = rec["config"]["workload"]
    load = rec["measured"]["expert_load"]
    assert load["first_timed_step"] == w["warmup_steps"]
    assert len(load["tokens_per_expert"]) == w["warmup_steps"] + w["steps"]
    for step, dropped in zip(load["tokens_per_expert"], load["dropped_tokens"]):
        assert len(step) == N_LAYERS and all(len(layer) == N_EXPERTS for layer in step)
        # every token of the global batch routed to top_k experts, counted once (not per rank, not twice)
        assert [sum(layer) for layer in step] == [TOKENS_PER_STEP * TOP_K] * N_LAYERS
        assert all(0 <= d <= TOKENS_PER_STEP * TOP_K for d in dropped)
    for step, ratios in zip(load["tokens_per_expert"], load["max_mean_ratio"]):
        assert ratios == pytest.approx([max(l) / (sum(l) / N_EXPERTS) for l in step], abs=1e-6)
    assert 1.0 <= load["timed_max_mean_ratio_mean"] <= load["timed_max_mean_ratio_max"] <= N_EXPERTS
    return load


@pytest.mark.parametrize("device", DEVICES)
def test_ep2_matches_single(tmp_path, single_reference, device):
    """ep=2 on dp=2: each rank holds half the experts, tokens cross by all-to-all, losses equal single's."""
    ref = single_reference("model=moe_tiny", *on(device, 2))
    rec = run(["strategy=ep", "model=moe_tiny", "parallel.dp=2", "parallel.ep=2", *on(device, 2)], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert rec["dims"] == {"dp": 2, "tp": 1, "pp": 1, "vpp": 1, "ep": 2, "world_size": 2, "cp": 1, "dp_replicate": 1}
    assert_losses_match(rec["measured"]["losses"], ref["measured"]["losses"])

    params, optimizer = moe_tiny_state_bytes(n_experts_held=N_EXPERTS // 2)
    m = rec["measured"]
    assert m["params_bytes_per_rank"] == m["grads_bytes_per_rank"] == [params, params]
    assert m["optimizer_bytes_per_rank"] == [optimizer, optimizer]
    assert m["model_states_bytes"] == 2 * params + optimizer < ref["measured"]["model_states_bytes"]
    assert_states_as_predicted(rec)
    load = check_expert_load(rec)
    assert load["timed_dropped_tokens"] == 0  # capacity_factor 0: no limit


@pytest.mark.heavy  # world 4; CI: ep in the other test here and tests/test_grad_parity.py[ep_dp4_ep2] (dp4 ep2 with SGD)
@pytest.mark.parametrize("device", DEVICES)
def test_ep2_on_dp4_capacity_limited_with_checkpointing(tmp_path, single_reference, device):
    """dp=4 = 2 replicas (dp_rep) of an ep group of 2: expert gradients are summed over dp_rep and the
    update still equals single's. Capacity factor 1.0 drops routes exactly as one process does
    (capacity is per micro-batch group: the same tokens either way). Full activation checkpointing
    re-runs each block (and its all-to-alls) in backward: losses still match, load counted once."""
    common = ["model=moe_tiny", "model.capacity_factor=1.0", *on(device, 4)]
    ref = single_reference(*common)
    rec = run(["strategy=ep", "parallel.dp=4", "parallel.ep=2", "workload.activation_checkpointing=full", *common],
              tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert_losses_match(rec["measured"]["losses"], ref["measured"]["losses"])
    params, optimizer = moe_tiny_state_bytes(n_experts_held=N_EXPERTS // 2)
    assert rec["measured"]["model_states_bytes_per_rank"] == [2 * params + optimizer] * 4
    assert_states_as_predicted(rec)
    load = check_expert_load(rec)
    assert load["timed_dropped_tokens"] > 0  # capacity 1.0 x 2 x 128 tokens / 8 experts = 32 routes bites
