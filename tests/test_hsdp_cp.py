"""The large runs' layouts on CPU (gloo): HSDP, context parallel, the distributed optimizer, FSDP's sharded
accumulation and MoE inside 3d. Each matches `single` (fp32, 1e-5 relative), holds exactly the
predicted model-state bytes on every rank, and moves the predicted bytes on each axis within 5 %
(one profiled step, counted by the flight recorder: harness/collect/trace_analysis.py)."""
from __future__ import annotations

import pytest

from tests.helpers import assert_losses_match, run

pytestmark = pytest.mark.slow
PROFILED = ["workload.profile_steps=1", "launcher.timeout_s=600"]
STATES = ("params_bytes", "grads_bytes", "optimizer_bytes", "master_bytes", "model_states_bytes")
AXES = ("dp", "dp_replicate", "cp", "tp", "pp", "ep")


def check(rec: dict, ref: dict, comm_axes=AXES) -> dict:
    assert rec["status"] == "ok", rec["error"]
    m, p = rec["measured"], rec["predicted"]
    assert_losses_match(m["losses"], ref["measured"]["losses"])
    for key in STATES:
        assert m[f"{key}_per_rank"] == p[f"{key}_per_rank"], key
    for axis in comm_axes:
        meas, pred = m.get(f"comm_{axis}_bytes", 0.0), p.get(f"comm_{axis}_bytes", 0.0)
        assert abs(meas - pred) <= 0.05 * max(pred, 1.0), (axis, meas, pred, m.get("comm_by_axis"))
    return m


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return tmp_path_factory.mktemp("hsdp_cp")


def test_hsdp_shards_within_a_group_and_all_reduces_across(results, single_reference):
    rec = run(["strategy=fsdp", "parallel.dp=4", "parallel.dp_replicate=2", *PROFILED], results)
    m = check(rec, single_reference())
    # shard group of 2: half the model per rank, whatever the 4 ranks
    full = single_reference()["measured"]["params_bytes"]
    assert m["params_bytes_per_rank"] == [full // 2] * 4
    assert m["comm_dp_replicate_bytes"] > 0 and "all_reduce" in m["comm_by_axis"]["dp_replicate"]


def test_context_parallel_splits_the_sequence(results, single_reference):
    rec = run(["strategy=3d", "parallel.cp=2", *PROFILED], results)
    m = check(rec, single_reference())
    # per layer and micro-batch: K and V all-gathered forward, their grads reduce-scattered backward
    calls = m["comm_by_axis"]["cp"]
    layers, micro = rec["config"]["model"]["n_layers"], rec["measured"]["num_microbatches"]
    assert calls["all_gather"]["count"] == calls["reduce_scatter"]["count"] == 2 * layers * micro


def test_cp_attention_hands_sdpa_one_mask_bias_for_every_layer():
    """Given cp's boolean mask, SDPA converts it on every call (aten.where) and keeps that (2c, T) copy
    for backward: one per layer. The cp attention hands it an additive bias made once per dtype instead:
    the same attention, no copy per call."""
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from harness.strategies.cp import ContextParallelAttention

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    core = ContextParallelAttention(None, seq_len=16, cp=2, cp_rank=1, device="cpu")
    q, k, v = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 16, 4), torch.randn(1, 2, 16, 4)
    assert core.bias(torch.float32) is core.bias(torch.float32)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=core.bias(q.dtype)),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=core.mask))
    with Ops() as with_bias:
        for _ in range(2):  # two layers
            F.scaled_dot_product_attention(q, k, v, attn_mask=core.bias(q.dtype))
    with Ops() as with_mask:
        F.scaled_dot_product_attention(q, k, v, attn_mask=core.mask)
    assert "where.self" not in with_bias.names and "where.self" in with_mask.names


@pytest.mark.heavy  # world 8; CI: cp in tests/test_grad_parity.py[3d_cp2] and test_context_parallel_splits_the_sequence
def test_context_parallel_with_tp_and_pp_and_fsdp(results, single_reference):
    rec = run(["strategy=3d", "parallel.cp=2", "parallel.tp=2", "parallel.pp=2", *PROFILED], results)
    check(rec, single_reference())


@pytest.mark.heavy  # world 8; CI: HSDP in test_hsdp_shards_within_a_group_and_all_reduces_across, cp as above
def test_hsdp_in_3d_over_cp(results, single_reference):
    rec = run(["strategy=3d", "parallel.dp=2", "parallel.dp_replicate=2", "parallel.cp=2",
               "model.attention=eager", "workload.activation_checkpointing=selective", *PROFILED], results)
    check(rec, single_reference("model.attention=eager"))


def test_distributed_optimizer_plain_and_in_3d(results, single_reference):
    rec = run(["strategy=zero1", "parallel.dp=2", "strategy.zero1_impl=distributed", *PROFILED], results)
    m = check(rec, single_reference())
    full = single_reference()["measured"]
    n = full["params_bytes"] // 4  # even halves of AdamW's moments, one step tensor; the fp32 slice as master
    assert m["optimizer_bytes_per_rank"] == [8 * n // 2 + 4] * 2 and m["master_bytes_per_rank"] == [4 * n // 2] * 2
    rec = run(["strategy=3d", "parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "strategy.data_parallel=zero1",
               *PROFILED], results)
    check(rec, single_reference())


def test_distributed_optimizer_with_low_precision_params(results, single_reference):
    """strategy.low_precision_params (Megatron-LM's --bf16): bf16 params, an fp32 gradient buffer and
    master slice, fp32 reduce-scatter, bf16 all-gather; the bytes held and moved are the predicted ones,
    with tp (DTensor params cast in place) and with a zero-bubble V schedule, whose weight-gradient pass
    assigns .grad (folded at the step) and whose turn stage -> stage stays on its rank (no pp send)."""
    fp32 = single_reference()["measured"]
    n = fp32["params_bytes"] // 4
    for layout in (["strategy=zero1", "strategy.zero1_impl=distributed"],
                   ["strategy=3d", "parallel.tp=2", "strategy.data_parallel=zero1", "strategy.sequence_parallel=true"],
                   ["strategy=3d", "parallel.pp=2", "parallel.vpp=2", "strategy.schedule=zbv_zero_bubble",
                    "strategy.data_parallel=zero1"]):
        rec = run([*layout, "parallel.dp=2", "workload.precision=bf16-mixed", "strategy.low_precision_params=true",
                   *PROFILED], results)
        assert rec["status"] == "ok", rec["error"]
        m, p = rec["measured"], rec["predicted"]
        # bf16 weights and activations: the loss follows fp32's to a few bf16 roundings (2^-8), not to 1e-5
        assert max(abs(a - b) / b for a, b in zip(m["losses"], fp32["losses"])) <= 2e-2, (m["losses"], fp32["losses"])
        for key in STATES:
            assert m[f"{key}_per_rank"] == p[f"{key}_per_rank"], (layout, key)
        for axis in AXES:
            meas, pred = m.get(f"comm_{axis}_bytes", 0.0), p.get(f"comm_{axis}_bytes", 0.0)
            assert abs(meas - pred) <= 0.05 * max(pred, 1.0), (layout, axis, meas, pred)
        if layout[0] == "strategy=zero1":  # 2 B per param; the fp32 buffer, master and moments as in fp32
            assert m["params_bytes_per_rank"] == [2 * n] * 2 and m["grads_bytes_per_rank"] == [4 * n] * 2
            assert m["comm_dp_bytes"] == 0.5 * (4 * n + 2 * n)  # (N-1)/N of an fp32 reduce-scatter and a bf16 all-gather


@pytest.mark.parametrize("overrides", [["strategy=fsdp", "parallel.dp=2"],
                                       # the pipeline's own stage hook: `make test-all` (CI: the fsdp row)
                                       pytest.param(["strategy=3d", "parallel.dp=2", "parallel.pp=2"],
                                                    marks=pytest.mark.heavy)])
def test_fsdp_sharded_accumulation_reduce_scatters_every_microbatch(results, single_reference, overrides):
    counts = {}
    for mode in ("unsharded", "sharded"):
        rec = run([*overrides, f"strategy.fsdp_accumulate={mode}", *PROFILED], results)
        m = check(rec, single_reference(), comm_axes=("cp", "tp", "ep"))
        counts[mode] = m["comm_by_axis"]["dp"]["reduce_scatter"]["count"]
    micro = rec["measured"]["num_microbatches"]
    assert micro == 2 and counts["sharded"] == micro * counts["unsharded"], counts


def test_moe_inside_3d_world_8(results, single_reference):
    rec = run(["model=moe_tiny", "strategy=3d", "parallel.dp=2", "parallel.ep=2", "parallel.tp=2", "parallel.pp=2",
               "strategy.data_parallel=ddp", *PROFILED], results)
    check(rec, single_reference("model=moe_tiny"), comm_axes=("dp", "tp", "pp"))
    assert rec["measured"]["comm_ep_bytes"] > 0
