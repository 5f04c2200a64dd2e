"""Trace parsing on stored traces of real runs (tests/fixtures/traces/, made by make_fixtures.py):
the collectives by axis, their counts and bytes are known from the model's shape.

model=tiny: L=4 layers, h=128, V=1024, s=64, d_ff=512; global batch 8, micro-batch 2.
    block params 4 * (4h^2 + 2h*d_ff + 4h) = 788,480; root params (embeddings, head, ln_f)
    2Vh + sh + 2h = 270,592; total Ψ = 1,059,072 -> 4,236,288 fp32 gradient bytes.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from harness.collect import compute_classes
from harness.collect import trace_analysis as ta

FIX = Path(__file__).resolve().parent / "fixtures" / "traces"
BLOCKS, ROOT = 788_480, 270_592
GRAD_BYTES = 4 * (BLOCKS + ROOT)
B, S, H = 2, 64, 128


def analyse(name: str, rank: int) -> dict:
    return ta.analyse(ta.load(FIX / f"{name}_rank{rank}.json.gz"))


def test_interval_algebra():
    u = compute_classes.union([(5, 7), (0, 2), (1, 3), (6, 9), (10, 10)])
    assert u == [(0, 3), (5, 9)] and compute_classes.length(u) == 7
    assert compute_classes.intersect(u, [(2, 6)]) == [(2, 3), (5, 6)]
    assert compute_classes.subtract(u, [(2, 6)]) == [(0, 2), (6, 9)]


def test_bus_bytes_follow_nccl_tests_factors():
    assert ta.bus_bytes("all_reduce", 100, 100, 4) == 150  # 2(n-1)/n
    assert ta.bus_bytes("all_gather", 25, 100, 4) == 75  # (n-1)/n of the gathered output
    assert ta.bus_bytes("reduce_scatter", 100, 25, 4) == 75  # (n-1)/n of the input
    assert ta.bus_bytes("send", 100, 100, 2) == 100 and ta.bus_bytes("recv", 100, 100, 2) == 0
    assert ta.collective_name("gloo:all_reduce") == "all_reduce"
    assert ta.collective_name("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL") == "reduce_scatter"
    assert ta.logical_name("c10d::_reduce_scatter_base_") == "reduce_scatter"


@pytest.mark.parametrize("rank", [0, 1])
def test_ddp_one_gradient_all_reduce_on_dp(rank):
    a = analyse("ddp", rank)
    assert set(a["comm_by_axis"]) == {"dp"}
    ar = a["comm_by_axis"]["dp"]["all_reduce"]
    assert ar["bytes"] == GRAD_BYTES  # 2(n-1)/n * G at n = 2, one 25 MB bucket holds all 4.2 MB
    assert ar["calls"] == 1 and ar["count"] == 1
    assert 0 < a["comm_exposed_pct"] <= a["comm_share_pct"] < 100


@pytest.mark.parametrize("rank", [0, 1])
def test_fsdp_gathers_params_and_reduce_scatters_grads(rank):
    a = analyse("fsdp", rank)
    dp = a["comm_by_axis"]["dp"]
    assert set(a["comm_by_axis"]) == {"dp"} and set(dp) == {"all_gather", "reduce_scatter"}
    # 2 micro-batches: root gathered once (kept from forward to backward), blocks in the first
    # forward and in both backwards (kept gathered from a non-last backward into the next forward)
    assert dp["all_gather"]["bytes"] == 4 * (ROOT + 3 * BLOCKS) / 2
    assert dp["all_gather"]["calls"] == 1 + 4 * 3
    # one reduce-scatter per unit: (n-1)/n * G, which gloo runs as an all-reduce of G
    assert dp["reduce_scatter"]["bytes"] == GRAD_BYTES / 2
    assert dp["reduce_scatter"]["bytes_as_run"] == GRAD_BYTES
    assert dp["reduce_scatter"]["calls"] == 5


@pytest.mark.parametrize("rank", [0, 1])
def test_tp_all_reduces_are_exposed(rank):
    a = analyse("tp", rank)
    assert set(a["comm_by_axis"]) == {"tp"} and set(a["comm_by_axis"]["tp"]) == {"all_reduce"}
    ar = a["comm_by_axis"]["tp"]["all_reduce"]
    # per micro-batch (4): per layer 2 forward (o, fc2) + 4 backward (q, k, v, fc1 inputs), + the
    # vocab-parallel embedding and the head input, all (b, s, h); + 3 loss-parallel (b, s) scalars
    big, small = 4 * (6 * 4 + 2), 4 * 3
    assert ar["calls"] == big + small
    assert ar["bytes"] == 4 * (big * B * S * H + small * B * S)  # 2(n-1)/n = 1 at n = 2
    # nothing to overlap with: the main thread waits for every one
    assert a["comm_exposed_pct"] >= 0.9 * a["comm_share_pct"] > 0


def test_pp_sends_activations_forward_and_grads_back():
    r0, r1 = analyse("pp", 0), analyse("pp", 1)
    for a in (r0, r1):
        assert set(a["comm_by_axis"]) == {"pp"} and set(a["comm_by_axis"]["pp"]) == {"send", "recv"}
        pp = a["comm_by_axis"]["pp"]
        # 4 micro-batches of (b, s, h) fp32: rank 0 sends activations, rank 1 their gradients
        assert pp["send"]["calls"] == 4 and pp["recv"]["calls"] == 4
        assert pp["send"]["bytes"] == 4 * B * S * H * 4 and pp["recv"]["bytes"] == 0
        assert a["comm_bytes_by_axis"]["pp"] == 4 * B * S * H * 4


def test_merge_ranks_takes_the_busiest_rank_for_bytes():
    m = ta.merge_ranks([analyse("pp", 0), analyse("pp", 1)])
    assert m["comm_pp_bytes"] == 4 * B * S * H * 4 and m["comm_dp_bytes"] == 0
    assert len(m["comm_share_pct_per_rank"]) == 2
    assert m["comm_share_pct"] == pytest.approx(sum(m["comm_share_pct_per_rank"]) / 2)
