"""Scaling series (harness/report/scaling.py): strong and weak runs of one study are separate curves,
each with its own efficiency and law, and the fits recover a known serial fraction.

The runs are records whose throughputs follow Amdahl's or Gustafson's law exactly for a chosen f (the
known answer a fit must return); their configs are composed by Hydra from conf/experiment/scaling.yaml's
own runs list, so the series names and batches are the ones the study really runs."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from harness.report import scaling
from harness.report.study import Run, Study
from tests.helpers import compose_config

TOKENS_PER_S_1 = 1000.0


def _study(tmp_path, laws: dict[str, float]) -> Study:
    """The scaling study's runs as ok records, tokens/s = one device's x the law's speed-up."""
    from harness.config import as_dict, to_run_config
    from harness.run.record import make_record
    from harness.validate import validate

    runs_list = OmegaConf.load("conf/experiment/scaling.yaml").hydra.sweeper.runs
    recs = []
    for overrides in runs_list:
        run = to_run_config(compose_config(["experiment=scaling", "hydra.mode=RUN", *overrides], tmp_path))
        dims = validate(run)
        n, f = dims.world_size, laws[run.series]
        s = scaling.amdahl(f, n) if run.series == "strong" else scaling.gustafson(f, n)
        recs.append(make_record(as_dict(run), run, dims, "ok", None, measured={"tokens_per_s": TOKENS_PER_S_1 * s}))
    return Study("scaling", tmp_path / "scaling.jsonl", [Run(r) for r in recs])


def test_strong_and_weak_are_separate_series_with_their_own_law(tmp_path):
    study = _study(tmp_path, {"strong": 0.1, "weak": 0.2})
    found = {s.name: s for s in scaling.series(study)}
    assert set(found) == {"strong", "weak"}
    strong, weak = found["strong"], found["weak"]
    assert (strong.kind, weak.kind) == ("strong", "weak")
    assert [p.devices for p in strong.points] == [p.devices for p in weak.points] == [1, 2, 4]
    assert strong.fit.law == "Amdahl" and strong.fit.serial_fraction == pytest.approx(0.1, abs=1e-12)
    assert weak.fit.law == "Gustafson" and weak.fit.serial_fraction == pytest.approx(0.2, abs=1e-12)
    assert strong.fit.rms_residual == pytest.approx(0, abs=1e-12) and strong.fit.n_points == 3
    # efficiency falls monotonically within each series (no zigzag between families)
    for s in (strong, weak):
        effs = [p.efficiency for p in s.points]
        assert effs[0] == pytest.approx(1.0) and effs == sorted(effs, reverse=True)
    # Karp-Flatt: each exact Amdahl point implies the same serial fraction; weak series have none
    assert [p.karp_flatt for p in strong.points] == [None, pytest.approx(0.1), pytest.approx(0.1)]
    assert all(p.karp_flatt is None for p in weak.points)


def test_a_fit_needs_three_device_counts_and_reports_its_residual():
    assert scaling.fit("strong", [(1, 1.0), (2, 1.8)]) is None
    pts = [(1, 1.0), (2, 1.9), (4, 3.0), (8, 4.0)]
    f = scaling.fit("strong", pts)
    assert 0 < f.serial_fraction < 1 and f.rms_residual > 0
    # the residual is the RMS of measured minus fitted speed-up
    rms = (sum((s - scaling.amdahl(f.serial_fraction, n)) ** 2 for n, s in pts) / 4) ** 0.5
    assert f.rms_residual == pytest.approx(rms)
    assert scaling.fit("mixed", pts) is None
