"""Run labels (harness/labels.py) and the pandas loader (harness/results.py), on records the real job
function writes for configs refused before launch (real composition and validation, no processes)."""
from __future__ import annotations

import pytest

from harness.labels import labels, own_label, slug
from tests.helpers import compose_config


def _record(overrides: list[str], tmp_path) -> dict:
    """A real record of a config composed by Hydra and validated, written as not run (status
    invalid, so nothing is launched); its config, dims and run_id are the ones a run would carry."""
    from harness.config import as_dict, to_run_config
    from harness.run.record import make_record
    from harness.validate import validate

    run = to_run_config(compose_config(overrides, tmp_path))
    return make_record(as_dict(run), run, validate(run), "invalid", "not run: a label test")


def test_labels_name_what_differs_between_a_studys_runs(tmp_path):
    base = ["model=tiny", "strategy=ddp", "parallel.dp=2"]
    recs = [_record(base, tmp_path), _record([*base, "workload.activation_checkpointing=full"], tmp_path),
            _record(["model=tiny", "strategy=pp", "parallel.pp=2", "parallel.vpp=2",
                     "strategy.schedule=zbv_zero_bubble", "workload.micro_batch_size=1"], tmp_path)]
    assert labels(recs) == ["ddp dp2 mbs=2 ac=none", "ddp dp2 mbs=2 ac=full",
                            "pp pp2 vpp2 zbv_zero_bubble mbs=1 ac=none"]
    # the same two ddp runs alone: only the checkpointing tells them apart
    assert labels(recs[:2]) == ["ddp dp2 ac=none", "ddp dp2 ac=full"]
    # runs that differ only in strategy and degrees need nothing more
    assert labels([recs[0], _record(["model=tiny", "strategy=fsdp", "parallel.dp=2"], tmp_path)]) == [
        "ddp dp2", "fsdp dp2"]


def test_a_group_option_names_its_inner_keys(tmp_path):
    recs = [_record(["model=tiny", "strategy=single"], tmp_path), _record(["model=small", "strategy=single"], tmp_path)]
    assert labels(recs) == ["single tiny", "single small"]  # not n_layers=..., d_model=...


def test_a_strategy_knob_labels_only_the_runs_of_the_strategy_it_differs_in(tmp_path):
    """plan --run-top ran 3d layouts that differ in data_parallel beside a tp run: the tp run was labelled
    `tp tp4 ... data_parallel=fsdp`, a knob tp never reads."""
    three_d = ["model=tiny", "strategy=3d", "parallel.dp=2", "parallel.tp=2", "launcher.nproc_per_node=4"]
    recs = [_record([*three_d, "strategy.data_parallel=fsdp"], tmp_path),
            _record([*three_d, "strategy.data_parallel=zero1"], tmp_path),
            _record(["model=tiny", "strategy=tp", "parallel.tp=4", "launcher.nproc_per_node=4"], tmp_path)]
    assert labels(recs) == ["3d dp2 tp2 data_parallel=fsdp", "3d dp2 tp2 data_parallel=zero1", "tp tp4"]


def test_own_label_and_slug_for_run_dirs_and_wandb(tmp_path):
    rec = _record(["model=tiny", "strategy=pp", "parallel.pp=2", "parallel.vpp=2", "strategy.schedule=interleaved_1f1b"],
                  tmp_path)
    overrides = ["model=tiny", "strategy=pp", "parallel.pp=2", "parallel.vpp=2", "strategy.schedule=interleaved_1f1b",
                 "workload.activation_checkpointing=full", "logger=none", "launcher.timeout_s=60", "series=strong"]
    assert own_label(rec, overrides) == "pp pp2 vpp2 interleaved_1f1b ac=full strong"
    assert slug(own_label(rec, overrides)) == "pp-pp2-vpp2-interleaved_1f1b-ac=full-strong"


def test_results_load_gives_a_flat_dataframe(tmp_path):
    from harness.results import load
    from harness.run.results_file import append, records_path

    recs = [_record(["model=tiny", "strategy=ddp", "parallel.dp=2"], tmp_path),
            _record(["model=tiny", "strategy=ddp", "parallel.dp=2", "workload.activation_checkpointing=full"], tmp_path)]
    for r in recs:
        append(records_path(tmp_path, r["study"]), r)
    append(records_path(tmp_path, recs[0]["study"]), {**recs[0], "status": "failed"})  # a re-run: the latest wins
    df = load(tmp_path / "adhoc.jsonl")
    assert sorted(df["status"]) == ["failed", "invalid"]
    assert set(df["label"]) == {"ddp dp2 ac=none", "ddp dp2 ac=full"}
    for col in ("run_id", "dims.dp", "config.workload.global_batch_size", "config.strategy.name", "env.python"):
        assert col in df.columns, col
    assert df["dims.dp"].tolist() == [2, 2]
    assert len(load(tmp_path / "adhoc.jsonl", latest=False)) == 3
    assert len(load(tmp_path)) == 2  # a directory: every study in it
    with pytest.raises(FileNotFoundError, match="no records"):
        load(tmp_path / "nosuch.jsonl")


def test_where_a_figure_comes_from_is_not_what_was_run(tmp_path):
    a = _record(["model=tiny", "strategy=ddp", "parallel.dp=2"], tmp_path)
    b = _record(["model=tiny", "strategy=ddp", "parallel.dp=4", "workload.global_batch_size=16"], tmp_path)
    b["config"]["hardware"]["source"] = {k: v + " (recalibrated)" for k, v in a["config"]["hardware"]["source"].items()}
    assert a["config"]["hardware"]["source"]  # the profile does say where its figures come from
    assert labels([a, b]) == ["ddp dp2 batch=8", "ddp dp4 batch=16"]


def test_every_axis_is_shown_where_degrees_are(tmp_path):
    """One enumeration of axes (harness/dims.py AXES) feeds the label, the run dir's name and the report's
    mesh: a cp run and an HSDP run say so in each."""
    from harness.dims import ParallelDims
    from harness.report import mesh
    from harness.report.study import Run

    cp = _record(["model=tiny", "strategy=3d", "parallel.cp=2", "parallel.tp=2"], tmp_path)
    hsdp = _record(["model=tiny", "strategy=fsdp", "parallel.dp=4", "parallel.dp_replicate=2"], tmp_path)
    assert own_label(cp, []) == "3d cp2 tp2" and slug(own_label(cp, [])) == "3d-cp2-tp2"
    assert own_label(hsdp, []) == "fsdp dp4 dprep2"
    assert ParallelDims(**{k: v for k, v in cp["dims"].items()}).label() == "cp2-tp2"

    desc = mesh.describe(Run(cp))
    by_axis = {a["axis"]: a for a in desc["axes"]}
    assert set(by_axis) == {"cp", "tp"} and by_axis["cp"]["groups"] == [[0, 2], [1, 3]]
    assert "cp" in mesh.describe(Run(cp))["dims"] and "dp_replicate" in {a["axis"] for a in mesh.describe(Run(hsdp))["axes"]}
