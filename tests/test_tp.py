"""tp on 2 processes: parity with single with and without sequence parallel and loss parallel, the
linear layers and the vocabulary sharded (bytes computed from the model shape), the plan covering
every module, and tp not dividing the heads refused before launch."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tests.helpers import DEVICES, assert_losses_match, assert_states_as_predicted, device_overrides, run

pytestmark = pytest.mark.slow


def tp_expected_bytes(model_cfg: dict, tp: int) -> dict:
    """Per tp rank, fp32: q, k, v, o, fc1, fc2 and the (V, h) embedding and head are split in tp
    equal parts (validation makes tp divide n_heads and d_ff; V = 1024 here); pos_emb (s, h) and
    the LayerNorms (2 per block + ln_f, weight and bias of h each) are replicated."""
    c = model_cfg
    h, L, V, s, f = c["d_model"], c["n_layers"], c["vocab_size"], c["seq_len"], c["d_ff"]
    assert V % tp == 0 and f % tp == 0 and h % tp == 0
    sharded = L * (4 * h * h + 2 * h * f) + 2 * V * h
    replicated = s * h + L * 4 * h + 2 * h
    local = sharded // tp + replicated
    n_tensors = L * 10 + 5  # per block ln1 w/b, q, k, v, o, ln2 w/b, fc1, fc2; tok, pos, ln_f w/b, head
    return {"params_bytes": 4 * local, "grads_bytes": 4 * local, "optimizer_bytes": 8 * local + 4 * n_tensors}


def _check_memory(rec: dict) -> None:
    m = rec["measured"]
    expected = tp_expected_bytes(rec["config"]["model"], 2)
    for key, value in expected.items():
        assert m[f"{key}_per_rank"] == [value] * 2, key
    assert_states_as_predicted(rec)


@pytest.mark.parametrize("device", DEVICES)
def test_tp_loss_parallel_matches_single_and_shards_linears(device, tmp_path, single_reference):
    ref = single_reference(*device_overrides(device))
    # 4 micro-batches per rank (tp ranks share the batch): accumulation under tp
    rec = run([*device_overrides(device), "strategy=tp", "parallel.tp=2", "strategy.loss_parallel=true"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert rec["measured"]["num_microbatches"] == 4
    assert_losses_match(rec["measured"]["losses"], ref["measured"]["losses"])
    _check_memory(rec)


@pytest.mark.parametrize("device", DEVICES)
def test_tp_sequence_parallel_matches_single(device, tmp_path, single_reference):
    ref = single_reference(*device_overrides(device))
    # SP with the logits all-gathered (no loss parallel) and each block recomputed in backward
    rec = run([*device_overrides(device), "strategy=tp", "parallel.tp=2", "strategy.sequence_parallel=true",
               "strategy.loss_parallel=false", "workload.activation_checkpointing=full"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert_losses_match(rec["measured"]["losses"], ref["measured"]["losses"])
    _check_memory(rec)  # SP makes the LayerNorm params Replicate DTensors: same bytes


def test_tp_plan_covers_the_model_and_matches_its_shapes(tmp_path):
    from harness.config import to_run_config
    from models import tp_plan
    from models.gpt import build_model
    from tests.helpers import compose_config

    cfg = to_run_config(compose_config(["model=tiny"], tmp_path)).model
    model = build_model(cfg, 0)
    assert tp_plan.param_shapes(cfg) == {n: tuple(p.shape) for n, p in model.named_parameters()}
    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):  # every module holding params is planned
            assert tp_plan.role_of(name) is not None, name
    roles = {tp_plan.role_of(n) for n, _ in model.named_modules()}
    assert {"colwise", "rowwise", "vocab_embedding", "head", "norm", "position", "gather_input"} <= roles
    expected = tp_expected_bytes(OmegaConf.to_container(OmegaConf.structured(cfg)), 2)["params_bytes"]
    assert 4 * tp_plan.local_param_numel(cfg, 2) == expected


def test_tp_not_dividing_heads_is_refused_before_launch(tmp_path):
    rec = run(["strategy=tp", "parallel.tp=3"], tmp_path)
    assert rec["status"] == "invalid"
    assert rec["error"] == "n_heads 4 not divisible by tp 3"
    assert rec["run_dir"] is None


def test_sequence_parallel_refusals_show_the_arithmetic(tmp_path):
    from harness.config import to_run_config
    from harness.dims import ConfigError
    from harness.validate import validate
    from tests.helpers import compose_config

    def refusal(*overrides):
        with pytest.raises(ConfigError) as e:
            validate(to_run_config(compose_config(["strategy=tp", "parallel.tp=2", "strategy.sequence_parallel=true",
                                                   *overrides], tmp_path)))
        return str(e.value)

    assert refusal("model=tiny", "model.seq_len=63") == "sequence_parallel: seq_len 63 not divisible by tp 2"
    assert "has 8 experts" in refusal("model=moe_tiny")
