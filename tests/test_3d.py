"""3d (dp x tp x pp on one mesh): 2x2x2 on 8 processes and a 2D dp x pp on 4 match `single`, and
every rank holds exactly its share of its stages' model states."""
from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from tests.helpers import _gpu_count, assert_losses_match, assert_states_as_predicted, device_overrides, run
from tests.test_pp import check_timeline, expected_state_bytes, rank_stages

pytestmark = pytest.mark.slow


def devices(world: int) -> list:
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        _gpu_count() < world, reason=f"needs {world} CUDA GPUs (one per rank); this machine has fewer")])]


def expected_3d_bytes(model_cfg: dict, stages: list[int], num_stages: int, dp: int, tp: int) -> dict:
    """Exact fp32 bytes of one rank: its stages' parameters (tiny's split: blocks evenly, embeddings
    first, ln_f + head last), each divided by tp if the TP plan (models/tp_plan.py) shards it, then
    by dp (FSDP2 shards every parameter on dim 0; every dim of model=tiny divides, so no padding).
    AdamW: two moments per element and one 0-d fp32 step per parameter tensor."""
    from models.gpt import build_model
    from models.tp_plan import SHARDED_DIM, role_of

    cfg = OmegaConf.create(model_cfg)
    per = cfg.n_layers // num_stages
    owned = {str(layer) for s in stages for layer in range(s * per, (s + 1) * per)}
    numel, tensors = 0, 0
    for name, p in build_model(cfg, 0).named_parameters():
        part = name.split(".")
        mine = (part[1] in owned if part[0] == "blocks" else
                0 in stages if part[0] in ("tok_emb", "pos_emb") else num_stages - 1 in stages)
        if not mine:
            continue
        n = math.prod(p.shape)
        if SHARDED_DIM[role_of(name.rsplit(".", 1)[0]) or "norm"] is not None:
            n //= tp
        assert n % dp == 0, name
        numel += n // dp
        tensors += 1
    return {"params_bytes": 4 * numel, "grads_bytes": 4 * numel, "optimizer_bytes": 8 * numel + 4 * tensors}


@pytest.mark.parametrize("device", devices(8))
def test_3d_2x2x2_fsdp_matches_single(device, tmp_path, single_reference):
    ref = single_reference(*device_overrides(device))
    rec = run([*device_overrides(device), "strategy=3d", "parallel.dp=2", "parallel.tp=2", "parallel.pp=2",
               "strategy.data_parallel=fsdp", "strategy.schedule=1f1b", "launcher.timeout_s=400"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    # dp=2: each replica takes 4 of the 8 sequences as 2 micro-batches of 2
    assert rec["measured"]["num_microbatches"] == 2
    assert_losses_match(rec["measured"]["losses"], ref["measured"]["losses"])

    m = rec["measured"]
    stages = rank_stages("1f1b", 2, 1)
    # rank = pp_rank * 4 + dp_rank * 2 + tp_rank: ranks 0-3 hold stage 0, ranks 4-7 stage 1
    expected = [expected_3d_bytes(rec["config"]["model"], stages[r // 4], 2, dp=2, tp=2) for r in range(8)]
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert m[f"{key}_per_rank"] == [e[key] for e in expected], key
    assert_states_as_predicted(rec)
    check_timeline(rec, "1f1b")


@pytest.mark.parametrize("device", devices(4))
def test_2d_dp2_ddp_x_pp2_interleaved_matches_single(device, tmp_path, single_reference):
    ref = single_reference(*device_overrides(device))
    rec = run([*device_overrides(device), "strategy=3d", "parallel.dp=2", "parallel.pp=2", "parallel.vpp=2",
               "strategy.data_parallel=ddp", "strategy.schedule=interleaved_1f1b"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert rec["measured"]["num_microbatches"] == 2  # 8 sequences / (dp 2 * micro 2)
    assert_losses_match(rec["measured"]["losses"], ref["measured"]["losses"])
    # DDP replicates over dp: every rank holds its pp coordinate's two stages whole
    stages = rank_stages("interleaved_1f1b", 2, 2)
    expected = [expected_state_bytes(rec["config"]["model"], stages[r // 2], 4) for r in range(4)]
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert rec["measured"][f"{key}_per_rank"] == [e[key] for e in expected], key
    assert_states_as_predicted(rec)
    check_timeline(rec, "interleaved_1f1b")
