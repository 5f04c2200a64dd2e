"""zero1 on engine torch (DDP + ZeroRedundancyOptimizer) on 2 processes: parity with single, params
and grads replicated, optimizer state split by the sorted-greedy partition, computed here."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tests.helpers import DEVICES, assert_losses_match, assert_states_as_predicted, device_overrides, run

pytestmark = pytest.mark.slow


def greedy_partition(sizes: list[int], n: int) -> list[list[int]]:
    """ZeroRedundancyOptimizer's split: largest tensor first, each to the rank with the fewest
    elements so far (ties: the lowest rank)."""
    ranks: list[list[int]] = [[] for _ in range(n)]
    for size in sorted(sizes, reverse=True):
        r = min(range(n), key=lambda i: (sum(ranks[i]), i))
        ranks[r].append(size)
    return ranks


@pytest.mark.parametrize("device", DEVICES)
def test_zero1_matches_single_and_shards_optimizer_state(device, tmp_path, single_reference):
    from models.gpt import build_model

    ref = single_reference(*device_overrides(device))
    # selective activation checkpointing on top: recomputing the attention core changes no number
    rec = run([*device_overrides(device), "strategy=zero1", "parallel.dp=2",
               "workload.activation_checkpointing=selective"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    m, r = rec["measured"], ref["measured"]
    assert_losses_match(m["losses"], r["losses"])

    assert m["params_bytes_per_rank"] == [r["params_bytes"]] * 2  # replicated, as in DDP
    assert m["grads_bytes_per_rank"] == [r["grads_bytes"]] * 2
    model = build_model(OmegaConf.create(rec["config"]["model"]), 0)
    parts = greedy_partition([p.numel() for p in model.parameters()], 2)
    # AdamW on the owned tensors: exp_avg + exp_avg_sq (fp32) + a 0-d fp32 step per tensor
    expected = [8 * sum(part) + 4 * len(part) for part in parts]
    assert m["optimizer_bytes_per_rank"] == expected
    assert sum(expected) == r["optimizer_bytes"]  # together the ranks hold exactly single's state
    assert_states_as_predicted(rec)  # the cost model's zero1_torch family, rank by rank
