"""DeepSpeed's pipeline (PipelineModule + train_batch) and MoE (deepspeed.moe.layer.MoE, ep_size 2)
against the single-process reference, and the combinations DeepSpeed refuses, refused before launch."""
from __future__ import annotations

import pytest

from tests.helpers import assert_losses_match
from tests.test_deepspeed import ADAM_STEP_BYTES, generated_config, refusal, run_deepspeed
from tests.test_pp import check_order_follows_schedule, check_timeline


@pytest.mark.slow
def test_pipeline_pp2_matches_single(tmp_path, single_reference):
    """pp=2, m=4 micro-batches through DeepSpeed's 1F1B schedule, ZeRO-1 (its pipeline allows 0/1)."""
    ref = single_reference()
    rec = run_deepspeed(["strategy=pp", "parallel.pp=2", "strategy.zero_stage=1"], tmp_path)
    m, p = rec["measured"], rec["predicted"]
    assert m["num_microbatches"] == 4 and generated_config(rec)["gradient_accumulation_steps"] == 4
    assert_losses_match(m["losses"], ref["measured"]["losses"])
    # stage 0: embeddings + blocks 0-1; stage 1: blocks 2-3 + ln_f + head. Together: the whole model once.
    params = m["params_bytes_per_rank"]
    assert params[0] != params[1] and sum(params) == ref["measured"]["params_bytes"]
    # ZeRO-1 over dp=1: the master "partition" is the whole stage, a copy DeepSpeed keeps even so
    assert m["master_bytes_per_rank"] == m["grads_bytes_per_rank"] == params
    assert m["model_states_bytes_per_rank"] == p["model_states_bytes_per_rank"]
    # its timeline, recorded as torch's pipelines' is: every F and B of the rank's stage, in the order of
    # the simulator's 1F1B (the bubble against the simulator's is a benchmark: tests/test_pp.py says why)
    assert rec["config"]["strategy"]["schedule"] == "1f1b"
    check_timeline(rec, "1f1b")
    check_order_follows_schedule(rec)


@pytest.mark.slow
def test_moe_ep2_matches_single(tmp_path, single_reference):
    """ep=2 on dp=2 under ZeRO-2: DeepSpeed MoE layers built from the single model's weights; expert
    parameters in their own optimizer group, partitioned over the expert-data group (dp/ep = 1 rank)."""
    ref = single_reference("model=moe_tiny")
    rec = run_deepspeed(["model=moe_tiny", "strategy=ep", "parallel.dp=2", "parallel.ep=2", "strategy.zero_stage=2",
                         "workload.profile_steps=1"], tmp_path)
    m, p = rec["measured"], rec["predicted"]
    assert_losses_match(m["losses"], ref["measured"]["losses"])
    L, E, h, d_ff = 4, 8, 128, 512  # moe_tiny
    experts4 = 4 * L * E * 2 * h * d_ff  # fp32 bytes of every expert weight
    dense4 = ref["measured"]["params_bytes"] - experts4
    assert m["params_bytes_per_rank"] == [dense4 + experts4 // 2] * 2  # half the experts per rank
    # dense group partitioned over dp=2, expert group over dp/ep=1: grads and master of both, per rank
    assert m["grads_bytes_per_rank"] == m["master_bytes_per_rank"] == [dense4 // 2 + experts4 // 2] * 2
    assert m["optimizer_bytes_per_rank"] == [2 * (dense4 // 2 + experts4 // 2) + 2 * ADAM_STEP_BYTES] * 2
    assert m["model_states_bytes_per_rank"] == p["model_states_bytes_per_rank"]
    # dp traffic as the profiled step saw it: ZeRO-2 all-reduces the dense gradients over dp each
    # micro-batch (the expert-data group has one rank here, so expert gradients move nowhere)
    assert m["comm_dp_bytes"] == pytest.approx(p["comm_dp_bytes"], rel=0.05)


@pytest.mark.parametrize("overrides, reason", [
    (["strategy=pp", "parallel.pp=2", "strategy.zero_stage=2"], "'ZeRO-2 and ZeRO-3 are incompatible with pipeline"),
    (["strategy=pp", "parallel.pp=2", "strategy.zero_stage=3"], "refuses ZeRO stage 3 with pipeline parallelism"),
    (["model=moe_tiny", "strategy=ep", "parallel.dp=2", "parallel.ep=2", "strategy.zero_stage=3"],
     "'MoE not supported with Stage 3'"),
    (["strategy=pp", "parallel.pp=2", "strategy.ds.wall_clock_breakdown=true"], "bwd_microstep timer"),
    (["strategy=pp", "parallel.pp=2", "parallel.vpp=2", "strategy.schedule=interleaved_1f1b"],
     "DeepSpeed's pipeline runs one stage per rank"),
])
def test_refused_before_launch(tmp_path, overrides, reason):
    assert reason in refusal(["strategy.engine=deepspeed", *overrides], tmp_path)
