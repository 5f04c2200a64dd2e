"""tp on 2 processes: parity with single with and without sequence parallel and loss parallel, the
linear layers and the vocabulary sharded (bytes computed from the model shape), the embedding's grad
sharded as it reaches FSDP, the plan covering every module, and tp not dividing the heads refused
before launch."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from harness.config import compose_run
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


def _backward_outputs_under_tp_and_fsdp(run) -> list[tuple[str, int]]:
    """In a forked child, rank 0 of dp2 x tp2 on the fake process group: the model under TP then FSDP
    (as a 3d stage), one micro-batch's forward and backward without gradient sync (what the first
    micro-batches of gradient accumulation do); returns (operator, output bytes) of backward's ops."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from harness.strategies.fsdp import apply_fsdp
    from harness.strategies.tp import apply_tensor_parallel, register_grad_hooks
    from harness.validate import validate
    from harness.worker.measure import local_tensor
    from models.gpt import build_model, materialize

    dims = validate(run)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dims.world_size)
    mesh = dims.build_mesh("cpu")
    model = apply_fsdp(apply_tensor_parallel(build_model(run.model, device="meta"), mesh["tp"], run), mesh["dp"], run)
    model = materialize(model, "cpu", 0)
    register_grad_hooks(model)
    model.set_requires_gradient_sync(False)
    tokens = torch.randint(0, run.model.vocab_size, (1, run.model.seq_len))
    loss = model(tokens).float().logsumexp(-1).mean()

    class Outputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.made += [(str(func), local_tensor(t).untyped_storage().nbytes())
                          for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            return out

    with Outputs() as seen:
        loss.backward()
    dist.destroy_process_group()
    return seen.made


def test_the_vocab_parallel_embeddings_grad_reaches_fsdp_as_a_shard():
    """DTensor's embedding backward makes the vocab-sharded embedding's grad whole (V, h); brigade's
    hook slices it back to the rank's rows as autograd produces it. Under FSDP the hook must sit on the
    parameter the forward uses (FSDP's unsharded one): else FSDP casts the whole (V, h) grad to fp32
    and holds it across micro-batches, 4 GiB a rank for llama3_70b (the dryrun_scale 3d rows)."""
    from launch.fork import run_forked

    run = compose_run(["model=llama_tiny", "strategy=3d", "parallel.dp=2", "parallel.tp=2",
                       "workload.precision=bf16-mixed", "workload.global_batch_size=4", "workload.micro_batch_size=1"])
    V, h = run.model.vocab_size, run.model.d_model
    made = run_forked(_backward_outputs_under_tp_and_fsdp, run)
    casts = [n for op, n in made if op.startswith("aten._to_copy")]
    assert casts.count(V // 2 * h * 4) == 2  # FSDP's fp32 copies of this rank's rows: embedding's and head's grads
    assert V * h * 4 not in casts  # never of the whole table
