"""The report in a real browser: Debian's headless Chromium (`make chromium` installs it) driven by
Playwright's Python package, on the report of the real fixture study of tests/test_report.py. Each
mode is clicked; the page must show the expected elements and the study's own numbers, log no
JavaScript error and make no network request. Screenshots land in the test's tmp dir.
"""
from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest

from harness.labels import nbytes, pct, rate
from harness.report import write_report
from tests.test_report import STUDY, by_strategy, report_study

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def browser():
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} missing: run `make chromium` (apt-get install chromium)"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def full_report(tmp_path_factory):
    """The report the fixture study's sweep wrote."""
    study = report_study(tmp_path_factory)
    return {"html": study["dir"] / f"{STUDY}.html", "records": study["records"]}


@contextlib.contextmanager
def page_of(browser, html: Path):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(120_000)  # a loaded 2-core machine needs seconds to parse 5 MB of inline JS
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))

    def offline(route):  # the report must open with no network: any request beyond the file fails the test
        if route.request.url.startswith(("file:", "data:", "blob:")):
            return route.continue_()
        errors.append(f"network request: {route.request.url}")
        return route.abort()

    page.route("**/*", offline)
    page.goto(html.as_uri())
    page.wait_for_selector("body[data-ready='1']")
    try:
        yield page, errors
    finally:
        page.close()


def key(page, k: str) -> str:
    loc = page.locator(f'[data-key="{k}"]:visible')
    assert loc.count() >= 1, f"no visible element for {k}"
    return loc.first.inner_text().strip()


def click_mode(page, mode: str, shots: Path):
    page.click(f"#tab-{mode}")
    assert page.locator(f"#mode-{mode}").is_visible()
    for other in {"dp", "tp", "pp", "mesh"} - {mode}:
        assert not page.locator(f"#mode-{other}").is_visible()
    page.wait_for_timeout(200)
    page.screenshot(path=str(shots / f"mode_{mode}.png"), full_page=True)


def test_every_mode_shows_the_study_numbers(browser, full_report, tmp_path):
    recs = full_report["records"]
    ok = by_strategy(recs)
    with page_of(browser, full_report["html"]) as (page, errors):
        assert page.locator(".report-error").count() == 0
        assert page.locator("#study-name").inner_text() == STUDY

        # DP: the ddp dp=2 run; ring all-reduce step by step; bytes formula and measured
        click_mode(page, "dp", tmp_path)
        ddp = ok["ddp"]
        g = 4 * ddp["predicted"]["params_per_rank"]  # fp32 gradient of every parameter
        assert key(page, "dp-bytes-formula") == nbytes(2 * (2 - 1) / 2 * g)
        assert key(page, "dp-bytes-measured") == nbytes(ddp["measured"]["comm_dp_bytes"])
        assert key(page, "dp-bytes-predicted") == nbytes(ddp["predicted"]["comm_dp_bytes"])
        assert key(page, "dp-comm-share") == pct(ddp["measured"]["comm_share_by_axis_pct"]["dp"])
        assert key(page, "dp-tokens") == rate(ddp["measured"]["tokens_per_s"])
        ring = page.locator(".ring-widget:visible").first
        assert ring.get_attribute("data-n") == "2" and ring.get_attribute("data-step") == "0"
        assert "start" in ring.locator(".ring-caption").inner_text()
        ring.locator(".ring-next").click()
        assert "reduce-scatter step 1 of 1" in ring.locator(".ring-caption").inner_text()
        ring.locator(".ring-next").click()
        assert "all-gather step 1 of 1" in ring.locator(".ring-caption").inner_text()
        assert "Done" in ring.locator(".ring-caption").inner_text()
        cells = ring.locator("rect.chunk")
        assert cells.count() == 4 and all(cells.nth(i).get_attribute("fill-opacity") == "1.000" for i in range(4))
        zero = page.locator(".zero-widget:visible").first
        zero.locator('.zero-btn[data-stage="3"]').click()
        assert zero.locator('.zero-stage[data-stage="3"]').is_visible()
        assert not zero.locator('.zero-stage[data-stage="0"]').is_visible()
        page.screenshot(path=str(tmp_path / "dp_ring_done.png"))

        # TP: the 3d run's tp=2; its split, the per-block bytes and the measured comm share
        click_mode(page, "tp", tmp_path)
        tp = ok["3d"]
        m = tp["config"]["model"]
        a = tp["config"]["workload"]["micro_batch_size"] * m["seq_len"] * m["d_model"] * 4
        # brigade runs 6 all-reduces per block (o, fc2 forward; q, k, v, fc1 input grads backward)
        assert key(page, "tp-bytes-block") == nbytes(6 * 2 * (2 - 1) / 2 * a)
        assert key(page, "tp-comm-share") == pct(tp["measured"]["comm_share_by_axis_pct"]["tp"])
        assert key(page, "tp-bytes-measured") == nbytes(tp["measured"]["comm_tp_bytes"])
        assert page.locator("#mode-tp svg.tp-block:visible").count() == 1
        assert page.locator('#mode-tp .collective[data-op="g"]:visible').count() == 2

        # PP: the 3d run's pp=2 1f1b; predicted and measured Gantt charts, bubble four ways
        click_mode(page, "pp", tmp_path)
        pp = ok["3d"]
        p_, m_ = 2, pp["measured"]["num_microbatches"]
        assert key(page, "pp-bubble-formula") == pct(100 * (p_ - 1) / (m_ + p_ - 1))
        assert key(page, "pp-bubble-sim") == pct(100 * (p_ - 1) / (m_ + p_ - 1))
        assert key(page, "pp-bubble-measured") == pct(pp["measured"]["bubble_pct"])
        assert key(page, "pp-bubble-predicted") == pct(pp["predicted"]["bubble_pct"])
        page.wait_for_function("document.querySelectorAll('#mode-pp .gantt-grid .js-plotly-plot').length == 2")
        gantt_text = page.locator("#mode-pp .gantt-grid:visible").inner_text()
        assert "Predicted: 1f1b" in gantt_text and "Measured: one timed step" in gantt_text

        # 3D: the 3d tp2 x pp2 run's mesh; hardware=cpu has 2 ranks per node, so pp crosses nodes
        click_mode(page, "mesh", tmp_path)
        ranks = page.locator("#mode-mesh .mesh-rank:visible")
        assert ranks.count() == 4
        page.locator('#mode-mesh .mesh-btn[data-axis="pp"]:visible').click()
        fills = {int(ranks.nth(i).get_attribute("data-rank")): ranks.nth(i).locator("rect").get_attribute("fill")
                 for i in range(4)}
        assert fills[0] == fills[2] and fills[1] == fills[3] and fills[0] != fills[1]  # rank = pp*2 + tp
        table = page.locator("#mode-mesh .mesh-table:visible").inner_text()
        assert "2 of 2 cross nodes" in table and "all inside a node" in table  # pp crosses, tp does not
        three_d = ok["3d"]
        assert key(page, "mesh-share-tp") == pct(three_d["measured"]["comm_share_by_axis_pct"]["tp"])
        assert key(page, "mesh-bytes-pp") == nbytes(three_d["measured"]["comm_pp_bytes"])
        page.screenshot(path=str(tmp_path / "mesh_pp_groups.png"), full_page=True)

        # study views: one row per config, measured numbers, failures with reasons, charts drawn
        rows = page.locator("#runs-table tbody tr")
        assert rows.count() == len(recs)
        for r in recs:
            if r["status"] == "ok" and r["measured"]:
                cell = page.locator(f'[data-key="tokens-{r["run_id"]}"] .meas')
                assert cell.inner_text() == rate(r["measured"]["tokens_per_s"])
        fail_text = page.locator("#failures-table").inner_text()
        assert "fault injection: rank 1 crashed on purpose" in fail_text and "nosuch" in fail_text
        assert "global_batch_size 8 not divisible" in fail_text
        page.wait_for_function("document.querySelectorAll('#study-views .js-plotly-plot').length == 5")
        for fig in ("scaling-tput", "scaling-eff", "memory", "comm", "compute"):
            assert page.locator(f'#study-views [data-fig^="fig-{fig}-"].js-plotly-plot').count() == 1, fig
        # compute by kind of work: every ok run was profiled, each row its measured and predicted shares
        ok = [r for r in recs if r["status"] == "ok"]
        assert page.locator("#compute-table tbody tr").count() == len(ok)
        single = next(r for r in ok if r["strategy"] == "single")
        m = single["measured"]
        assert pct(100 * m["compute_gemm_time_s"] / m["compute_time_s"]) in page.locator("#compute-table").inner_text()
        assert "Amdahl" in page.locator("#study-views").inner_text()
        page.screenshot(path=str(tmp_path / "full.png"), full_page=True)
        assert errors == []


def test_one_strategy_study_and_failures_in_the_browser(browser, tmp_path_factory, tmp_path):
    """Only the failed and invalid runs plus one ok strategy (ddp): every mode still opens cleanly."""
    study = report_study(tmp_path_factory)
    recs = [r for r in study["records"] if r["strategy"] in ("ddp", "nosuch")]
    jsonl = tmp_path / "ddponly.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in recs))
    html = write_report(jsonl)
    with page_of(browser, html) as (page, errors):
        assert page.locator(".report-error").count() == 0
        click_mode(page, "dp", tmp_path)
        assert page.locator("#mode-dp .ring-widget:visible").count() == 1
        click_mode(page, "tp", tmp_path)
        assert "This study ran no tensor-parallel config" in page.locator("#mode-tp").inner_text()
        assert "strategy=tp parallel.tp=2" in page.locator("#mode-tp pre.cmd").inner_text()
        click_mode(page, "pp", tmp_path)
        assert "This study ran no pipeline-parallel config" in page.locator("#mode-pp").inner_text()
        assert key(page, "pp-demo-formula") == "27.3%"  # the textbook 4 stages x 8 micro-batches
        page.select_option("#mode-pp select.run-select", "2")  # interleaved: its own chart appears
        page.wait_for_function("document.querySelectorAll('#mode-pp .js-plotly-plot').length == 2")
        assert key(page, "pp-demo-formula") == "15.8%"  # (4-1)/(2*8+4-1)
        click_mode(page, "mesh", tmp_path)
        assert "This study ran no config that combines" in page.locator("#mode-mesh").inner_text()
        assert page.locator("#mode-mesh .mesh-rank").count() == 2  # the largest run's mesh: ddp dp2
        assert page.locator("#failures-table tbody tr").count() == 3
        assert errors == []
    shutil.copy(html, tmp_path / "kept.html")
