"""Repeats end to end: `repeats=N` runs a study's configs round-robin, each repeat its own record that a
resumed study skips; `harness.compare` calls clean studies `same` and a study with every step slowed on
purpose (`slow_step_pct`) `slower`; the index across studies shows them and flags the regression, in a
real browser; with 50 studies it stays under 1 MB."""
from __future__ import annotations

import copy
import json
import random
import subprocess
import sys

import pytest

from harness.collect import aggregate
from harness.labels import ci_text
from harness.report.index import INDEX, load_studies, write_index
from tests.helpers import FAST, REPO, cli, records

pytestmark = pytest.mark.slow
BASE = [o for o in FAST if not o.startswith("logger")] + ["logger=none", "strategy=single"]
# slow_step_pct=900: every slowed step busy-waits nine times its own time, inside the timed region, so its
# tokens/s is a tenth of what the same steps would give clean
SLOW_PCT = 900
# The threshold the comparisons here use, and why they cannot flake on a loaded 2-core machine. The
# clean A and B and the slowed C run interleaved in ONE sweep (A B C A B C A B C, seconds apart), so
# drift in the load from other jobs falls on all three alike, and the busy wait scales with the step it
# follows. With 3 repeats a side the ratio's interval spans about the extreme repeats, so `same` fails
# only if every B repeat ran 2x slower than every A repeat, and `slower` only if C's fastest repeat
# computed 5x faster than A's slowest (10x / 2). At load 14 on 2 cores repeats of one config a
# minute apart differed by up to 4x, never 5x, and never all in one direction for a whole study.
THRESHOLD = "50"
NAMES = ("clean_a", "clean_b", "slowed")


@pytest.fixture(scope="module")
def noise_studies(tmp_path_factory):
    """One sweep, repeats=3, of three runs of one config (clean, clean, slowed), rerun=all so that the
    copies all run; its records split by position into three studies, as three invocations would leave."""
    out = tmp_path_factory.mktemp("noise")
    runs = f"[['slow_step_pct=0'],['slow_step_pct=0'],['slow_step_pct={SLOW_PCT}']]"
    p = cli(["-m", *BASE, "study=noise", "repeats=3", "rerun=all", f"hydra.sweeper.runs={runs}"], out)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = records(out, "noise")
    studies = out / "studies"
    studies.mkdir()
    for i, name in enumerate(NAMES):
        (studies / f"{name}.jsonl").write_text("".join(json.dumps({**r, "study": name}) + "\n" for r in rows[i::3]))
    return {"dir": out, "records": rows, "studies": studies, "stderr": p.stderr}


def test_repeats_run_round_robin_each_its_own_record(noise_studies):
    rows = noise_studies["records"]
    assert [(r["repeat"], r["config"]["slow_step_pct"]) for r in rows] == [
        (i, pct) for i in range(3) for pct in (0, 0, SLOW_PCT)]
    # the clean copies are one config; the slowed copy is its own, and names the clean one's run_id
    assert len({r["run_id"] for r in rows}) == 2 and all(r["status"] == "ok" for r in rows)
    assert {r["slowed_on_purpose"]["clean_run_id"] for r in rows[2::3]} == {rows[0]["run_id"]}
    env = rows[0]["env"]  # the fingerprint the ranks read: each field a value or a reason
    for k in ("cuda", "nccl", "driver", "interconnect", "slurm_job_id", "slurm_partition"):
        assert (env.get(k) is None) == (k in env["unavailable"]), (k, env.get(k), env["unavailable"])
    assert list(env["gpus"]) == env["nodes"] and env["cluster"]
    for r in rows:  # each run's own interval, from its step times
        m = r["measured"]
        med, lo, hi = aggregate.median_ci([m["step_times_s"]])
        assert m["step_time_s"] == med and m["step_time_s_ci95"] == [lo, hi]
        assert m["tokens_per_s_ci95"] == pytest.approx([m["tokens_per_step"] / hi, m["tokens_per_step"] / lo])
    # the end-of-study table and the report: one row per config, its repeats pooled with their interval
    # (the clean config's latest record of each repeat is clean_b's: a re-run replaces a record)
    config, slowed = aggregate.config_records(rows)
    interval = ci_text(config["measured"]["tokens_per_s_ci95"])
    assert config["repeats"] == slowed["repeats"] == 3
    assert config["measured"]["step_times_s"] == rows[-2]["measured"]["step_times_s"]
    assert "95% CI" in noise_studies["stderr"] and "│ 3 │" in noise_studies["stderr"]
    assert interval in noise_studies["stderr"]
    page = (noise_studies["dir"] / "noise.html").read_text()
    assert "tokens/s 95% CI" in page and f'<td class="num">{interval}</td><td class="num">3</td>' in page


def _compare(a, b):
    return subprocess.run([sys.executable, "-m", "harness.compare", str(a), str(b), "--threshold", THRESHOLD],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_compare_clean_studies_same_and_a_slowed_one_slower(noise_studies):
    d = noise_studies["studies"]
    same = _compare(d / "clean_a.jsonl", d / "clean_b.jsonl")
    assert same.returncode == 0, same.stdout
    assert "0 slower, 0 faster, 1 same, 0 not compared; exit 0" in " ".join(same.stdout.split())
    slower = _compare(d / "clean_a.jsonl", d / "slowed.jsonl")
    assert slower.returncode == 1, slower.stdout
    assert "1 slower, 0 faster, 0 same, 0 not compared; exit 1" in " ".join(slower.stdout.split())
    assert "environment: the same in torch, cuda" in " ".join(slower.stdout.split())  # one machine, one commit


def test_the_index_shows_every_study_and_flags_the_slowed_one(noise_studies):
    d = noise_studies["studies"]
    p = subprocess.run([sys.executable, "-m", "harness.report", "--index", str(d)], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == str(d / INDEX), p.stderr
    page = (d / INDEX).read_text()
    assert [s.name for s in load_studies(d)] == list(NAMES)  # time order: the sweep ran them A B C
    for name in NAMES:
        assert f">{name}<" in page
    regressions = page.split('id="regressions"')[1].split("</table>")[0]
    assert "<td>clean_b</td><td>slowed</td>" in regressions
    # the sweep itself wrote an index of its own results dir at its end
    assert (noise_studies["dir"] / INDEX).exists()


def test_the_index_in_a_browser(noise_studies, tmp_path):
    pytest.importorskip("playwright")
    from playwright.sync_api import sync_playwright

    from tests.test_report_browser import ARGS, CHROMIUM, page_of

    d = noise_studies["studies"]
    html = write_index(d)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        with page_of(browser, html) as (page, errors):
            assert page.locator("#studies-table tbody tr").count() == 3
            plots = page.locator(".plot[data-fig]")
            assert plots.count() == 2 and page.locator(".plot[data-rendered='1']").count() == 2  # scaling, history
            assert page.locator(".plot .scatterlayer .trace").count() >= 3 + 1 + 1  # 3 studies, 1 config, 1 flag
            assert "slowed" in page.locator("#regressions").inner_text()
            page.screenshot(path=str(tmp_path / "index.png"), full_page=True)
            assert not errors, errors
        browser.close()


def test_resume_skips_done_repeats_and_runs_only_new_ones(tmp_path):
    args = ["-m", *BASE, "study=rr", "repeats=2"]
    assert cli(args, tmp_path).returncode == 0
    assert [r["repeat"] for r in records(tmp_path, "rr")] == [0, 1]
    again = cli(args, tmp_path)
    assert again.returncode == 0 and again.stderr.count("already ok") == 2, again.stderr[-2000:]
    more = cli([*args[:-1], "repeats=3"], tmp_path)
    assert more.returncode == 0 and more.stderr.count("already ok") == 2
    assert [r["repeat"] for r in records(tmp_path, "rr")] == [0, 1, 2]


def test_an_index_of_50_studies_stays_under_1_MB(noise_studies, tmp_path):
    """50 studies of 3 configs x 3 repeats each, from the real records (step times scaled per study)."""
    rng = random.Random(6)
    real = noise_studies["records"][0]
    for s in range(50):
        rows = []
        for c, dp in enumerate((1, 2, 4)):
            for rep in range(3):
                r = copy.deepcopy(real)
                r.update(study=f"s{s:02d}", run_id=f"cfg{c}", repeat=rep, created_at=f"2026-12-{1 + s // 24:02d}T"
                         f"{s % 24:02d}:00:00+0000", dims={**r["dims"], "world_size": dp, "dp": dp})
                f = 1 + 0.1 * rng.random()
                r["measured"]["step_times_s"] = [t * f for t in r["measured"]["step_times_s"]]
                rows.append(r)
        (tmp_path / f"s{s:02d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    html = write_index(tmp_path)
    assert len(load_studies(tmp_path)) == 50
    assert html.stat().st_size <= 1 << 20, html.stat().st_size
