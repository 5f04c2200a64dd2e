"""Pure tier: every config file composes, and every impossible config is refused with its arithmetic."""
from __future__ import annotations

from pathlib import Path

import pytest

from harness.config import to_run_config
from harness.dims import ConfigError, ParallelDims
from harness.validate import validate
from tests.helpers import CONF_DIR, compose_config

GROUPS = ["model", "strategy", "workload", "hardware", "launcher", "logger"]


@pytest.mark.parametrize("group,option", [(g, p.stem) for g in GROUPS
                                          for p in sorted((Path(CONF_DIR) / g).glob("*.yaml"))])
def test_every_option_composes(group, option, tmp_path):
    run = to_run_config(compose_config([f"{group}={option}"], tmp_path))
    assert group == "workload" or getattr(run, group).name == option


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml")))
def test_every_experiment_composes_and_its_runs_validate_or_are_meant_invalid(experiment, tmp_path):
    cfg = compose_config([f"experiment={experiment}"], tmp_path)
    run = to_run_config(cfg)
    assert run.study == experiment or run.study
    # every run listed by the study composes too
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        full = compose("config", overrides=[f"experiment={experiment}"], return_hydra_config=True)
    for overrides in full.hydra.sweeper.get("runs") or []:
        to_run_config(compose_config([f"experiment={experiment}", *overrides], tmp_path))


def refused(overrides: list[str], tmp_path) -> str:
    run = to_run_config(compose_config(overrides, tmp_path))
    with pytest.raises(ConfigError) as e:
        validate(run)
    return str(e.value)


def test_world_size_arithmetic():
    with pytest.raises(ConfigError, match=r"dp\(2\) \* tp\(2\) \* pp\(1\) = 4 != world size 3"):
        ParallelDims(dp=2, tp=2, pp=1, world_size=3)


def test_world_size_from_launcher(tmp_path):
    msg = refused(["strategy=ddp", "parallel.dp=2", "launcher.nproc_per_node=3"], tmp_path)
    assert "dp(2) * tp(1) * pp(1) = 2 != world size 3" in msg


def test_heads_not_divisible_by_tp(tmp_path):
    run = to_run_config(compose_config(["strategy=3d", "model.n_heads=6", "model.d_model=384"], tmp_path))
    run.parallel.tp = 4
    with pytest.raises(ConfigError, match="n_heads 6 not divisible by tp 4"):
        validate(run)


def test_fewer_layers_than_stages(tmp_path):
    run = to_run_config(compose_config(["strategy=pp", "model.n_layers=3"], tmp_path))
    run.strategy.schedule = "interleaved_1f1b"
    run.parallel.pp, run.parallel.vpp = 2, 2
    with pytest.raises(ConfigError, match=r"n_layers 3 < pp\*vpp 4"):
        validate(run)
    run.model.n_layers = 10  # 10 on 4 stages: 3 3 2 2 (models/pipeline_split.py)
    validate(run)


def test_batch_not_divisible(tmp_path):
    msg = refused(["strategy=ddp", "parallel.dp=2", "workload.global_batch_size=12",
                   "workload.micro_batch_size=4"], tmp_path)
    assert "global_batch_size 12 not divisible by dp*micro_batch_size 8" in msg


def test_num_microbatches_inconsistent(tmp_path):
    msg = refused(["strategy=ddp", "parallel.dp=2", "workload.num_microbatches=3"], tmp_path)
    assert "num_microbatches 3 != global_batch_size 8 / (dp 2 * micro_batch_size 2) = 2" in msg


def test_unknown_strategy_lists_available(tmp_path):
    msg = refused(["strategy.name=nosuch"], tmp_path)
    assert "unknown strategy 'nosuch'" in msg and "ddp" in msg and "single" in msg


def test_precision_the_device_cannot_run(tmp_path):
    msg = refused(["workload.precision=fp16-mixed"], tmp_path)
    assert "precision fp16-mixed cannot run on hardware cpu" in msg


def test_axis_the_strategy_does_not_use(tmp_path):
    msg = refused(["strategy=single", "parallel.dp=2"], tmp_path)
    assert "strategy single does not use the dp axis" in msg


def test_typo_in_override_is_an_error(tmp_path):
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    with pytest.raises((ConfigAttributeError, ConfigKeyError, Exception), match="n_layer"):
        compose_config(["model.n_layer=3"], tmp_path)


def test_rank_placement_tp_innermost():
    d = ParallelDims(dp=2, tp=2, pp=2, world_size=8)
    assert d.coords(5) == {"pp": 1, "dp": 0, "tp": 1, "ep": 0, "cp": 0, "dp_replicate": 0, "dp_shard": 0}
    assert d.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # cp between tp and dp; HSDP's shard group is neighbouring dp ranks, replicas stride across it
    d = ParallelDims(dp=4, dp_replicate=2, cp=2, world_size=8)
    assert d.coords(5) == {"pp": 0, "dp": 2, "tp": 0, "ep": 0, "cp": 1, "dp_replicate": 1, "dp_shard": 0}
    assert d.groups("cp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.groups("dp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.groups("dp_cp") == [list(range(8))]
    # ep shares the dp ranks: ep groups are neighbouring dp ranks, the expert-data groups (which reduce
    # expert gradients, e.g. DeepSpeed MoE's own) the dp ranks holding the same experts
    d = ParallelDims(dp=4, ep=2, world_size=4)
    assert d.groups("ep") == [[0, 1], [2, 3]]
    assert d.groups("ep_dp") == [[0, 2], [1, 3]]
