"""README.md's demo table is generated from the committed reference records, and says what they are."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from harness.tools.readme_table import (
    FILE_GROUPS,
    GROUPS_BEGIN,
    GROUPS_END,
    README,
    groups_table,
    header_comment,
    read_reference,
    readme_block,
    render,
)
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


def test_readme_groups_table_is_generated_from_conf():
    text = README.read_text()
    block = readme_block(text, GROUPS_BEGIN, GROUPS_END)
    assert block == groups_table(), \
        "README.md's groups table differs from conf/: python -m harness.tools.readme_table --write"
    # what the hand-written table once missed: every file of every group, the dry-run launcher, cp and HSDP
    for group in FILE_GROUPS:
        for path in (Path(CONF_DIR) / group).glob("*.yaml"):
            assert f"`{group}={path.stem}`" in block, path
    for name in ("`model=llama3_8b`", "`model=llama_tiny`", "`launcher=dryrun`", "`parallel.cp`",
                 "`parallel.dp_replicate`", "`experiment=long_context`", "`experiment=dryrun_scale`"):
        assert name in block, name


def test_a_conf_file_without_a_header_comment_is_refused(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "bare.yaml").write_text("name: bare\n")
    with pytest.raises(ValueError, match="model/bare.yaml has no header comment"):
        header_comment(tmp_path / "model" / "bare.yaml")


def test_header_comment_is_the_first_sentence_of_the_first_paragraph(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("# @package _global_\n# GPT-3 XL (Brown et al. 2020, Table 2.1). More here.\n#   brigade x\nname: x\n")
    assert header_comment(f) == "GPT-3 XL (Brown et al. 2020, Table 2.1)"
