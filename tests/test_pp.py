"""pp on 2 processes: every torch.distributed.pipelining schedule matches `single`, each rank holds
exactly its stages' model states, the timeline and the bubble are recorded, and configs a schedule
cannot run are refused before launch with their arithmetic."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from harness.dims import ParallelDims
from tests.helpers import DEVICES, assert_losses_match, assert_states_as_predicted, device_overrides, run

pytestmark = pytest.mark.slow

# model=tiny (4 layers), global batch 8, micro-batch 2, dp 1 -> m = 4 micro-batches per step
M = 4
SCHEDULES = {  # schedule -> vpp
    "gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "looped_bfs": 2, "interleaved_zero_bubble": 2,
    "zbv_zero_bubble": 2, "dualpipev": 2,
}
V_SHAPED = ("zbv_zero_bubble", "dualpipev")


def rank_stages(schedule: str, pp: int, vpp: int) -> list[list[int]]:
    """Stages per pp rank: looped r + i*pp, V-shaped [r, 2pp-1-r] (docs/notes.md#pipeline-placement, stated here independently of the catalog)."""
    if schedule in V_SHAPED:
        return [[r, 2 * pp - 1 - r] for r in range(pp)]
    return [[r + i * pp for i in range(vpp)] for r in range(pp)]


def expected_state_bytes(model_cfg: dict, stages: list[int], num_stages: int) -> dict:
    """Exact fp32 bytes of a rank holding `stages`, from the model's parameter shapes: stage s owns
    blocks [s*L/S, (s+1)*L/S); the embeddings go with stage 0, ln_f and head with the last stage.
    AdamW: exp_avg + exp_avg_sq per element and a 0-d fp32 step per parameter tensor."""
    from models.gpt import build_model

    cfg = OmegaConf.create(model_cfg)
    per = cfg.n_layers // num_stages
    owned = {str(layer) for s in stages for layer in range(s * per, (s + 1) * per)}

    def mine(name: str) -> bool:
        part = name.split(".")
        if part[0] == "blocks":
            return part[1] in owned
        if part[0] in ("tok_emb", "pos_emb"):
            return 0 in stages
        return num_stages - 1 in stages  # ln_f, head

    shapes = [tuple(p.shape) for n, p in build_model(cfg, 0).named_parameters() if mine(n)]
    numel = sum(math.prod(s) for s in shapes)
    return {"params_bytes": 4 * numel, "grads_bytes": 4 * numel, "optimizer_bytes": 8 * numel + 4 * len(shapes)}


def check_timeline(rec: dict, schedule: str) -> None:
    """Per rank: one F and one B for every (stage, micro-batch) it owns, a W only after its B, actions
    in order and inside the step; the recorded bubble is a fraction of the step."""
    m, d = rec["measured"], rec["dims"]
    pp, vpp, world = d["pp"], d["vpp"], d["world_size"]
    stages = rank_stages(schedule, pp, vpp)
    w, nmb = rec["config"]["workload"], m["num_microbatches"]
    for r in range(world):
        mine = stages[ParallelDims(**d).coords(r)["pp"]]
        doc = json.loads((Path(rec["run_dir"]) / f"timeline_rank{r}.json").read_text())
        assert {k: doc[k] for k in ("schedule", "pp", "vpp", "num_microbatches", "rank", "stages")} == {
            "schedule": schedule, "pp": pp, "vpp": vpp, "num_microbatches": nmb, "rank": r, "stages": mine}
        assert doc["step"] == w["warmup_steps"] + w["steps"] - 1  # the last timed step
        ev = doc["events"]
        keys = lambda a, ev=ev: sorted((e["stage"], e["mb"]) for e in ev if e["action"] == a)  # noqa: E731
        everything = sorted((s, mb) for s in mine for mb in range(nmb))
        assert keys("F") == everything and keys("B") == everything
        assert set(keys("W")) <= set(everything)
        if schedule in ("interleaved_zero_bubble", "zbv_zero_bubble"):
            assert keys("W") == everything  # these schedules split every backward into input and weight
        t_end = {}
        for e in ev:  # one thread runs a rank's actions: they are sequential and inside the step
            assert 0 <= e["start_s"] <= e["end_s"] <= doc["step_time_s"]
            t_end[(e["stage"], e["mb"], e["action"])] = e["end_s"]
        for a, b in zip(ev, ev[1:]):
            assert a["end_s"] <= b["start_s"]
        for (s, mb, a), end in t_end.items():
            if a == "W":
                assert t_end[(s, mb, "B")] <= end
            if a == "B":
                assert t_end[(s, mb, "F")] <= end
    assert len(m["bubble_pct_per_rank"]) == world and all(0 < b < 100 for b in m["bubble_pct_per_rank"])
    assert m["bubble_pct"] == pytest.approx(sum(m["bubble_pct_per_rank"]) / world)


# Schedules whose order the simulator draws as torch runs it, action for action (pp2 m4, measured).
# Not looped_bfs (torch runs each stage's backwards from the last micro-batch down, the simulator from
# the first up) nor interleaved_zero_bubble (torch places the W actions elsewhere); the V-shaped ones
# are drawn by a greedy approximation (Simulation.approximate).
SIMULATED_IN_TORCH_ORDER = ("gpipe", "1f1b", "interleaved_1f1b")


def check_order_follows_schedule(rec: dict) -> None:
    """Every rank ran its actions in the order of the schedule simulator (for 1F1B: p-1-r warm-up
    forwards, then one forward one backward, then the cool-down backwards): the order is what makes
    the bubble ((p-1)/(m+p-1) for 1F1B). How long the ranks then wait is this machine's speed and load
    (4 ranks time-share 2 cores here), so the measured bubble against the simulator's is a benchmark
    (tests/benchmarks/test_bench_pipeline_bubble.py), not a test."""
    from harness.costmodel.schedule import simulate

    m, d = rec["measured"], rec["dims"]
    sim = simulate(rec["config"]["strategy"]["schedule"], d["pp"], m["num_microbatches"], d["vpp"])
    for r in range(d["world_size"]):  # pp only: rank r is pp rank r
        doc = json.loads((Path(rec["run_dir"]) / f"timeline_rank{r}.json").read_text())
        ran = [(e["action"], e["stage"], e["mb"]) for e in doc["events"]]
        planned = [(e["action"], e["stage"], e["mb"]) for e in sorted(sim.events, key=lambda e: e["start_s"])
                   if e["rank"] == r]
        assert ran == planned, (r, ran, planned)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_pp_schedule_matches_single(schedule, device, tmp_path, single_reference):
    vpp = SCHEDULES[schedule]
    ref = single_reference(*device_overrides(device))
    rec = run([*device_overrides(device), "strategy=pp", "parallel.pp=2", f"parallel.vpp={vpp}",
               f"strategy.schedule={schedule}"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert rec["measured"]["num_microbatches"] == M
    assert_losses_match(rec["measured"]["losses"], ref["measured"]["losses"])

    # each rank holds exactly the model states of its stages
    m, pp = rec["measured"], 2
    expected = [expected_state_bytes(rec["config"]["model"], st, pp * vpp) for st in rank_stages(schedule, pp, vpp)]
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert m[f"{key}_per_rank"] == [e[key] for e in expected], key
    # together the ranks hold the single process's parameters, each exactly once
    assert sum(m["params_bytes_per_rank"]) == ref["measured"]["params_bytes"]
    assert_states_as_predicted(rec)
    check_timeline(rec, schedule)
    if schedule in SIMULATED_IN_TORCH_ORDER:
        check_order_follows_schedule(rec)


def test_1f1b_pp4_m8_runs_the_schedule_s_order(tmp_path):
    """pp4, m = 16 / 2 = 8: one layer per stage, each rank in 1F1B's order (the simulator's bubble:
    3/11 = 27.3 %)."""
    rec = run(["strategy=pp", "parallel.pp=4", "strategy.schedule=1f1b", "workload.global_batch_size=16"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert rec["measured"]["num_microbatches"] == 8
    check_timeline(rec, "1f1b")
    check_order_follows_schedule(rec)


def test_bad_pipeline_config_is_an_invalid_record_and_nothing_launches(tmp_path):
    rec = run(["strategy=pp", "parallel.pp=2", "parallel.vpp=2", "strategy.schedule=dualpipev",
               "workload.global_batch_size=4"], tmp_path)
    assert rec["status"] == "invalid"
    assert rec["run_dir"] is None  # refused before launch
    assert ("dualpipev needs num_microbatches >= stages: num_microbatches 2 = global_batch_size 4 / "
            "(dp 1 * micro_batch_size 2) < pp 2 * vpp 2 = 4 stages") in rec["error"]


@pytest.fixture(scope="module")
def pp_config(tmp_path_factory):
    """strategy=pp, pp=2 on model=tiny (4 layers), composed once; each case edits a copy."""
    from harness.config import to_run_config
    from tests.helpers import compose_config

    return to_run_config(compose_config(["model=tiny", "strategy=pp", "parallel.pp=2"],
                                        tmp_path_factory.mktemp("pp_config")))


@pytest.mark.parametrize("edits, message", [
    ({"parallel.vpp": 3, "strategy.schedule": "interleaved_1f1b"},
     r"n_layers 4 < pp\*vpp 6 \(pp 2 \* vpp 3\): a stage would hold no block"),
    ({"strategy.schedule": "1f1b", "workload.global_batch_size": 2},
     r"1f1b needs num_microbatches >= stages: num_microbatches 1 = global_batch_size 2 / "
     r"\(dp 1 \* micro_batch_size 2\) < pp 2"),
    ({"parallel.vpp": 2, "strategy.schedule": "interleaved_1f1b", "workload.global_batch_size": 10},
     r"rounds = max\(1, 5 // pp 2\) = 2, 5 % 2 = 1"),
    ({"parallel.vpp": 2, "strategy.schedule": "1f1b"}, r"schedule 1f1b runs one stage per rank: vpp must be 1"),
    ({"parallel.vpp": 3, "strategy.schedule": "zbv_zero_bubble", "model.n_layers": 6},
     r"zbv_zero_bubble is V-shaped: vpp must be 2 \(got 3\)"),
    ({"strategy.schedule": "zigzag"}, r"unknown schedule 'zigzag'; available: gpipe, 1f1b"),
])
def test_bad_pipeline_config_refused_with_arithmetic(edits, message, pp_config):
    import copy

    from harness.dims import ConfigError
    from harness.validate import validate

    cfg = copy.deepcopy(pp_config)
    for key, value in edits.items():
        group, field = key.split(".")
        setattr(getattr(cfg, group), field, value)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
