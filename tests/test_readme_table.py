"""README.md's demo table is generated from the committed reference records, and says what they are."""
from __future__ import annotations

import pytest
import yaml

from harness.tools.readme_table import README, read_reference, readme_block, render
from tests.helpers import CONF_DIR


def test_readme_demo_table_is_the_reference_records():
    records, meta = read_reference()
    assert readme_block(README.read_text()) == render(records, meta), \
        "README.md's demo table differs from results/reference/demo.jsonl: python -m harness.tools.readme_table --write"


def test_reference_records_are_the_demo_study_on_a_calibrated_profile():
    records, meta = read_reference()
    runs = yaml.safe_load(open(f"{CONF_DIR}/experiment/demo.yaml"))["hydra"]["sweeper"]["runs"]
    assert len(records) == len(runs) and all(r["status"] == "ok" and r["study"] == "demo" for r in records)
    for r in records:
        hw, m = r["config"]["hardware"], r["measured"]
        assert hw["device"] == "cpu" and hw["name"] == meta["profile"]  # calibrated just before, same machine
        # MFU of the matmul rate calibrate measured, not of a datasheet peak
        assert m["mfu_peak_tflops"] == hw["achievable_tflops"]["fp32"]
        assert m["mfu_pct"] == pytest.approx(100 * m["tflops_per_device"] / m["mfu_peak_tflops"], rel=1e-12)
    assert {"command", "calibrate_command", "cpu", "cpu_count", "load_before", "load_after", "profile"} <= set(meta)
