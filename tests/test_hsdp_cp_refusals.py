"""The refusals of the large runs' layouts (HSDP, context parallel, the distributed optimizer), before
anything is launched, with their arithmetic; and the cost model's terms for HSDP and context parallel (pure)."""
from __future__ import annotations

import pytest

from harness.config import to_run_config
from harness.dims import ConfigError
from harness.validate import validate
from tests.helpers import compose_config


def refusal(tmp_path, *overrides) -> str:
    with pytest.raises(ConfigError) as e:
        validate(to_run_config(compose_config(["model=tiny", *overrides], tmp_path)))
    return str(e.value)


def test_refusals_show_the_arithmetic(tmp_path):
    assert "dp 4 not divisible by dp_replicate 3" in refusal(tmp_path, "strategy=fsdp", "parallel.dp=4",
                                                             "parallel.dp_replicate=3")
    assert "HSDP) needs FSDP2" in refusal(tmp_path, "strategy=ddp", "parallel.dp=4", "parallel.dp_replicate=2")
    assert "seq_len 60 not divisible by 2 x cp = 8" in refusal(tmp_path, "strategy=3d", "parallel.cp=4",
                                                               "model.seq_len=60")
    assert "does not use the cp axis" in refusal(tmp_path, "strategy=fsdp", "parallel.cp=2")
    assert "context parallel with MoE" in refusal(tmp_path, "strategy=3d", "parallel.cp=2", "model=moe_tiny")
    assert "ep 2 with dp_replicate 1 / cp 2" in refusal(tmp_path, "strategy=3d", "model=moe_tiny", "parallel.dp=2",
                                                         "parallel.ep=2", "parallel.cp=2")
    assert "data_parallel=zero1 means nothing for strategy fsdp" in refusal(tmp_path, "strategy=fsdp", "parallel.dp=2",
                                                                      "strategy.data_parallel=zero1")
    assert "zero1_impl=distributed means nothing for strategy ddp" in refusal(
        tmp_path, "strategy=ddp", "parallel.dp=2", "strategy.zero1_impl=distributed")
    assert "fsdp_accumulate=sharded applies to FSDP2 only" in refusal(
        tmp_path, "strategy=ddp", "parallel.dp=2", "strategy.fsdp_accumulate=sharded")
    assert "data_parallel=fsdp" in refusal(tmp_path, "strategy=3d", "model=moe_tiny", "parallel.dp=2", "parallel.ep=2")
    assert "dp(2) * tp(2) * pp(2) = 8 != world size 4" in refusal(
        tmp_path, "strategy=3d", "model=moe_tiny", "parallel.dp=2", "parallel.ep=2", "parallel.tp=2",
        "parallel.pp=2", "strategy.data_parallel=ddp", "launcher.nproc_per_node=4")
    assert "cannot reduce tensor-parallel (DTensor) gradients" in refusal(
        tmp_path, "strategy=3d", "parallel.dp=2", "parallel.tp=2", "strategy.data_parallel=ddp")
    assert "dp(1) * cp(2) * tp(2) * pp(1) = 4 != world size 2" in refusal(
        tmp_path, "strategy=3d", "parallel.cp=2", "parallel.tp=2", "launcher.nproc_per_node=2")


def test_megatron_overlap_knobs_are_priced_not_run(tmp_path):
    """tp_comm_overlap / overlap_grad_reduce / overlap_param_gather: refused where Megatron-Core refuses
    them, and refused at launch everywhere (brigade's runtime has none; the published set predicts them)."""
    assert "needs tp > 1 (tp 1)" in refusal(tmp_path, "strategy=ddp", "parallel.dp=2", "strategy.tp_comm_overlap=true")
    assert "strategy.sequence_parallel=true (got false)" in refusal(
        tmp_path, "strategy=3d", "parallel.tp=2", "strategy.tp_comm_overlap=true")
    assert "needs strategy=zero1 with zero1_impl=distributed" in refusal(
        tmp_path, "strategy=ddp", "parallel.dp=2", "strategy.overlap_grad_reduce=true")
    msg = refusal(tmp_path, "strategy=3d", "parallel.dp=2", "parallel.tp=2", "strategy.data_parallel=zero1",
                  "strategy.sequence_parallel=true", "strategy.tp_comm_overlap=true", "strategy.overlap_param_gather=true")
    assert "strategy.tp_comm_overlap, strategy.overlap_param_gather" in msg and "does not implement" in msg
    run = to_run_config(compose_config(["model=tiny", "strategy=zero1", "parallel.dp=2", "strategy.zero1_impl=distributed",
                                        "strategy.overlap_grad_reduce=true"], tmp_path))
    assert validate(run, torch_runs=False).dp == 2


def test_low_precision_params_need_the_distributed_optimizer_under_bf16(tmp_path):
    """Run with the distributed optimizer under bf16-mixed; with DDP (Megatron-LM's bf16 module, as the Megatron-LM
    rows of the published set ran) priced by the cost model and refused at launch; refused everywhere else."""
    for overrides in (["strategy=fsdp", "parallel.dp=2", "workload.precision=bf16-mixed"],
                      ["strategy=zero1", "parallel.dp=2", "workload.precision=bf16-mixed"],  # torch_zero: DDP's fp32 params
                      ["strategy=zero1", "parallel.dp=2", "strategy.zero1_impl=distributed"],  # fp32
                      ["strategy=ddp", "parallel.dp=2"]):  # fp32
        msg = refusal(tmp_path, *overrides, "strategy.low_precision_params=true")
        assert "needs workload.precision=bf16-mixed and the distributed optimizer" in msg and "got strategy" in msg
    run = to_run_config(compose_config(["model=tiny", "strategy=3d", "parallel.dp=2", "parallel.tp=2", "strategy.data_parallel=zero1",
                                        "workload.precision=bf16-mixed", "strategy.low_precision_params=true"], tmp_path))
    assert validate(run).world_size == 4
    ddp = ["strategy=ddp", "parallel.dp=2", "workload.precision=bf16-mixed", "strategy.low_precision_params=true"]
    msg = refusal(tmp_path, *ddp)
    assert "priced by the cost model" in msg and "not run" in msg
    assert validate(to_run_config(compose_config(["model=tiny", *ddp], tmp_path)), torch_runs=False).dp == 2


def test_4d_and_cp_layouts_validate(tmp_path):
    for overrides in (["strategy=3d", "model=moe_tiny", "parallel.dp=2", "parallel.ep=2", "parallel.tp=2",
                       "parallel.pp=2", "strategy.data_parallel=ddp"],
                      ["strategy=3d", "parallel.dp=2", "parallel.cp=2", "parallel.tp=2"],
                      ["strategy=zero3", "parallel.dp=4", "parallel.dp_replicate=2", "strategy.fsdp_accumulate=sharded"]):
        dims = validate(to_run_config(compose_config(["model=tiny", *overrides], tmp_path)))
        assert dims.world_size == 8 if "parallel.pp=2" in overrides else True


def _predict(tmp_path, *overrides):
    from harness.costmodel import predict

    run = to_run_config(compose_config(["model=tiny", *overrides], tmp_path))
    return predict(run, validate(run))


def test_costmodel_hsdp_and_cp_terms(tmp_path):
    fsdp2 = _predict(tmp_path, "strategy=fsdp", "parallel.dp=2", "workload.global_batch_size=4")  # m = 1 as below
    hsdp = _predict(tmp_path, "strategy=fsdp", "parallel.dp=4", "parallel.dp_replicate=2")
    # HSDP 2 x 2: the states and the shard group's traffic of FSDP over 2; the replicas all-reduce the shard
    assert hsdp["model_states_bytes"] == fsdp2["model_states_bytes"]
    assert hsdp["comm_dp_bytes"] == fsdp2["comm_dp_bytes"]
    assert hsdp["comm_dp_replicate_bytes"] == pytest.approx(2 * (2 - 1) / 2 * hsdp["grads_bytes"])
    one = _predict(tmp_path, "strategy=single")
    cp2 = _predict(tmp_path, "strategy=3d", "parallel.cp=2")
    # cp 2: FSDP over the 2 cp ranks; half the activations plus the mask's (s/2, s) fp32 bias, held once;
    # K/V traffic per layer and micro-batch
    b, s, h, layers, micro = 2, 64, 128, 4, 4
    assert cp2["model_states_bytes"] == fsdp2["model_states_bytes"]
    assert cp2["activations_bytes"] == pytest.approx(one["activations_bytes"] / 2 + (s // 2) * s * 4)
    assert cp2["comm_cp_bytes"] == pytest.approx(micro * layers * 4 * (2 - 1) * b * (s // 2) * h * 4)
