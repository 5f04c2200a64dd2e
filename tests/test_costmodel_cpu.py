"""Pure tier: the CPU mechanisms that calibrate measures: DTensor dispatch under
tensor parallelism, co-running cores, and collectives timed per message size. Each is read from the
profile, changes only the layouts it describes, and a profile without it predicts as before."""
from __future__ import annotations

import copy
import math

import pytest

from harness.config import as_dict, compose_run
from harness.costmodel import comm, pipeline, schedule
from harness.costmodel.estimate import evaluate
from harness.costmodel.inputs import Hardware, Model, StrategyKnobs
from harness.costmodel.layout import placement

MD = Model.of(compose_run(["model=small"]).model)
BASE = as_dict(compose_run(["hardware=cpu_reference"]))["hardware"]
DTENSOR = {"op_us": 100.0, "ops_per_layer": 78, "outside_op_us": 300.0, "ops_outside_layers": 24,
           "optimizer_op_us": 40.0, "optimizer_ops_per_layer": 54, "optimizer_ops_outside_layers": 18}


def hardware(**compute) -> Hardware:
    """cpu_reference with compute.<key> replaced (None: removed), and without the in-step collectives
    (tp then takes the back-to-back ones), so each test sees one mechanism."""
    hw = copy.deepcopy(BASE)
    hw["collectives"] = {k: v for k, v in hw["collectives"].items() if k not in comm.IN_STEP.values()}
    hw["compute"] = {k: v for k, v in {**hw.get("compute", {}), **compute}.items() if v is not None}
    return Hardware.of(_Obj(hw))


class _Obj(dict):
    """A profile dict read by attribute, as Hardware.of reads the composed config."""
    def __getattr__(self, key):
        v = self[key]
        return _Obj(v) if isinstance(v, dict) else v


def predict(hw, dp=1, tp=1, pp=1, strategy="single", mb=2, m=4, ckpt="none", nodes=1):
    st = StrategyKnobs.of(compose_run([f"strategy={strategy}"]).strategy)
    return evaluate(MD, hw, st, dp, tp, pp, 1, 1, mb, m, "fp32", ckpt, nodes=nodes, detail=False)


def test_dtensor_dispatch_adds_ops_times_cost_to_a_tensor_parallel_step():
    without, with_ = hardware(dtensor=None, corun=None), hardware(dtensor=DTENSOR, corun=None)
    m = 4
    a, b = predict(without, tp=2, strategy="tp", m=m), predict(with_, tp=2, strategy="tp", m=m)
    per_microbatch = MD.L * 78 * 100e-6 + 24 * 300e-6  # blocks, then embedding/head/loss parallel
    optimizer = (MD.L * 54 + 18) * 40e-6
    assert b["compute_time_s"] - a["compute_time_s"] == pytest.approx(m * per_microbatch + optimizer, rel=1e-9)
    assert b["step_time_s"] - a["step_time_s"] == pytest.approx(m * per_microbatch + optimizer, rel=1e-9)
    # no DTensor without tensor parallelism: single and ddp predict the same on both profiles
    for kw in ({}, {"dp": 2, "strategy": "ddp", "m": 2}):
        assert predict(with_, **kw)["step_time_s"] == predict(without, **kw)["step_time_s"]


def test_dtensor_dispatch_is_what_the_profile_measured():
    hw = hardware(dtensor={**DTENSOR, "op_us": 200.0}, corun=None)
    base = predict(hardware(dtensor={**DTENSOR, "op_us": 0.0}, corun=None), tp=2, strategy="tp")
    assert predict(hw, tp=2, strategy="tp")["compute_time_s"] - base["compute_time_s"] == pytest.approx(
        4 * MD.L * 78 * 200e-6, rel=1e-9)


def test_a_blocks_dtensor_operator_grows_with_the_micro_batch_as_calibrated():
    """op_us_per_melem: each of a block's DTensor operators costs op_us + slope x the micro-batch's
    tokens x d_model / 10^6; the embedding/head and optimizer operators do not grow."""
    flat = hardware(dtensor=DTENSOR, corun=None)
    sloped = hardware(dtensor={**DTENSOR, "op_us_per_melem": 500.0}, corun=None)
    for mb in (1, 4):
        elements = mb * MD.s * MD.h
        extra = (predict(sloped, tp=2, strategy="tp", mb=mb)["compute_time_s"]
                 - predict(flat, tp=2, strategy="tp", mb=mb)["compute_time_s"])
        assert extra == pytest.approx(4 * MD.L * 78 * 500e-12 * elements, rel=1e-9)
    assert predict(sloped)["step_time_s"] == predict(flat)["step_time_s"]  # no tensor parallelism, no DTensor


def test_sequence_parallel_reads_its_own_dtensor_figures():
    """Under SP the norms and the residual stream are DTensors too: calibrate counts them apart."""
    sp = {**DTENSOR, "ops_per_layer": 120}
    both = hardware(dtensor={**DTENSOR, "sequence_parallel": sp}, corun=None)
    zero = hardware(dtensor={**DTENSOR, "op_us": 0.0, "sequence_parallel": {**sp, "op_us": 0.0}}, corun=None)
    extra = predict(both, tp=2, strategy="tp")["compute_time_s"] - predict(zero, tp=2, strategy="tp")["compute_time_s"]
    assert extra == pytest.approx(4 * MD.L * 78 * 100e-6, rel=1e-9)  # strategy=tp: sequence_parallel false
    st = StrategyKnobs.of(compose_run(["strategy=tp", "strategy.sequence_parallel=true"]).strategy)
    with_sp = evaluate(MD, both, st, 1, 2, 1, 1, 1, 2, 4, "fp32", "none", detail=False)
    without = evaluate(MD, zero, st, 1, 2, 1, 1, 1, 2, 4, "fp32", "none", detail=False)
    assert with_sp["compute_time_s"] - without["compute_time_s"] == pytest.approx(4 * MD.L * 120 * 100e-6, rel=1e-9)


def test_fsdp_host_work_is_charged_per_block_microbatch_and_step():
    fsdp = {"block_us": 2000.0, "outside_us": 1000.0, "step_block_us": 5000.0, "step_outside_us": 1500.0}
    with_, without = hardware(fsdp2=fsdp, corun=None), hardware(fsdp2=None, corun=None)
    m = 2
    a, b = predict(without, dp=2, strategy="fsdp", m=m), predict(with_, dp=2, strategy="fsdp", m=m)
    expected = m * (MD.L * 2000e-6 + 1000e-6) + MD.L * 5000e-6 + 1500e-6
    assert b["compute_time_s"] - a["compute_time_s"] == pytest.approx(expected, rel=1e-9)
    for kw in ({}, {"dp": 2, "strategy": "ddp", "m": 2}, {"tp": 2, "strategy": "tp"}):  # FSDP2 shards none of these
        assert predict(with_, **kw)["step_time_s"] == predict(without, **kw)["step_time_s"]


def test_corunning_slows_every_rank_of_a_busy_node_by_the_measured_factor():
    hw = hardware(corun={"cores": 2, "gemm": 1.25, "memory": 1.5})
    assert (placement(hw, 1, 1, 1, 1, 1, 1).slowdown, placement(hw, 1, 1, 1, 1, 1, 1).mem_slowdown) == (1.0, 1.0)
    two = placement(hw, 2, 1, 1, 1, 1, 1)
    assert (two.slowdown, two.mem_slowdown) == (1.25, 1.5)
    four = placement(hw, 4, 1, 1, 1, 1, 1)  # 4 ranks on 2 cores: time-sharing x co-running
    assert (four.slowdown, four.mem_slowdown) == (2.5, 3.0)
    plain = hardware(corun=None)
    assert predict(hw)["step_time_s"] == predict(plain)["step_time_s"]  # one rank: nothing co-runs
    ddp, ddp_plain = predict(hw, dp=2, strategy="ddp", m=2), predict(plain, dp=2, strategy="ddp", m=2)
    assert ddp_plain["compute_time_s"] * 1.25 < ddp["compute_time_s"] < ddp_plain["compute_time_s"] * 1.5


def test_a_pipelines_stages_run_at_the_rate_of_the_stages_computing_with_them():
    """1F1B, 2 stages, 4 micro-batches (F = 1, B = 2 units; schedule.py's timeline): one stage computes
    alone for 6 of the 15 units (the fill, rank 0's wait for the first backward, the drain), both for 9;
    of the ranks' 24 busy units 6 run alone and 18 together. Stretching each instant by relative[k]
    (k stages computing) stretches the span and the busy time so."""
    r = 0.8
    span, busy = pipeline.warped_timeline("1f1b", 2, 1, 4, (1.0, r, 1.0))
    assert span == pytest.approx(6 * r + 9) and sum(busy) == pytest.approx(6 * r + 18)
    assert pipeline.warped_timeline("1f1b", 2, 1, 4, (1.0, 1.0, 1.0)) == (15.0, (12.0, 12.0))


def test_the_schedule_runs_each_stage_at_its_own_cost():
    """1F1B, 2 stages, 4 micro-batches, the last stage twice the first (its head and loss): stage 1 never
    waits once it has its first input, so the step is stage 0's first forward (1), stage 1's 4 x (2 + 4)
    and stage 0's last backward (2): 27 units, against 15 with equal stages; stage 0 idles 27 - 12.
    (F = 1, B = 2 units on a plain stage: schedule.py's timeline.)"""
    equal, heavy = schedule.simulate("1f1b", 2, 4), schedule.simulate("1f1b", 2, 4, 1, (1.0, 2.0))
    assert (equal.makespan, heavy.makespan) == (15.0, 27.0)
    busy = [sum(e["end_s"] - e["start_s"] for e in heavy.events if e["rank"] == r) for r in (0, 1)]
    assert busy == [12.0, 24.0]
    # the CPU model's pipeline: with the head on the last stage its ranks wait on it, so fewer of them
    # compute at once than with equal stages, and the bubble is the timeline's (step_time._cpu_pipeline)
    assert pipeline.warped_timeline("1f1b", 2, 1, 4, (1.0, 1.0, 1.0), (1.0, 2.0)) == (27.0, (12.0, 24.0))
    r = 0.8  # each instant with one stage computing runs at 0.8 of the all-busy time
    span, busy = pipeline.warped_timeline("1f1b", 2, 1, 4, (1.0, r, 1.0), (1.0, 2.0))
    # stage 0 computes beside stage 1 for 9 of its 12 units (not F of mb 0, B of mb 3): 9 units with both
    # busy, 18 with one (stage 0's 3, stage 1's 15)
    assert span == pytest.approx(18 * r + 9) and busy == pytest.approx((9 + 3 * r, 9 + 15 * r))


@pytest.mark.parametrize("pp,corun", [(2, {"cores": 2, "gemm": 1.25, "memory": 1.5}), (4, None)])
def test_cpu_pipeline_fill_and_drain_run_faster_than_its_steady_state(monkeypatch, pp, corun):
    """pp 2 on 2 cores: one stage alone escapes the co-running slowdown; pp 4 on 2 cores: fewer than 4
    stages computing time-share less. The pipeline's span (compute + bubble) is the unwarped timeline's
    stretched by pipeline.warped_timeline, and the busy part less than the span."""
    hw = hardware(corun=corun)
    warped = predict(hw, pp=pp, strategy="pp", m=4)
    timeline = pipeline.warped_timeline
    with monkeypatch.context() as mp:  # every instant at the all-busy rate
        mp.setattr(pipeline, "warped_timeline", lambda s, p, v, m, rel, scale: timeline(s, p, v, m, (1.0,) * len(rel), scale))
        flat = predict(hw, pp=pp, strategy="pp", m=4)
    span = lambda p: p["compute_time_s"] + p["bubble_time_s"] - p["optimizer_time_s"]  # noqa: E731
    busy = lambda p: p["compute_time_s"] - p["optimizer_time_s"]  # noqa: E731
    low = 1 / 1.5 if corun else 1 / 2
    assert low < span(warped) / span(flat) < busy(warped) / busy(flat) < 1.0
    assert warped["bubble_pct"] < flat["bubble_pct"]


def test_gpu_profiles_ignore_the_cpu_terms():
    h100 = as_dict(compose_run(["hardware=h100_sxm"]))["hardware"]
    plain = Hardware.of(_Obj(h100))
    h100["compute"] = {**h100.get("compute", {}), "corun": {"gemm": 3.0, "memory": 3.0}}
    assert placement(Hardware.of(_Obj(h100)), 8, 1, 1, 1, 1, 1).slowdown == placement(plain, 8, 1, 1, 1, 1, 1).slowdown == 1.0


def test_collective_time_per_call_follows_the_measured_sizes():
    measured = ((4, 343e-6), (262144, 2313e-6), (4194304, 6046e-6))  # cpu_reference's all_reduce at 2 ranks
    link = comm.Link(400e-6, 0.85e9, tuple((math.log(b), t) for b, t in measured))
    assert comm.call_s(link, "all_reduce", 2, 262144) == pytest.approx(2313e-6)  # a measured size: its time
    assert 2313e-6 < comm.call_s(link, "all_reduce", 2, 2**20) < 6046e-6  # between: interpolated in log size
    big = 64 * 2**20  # beyond the sizes measured: the α-β fit
    assert comm.call_s(link, "all_reduce", 2, big) == pytest.approx(400e-6 + big / 0.85e9)
    assert comm.call_s(comm.Link(400e-6, 0.85e9), "all_reduce", 2, 262144) == pytest.approx(400e-6 + 262144 / 0.85e9)


def test_tensor_parallel_comm_uses_the_calibrated_time_of_its_message():
    """model=small, mb 2: each TP all-reduce moves 2 x 128 x 256 fp32 = 256 KiB, a size calibrate timed."""
    hw = hardware(dtensor=None, corun=None)
    out = predict(hw, tp=2, strategy="tp", m=4)
    measured = BASE["collectives"]["all_reduce"]["2"]["time_us_by_bytes"]["262144"] * 1e-6
    calls = 4 * (6 * MD.L + 2)  # 6 all-reduces per block, the embedding's and the head input's
    assert out["comm_tp_time_s"] == pytest.approx(calls * measured, rel=1e-9)


def test_elementwise_bandwidth_times_the_layers_and_heads_traffic_only():
    """compute.elementwise_GBps (calibrate_elementwise.py) divides the layers' and the head's element-wise
    bytes; AdamW and gradient accumulation stay at memory_bw_GBps; without it, the memory's bandwidth."""
    from harness.costmodel import traffic

    mem = BASE["memory_bw_GBps"] * 1e9
    plain, slow = hardware(corun=None, elementwise_GBps=None), hardware(corun=None, elementwise_GBps=BASE["memory_bw_GBps"] / 4)
    assert plain.elem_bw == mem and slow.elem_bw == mem / 4
    a, b = predict(plain), predict(slow)
    tokens = 2 * MD.s
    per_mb = tokens * (MD.L * traffic.layer_bytes_per_token(MD.cfg, 1, False, 4, 4, "none")
                       + traffic.head_bytes_per_token(MD.cfg, 1))
    assert b["compute_time_s"] - a["compute_time_s"] == pytest.approx(4 * per_mb * (4 / mem - 1 / mem), rel=1e-6)


def test_tensor_parallel_all_reduces_are_costed_as_a_step_meets_them():
    """collectives.all_reduce_in_step (calibrate: DTensor's functional all-reduce after each rank's own
    compute) times the tp axis where the profile has it; dp keeps the back-to-back all_reduce."""
    base = hardware(corun=None)
    slow = copy.deepcopy(BASE)
    slow["compute"].pop("corun", None)
    fig = copy.deepcopy(BASE["collectives"]["all_reduce"]["2"])
    fig["time_us_by_bytes"] = {k: 3 * v for k, v in fig["time_us_by_bytes"].items()}
    slow["collectives"]["all_reduce_in_step"] = {"2": fig}
    slow = Hardware.of(_Obj(slow))
    a, b = predict(base, tp=2, strategy="tp"), predict(slow, tp=2, strategy="tp")
    assert b["comm_tp_time_s"] == pytest.approx(3 * a["comm_tp_time_s"], rel=0.05)
    assert predict(slow, dp=2, strategy="ddp", m=2)["step_time_s"] == predict(base, dp=2, strategy="ddp", m=2)["step_time_s"]


def test_sequence_parallel_pays_its_gathers_scatters_and_norm_gradients():
    """With sequence parallel each of the tp2 trace's collectives is costed as what it is (model=small, mb 2,
    4 micro-batches; its trace counts 136 of each per step, docs/notes.md#sp-collectives): all-gathers and reduce-scatters of
    the 256 KiB activations, and all-reduces of each LayerNorm parameter's (256,) fp32 gradient; each
    from its own in-step figure where the profile has one."""
    base = hardware(dtensor=None, corun=None)
    st = StrategyKnobs.of(compose_run(["strategy=tp", "strategy.sequence_parallel=true"]).strategy)
    sp = evaluate(MD, base, st, 1, 2, 1, 1, 1, 2, 4, "fp32", "none")
    each = 4 * (4 * MD.L + 2)  # 4 per block, one more of each on the embedding and the head's input
    norms = 4 * (2 * 2 * MD.L + 2)  # ln1, ln2: weight and bias; ln_f on the last stage
    assert each == norms == 136
    act, grad = 2 * MD.s * MD.h * 4, MD.h * 4

    def time(name, size):  # cpu_reference's back-to-back figure at 2 ranks
        return comm.call_s(base.collectives[name][2][2], name, 2, size)
    want = each * (time("all_gather", act) + time("reduce_scatter", act)) + norms * time("all_reduce", grad)
    assert sp["comm_tp_time_s"] == pytest.approx(want, rel=1e-9)
    assert sp["comm_tp_bytes"] == pytest.approx(2 * 0.5 * each * act + 1.0 * norms * grad)
    slow = copy.deepcopy(BASE)
    slow["compute"].pop("corun", None)
    slow["compute"].pop("dtensor", None)
    slow["collectives"] = {k: v for k, v in slow["collectives"].items() if k not in comm.IN_STEP.values()}
    for name in ("all_gather", "reduce_scatter"):
        fig = copy.deepcopy(BASE["collectives"][name]["2"])
        fig["time_us_by_bytes"] = {k: 3 * v for k, v in fig["time_us_by_bytes"].items()}
        slow["collectives"][comm.IN_STEP[name]] = {"2": fig}
    b = evaluate(MD, Hardware.of(_Obj(slow)), st, 1, 2, 1, 1, 1, 2, 4, "fp32", "none")
    assert b["comm_tp_time_s"] - sp["comm_tp_time_s"] == pytest.approx(
        2 * each * (time("all_gather", act) + time("reduce_scatter", act)), rel=1e-6)


def test_a_collective_of_ranks_sharing_the_cores_takes_their_share_of_a_core():
    """calibrate times each group size with only that group on the cores; in a step every rank of the node
    computes around the call, so on 2 cores a 2-rank collective among 8 ranks takes 4x its calibrated
    time, among 4 ranks 2x; a group timed at its own sharing (4 ranks, measured at 4) takes it as measured."""
    hw = hardware(corun=None)
    two = hw.collectives["all_reduce"][2][2]
    alone = comm.collective_link(hw, "all_reduce", 2, 1, 2)
    assert (alone.alpha_s, alone.bw_Bps, alone.measured) == (two.alpha_s, two.bw_Bps, two.measured)
    for rpn, f in ((4, 2.0), (8, 4.0)):
        shared = comm.collective_link(hw, "all_reduce", 2, 1, rpn)
        assert shared.alpha_s == pytest.approx(f * two.alpha_s) and shared.bw_Bps == pytest.approx(two.bw_Bps / f)
        assert comm.call_s(shared, "all_reduce", 2, 262144) == pytest.approx(f * comm.call_s(two, "all_reduce", 2, 262144))
    four = comm.collective_link(hw, "all_reduce", 4, 1, 4)
    assert four.alpha_s == hw.collectives["all_reduce"][4][4].alpha_s
    assert comm.collective_link(hw, "all_reduce", 4, 1, 8).alpha_s == pytest.approx(2 * four.alpha_s)
    # the step: each rank of dp 2 x tp 2 (4 ranks) makes the calls of tp 2 alone (2 ranks), at twice the time
    shared = predict(hw, dp=2, tp=2, strategy="3d", m=2)["comm_tp_time_s"]
    assert shared == pytest.approx(2 * predict(hw, tp=2, strategy="tp", m=2)["comm_tp_time_s"], rel=1e-9)
    # GPU ranks never share a device: a calibrated NCCL table is read as measured (below)
    _pairs_timed_at_once_are_read_at_their_own_sharing()
    h100 = as_dict(compose_run(["hardware=h100_sxm"]))["hardware"]
    h100["collectives"] = {"all_reduce": {"2": {"bus_bw_GBps": 100.0, "latency_us": 20.0}}}
    gpu = Hardware.of(_Obj(h100))
    assert comm.collective_link(gpu, "all_reduce", 2, 1, 8).alpha_s == pytest.approx(20e-6)


def _pairs_timed_at_once_are_read_at_their_own_sharing():
    """calibrate's "2@4" figures (pairs of ranks, both pairs timing at once on the 2 cores) stand for a
    2-rank group among 4 ranks as measured, and for one among 8 at twice that; a 2-rank group alone
    still reads the "2" figure, and a 4-rank group its own."""
    prof = copy.deepcopy(BASE)
    prof["compute"].pop("corun", None)
    for by_key in prof["collectives"].values():
        fig = copy.deepcopy(by_key["2"])
        fig["time_us_by_bytes"] = {k: 1.7 * v for k, v in fig["time_us_by_bytes"].items()}
        fig["latency_us"], fig["bus_bw_GBps"] = 1.7 * fig["latency_us"], fig["bus_bw_GBps"] / 1.7
        by_key["2@4"] = fig
    hw = Hardware.of(_Obj(prof))
    assert sorted(hw.collectives["all_reduce"][2]) == [2, 4] and sorted(hw.collectives["all_reduce"][4]) == [4]
    two, pairs = hw.collectives["all_reduce"][2][2], hw.collectives["all_reduce"][2][4]
    size = 262144
    assert comm.call_s(comm.collective_link(hw, "all_reduce", 2, 1, 2), "all_reduce", 2, size) == comm.call_s(two, "all_reduce", 2, size)
    among4 = comm.collective_link(hw, "all_reduce", 2, 1, 4)
    assert among4.alpha_s == pairs.alpha_s and comm.call_s(among4, "all_reduce", 2, size) == pytest.approx(
        1.7 * comm.call_s(two, "all_reduce", 2, size))
    among8 = comm.collective_link(hw, "all_reduce", 2, 1, 8)
    assert comm.call_s(among8, "all_reduce", 2, size) == pytest.approx(2 * 1.7 * comm.call_s(two, "all_reduce", 2, size))
    assert comm.collective_link(hw, "all_reduce", 4, 1, 4).alpha_s == hw.collectives["all_reduce"][4][4].alpha_s
    # the step: dp 2 x tp 2's dp all-reduce (ranks 2 apart) reads the pairs' figure too
    base = hardware(corun=None)
    ratio = predict(hw, dp=2, tp=2, strategy="3d", m=2)["comm_dp_time_s"] / predict(base, dp=2, tp=2, strategy="3d", m=2)["comm_dp_time_s"]
    assert ratio == pytest.approx(1.7 / 2, rel=0.02)
