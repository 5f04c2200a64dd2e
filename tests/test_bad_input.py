"""Bad input never crashes the parent: every config either passes validation and prediction or
becomes an `invalid` record with a message, before anything is launched."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from harness.config import DOMAINS, RunConfig, as_dict, to_run_config
from harness.dims import ConfigError
from harness.run import record as rec
from harness.run import results_file
from harness.run.job import _validate_and_predict
from launch import local
from tests.helpers import REPO, cli, compose_config, records

INTS = [-2**40, -4, -1, 0, 1, 2, 3, 4, 7, 8, 64, 2**31, 2**40]
FLOATS = [math.nan, math.inf, -math.inf, -1.0, 0.0, 1e-12, 0.5, 0.99, 1.0, 2.0, 1e12, 1e308]
ODD = ["", "nosuch", "../x", "1,2", "${oops}", "0", "-1", "nan", "true", None]
BASES = [("tiny", "single"), ("tiny", "ddp"), ("tiny", "pp"), ("tiny", "3d"), ("moe_tiny", "ep"), ("tiny", "zero3")]
_COMPOSED: dict = {}


def base(model: str, strategy: str, tmp_dir):
    if (model, strategy) not in _COMPOSED:
        cfg = compose_config([f"model={model}", f"strategy={strategy}", "logger=none"], tmp_dir)
        _COMPOSED[model, strategy] = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    return _COMPOSED[model, strategy]


def _leaves(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out += _leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}"]
    return out


# Every scalar field of the schema (new fields join by themselves), the ones with a domain twice.
_SKIP = ("results_dir", "study", "hardware.source", "hardware.collectives", "hardware.compute", "strategy.ds.extra",
         "launcher.additional_parameters")
FIELDS = sorted(DOMAINS) + [f for f in _leaves(OmegaConf.to_container(OmegaConf.structured(RunConfig)))
                            if not f.startswith(_SKIP)]
# Mostly values of the field's own type (zeros, negatives, huge, non-finite), sometimes of any type.
VALUES = {int: st.one_of(st.sampled_from(INTS), st.integers(-3, 16)),
          float: st.one_of(st.sampled_from(FLOATS), st.sampled_from(INTS), st.floats(-2, 2)),
          str: st.sampled_from(ODD[:-1]), type(None): st.sampled_from([None, *INTS])}
ANYTHING = st.sampled_from(INTS + FLOATS + ODD)


@st.composite
def overrides(draw, cfg):
    out = {}
    for path in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=5, unique=True)):
        typed = VALUES.get(type(OmegaConf.select(cfg, path)), ANYTHING)
        out[path] = draw(st.one_of(typed, typed, typed, ANYTHING))
    return out


def prelaunch(cfg) -> dict:
    """What run_job does before launching, as one record-or-None: the invalid record, or None when
    the config would be launched."""
    try:
        run = to_run_config(cfg)
        config = as_dict(run)
    except Exception as e:  # noqa: BLE001 - run_job's composition path: an invalid record
        return rec.make_record({"study": "adhoc"}, None, None, "invalid", f"{type(e).__name__}: {e}")
    try:
        _validate_and_predict(run)
    except ConfigError as e:
        return rec.make_record(config, run, None, "invalid", str(e))
    return None


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_any_config_passes_or_is_an_invalid_record_with_a_message(tmp_path, monkeypatch, data):
    monkeypatch.setattr(rec, "parent_env", dict)  # two git calls per record: the same every example
    cfg = OmegaConf.merge(base(*data.draw(st.sampled_from(BASES)), tmp_path), OmegaConf.create({}))
    changes = data.draw(overrides(cfg))
    try:
        for path, value in changes.items():
            OmegaConf.update(cfg, path, value, force_add=False)
    except Exception:  # noqa: BLE001 - refused by the schema already (Hydra would say so at composition)
        event("refused by the schema")
        return
    record = prelaunch(cfg)  # raises only on a brigade bug: that is what the property catches
    event("would launch" if record is None else "invalid record")
    if record is not None:
        assert record["status"] == "invalid" and record["error"].strip()
        assert "brigade bug" not in record["error"], record["error"]
        json.dumps(results_file.finite(record), default=str, allow_nan=False)  # strict JSON


@pytest.mark.parametrize("override, message", [
    ("workload.micro_batch_size=0", "workload.micro_batch_size=0 (must be >= 1)"),
    ("model.n_heads=0", "model.n_heads=0 (must be >= 1)"),
    ("model.n_layers=-4", "model.n_layers=-4 (must be >= 1)"),
    ("workload.micro_batch_size=-2", "workload.micro_batch_size=-2 (must be >= 1)"),
    ("workload.global_batch_size=-8", "workload.global_batch_size=-8 (must be >= 1)"),
    ("model.dropout=2.0", "model.dropout=2.0 (must be in [0, 1))"),
    ("model.seq_len=0", "model.seq_len=0 (must be >= 1)"),
    ("model.vocab_size=0", "model.vocab_size=0 (must be >= 1)"),
    ("model.n_layers=0", "model.n_layers=0 (must be >= 1)"),
    ("workload.lr=nan", "workload.lr=nan (must be > 0 and finite)"),
    ("launcher.timeout_s=0", "launcher.timeout_s=0.0 (must be > 0 and finite)"),
    ("workload.steps=0", "workload.steps=0 (must be >= 1)"),
    ("launcher.master_port=70000", "launcher.master_port=70000 (must be 0 (a free port) or 1-65535)"),
    ("parallel.dp=1000000", "parallel.dp=1000000 (must be in 1..65536)"),
])
def test_out_of_domain_fields_are_refused_naming_the_field(tmp_path, override, message):
    cfg = compose_config(["model=tiny", override], tmp_path)
    record = prelaunch(cfg)
    assert record is not None and message in record["error"], record and record["error"]


def test_n_layers_negative_with_pp_is_refused_before_the_cost_model(tmp_path):
    record = prelaunch(compose_config(["model=tiny", "strategy=pp", "parallel.pp=2", "model.n_layers=-4"], tmp_path))
    assert "model.n_layers=-4 (must be >= 1)" in record["error"]


def test_cuda_hardware_without_cuda_devices_is_refused_before_launch(tmp_path):
    if local.visible_gpus()[0] >= 1:
        pytest.skip("this machine has a CUDA device")
    record = prelaunch(compose_config(["model=tiny", "hardware=h100_sxm"], tmp_path))
    assert "runs one CUDA device per rank: 1 rank(s) need 1 device(s), this machine has 0" in record["error"]


@pytest.mark.parametrize("schedule", ["zbv_zero_bubble", "dualpipev"])
def test_a_v_shaped_pipeline_on_gloo_under_torch_2_11_is_refused_before_launch(tmp_path, monkeypatch, schedule):
    """torch 2.11 opens it with a send from a rank to itself, which gloo refuses (docs/notes.md#gpu-offline)."""
    from harness import validate

    cfg = compose_config(["model=tiny", "strategy=pp", "parallel.pp=2", "parallel.vpp=2",
                          f"strategy.schedule={schedule}", "workload.micro_batch_size=1"], tmp_path)
    assert prelaunch(cfg) is None  # the pinned torch runs it
    monkeypatch.setattr(validate, "torch_version", lambda: (2, 11))
    record = prelaunch(cfg)
    assert f"schedule {schedule} on gloo (cpu) needs torch >= 2.12: torch 2.11 opens" in record["error"], record
    validate.validate(to_run_config(cfg), torch_runs=False)  # the cost model still predicts it


class _Dims:
    def __init__(self, world):
        self.world_size = world


def test_on_cpu_the_sum_over_the_hosts_ranks_must_fit_its_memory(tmp_path):
    run = to_run_config(compose_config(["model=tiny", "strategy=ddp", "parallel.dp=4"], tmp_path))
    avail = local.host_available_bytes()
    assert avail > 0
    local.preflight(run, _Dims(4), {"peak_mem_bytes": avail // 10})  # 4 x 10% fits in 90%
    with pytest.raises(ConfigError, match=r"on CPU the 4 ranks share this host's memory: 4 ranks x .* GiB predicted "
                                          r"peak = .* GiB > 90% of the .* GiB available"):
        local.preflight(run, _Dims(4), {"peak_mem_bytes": avail // 3})  # 4 x 33% does not
    run.allow_oversubscribe_memory = True
    local.preflight(run, _Dims(4), {"peak_mem_bytes": avail // 3})


def test_the_issue_example_gpt2_at_dp8_is_refused_on_a_small_host(tmp_path):
    cfg = compose_config(["model=gpt2_124m", "strategy=ddp", "parallel.dp=8", "workload.global_batch_size=16"], tmp_path)
    if local.host_available_bytes() > 37.8 * 0.9 ** -1 * 1024**3:
        pytest.skip("this host has the memory for 8 ranks of gpt2_124m")
    record = prelaunch(cfg)
    assert "on CPU the 8 ranks share this host's memory: 8 ranks x 4.72 GiB predicted peak = 37.8 GiB" in record["error"]


# -- the CLI: what a user types, in a subprocess ---------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["parallel.dpp=2"], "Could not override 'parallel.dpp'"),
    (["-m", "parallel.dpp=2"], "Could not override 'parallel.dpp'"),
    (["-m", "parallel.dp=1,2", "strategy=nosuch"], "nosuch"),
    (["workload.lr=abc"], "workload.lr=abc"),
])
def test_a_config_that_does_not_compose_is_an_invalid_record_with_and_without_m(tmp_path, args, message):
    p = cli([*[a for a in args if a == "-m"], "model=tiny", "logger=none", *[a for a in args if a != "-m"]], tmp_path)
    (r,) = records(tmp_path)
    assert r["status"] == "invalid" and message in r["error"], r["error"]
    assert p.returncode == 2, p.stderr[-2000:]
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("workers.log"))


@pytest.mark.slow
@pytest.mark.parametrize("study", ["../../x", "/abs", ".hidden", "a/b", "'a b'"])
def test_an_unsafe_study_name_is_one_line_and_writes_nothing(tmp_path, study):
    results = tmp_path / "results"
    p = cli(["model=tiny", "logger=none", f"study={study}"], results)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "is not a safe name" in p.stderr, p.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []  # not even results_dir: nothing is written anywhere


@pytest.mark.slow
def test_a_results_dir_that_cannot_take_files_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    p = cli(["model=tiny", "logger=none"], blocker / "results")
    assert p.returncode == 2
    line = p.stderr.strip()
    assert line.count("\n") == 0 and "is not a writable directory" in line and "Traceback" not in line, line


@pytest.mark.slow
def test_a_record_that_cannot_be_written_is_reported_and_exits_1(tmp_path):
    # RLIMIT_FSIZE: the kernel lets write(2) go up to the limit (a short write), then fails with EFBIG
    import resource
    import signal as sig

    path = tmp_path / "adhoc.jsonl"
    path.write_text('{"status": "ok", "run_id": "earlier"}\n' * 200)
    before = path.read_bytes()
    limit = len(before) + 500  # the invalid record below is a few KiB

    def limited():
        sig.signal(sig.SIGXFSZ, sig.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    p = subprocess.run([sys.executable, "-m", "harness", "model=tiny", "logger=none", "workload.steps=0",
                        f"results_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, preexec_fn=limited,
                       timeout=300)
    assert "NOT RECORDED" in p.stderr and "File too large" in " ".join(p.stderr.split()), p.stderr[-2000:]
    assert p.returncode == 1
    assert path.read_bytes() == before  # nothing of the record stayed behind
