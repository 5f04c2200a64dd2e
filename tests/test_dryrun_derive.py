"""A dry run's middle pipeline ranks derived from two simulated ones (harness/strategies/pp_derive.py): for
every schedule, the derived dry run's per-rank peaks and state bytes, and the worst rank's step, phase
and operator, equal those of the dry run that simulates every role; the V-shaped schedules derive nothing.
The checks that decide whether to derive refuse what breaks the rule."""
from __future__ import annotations

import pytest

from harness import catalog
from harness.strategies import pp_derive
from tests.helpers import run
from tests.test_dryrun_shorten import _torch_order

# pp 6: four middle ranks, the two ends simulated and the two between derived; 12 layers, one or two a stage
BASE = ["launcher=dryrun", "model=llama_tiny", "model.n_layers=12", "workload.global_batch_size=24",
        "workload.micro_batch_size=2", "logger=none"]
LAYOUTS = {s: ["strategy=pp", "parallel.pp=6", f"strategy.schedule={s}",
               *(["parallel.vpp=2"] if catalog.chunks_per_rank(s, 2) == 2 else [])] for s in catalog.SCHEDULES}
LAYOUTS["3d 1f1b"] = ["strategy=3d", "parallel.dp=2", "parallel.tp=2", "parallel.pp=6"]  # FSDP and TP in the stages
# 1F1B derives from its ends (the warm-up's bytes prove the line), interleaved 1F1B after simulating a witness;
# 3d puts FSDP and TP in the stages
CI = {"1f1b", "interleaved_1f1b", "3d 1f1b"}
KEYS = ("peak_mem_bytes", "params_bytes", "grads_bytes", "optimizer_bytes", "model_states_bytes")


@pytest.mark.slow
@pytest.mark.parametrize("family", [pytest.param(k, marks=[] if k in CI else [pytest.mark.heavy]) for k in LAYOUTS])
def test_a_derived_dry_run_gives_every_ranks_peak_as_the_one_that_simulates_them_all(family, tmp_path):
    derived = run([*BASE, *LAYOUTS[family], "study=derived"], tmp_path)
    every = run([*BASE, *LAYOUTS[family], "launcher.derive=false", "study=every"], tmp_path)
    for rec in (derived, every):
        assert rec["status"] == "ok", rec["error"]
        assert "dryrun_step_error" not in rec["measured"]
    d, e = derived["measured"], every["measured"]
    assert d["dryrun_ranks"] == e["dryrun_ranks"]
    for key in KEYS:
        assert d[f"{key}_per_rank"] == e[f"{key}_per_rank"], key
    assert [d[k] for k in ("peak_rank", "peak_step", "peak_phase", "peak_op")] == \
           [e[k] for k in ("peak_rank", "peak_step", "peak_phase", "peak_op")]
    assert e["dryrun_derived"] == [None] * len(e["dryrun_ranks"])
    made = [r for r, x in zip(d["dryrun_ranks"], d["dryrun_derived"]) if x]
    schedule = family.split()[-1]
    if catalog.schedule(schedule).derive_middle:
        assert made and "dryrun_not_derived" not in d, d.get("dryrun_not_derived")
        assert all(d["dryrun_rank_wall_s"][d["dryrun_ranks"].index(r)] is None for r in made)
    else:
        assert not made


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_in_flight_is_what_torchs_order_holds(schedule):
    """1F1B: pp rank r holds min(m, pp - r) forwards before backward frees them; GPipe: all m."""
    for pp in (2, 4, 8):
        for m in (pp, 3 * pp):
            held = [pp_derive.in_flight(_torch_order(schedule, pp, m, r)) for r in range(pp)]
            assert held == ([min(m, pp - r) for r in range(pp)] if schedule == "1f1b" else [m] * pp)


class _Dims:
    def coords(self, rank):
        return {"pp": rank}


def _result(peak: int, forward: int, warmup: int | None = None, op: str = "aten.mm") -> dict:
    return {"in_flight": [6, 5, 4, 3, 2, 1], "warmup_bytes": warmup,
            "memory": {"params_bytes": 10, "peak_mem_bytes": peak, "peak_step": 2, "peak_phase": "backward x",
                       "peak_op": op, "peak_live_by_kind": {"forward": forward, "at_rest": peak - forward}}}


def test_the_ends_derive_the_middle_where_one_warmup_forward_left_their_slope():
    got = pp_derive.derive([1, 2, 3, 4], {1: _result(500, 400, 100), 4: _result(200, 100, 100)}, _Dims())
    assert sorted(got) == [2, 3]
    assert [got[r]["memory"]["peak_mem_bytes"] for r in (2, 3)] == [400, 300]
    assert got[2]["memory"]["peak_live_by_kind"] == {"forward": 300, "at_rest": 100}
    assert got[2]["derived"] == {"from_ranks": [1, 4], "in_flight": 4, "bytes_per_forward_in_flight": 100}


def test_a_slope_no_warmup_forward_shows_asks_for_a_witness_then_checks_it():
    ends = {1: _result(500, 400, 90), 4: _result(200, 100, None)}
    with pytest.raises(pp_derive.NeedWitness) as asked:
        pp_derive.derive([1, 2, 3, 4], dict(ends), _Dims())
    assert asked.value.rank == 2  # 4 forwards in flight, nearest the middle of the ends' 5 and 2
    assert sorted(pp_derive.derive([1, 2, 3, 4], {**ends, 2: _result(400, 300)}, _Dims())) == [3]
    with pytest.raises(pp_derive.NotDerived, match="not at the 400 of the line"):
        pp_derive.derive([1, 2, 3, 4], {**ends, 2: _result(410, 310)}, _Dims())


def test_a_peak_in_the_warmup_is_the_same_on_every_rank_once_a_witness_says_so():
    """Full recompute, many chunks: the peak comes in an early forward, before the ranks' warm-ups differ;
    the ends' peaks are equal although they hold different numbers of forwards in flight."""
    ends = {1: _result(500, 400, 90), 4: _result(500, 400, 90)}
    with pytest.raises(pp_derive.NeedWitness):
        pp_derive.derive([1, 2, 3, 4], dict(ends), _Dims())
    got = pp_derive.derive([1, 2, 3, 4], {**ends, 2: _result(500, 400)}, _Dims())
    assert got[3]["memory"]["peak_mem_bytes"] == 500


@pytest.mark.parametrize("ends,message", [
    ({1: _result(500, 400, 100), 4: _result(201, 101, 100)}, "not a whole number of bytes a forward"),
    ({1: _result(500, 400, 100), 4: _result(200, 100, 100, op="aten.sum")}, "peak at different places"),
    ({1: _result(500, 400, 100), 4: {**_result(200, 100, 100), "in_flight": [6, 5, 4, 3, 2, 2]}},
     "different in-flight forwards"),
    ({1: _result(500, 400, 100), 4: {"memory": {"params_bytes": 10}}}, "have no peak"),
])
def test_ends_that_break_the_rule_derive_nothing(ends, message):
    with pytest.raises(pp_derive.NotDerived, match=message):
        pp_derive.derive([1, 2, 3, 4], ends, _Dims())
