"""Resumable studies with the local launcher: a named study skips configs that already have a
finished record, rerun=failed re-runs the failed ones, rerun=all everything, invalid configs are
always checked again, and records are only ever appended."""
from __future__ import annotations

import pytest

from tests.helpers import records, run

pytestmark = pytest.mark.slow

STUDY = ["study=resume"]
CRASH = ["strategy=ddp", "parallel.dp=2", "fault=crash_rank1"]  # rank 1 raises after setup, every time


@pytest.mark.heavy  # CI: resume in tests/test_faults.py (two invocations) and tests/test_slurm.py (then resume)
def test_resume_skips_done_and_reruns_failed(tmp_path, single_reference):
    path = tmp_path / "resume.jsonl"

    ok = run([*STUDY, "strategy=single"], tmp_path)
    assert ok["status"] == "ok", ok["error"]
    assert ok["measured"]["losses"] == single_reference()["measured"]["losses"]
    failed = run([*STUDY, *CRASH], tmp_path)
    assert failed["status"] == "failed" and "fault injection" in failed["error"], failed["error"]
    invalid = run([*STUDY, "strategy=tp", "parallel.tp=3"], tmp_path)  # 4 heads % 3
    assert invalid["status"] == "invalid"
    first = path.read_bytes()
    assert [r["status"] for r in records(tmp_path, "resume")] == ["ok", "failed", "invalid"]

    # Resumed: ok and failed configs are skipped (their records returned as they are); the invalid
    # one is validated again (a fixed conf/ may make it valid) and gets a new record.
    again_ok = run([*STUDY, "strategy=single"], tmp_path)
    again_failed = run([*STUDY, *CRASH], tmp_path)
    again_invalid = run([*STUDY, "strategy=tp", "parallel.tp=3"], tmp_path)
    assert again_ok.get("skipped") and again_ok["run_id"] == ok["run_id"] and again_ok["status"] == "ok"
    assert again_failed.get("skipped") and again_failed["status"] == "failed"
    assert not again_invalid.get("skipped")
    assert [r["status"] for r in records(tmp_path, "resume")] == ["ok", "failed", "invalid", "invalid"]

    # rerun=failed: the failed config runs again (and fails again: a new record), the ok one does not.
    rerun_failed = run([*STUDY, *CRASH, "rerun=failed"], tmp_path)
    rerun_ok = run([*STUDY, "strategy=single", "rerun=failed"], tmp_path)
    assert not rerun_failed.get("skipped") and rerun_failed["status"] == "failed"
    assert rerun_failed["run_dir"] != failed["run_dir"]  # a fresh run dir per attempt
    assert rerun_ok.get("skipped")

    # rerun=all: the ok config runs again too.
    rerun_all = run([*STUDY, "strategy=single", "rerun=all"], tmp_path)
    assert not rerun_all.get("skipped") and rerun_all["status"] == "ok"
    assert rerun_all["measured"]["losses"] == ok["measured"]["losses"]

    recs = records(tmp_path, "resume")
    assert [r["status"] for r in recs] == ["ok", "failed", "invalid", "invalid", "failed", "ok"]
    assert path.read_bytes().startswith(first)  # appended, never rewritten

