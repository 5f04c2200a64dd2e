"""Pipelines practitioners run: stages of unequal layer counts (a layer count pp does not divide, or an
explicit split) and fewer micro-batches than stages. The split rule, its refusals with their arithmetic,
the cost model's ranks and prices, and real runs on 2-3 CPU processes against `single`."""
from __future__ import annotations

import pytest

from harness.config import compose_run
from harness.costmodel.inputs import Hardware, Model, StrategyKnobs
from harness.costmodel.layout import layout
from harness.dims import ConfigError
from harness.predict import predict_overrides
from harness.validate import validate
from models.pipeline_split import stage_layer_counts, stage_splits
from tests.helpers import assert_losses_match, run


def test_the_split_rule_gives_the_first_stages_the_extra_layers():
    assert stage_layer_counts(28, 8) == (4, 4, 4, 4, 3, 3, 3, 3)
    assert stage_layer_counts(80, 32) == (3,) * 16 + (2,) * 16
    assert stage_layer_counts(126, 16) == (8,) * 14 + (7,) * 2  # Llama 3 405B's 126 layers on 16 stages
    assert stage_layer_counts(8, 3, (2, 4, 2)) == (2, 4, 2)
    splits = stage_splits(7, 3)
    assert [s.layers for s in splits] == [(0, 1, 2), (3, 4), (5, 6)]
    assert splits[0].embeddings and splits[-1].head and not splits[1].embeddings


@pytest.mark.parametrize("overrides, words", [
    (["strategy.stage_layers=[2,2,2]"], "3 counts summing to 6, need pp 2 * vpp 1 = 2 counts"),
    (["strategy.stage_layers=[8,0]"], "of at least 1 summing to n_layers 8"),
    (["parallel.pp=8", "parallel.vpp=2", "strategy.schedule=interleaved_1f1b", "workload.global_batch_size=32"],
     "n_layers 8 < pp*vpp 16"),
    (["parallel.pp=3", "strategy.engine=deepspeed"], "engine deepspeed splits a pipeline evenly only: n_layers 8 % pp*vpp 3 = 2"),
])
def test_a_split_that_cannot_run_is_refused_with_its_arithmetic(overrides, words):
    run_cfg = compose_run(["model=small", "strategy=pp", "parallel.pp=2", *overrides, "logger=none"])
    with pytest.raises(ConfigError, match=words.replace("*", r"\*")):
        validate(run_cfg)


OVERRIDES = ["model=gpt_70b", "hardware=h100_sxm", "strategy=3d", "parallel.dp=1", "parallel.tp=8", "parallel.pp=32",
             "workload.global_batch_size=64", "workload.micro_batch_size=1", "workload.precision=bf16-mixed",
             "logger=none"]


def test_an_uneven_split_is_accepted_and_priced_by_its_heaviest_stage():
    run_cfg = compose_run(OVERRIDES)
    validate(run_cfg, torch_runs=False)
    md, hw, st = Model.of(run_cfg.model), Hardware.of(run_cfg.hardware), StrategyKnobs.of(run_cfg.strategy)
    lo = layout(md, hw, st, 1, 8, 32, 1, 1, "bf16-mixed")
    # ranks 0-15 hold 3 blocks, 16-31 hold 2: one rank of each kind stands for its kind
    assert sum(r.layers * r.weight for r in lo.ranks) == 80 and sum(r.weight for r in lo.ranks) == 32
    assert {r.pp_rank: r.layers for r in lo.ranks} == {0: 3, 1: 3, 16: 2, 31: 2}
    detail = layout(md, hw, st, 1, 8, 32, 1, 1, "bf16-mixed", detail=True)
    assert [r.layers for r in detail.ranks] == list(stage_layer_counts(80, 32))
    assert max(r.numel for r in lo.ranks) == max(r.numel for r in detail.ranks)
    # an explicit split: the head's stage holds one block, 17 stages hold 3 and 14 hold 2
    split = [3] * 17 + [2] * 14 + [1]
    ex_cfg = compose_run([*OVERRIDES, "strategy.stage_layers=[" + ",".join(map(str, split)) + "]"])
    validate(ex_cfg, torch_runs=False)
    ex = layout(md, hw, StrategyKnobs.of(ex_cfg.strategy), 1, 8, 32, 1, 1, "bf16-mixed")
    assert sum(r.layers * r.weight for r in ex.ranks) == 80 and [r for r in ex.ranks if r.last][0].layers == 1


def test_1f1b_with_fewer_micro_batches_than_stages_is_priced_and_said_not_run():
    out = predict_overrides(["model=small", "strategy=pp", "parallel.pp=4", "strategy.schedule=1f1b",
                             "workload.global_batch_size=2", "workload.micro_batch_size=1", "logger=none"])
    assert out["status"] == "ok" and out["step_time_s"] > 0 and out["bubble_time_s"] > 0
    assert "1f1b needs num_microbatches >= stages" in out["not_run"] and "< pp 4" in out["not_run"]
    # on more micro-batches the same layout runs and its bubble share is smaller
    runs = predict_overrides(["model=small", "strategy=pp", "parallel.pp=4", "strategy.schedule=1f1b",
                              "workload.global_batch_size=8", "workload.micro_batch_size=1", "logger=none"])
    assert "not_run" not in runs and runs["bubble_pct"] < out["bubble_pct"]


@pytest.mark.slow
def test_uneven_1f1b_on_3_stages_matches_single(tmp_path, single_reference):
    """model=tiny's 4 layers on pp 3: stages of 2, 1, 1 blocks; 1F1B with m = 4."""
    ref = single_reference()
    rec = run(["strategy=pp", "parallel.pp=3", "strategy.schedule=1f1b"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert_losses_match(rec["measured"]["losses"], ref["measured"]["losses"])
    assert sum(rec["measured"]["params_bytes_per_rank"]) == ref["measured"]["params_bytes"]


@pytest.mark.slow
def test_explicit_split_and_one_micro_batch_on_2_stages_match_single(tmp_path, single_reference):
    """An explicit split [3, 1] under GPipe with m = 1 < 2 stages (torch's GPipe allows it)."""
    ref = single_reference("workload.global_batch_size=2")
    rec = run(["strategy=pp", "parallel.pp=2", "strategy.schedule=gpipe", "strategy.stage_layers=[3,1]",
               "workload.global_batch_size=2"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert rec["measured"]["num_microbatches"] == 1
    assert_losses_match(rec["measured"]["losses"], ref["measured"]["losses"])
    first, last = rec["measured"]["params_bytes_per_rank"]
    assert first > last  # three blocks and the embeddings against one block and the head
