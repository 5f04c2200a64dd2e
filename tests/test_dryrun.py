"""launcher=dryrun: the worker's code path on torch's fake process group. A Llama 3 70B layout of
1024 ranks ends in an ok record whose per-stage model-state bytes equal the cost model's; a dry run
at world 8 gives rank by rank the bytes of the real 8-process gloo run; one rank simulated per role
stands for every rank of it (Llama 3 405B on 16,384 ranks: 18 roles); bad input is refused."""
from __future__ import annotations

import pytest

from harness.config import MAX_WORLD, compose_run
from harness.costmodel import predict
from harness.dims import ConfigError
from harness.strategies import pp_derive
from harness.validate import validate
from launch.dryrun import role_key, roles
from tests.helpers import run

STATES = ("params_bytes", "grads_bytes", "optimizer_bytes", "model_states_bytes")
LLAMA3_70B_1024 = ["launcher=dryrun", "model=llama3_70b", "strategy=3d", "parallel.dp=32", "parallel.tp=8",
                   "parallel.pp=4", "hardware=h100_sxm", "workload.precision=bf16-mixed",
                   "workload.global_batch_size=128", "workload.micro_batch_size=1"]


def _per_rank_equal_predicted(rec: dict) -> None:
    m, p = rec["measured"], rec["predicted"]
    for key in STATES:
        assert m[f"{key}_per_rank"] == [p[f"{key}_per_rank"][r] for r in m["dryrun_ranks"]], key


@pytest.mark.slow
def test_llama3_70b_on_1024_ranks_matches_the_cost_model_per_stage(tmp_path):
    # 4 micro-batches of 8192 tokens per stage (the states do not depend on the batch), two fake steps;
    # the limit leaves room for a loaded machine (the timing itself is not asserted)
    rec = run([*LLAMA3_70B_1024, "launcher.timeout_s=3000"], tmp_path, fast=False)
    assert rec["status"] == "ok", rec["error"]
    m = rec["measured"]
    assert m["kind"] == "dryrun" and m["world_size"] == 1024
    assert m["dryrun_ranks"] == [0, 256, 512, 768]  # one role a pipeline stage: every dp shard is even
    assert m["dryrun_rank_stands_for"] == [256] * 4
    _per_rank_equal_predicted(rec)
    assert rec["fidelity"]["model_states_bytes"] == 1.0
    # the pipeline's step ran on fake tensors: a peak on every stage, above its model states
    assert "dryrun_step_error" not in m and m["peak_mem_kind"] == "fake_tensor_storages"
    assert all(p > s for p, s in zip(m["peak_mem_bytes_per_rank"], m["model_states_bytes_per_rank"]))
    assert rec["predicted"]["peak_mem_bytes"] == pytest.approx(max(m["peak_mem_bytes_per_rank"]), rel=0.05)


@pytest.mark.slow
def test_zero3_with_full_recompute_peaks_at_the_end_of_backward_as_predicted(tmp_path):
    """llama3_70b zero3 dp16, full recompute, one sequence a rank: the peak comes late in backward (every
    block's sharded grads made, a block rerun, its grads unsharded in fp32 for the reduce-scatter, the
    root unit's grads whole), not at the loss; the prediction's end-of-backward phase holds it."""
    rec = run(["launcher=dryrun", "model=llama3_70b", "strategy=zero3", "parallel.dp=16", "hardware=h100_sxm",
               "workload.precision=bf16-mixed", "workload.global_batch_size=16", "workload.micro_batch_size=1",
               "workload.activation_checkpointing=full"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    m, p = rec["measured"], rec["predicted"]
    assert p["peak_mem_phase"] == "end of backward"
    assert p["peak_mem_bytes"] == pytest.approx(max(m["peak_mem_bytes_per_rank"]), rel=0.05)


@pytest.mark.slow
def test_dry_run_at_world_8_gives_the_bytes_of_the_real_gloo_run(tmp_path):
    layout = ["model=llama_tiny", "strategy=3d", "parallel.dp=2", "parallel.tp=2", "parallel.pp=2",
              "workload.global_batch_size=8", "workload.micro_batch_size=2", "logger=none"]
    real = run(layout, tmp_path)
    assert real["status"] == "ok", real["error"]
    dry = run([*layout, "launcher=dryrun", "launcher.ranks=[0,1,2,3,4,5,6,7]", "study=dry"], tmp_path)
    assert dry["status"] == "ok", dry["error"]
    for key in STATES:
        assert dry["measured"][f"{key}_per_rank"] == real["measured"][f"{key}_per_rank"], key
    _per_rank_equal_predicted(dry)


@pytest.mark.parametrize("overrides,message", [
    (["strategy=zero2", "strategy.engine=deepspeed", "parallel.dp=2", "strategy.offload=optimizer"],
     "simulates DeepSpeed's ZeRO engine .* not offload optimizer"),
    (["strategy=ddp", "parallel.dp=2", "launcher.ranks=[0,2]"], r"launcher.ranks \[2\] outside the world: ranks are 0..1"),
    # the one world-size limit (harness/config.py, the cost model's per-rank lists) holds for dry runs too
    (["strategy=3d", f"parallel.dp={MAX_WORLD}", "parallel.tp=2", f"workload.global_batch_size={MAX_WORLD}",
      "workload.micro_batch_size=1"], rf"= {2 * MAX_WORLD} ranks \(must be <= {MAX_WORLD}\)"),
])
def test_dry_run_refusals_show_why(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_run(["launcher=dryrun", "model=llama_tiny", *overrides]))


LLAMA3_405B_16K = ["launcher=dryrun", "model=llama3_405b", "strategy=3d", "parallel.dp=128", "parallel.tp=8",
                   "parallel.pp=16", "hardware=h100_sxm", "workload.precision=bf16-mixed",
                   "workload.global_batch_size=2048", "workload.micro_batch_size=1"]


def test_llama3_405b_on_16384_ranks_is_18_roles():
    """tp8 pp16 dp128: a role per pipeline stage, and on the first and the last stage a second one, the last
    dp position, whose FSDP shard of the vocabulary's rows (16032 a tp rank, over 128) is the short one."""
    run_ = compose_run(LLAMA3_405B_16K)
    dims = validate(run_)
    stands_for = roles(run_, dims, predict(run_, dims))
    assert sum(stands_for.values()) == 16384
    stage = 1024
    assert stands_for == {0: stage - 8, stage - 8: 8, **{p * stage: stage for p in range(1, 15)},
                          15 * stage: stage - 8, 16 * stage - 8: 8}


@pytest.mark.slow
def test_every_rank_of_a_role_holds_what_the_rank_simulated_for_it_holds(tmp_path):
    """dp3 splits llama_tiny's rows unevenly (FSDP2's torch.chunk: 1024 = 342 + 342 + 340): two roles a
    stage. All twelve ranks simulated: within a role every figure is the same; the default dry run
    simulates one rank per role and gives those figures."""
    layout = ["launcher=dryrun", "model=llama_tiny", "strategy=3d", "parallel.dp=3", "parallel.tp=2", "parallel.pp=2",
              "workload.global_batch_size=12", "workload.micro_batch_size=2", "logger=none"]
    every = run([*layout, f"launcher.ranks=[{','.join(map(str, range(12)))}]", "study=every"], tmp_path)
    one = run([*layout, "study=one"], tmp_path)
    assert every["status"] == "ok" and one["status"] == "ok", (every["error"], one["error"])
    e, o = every["measured"], one["measured"]
    run_ = compose_run(layout)
    dims = validate(run_)
    stands_for = roles(run_, dims, predict(run_, dims))
    assert o["dryrun_ranks"] == list(stands_for) == [0, 4, 6, 10]
    assert o["dryrun_rank_stands_for"] == list(stands_for.values()) == [4, 2, 4, 2]
    keys = ("peak_mem_bytes", *STATES)
    for rank in range(12):
        role = max(r for r in stands_for if r <= rank and dims.coords(r)["pp"] == dims.coords(rank)["pp"]
                   and (dims.coords(r)["dp"] == 2) == (dims.coords(rank)["dp"] == 2))
        for key in keys:
            assert e[f"{key}_per_rank"][rank] == e[f"{key}_per_rank"][role], (key, rank, role)
    for i, rank in enumerate(o["dryrun_ranks"]):
        for key in keys:
            assert o[f"{key}_per_rank"][i] == e[f"{key}_per_rank"][rank], (key, rank)
    assert len(set(e["peak_mem_bytes_per_rank"])) > 2  # the roles do differ


@pytest.mark.slow
@pytest.mark.heavy
def test_llama3_405b_on_16384_ranks_peaks_on_every_stage_as_predicted(tmp_path):
    """The scale Llama 3 405B was trained at (Llama Team 2024: 16,384 H100s, tp8 pp16 dp128, 8192-token
    sequences); 16 sequences a pipeline (global batch 2048). Its time is in `make bench`."""
    rec = run([*LLAMA3_405B_16K, "launcher.timeout_s=3000", "logger=none"], tmp_path, fast=False)
    assert rec["status"] == "ok", rec["error"]
    m = rec["measured"]
    assert m["world_size"] == 16384 and sum(m["dryrun_rank_stands_for"]) == 16384
    assert "dryrun_step_error" not in m
    stages = {r // 1024 for r, p in zip(m["dryrun_ranks"], m["peak_mem_bytes_per_rank"]) if p}
    assert stages == set(range(16))
    _per_rank_equal_predicted(rec)
    assert rec["predicted"]["peak_mem_bytes"] == pytest.approx(m["peak_mem_bytes"], rel=0.05)


def test_llama3_405b_on_16384_ranks_simulates_7_of_its_18_roles():
    """Stages 1-13 hold eight layers each, as middle stages: 1 and 13 are simulated, 2-12 derived from them
    (harness/strategies/pp_derive.py); stage 14 holds seven. Both roles of the first and the last stage run."""
    run_ = compose_run(LLAMA3_405B_16K)
    dims = validate(run_)
    predicted = predict(run_, dims)
    stands_for = roles(run_, dims, predicted)
    stage = 1024
    assert pp_derive.groups(run_, dims, role_key(run_, dims, predicted), stands_for) == [
        [p * stage for p in range(1, 14)]]
    assert pp_derive.groups(compose_run([*LLAMA3_405B_16K, "launcher.derive=false"]), dims,
                            role_key(run_, dims, predicted), stands_for) == []
