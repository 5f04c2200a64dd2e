"""docs/memory.md's dryrun_scale and planner tables are generated from the stored dry-run records
(results/reference/, lab/dryrun_scale.py) and the cost model as it stands; under `make test-all` every
stored dry run is run again and must hold the same bytes."""
from __future__ import annotations

import pytest
import yaml

from lab import dryrun_scale
from tests.helpers import CONF_DIR, run

RECORDS, META = dryrun_scale.read_reference()
PLAN_RECORDS, PLAN_META = dryrun_scale.read_reference(dryrun_scale.PLAN_REFERENCE)
STUDY = yaml.safe_load(open(f"{CONF_DIR}/experiment/dryrun_scale.yaml"))["hydra"]["sweeper"]["runs"]
SAME = ("peak_mem_bytes_per_rank", "peak_step", "peak_phase", "model_states_bytes_per_rank", "dryrun_ranks")


def test_memory_md_shows_the_tables_the_records_give():
    text = dryrun_scale.DOC.read_text()
    for block in dryrun_scale.blocks():
        lines = block.splitlines()
        assert dryrun_scale.doc_block(text, lines[0], lines[-1]) == block, \
            "docs/memory.md's dry-run tables differ from the stored records: python -m lab.dryrun_scale --write"


def test_the_stored_records_are_the_study_every_row_named():
    """One ok dry run per config of conf/experiment/dryrun_scale.yaml, in its order; DeepSpeed's and the layouts
    tests/test_memory_peak.py exempts from its 5 % check are rows of the same table."""
    assert len(RECORDS) == len(STUDY)
    for rec, overrides in zip(RECORDS, STUDY):
        assert rec["status"] == "ok" and rec["measured"]["kind"] == "dryrun", rec.get("error")
        assert rec["measured"]["peak_mem_kind"] == "fake_tensor_storages"
        model = next(o.split("=", 1)[1] for o in overrides if o.startswith("model="))
        assert rec["config"]["model"]["name"] == model
    engines = {r["config"]["strategy"]["engine"] for r in RECORDS}
    assert engines == {"torch", "deepspeed"}
    from tests.test_memory_peak import UNMODELLED_AT_TINY

    for exempt in UNMODELLED_AT_TINY:
        assert any(exempt in o and "model=llama_tiny" in o for o in STUDY), exempt


def test_the_planner_still_ranks_the_stored_layouts_first():
    """The planner's table is its confirmation of its own best layouts: stale once it ranks others first."""
    assert dryrun_scale.planner_layouts() == PLAN_META["layouts"], \
        "the planner ranks other layouts first now: python -m lab.dryrun_scale --make-plan"
    assert len(PLAN_RECORDS) == len(PLAN_META["layouts"]) == dryrun_scale.PLAN_TOP


def _same_dry_run(new: dict, stored: dict) -> None:
    assert new["status"] == "ok", new.get("error")
    for key in SAME:
        assert new["measured"][key] == stored["measured"][key], \
            f"{key}: the dry run now holds other bytes than its stored record: python -m lab.dryrun_scale --make"


@pytest.mark.slow
@pytest.mark.heavy  # each row is a dry run of up to 1024 simulated ranks: the study takes about half an hour
@pytest.mark.parametrize("i", range(len(STUDY)), ids=[" ".join(o) for o in STUDY])
def test_a_stored_dry_run_is_what_the_study_gives_now(i, tmp_path):
    _same_dry_run(run(["experiment=dryrun_scale", *STUDY[i]], tmp_path, fast=False), RECORDS[i])


@pytest.mark.slow
@pytest.mark.heavy  # a dry run of 1024 simulated ranks each
@pytest.mark.parametrize("i", range(len(PLAN_META["layouts"])))
def test_a_stored_planner_dry_run_is_what_the_layout_gives_now(i, tmp_path):
    keep = [o for o in dryrun_scale.PLAN if not o.startswith("plan.")]
    new = run([*keep, *PLAN_META["layouts"][i], "launcher=dryrun", "logger=none"], tmp_path, fast=False)
    _same_dry_run(new, PLAN_RECORDS[i])
