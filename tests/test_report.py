"""The report (harness/report): the pure parts (schedule simulator, ring, Amdahl fit, mesh) against
their known answers, then the report of a real study run once per session through the CLI.

The fixture study (`report_study`) is real, no hand-written record: `brigade -m` with model=tiny on
this machine runs single, ddp dp=2, 3d tp2 x pp2 1f1b (world 4: tp inside a node, pp across the 2
"nodes" of hardware=cpu; it writes pipeline timelines), an invalid config (dp=3), an
unknown strategy (a record with no dims) and a rank that crashes (fault=crash_rank1). Its end-of-sweep
hook writes the report.
"""
from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest

from harness import catalog
from harness.costmodel import pipeline, schedule
from harness.report import ring, scaling
from harness.report.mesh import describe
from harness.report.study import Run, load
from tests.helpers import cli, records

STUDY = "rfix"
# One 3d tp2 x pp2 run serves the TP, PP and 3D modes (separate tp and pp runs would cost ~4 more
# processes of CI time for no extra mechanism).
RUNS = [["strategy=single"], ["strategy=ddp", "parallel.dp=2"],
        ["strategy=3d", "parallel.tp=2", "parallel.pp=2", "strategy.schedule=1f1b"], ["strategy=ddp", "parallel.dp=3"],
        ["strategy=nosuch"], ["strategy=ddp", "parallel.dp=2", "fault=crash_rank1", "workload.seed=7"]]
# 1 warm-up + 5 timed steps + 1 profiled step (the comm share needs a profiled window)
OVERRIDES = ["model=tiny", "logger=none", "workload.warmup_steps=1", "workload.steps=5", "workload.profile_steps=1",
             "launcher.timeout_s=300"]
_CACHE: dict = {}


def report_study(tmp_path_factory) -> dict:
    """The fixture study, run once per session (shared with test_report_browser.py)."""
    if "study" not in _CACHE:
        out = tmp_path_factory.mktemp("report_study")
        runs = "[" + ",".join("[" + ",".join(f'"{o}"' for o in r) + "]" for r in RUNS) + "]"
        # allow_failures: the study holds an invalid and a crashed run on purpose (exit 0 once recorded)
        p = cli(["-m", f"study={STUDY}", *OVERRIDES, "allow_failures=true", f"hydra.sweeper.runs={runs}"], out,
                timeout=1200)
        assert p.returncode == 0, p.stderr[-4000:]
        recs = records(out, STUDY)
        assert len(recs) == len(RUNS), [r["status"] for r in recs]
        _CACHE["study"] = {"dir": out, "jsonl": out / f"{STUDY}.jsonl", "records": recs, "stdout": p.stdout,
                           "stderr": p.stderr}
    return _CACHE["study"]


def by_strategy(recs: list[dict], status: str = "ok") -> dict[str, dict]:
    return {r["strategy"]: r for r in recs if r["status"] == status}


# -- pure parts ------------------------------------------------------------------------------------------
def _check_schedule(sim: schedule.Simulation):
    """Every action once, no overlap on a rank, and every dependency finished before its consumer."""
    p, v, m = sim.pp, sim.vpp, sim.num_microbatches
    done = {(e["action"], e["stage"], e["mb"]): e for e in sim.events}
    split = catalog.schedule(sim.schedule).split_backward
    assert len(done) == len(sim.events) == p * v * m * (3 if split else 2)
    last = p * v - 1
    for e in sim.events:
        a, s, mb = e["action"], e["stage"], e["mb"]
        deps = {"F": [("F", s - 1, mb)] if s else [],
                "B": [("F", s, mb)] + ([("B", s + 1, mb)] if s < last else []),
                "W": [("B", s, mb)]}[a]
        for d in deps:
            assert done[d]["end_s"] <= e["start_s"] + 1e-9, (e, done[d])
    for r in range(p):
        mine = sorted((e for e in sim.events if e["rank"] == r), key=lambda e: e["start_s"])
        for x, y in zip(mine, mine[1:]):
            assert x["end_s"] <= y["start_s"] + 1e-9, (x, y)
        assert {e["stage"] for e in mine} == set(catalog.stages_of_rank(sim.schedule, r, p, v))


@pytest.mark.parametrize("sched,p,v,m", [("gpipe", 4, 1, 8), ("1f1b", 4, 1, 8), ("1f1b", 2, 1, 4), ("1f1b", 3, 1, 7),
                                         ("gpipe", 2, 1, 1), ("interleaved_1f1b", 4, 2, 8),
                                         ("interleaved_1f1b", 2, 2, 4), ("looped_bfs", 2, 2, 4),
                                         ("interleaved_zero_bubble", 4, 2, 8), ("zbv_zero_bubble", 4, 2, 8),
                                         ("dualpipev", 2, 2, 4)])
def test_schedule_simulator_respects_dependencies(sched, p, v, m):
    _check_schedule(schedule.simulate(sched, p, m, v))


def test_simulated_bubble_is_the_textbook_formula():
    # the seed's example: 4 stages, 8 micro-batches -> 3/11 = 27.27 %
    assert schedule.simulate("1f1b", 4, 8).bubble_pct == pytest.approx(100 * 3 / 11)
    assert schedule.formula_bubble_pct(4, 8) == pytest.approx(27.2727, abs=1e-3)
    for p, m in ((2, 4), (4, 4), (3, 9), (8, 16)):
        f = schedule.formula_bubble_pct(p, m)
        assert schedule.simulate("gpipe", p, m).bubble_pct == pytest.approx(f)
        assert schedule.simulate("1f1b", p, m).bubble_pct == pytest.approx(f)
        # interleaving v chunks per rank divides the bubble's time by v: (p-1)/(v*m + p-1)
        assert schedule.simulate("interleaved_1f1b", p, m, 2).bubble_pct == pytest.approx(
            schedule.formula_bubble_pct(p, m, 2))
    # zero-bubble schedules fill the gaps with weight-gradient work: less bubble than 1F1B
    assert schedule.simulate("interleaved_zero_bubble", 4, 8, 2).bubble_pct < schedule.formula_bubble_pct(4, 8, 2)
    assert schedule.simulate("zbv_zero_bubble", 4, 8, 2).bubble_pct < schedule.formula_bubble_pct(4, 8)


def test_an_unfilled_interleaved_pipeline_idles_while_the_other_rank_runs_its_chunks():
    # m = 1, pp 2, vpp 2: the micro-batch walks 4 chunks rank after rank, so each rank idles while the
    # other runs its 2 chunks' F + B: 2 units; the filled formula's p - 1 would say 1
    assert pipeline.bubble_units("interleaved_1f1b", 2, 2, 1) == 2
    assert pipeline.bubble_units("interleaved_1f1b", 2, 2, 2) == 1


@pytest.mark.parametrize("sched,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3),
                                     ("interleaved_1f1b", 4), ("looped_bfs", 2), ("interleaved_zero_bubble", 2),
                                     ("interleaved_zero_bubble", 3), ("interleaved_zero_bubble", 4),
                                     ("zbv_zero_bubble", 2), ("dualpipev", 2)])
def test_unfilled_pipeline_idles_as_its_timeline_says(sched, v):
    """Fewer micro-batches than ranks: the cost model's idle time (pipeline.bubble_units, in units of one
    chunk's F + B + W) is the simulated timeline's, where the filled formulas would say far less
    (interleaved, m = 1, pp 2, v 2: 2 units, not 1)."""
    for p in (2, 3, 4, 6, 8, 12):
        for m in range(1, p):
            sim = schedule.simulate(sched, p, m, v)
            idle = (sim.makespan - 3 * m) * sim.vpp / 3  # a rank is busy 3/v per chunk, v m chunks
            assert pipeline.bubble_units(sched, p, v, m) == pytest.approx(idle), (p, m)


def test_1f1b_keeps_at_most_p_minus_rank_microbatches_in_flight():
    sim = schedule.simulate("1f1b", 4, 8)
    for r in range(4):
        live, peak = 0, 0
        for e in sorted((e for e in sim.events if e["rank"] == r), key=lambda e: e["start_s"]):
            live += 1 if e["action"] == "F" else -1
            peak = max(peak, live)
        assert peak == 4 - r  # GPipe would hold all 8


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_ring_allreduce_ends_with_every_rank_holding_the_full_sum(n):
    steps = ring.steps(n)
    assert len(steps) == 1 + 2 * (n - 1)
    assert all(v == n for row in steps[-1]["state"] for v in row)
    # after the reduce-scatter half, rank i holds the full sum of exactly chunk (i + 1) mod n
    if n > 1:
        mid = steps[n - 1]["state"]
        assert [[c for c in range(n) if mid[i][c] == n] for i in range(n)] == [[(i + 1) % n] for i in range(n)]
    for st in steps[1:]:  # each step every rank sends one chunk and receives one
        assert sorted(s for s, _, _ in st["sends"]) == sorted(d for _, d, _ in st["sends"]) == list(range(n))
    # one chunk per step per rank over 2(n-1) steps: the nccl-tests bus factor 2(n-1)/n
    assert ring.allreduce_bytes_per_rank(1000.0, n) == pytest.approx(2 * (n - 1) * 1000.0 / n)


def test_amdahl_fit_recovers_the_serial_fraction():
    for f in (0.0, 0.05, 0.3, 1.0):
        pts = [(n, scaling.amdahl(f, n)) for n in (1, 2, 4, 8)]
        assert scaling.fit_serial_fraction(pts) == pytest.approx(f, abs=1e-12)
    assert scaling.fit_serial_fraction([(1, 1.0)]) is None


def test_mesh_groups_and_node_crossing():
    run = Run({"dims": {"dp": 2, "tp": 2, "pp": 2, "vpp": 1, "ep": 1, "world_size": 8}, "strategy": "3d",
               "config": {"hardware": {"devices_per_node": 4}, "strategy": {"data_parallel": "fsdp"}}})
    d = describe(run)
    axes = {a["axis"]: a for a in d["axes"]}
    assert axes["tp"]["groups"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and axes["tp"]["crossing"] == 0
    assert axes["dp"]["groups"] == [[0, 2], [1, 3], [4, 6], [5, 7]] and axes["dp"]["crossing"] == 0
    assert axes["pp"]["groups"] == [[0, 4], [1, 5], [2, 6], [3, 7]] and axes["pp"]["crossing"] == 4
    assert axes["pp"]["link"] == "inter_node" and axes["tp"]["link"] == "intra_node"
    assert [r["node"] for r in d["ranks"]] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert "all-gather" in axes["dp"]["collective"]  # 3D shards the dp axis with FSDP by default


# -- the report of a real study ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def study(tmp_path_factory):
    return report_study(tmp_path_factory)


def _png_ok(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    w, h = struct.unpack(">II", data[16:24])
    assert w > 100 and h > 100 and len(data) > 5000, (path, w, h, len(data))
    return w, h


def test_a_chart_with_nothing_to_draw_says_so_without_a_legend_warning(tmp_path):
    """A study of single-device runs: communication is 0 for every run, measured and predicted."""
    import warnings

    from harness.report import png

    series = {"axes": ["dp"], "rows": [{"label": "single", "measured": {"dp": 0.0}, "predicted": {"dp": 0.0}}]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns when legend() finds no labelled artist
        _png_ok(png.comm(series, tmp_path / "comm.png"))


@pytest.mark.slow
def test_the_sweep_writes_the_report_and_prints_its_path_last(study):
    recs = study["records"]
    assert sorted(r["status"] for r in recs) == ["failed", "invalid", "invalid", "ok", "ok", "ok"]
    assert set(by_strategy(recs)) == {"single", "ddp", "3d"}
    html = study["dir"] / f"{STUDY}.html"
    assert study["stdout"].strip().splitlines()[-1] == f"report: {html}"
    # plotly.js once per results dir, beside the pages; each page well under 1 MB
    assert html.stat().st_size <= 1_000_000, html.stat().st_size
    assert len(list(study["dir"].glob("plotly-*.min.js"))) == 1
    for key in ("scaling", "memory", "comm", "pipeline"):
        _png_ok(study["dir"] / f"{STUDY}_{key}.png")


@pytest.mark.slow
def test_report_cli_needs_no_network_and_degrades_without_failing(study, tmp_path):
    jsonl = tmp_path / f"{STUDY}.jsonl"
    shutil.copy(study["jsonl"], jsonl)
    p = cli_report(jsonl)
    assert p.returncode == 0, p.stderr
    html = Path(p.stdout.strip().splitlines()[-1])
    assert html == tmp_path / f"{STUDY}.html"
    text = html.read_text()
    # no network: the page's script inline, plotly.js from the file beside it (the browser test also
    # blocks every request), nothing else linked
    srcs = re.findall(r'<script src="([^"]+)"', text)
    assert len(srcs) == 1 and srcs[0].startswith("plotly-") and (tmp_path / srcs[0]).stat().st_size > 1_000_000
    assert "<link " not in text
    outside_scripts = re.sub(r"<script[^>]*>.*?</script>", "", text, flags=re.S)
    assert "http://" not in outside_scripts and "https://" not in outside_scripts
    assert 'class="report-error"' not in text  # every section drew, although fields are missing
    recs = study["records"]
    # the failed and invalid runs are listed with their reasons
    for r in recs:
        if r["status"] != "ok":
            assert r["run_id"] in text
    assert "fault injection: rank 1 crashed on purpose" in text
    assert "global_batch_size 8 not divisible by dp*micro_batch_size 6" in text
    assert sorted(q.name for q in tmp_path.glob("*.png")) == [f"{STUDY}_{k}.png" for k in
                                                             ("comm", "memory", "pipeline", "scaling")]


def cli_report(jsonl: Path, *args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "harness.report", str(jsonl), *args], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent)


@pytest.mark.slow
def test_one_strategy_study(study, tmp_path):
    # only the 3d run: the DP mode says what was not run and how to run it; TP, PP and 3D draw it
    jsonl = tmp_path / "only3d.jsonl"
    jsonl.write_text(json.dumps(by_strategy(study["records"])["3d"]) + "\n")
    from harness.report import write_report

    html = write_report(jsonl)
    text = html.read_text()
    assert 'class="report-error"' not in text
    assert "This study ran no data-parallel config" in text and "strategy=ddp parallel.dp=2" in text
    assert "This study ran no tensor-parallel config" not in text and "Measured: one timed step" in text
    assert "Scaling: not measured" in text  # one device count: no curve
    assert (tmp_path / "only3d_pipeline.png").exists() and not (tmp_path / "only3d_scaling.png").exists()


@pytest.mark.slow
def test_report_of_records_without_the_newer_fields(study, tmp_path):
    # the same real records as an older brigade wrote them: no prediction, no comm or bubble
    # measurement, run directories gone (no timelines): every mode still draws, saying what is missing
    recs = []
    for r in study["records"]:
        r = json.loads(json.dumps(r))
        r["predicted"], r["run_dir"] = {}, None
        r["measured"] = {k: v for k, v in (r.get("measured") or {}).items()
                         if not k.startswith(("comm", "bubble", "profiled"))}
        recs.append(r)
    jsonl = tmp_path / "old.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in recs))
    from harness.report import write_report

    text = write_report(jsonl).read_text()
    assert 'class="report-error"' not in text
    assert "Measured timeline: not measured" in text and "not predicted" in text
    assert "The measured communication share of the tp axis: not measured" in text
    assert "Communication share by axis: not measured and not predicted" in text


def test_report_of_an_empty_or_torn_study(tmp_path):
    # a study whose only line was torn by a killed writer: the report says so instead of failing
    jsonl = tmp_path / "torn.jsonl"
    jsonl.write_text('{"schema_version": 1, "run_id": "abc", "stat')
    from harness.report import write_report

    text = write_report(jsonl).read_text()
    assert 'class="report-error"' not in text and "0 configs" in text


@pytest.mark.slow
def test_report_switch_and_a_report_failure_never_fail_the_sweep(tmp_path):
    # Studies of one invalid config (refused before launch: no ranks, quick).
    one = ["-m", "model=tiny", "logger=none", "strategy=ddp", "parallel.dp=3"]
    p = cli([*one, "study=off", "report=false"], tmp_path)
    assert p.returncode == 2 and not (tmp_path / "off.html").exists()
    assert "report:" not in p.stdout
    # a real failure: the report's path is taken by a directory, so writing it fails
    (tmp_path / "blocked.html").mkdir()
    p = cli([*one, "study=blocked"], tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]  # the invalid run; the report's failure does not change it
    assert "report failed" in p.stderr and "IsADirectoryError" in p.stderr
    (r,) = records(tmp_path, "blocked")
    assert r["status"] == "invalid"


@pytest.mark.slow
def test_wandb_summary_run_holds_the_study_tables(study, tmp_path):
    from harness.report.wandb_summary import log_summary
    from tests.wandb_file import summary_and_history

    jsonl = tmp_path / f"{STUDY}.jsonl"
    shutil.copy(study["jsonl"], jsonl)
    where = log_summary(jsonl, None, mode="offline")
    assert where is not None
    assert Path(where).resolve().parent == (tmp_path / "runs" / STUDY / "_summary" / "wandb").resolve()
    (run_file,) = Path(where).glob("run-*.wandb")
    summary, _ = summary_and_history(run_file)
    n = len(load(jsonl).runs)
    assert summary["runs_table/nrows"] == n and summary["n_runs"] == n
    assert summary["n_ok"] == 3 and summary["n_failed"] == 1 and summary["n_invalid"] == 2
    from harness.run.record import Status

    assert {k for k in summary if k.startswith("n_") and k != "n_runs"} == {f"n_{s}" for s in Status}  # all 7
    assert summary["not_ok_table/nrows"] == 3
    (table,) = Path(where).glob("files/media/table/runs_table_*.table.json")
    data = json.loads(table.read_text())
    assert {row[0] for row in data["data"]} == {r.run_id for r in load(jsonl).runs}
    assert not (Path.home() / "wandb").exists() or not any((Path.home() / "wandb").glob("offline-run-*rfix*"))


@pytest.mark.slow
def test_every_config_is_offered_labelled_by_what_differs_and_the_page_opens_on_its_mode(study, tmp_path):
    # the fixture's real pp run as seven configs that differ only in the schedule (as a study sweeping
    # the schedules records them): the PP picker offers all seven, named by their schedule, and a
    # study of pipelines opens on the PP mode
    pp_run = by_strategy(study["records"])["3d"]
    schedules = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble",
                 "dualpipev"]
    recs = []
    for i, sched in enumerate(schedules):
        r = json.loads(json.dumps(pp_run))
        r["config"]["strategy"]["schedule"], r["run_id"] = sched, f"{pp_run['run_id'][:10]}{i:02d}"
        recs.append(r)
    jsonl = tmp_path / "schedules.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in recs))
    from harness.report import write_report

    text = write_report(jsonl, pngs=False).read_text()
    picker = re.search(r'<select class="run-select" data-mode="pp">(.*?)</select>', text, flags=re.S).group(1)
    options = re.findall(r"<option[^>]*>([^<]*)</option>", picker)
    assert [o.split(" (")[0] for o in options] == [f"3d tp2 pp2 {s}" for s in schedules]
    # tp2 x pp2 runs use tp as much as pp: a tie opens on the first such mode, TP; without the tp
    # axis the page opens on PP (not on DP, which no run uses)
    assert 'data-default-mode="tp"' in text
    for r in recs:
        r["dims"]["tp"], r["dims"]["world_size"] = 1, 2
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert 'data-default-mode="pp"' in write_report(jsonl, pngs=False).read_text()


def test_mfu_above_the_profile_rate_is_flagged_in_the_runs_table(tmp_path):
    # a stored real record whose measured MFU exceeds 100 %: the table marks it as the terminal does
    from harness.collect.aggregate import MFU_EXCEEDED, mfu_warning
    from harness.report import write_report
    from harness.report.views import runs_table

    rec = json.loads((Path(__file__).resolve().parent.parent / "results/reference/demo.jsonl").read_text().splitlines()[0])
    rec["measured"]["mfu_pct"] = 105.0
    rec["measured"].update(mfu_warning(105.0))
    jsonl = tmp_path / "hot.jsonl"
    jsonl.write_text(json.dumps(rec) + "\n")
    assert MFU_EXCEEDED in runs_table(load(jsonl))
    rec["measured"]["mfu_pct"] = 40.0
    rec["measured"].pop("mfu_warning")
    jsonl.write_text(json.dumps(rec) + "\n")
    assert MFU_EXCEEDED not in runs_table(load(jsonl))
    assert 'class="report-error"' not in write_report(jsonl).read_text()
