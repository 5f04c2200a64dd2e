"""The predicted peak explains itself: `python -m harness.predict` gives it as named terms (whole bytes on
the peak rank at the peak's phase, harness/costmodel/memory_peak.py TERMS) that add up to it exactly, for
every layout family; and `activations_bytes` is one figure with its per-rank list."""
from __future__ import annotations

import json
import re

import pytest

from harness.costmodel.memory_peak import ACTIVATION_TERMS, TERMS
from harness.predict import main, predict_overrides

GPU = ["model=llama3_8b", "hardware=h100_sxm", "workload.precision=bf16-mixed", "workload.micro_batch_size=1"]
MOE = ["model=moe_tiny", "workload.micro_batch_size=2"]
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble",
                "dualpipev")

FAMILIES = {
    "single": [*GPU, "strategy=single", "workload.global_batch_size=2"],
    "ddp": [*GPU, "strategy=ddp", "parallel.dp=8", "workload.global_batch_size=16"],
    "zero1 torch": [*GPU, "strategy=zero1", "parallel.dp=8", "workload.global_batch_size=8"],
    "zero1 distributed": [*GPU, "strategy=zero1", "strategy.zero1_impl=distributed", "parallel.dp=8",
                          "workload.global_batch_size=8"],
    "zero2": [*GPU, "strategy=zero2", "parallel.dp=8", "workload.global_batch_size=16"],
    "zero3": [*GPU, "strategy=zero3", "parallel.dp=8", "workload.global_batch_size=8",
              "workload.activation_checkpointing=full"],
    "fsdp": [*GPU, "strategy=fsdp", "parallel.dp=8", "workload.global_batch_size=16"],
    "hsdp": [*GPU, "strategy=fsdp", "parallel.dp=16", "parallel.dp_replicate=2", "workload.global_batch_size=16"],
    "tp": [*GPU, "strategy=tp", "parallel.tp=8", "workload.global_batch_size=2"],
    "tp sp": [*GPU, "strategy=3d", "parallel.tp=8", "parallel.dp=1", "parallel.pp=1",
              "strategy.sequence_parallel=true", "workload.global_batch_size=2"],
    "cp": [*GPU, "strategy=3d", "parallel.dp=2", "parallel.cp=2", "parallel.tp=2", "parallel.pp=1",
           "workload.global_batch_size=4"],
    **{f"pp {s}": [*GPU, "strategy=pp", "parallel.pp=4", *([] if s in ("gpipe", "1f1b") else ["parallel.vpp=2"]),
                   f"strategy.schedule={s}", "workload.global_batch_size=16"] for s in PP_SCHEDULES},
    "pp megatron receives": [*GPU, "strategy=pp", "parallel.pp=8", "strategy.pp_recv_buffers=in_flight",
                             "workload.global_batch_size=32"],
    "3d": [*GPU, "strategy=3d", "parallel.dp=4", "parallel.tp=2", "parallel.pp=4", "workload.global_batch_size=32"],
    "3d zero1 sp full": [*GPU, "strategy=3d", "parallel.dp=4", "parallel.tp=2", "parallel.pp=2",
                         "strategy.data_parallel=zero1", "strategy.sequence_parallel=true",
                         "workload.activation_checkpointing=full", "workload.global_batch_size=16"],
    "ep": [*MOE, "strategy=ep", "parallel.dp=4", "parallel.ep=2", "workload.global_batch_size=8"],
    **{f"deepspeed zero{z}": [*GPU, f"strategy={'ddp' if z == 0 else f'zero{z}'}", "strategy.engine=deepspeed",
                              "parallel.dp=8", "workload.global_batch_size=16",
                              *(["workload.precision=fp32"] if z == 0 else [])] for z in range(4)},
    # Megatron-LM's bf16 module with selective recompute, one micro-batch: the peak at the end of backward
    "ddp low-precision params": ["model=gpt_7b", "hardware=a100_80g", "workload.precision=bf16-mixed",
                                 "workload.micro_batch_size=1", "strategy=ddp", "parallel.dp=8",
                                 "strategy.low_precision_params=true", "workload.activation_checkpointing=selective",
                                 "workload.global_batch_size=8"],
    # a profile with a measured allocator overhead
    "fsdp allocator": ["model=llama3_8b", "hardware=h100_hbm2e_96g", "workload.precision=bf16-mixed",
                       "workload.micro_batch_size=1", "strategy=fsdp", "parallel.dp=8", "workload.global_batch_size=8"],
}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_peaks_terms_add_up_to_it(family):
    out = predict_overrides(FAMILIES[family])
    assert out["status"] == "ok", out.get("error")
    terms = out["peak_mem_terms"]
    assert set(terms) <= set(TERMS) and all(isinstance(b, int) and b > 0 for b in terms.values()), terms
    assert sum(terms.values()) == out["peak_mem_bytes"]
    assert out["peak_mem_bytes"] + out["memory_headroom_bytes"] == out["device_memory_bytes"]
    # the scalar figures are the terms' own
    assert terms.get("grads", 0) == out["grads_at_peak_bytes"]
    assert terms.get("allocator", 0) == out["allocator_bytes"]
    assert terms["params"] == out["params_bytes_per_rank"][out["peak_mem_pp_rank"] * out["dims"]["world_size"]
                                                           // out["dims"]["pp"]]


@pytest.mark.parametrize("family", FAMILIES)
def test_activations_bytes_is_the_most_of_its_per_rank_list(family):
    """One figure, one formula: what autograd keeps for backward on each rank at its most micro-batches
    in flight, whatever phase the peak falls at (at the end of a lone micro-batch's backward none are left)."""
    out = predict_overrides(FAMILIES[family])
    assert out["activations_bytes"] == max(out["activations_bytes_per_rank"]) > 0
    if out["peak_mem_phase"] == "loss" and out["dims"]["pp"] == 1:  # the peak rank at its most
        assert out["activations_bytes"] == pytest.approx(
            sum(out["peak_mem_terms"].get(k, 0) for k in ACTIVATION_TERMS), abs=len(ACTIVATION_TERMS))


def test_predict_prints_the_peak_as_terms_that_sum_to_it(capsys):
    """The printout's bytes column adds up to its peak line, and --json carries the same terms."""
    overrides = FAMILIES["pp 1f1b"]
    assert main(overrides) == 0
    text = capsys.readouterr().out
    rows = [(int(b.replace(",", "")), what) for b, what in re.findall(r"GiB +([\d,]+) B  (.+)", text)]
    *terms, (total, label) = rows
    assert label == "= peak" and sum(b for b, _ in terms) == total
    assert main([*overrides, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(b, TERMS[k]) for k, b in out["peak_mem_terms"].items()] == terms and total == out["peak_mem_bytes"]
    assert "pipeline receive buffers" in text and f"on pp rank {out['peak_mem_pp_rank']} of 4" in text


def test_megatrons_ddp_reduces_its_grad_buffer_in_place():
    """torch's DDP keeps bucket copies of the gradients beside them; Megatron-LM's (the bf16 module that
    strategy.low_precision_params prices) all-reduces its contiguous fp32 gradient buffer in place."""
    torch_ddp = predict_overrides(FAMILIES["ddp"])
    megatron = predict_overrides([*FAMILIES["ddp"], "strategy.low_precision_params=true"])
    assert torch_ddp["peak_mem_terms"]["comm_buffers"] == torch_ddp["grads_bytes"] > 0
    assert "comm_buffers" not in megatron["peak_mem_terms"] and megatron["comm_buffer_bytes"] == 0
