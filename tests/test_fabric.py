"""Fabric profiles (conf/hardware/fabric/): composed beside a node profile, every measured point cited,
and collectives across nodes priced by message size and placement on the fabric's curve."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from harness.config import compose_run
from harness.costmodel import comm
from harness.costmodel.inputs import Hardware, Model, StrategyKnobs
from harness.costmodel.layout import layout, node_crossing_axes
from harness.costmodel.step_time import tp_comm
from harness.tools.plan_reasons import network

FABRICS = sorted((Path(__file__).resolve().parents[1] / "conf" / "hardware" / "fabric").glob("*.yaml"))


def hardware(fabric: str | None, node: str = "h100_sxm"):
    run = compose_run([f"hardware={node}", *([f"hardware/fabric={fabric}"] if fabric else []), "logger=none"])
    return run, Hardware.of(run.hardware)


@pytest.mark.parametrize("path", FABRICS, ids=lambda p: p.stem)
def test_every_measured_point_names_a_source_the_profile_cites(path):
    doc = yaml.safe_load(path.read_text())
    assert doc["name"] == path.stem
    for key in ("rails", "latency_us", "thin"):  # the rails, the latency and what the curves do not reach
        assert doc["source"].get(key), f"{path.name}: source.{key}"
    for coll, runs in (doc.get("curves") or {}).items():
        assert coll in comm.FACTOR
        for run in runs:
            assert run["source"] in doc["source"], f"{path.name}: {coll} {run['nodes']} nodes cites {run['source']!r}"
            sizes = [b for b, _ in run["busbw_GBps"]]
            assert sizes == sorted(sizes) and all(bw > 0 for _, bw in run["busbw_GBps"])


def test_a_node_profile_composes_with_any_fabric_and_without_one():
    _, plain = hardware(None)
    assert plain.fabric is None
    for path in FABRICS:
        _, hw = hardware(path.stem)
        assert hw.fabric.name == path.stem and hw.name == "h100_sxm"


def test_a_measured_point_is_priced_as_measured():
    _, hw = hardware("efa_p5")
    f = hw.fabric
    # 2 nodes x 8 GPUs, 1 GiB all-reduce: 435.14 GB/s busbw (the profile's point)
    t = f.call_s("all_reduce", 16, 8, 2**30)
    assert t == pytest.approx(comm.FACTOR["all_reduce"](16) * 2**30 / 435.14e9, rel=1e-9)
    # all-to-all has its own curve: 32 nodes, 2 GiB at 40.78 GB/s
    t = f.call_s("all_to_all", 256, 8, 2**31)
    assert t == pytest.approx(comm.FACTOR["all_to_all"](256) * 2**31 / 40.78e9, rel=1e-6)


def test_small_messages_pay_latency_large_ones_bandwidth():
    _, hw = hardware("ib_ndr400")
    f = hw.fabric
    tiny = f.call_s("all_reduce", 16, 8, 1024)
    assert f.latency_s <= tiny < 1.1 * f.latency_s  # latency-bound: the measured 2-node small-message time
    big = f.call_s("all_reduce", 16, 8, 2**30)
    busbw = comm.FACTOR["all_reduce"](16) * 2**30 / big
    # bandwidth-bound: 8 NICs at the 2-node curve's last point (41.31 GB/s each)
    assert busbw == pytest.approx(8 * 41.31e9, rel=0.01)


def test_one_rank_a_node_drives_one_nic_and_more_nodes_cost_more():
    _, hw = hardware("efa_p5")
    f = hw.fabric
    s = 256 * 2**20
    full, one = f.call_s("all_reduce", 128, 8, s), f.call_s("all_reduce", 16, 1, s)
    # a dp group with tp 8 (one rank a node) moves its bytes through one 400 Gb/s rail: at least its wire time
    assert one >= comm.FACTOR["all_reduce"](16) * s / 50e9
    assert one > full
    by_nodes = [f.call_s("all_reduce", 8 * n, 8, s) for n in (2, 4, 8, 16, 32)]
    assert by_nodes == sorted(by_nodes)
    # beyond the measured node counts NCCL's ring steps still add latency
    assert f.call_s("all_reduce", 8 * 128, 8, 1024) > f.call_s("all_reduce", 8 * 32, 8, 1024)


def test_tp_across_nodes_pays_the_fabric_at_small_messages():
    run, hw = hardware("ib_ndr400")
    md, st = Model.of(compose_run(["model=gpt_70b", "logger=none"]).model), StrategyKnobs.of(
        compose_run(["strategy=3d", "logger=none"]).strategy)
    inside = layout(md, hw, st, 8, 8, 1, 1, 1, "bf16-mixed")
    across = layout(md, hw, st, 4, 16, 1, 1, 1, "bf16-mixed")
    assert node_crossing_axes(inside.place) == ("dp",) and node_crossing_axes(across.place) == ("tp", "dp")
    assert across.links.tp.fabric and not inside.links.tp.fabric
    # per byte: NVLink's 360 GB/s against a 2-node ring over 8 NDR rails (8 x 41.31 GB/s at large sizes)
    per_byte_in = tp_comm(inside, 1, 1).time_s / tp_comm(inside, 1, 1).bytes
    per_byte_across = tp_comm(across, 1, 1).time_s / tp_comm(across, 1, 1).bytes
    assert per_byte_across > per_byte_in
    # and every call, on the critical path, pays at least the fabric's latency: a small activation (one
    # sequence of 128 tokens, 2 MiB in bf16) is latency-bound across nodes
    small = 128 * md.h * 2
    call_across = comm.call_s(across.links.tp, "all_reduce", 16, small)
    assert call_across >= hw.fabric.latency_s > 2 * comm.call_s(inside.links.tp, "all_reduce", 8, small)


def test_pp_crosses_nodes_at_stage_boundaries():
    _, hw = hardware("efa_p5")
    md = Model.of(compose_run(["model=gpt_70b", "logger=none"]).model)
    st = StrategyKnobs.of(compose_run(["strategy=3d", "logger=none"]).strategy)
    lo = layout(md, hw, st, 8, 8, 4, 1, 1, "bf16-mixed")
    assert "pp" in node_crossing_axes(lo.place) and lo.links.pp.fabric
    one = 2 * 4096 * md.h * 4
    # send/recv has no curve: one rail's line rate plus the latency
    assert comm.call_s(lo.links.pp, "send_recv", 2, one) == pytest.approx(
        hw.fabric.latency_s + one / 50e9, rel=1e-6)


def test_the_planner_header_names_node_and_fabric():
    run, _ = hardware("efa_p5")
    line = network(run)
    assert "8 x h100_sxm" in line and "efa_p5" in line and "node counts [2, 4, 8, 16, 32]" in line
    plain, _ = hardware(None)
    assert "none named" in network(plain)


def test_published_rows_carry_their_clusters_fabric():
    from lab.published import load, overrides

    models, rows = load()
    selene = [r for r in rows if r["source"] == "narayanan2021_t2"]
    assert selene and all(r["fabric"] == "ib_hdr200" for r in selene)
    assert "hardware/fabric=ib_hdr200" in overrides(selene[0], models[selene[0]["model"]])
    fabrics = {p.stem for p in FABRICS}
    assert {r["fabric"] for r in rows if r.get("fabric")} <= fabrics


def test_interpolation_is_log_log_between_points():
    _, hw = hardware("efa_p5")
    f = hw.fabric
    a, b = f.call_s("all_reduce", 16, 8, 2**25), f.call_s("all_reduce", 16, 8, 2**26)
    mid = f.call_s("all_reduce", 16, 8, 2**25.5)
    assert mid == pytest.approx(math.sqrt(a * b), rel=1e-9)


def test_a_calibrated_profile_prices_its_own_points_even_when_a_small_message_measured_slow():
    """On a loaded machine the median of the smallest all-reduce can catch the machine busy and come out
    slower than a larger message's. The profile's latency is the quickest call, so every measured point
    is still priced as measured (a latency above a measured time priced that point at the latency)."""
    from harness.costmodel.fabric import Fabric
    from harness.tools.calibrate_fabric import profile

    rows = [{"bytes": 4096, "time_s": 3.5e-3}, {"bytes": 262144, "time_s": 2.0e-4}, {"bytes": 2**20, "time_s": 3.6e-4}]
    doc = profile("loaded", 2, 1, 1, {"world_size": 2, "results": {"all_reduce": rows, "send_recv": rows}}, "gloo")
    assert doc["latency_us"] == 200.0 and "262144 B" in doc["source"]["latency_us"]
    fabric = Fabric.of(doc)
    for size, t in ((262144, 2.0e-4), (2**20, 3.6e-4)):
        assert fabric.call_s("all_reduce", 2, 1, size) == pytest.approx(t, rel=1e-5)
