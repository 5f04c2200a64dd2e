"""Records are appended atomically and never rewritten; a torn line does not corrupt the others."""
from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest

from harness.run import record as rec
from harness.run import results_file


def _writer(path, i):
    for j in range(50):
        results_file.append(path, {"status": "ok", "run_id": f"{i}-{j}", "pad": "x" * 5000})


def test_concurrent_appends_never_interleave(tmp_path):
    path = tmp_path / "s.jsonl"
    procs = [mp.Process(target=_writer, args=(path, i)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    rows = results_file.read(path)
    assert len(rows) == 200
    assert len({r["run_id"] for r in rows}) == 200


def test_torn_last_line_is_skipped_and_next_append_starts_fresh(tmp_path):
    path = tmp_path / "s.jsonl"
    results_file.append(path, {"status": "ok", "run_id": "a"})
    with open(path, "a") as f:
        f.write('{"status": "ok", "run_id": "tor')  # a writer killed mid-line
    results_file.append(path, {"status": "failed", "run_id": "b"})
    assert [r["run_id"] for r in results_file.read(path)] == ["a", "b"]


def test_run_id_survives_a_new_schema_field_left_at_its_default():
    old = {"model": {"n_layers": 2}, "workload": {"steps": 10}}
    new = {"model": {"n_layers": 2, "dropout": 0.0}, "workload": {"steps": 10, "compile": False}}
    assert rec.run_id(old) == rec.run_id(new)
    assert rec.run_id(old) != rec.run_id({"model": {"n_layers": 2, "dropout": 0.1}, "workload": {"steps": 10}})


def test_run_id_ignores_where_results_go():
    a = {"model": {"n_layers": 2}, "results_dir": "x", "logger": {"name": "wandb"}, "study": "s"}
    b = {"model": {"n_layers": 2}, "results_dir": "y", "logger": {"name": "none"}, "study": "t"}
    c = {"model": {"n_layers": 3}, "results_dir": "x"}
    assert rec.run_id(a) == rec.run_id(b) != rec.run_id(c)


def test_a_run_slowed_on_purpose_has_its_own_run_id_and_says_so(tmp_path):
    """slow_step_pct is part of run_id: a slowed record never resumes as the clean config's `ok`; the
    record names the slowdown and the clean config's run_id (what harness.compare matches it with)."""
    from harness.config import as_dict, compose_run
    from harness.validate import validate

    base = ["model=tiny", "logger=none", "study=s", f"results_dir={tmp_path}"]
    clean, slowed = (compose_run(base + extra) for extra in ([], ["slow_step_pct=30"]))
    assert rec.run_id(as_dict(clean)) == rec.run_id(as_dict(compose_run(base + ["slow_step_pct=0"])))
    assert rec.run_id(as_dict(slowed)) != rec.run_id(as_dict(clean))
    record = rec.make_record(as_dict(slowed), slowed, validate(slowed), "ok", None)
    assert record["slowed_on_purpose"] == {"slow_step_pct": 30.0, "clean_run_id": rec.run_id(as_dict(clean))}
    assert "slowed_on_purpose" not in rec.make_record(as_dict(clean), clean, validate(clean), "ok", None)
    results_file.append(results_file.records_path(tmp_path, "s"), record)
    assert results_file.already_done(as_dict(clean), clean) is None  # the clean config is still to run
    assert results_file.already_done(as_dict(slowed), slowed)["run_id"] == record["run_id"]


def test_records_written_before_the_reorganisation_still_load_and_resume(tmp_path):
    """A record of schema 1 written before harness/catalog.py (its config still has strategy.axes and
    strategy.impl, and none of the fields added since) loads, reports, and keeps its run_id: the same
    config composed today hashes to it, so a resumed study skips it."""
    import shutil

    from harness.config import as_dict, compose_run
    from harness.fidelity import table
    from harness.report import write_report

    src = Path(__file__).parent / "fixtures" / "records" / "pre_catalog.jsonl"
    old = results_file.read(src)
    assert {r["config"]["strategy"]["name"] for r in old} == {"ddp", "3d"}
    assert all("axes" in r["config"]["strategy"] for r in old)
    for r in old:
        s = r["config"]["strategy"]
        overrides = [f"strategy={s['name']}", "model=tiny", "workload.steps=2", "workload.warmup_steps=1",
                     "workload.profile_steps=1", "logger=none"] + [
            f"parallel.{a}={r['dims'][a]}" for a in ("dp", "tp", "pp") if r["dims"][a] > 1]
        assert rec.run_id(as_dict(compose_run(overrides))) == r["run_id"], s["name"]
    shutil.copy(src, tmp_path / "old.jsonl")
    html = write_report(tmp_path / "old.jsonl", pngs=False)
    assert "ddp" in html.read_text()
    assert "ddp dp2" in table(old) and "3d tp2" in table(old)


def _append_under_a_file_size_limit(path, limit, record):
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write(2) then fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        results_file.append(path, record)
    except OSError as e:
        raise SystemExit(3 if e.errno == errno.EFBIG else 4) from None
    raise SystemExit(5)  # appended whole: the limit did not bite


def test_a_write_that_fails_partway_leaves_nothing_and_raises(tmp_path):
    path = tmp_path / "s.jsonl"
    results_file.append(path, {"status": "ok", "run_id": "a"})
    before = path.read_bytes()
    # the kernel writes up to the limit (a short write), the next write fails: a real partial write
    p = mp.get_context("fork").Process(target=_append_under_a_file_size_limit,
                                       args=(path, len(before) + 1000, {"status": "ok", "run_id": "b", "pad": "x" * 5000}))
    p.start()
    p.join()
    assert p.exitcode == 3  # raised EFBIG
    assert path.read_bytes() == before
    results_file.append(path, {"status": "ok", "run_id": "c"})
    assert [r["run_id"] for r in results_file.read(path)] == ["a", "c"]


def test_non_finite_numbers_are_written_as_null_and_parse_as_strict_json(tmp_path):
    path = tmp_path / "s.jsonl"
    results_file.append(path, {"status": "diverged", "run_id": "a", "measured": {"losses": [6.9, float("nan"), float("inf")]}})
    line = path.read_text()

    def refuse(name):
        raise AssertionError(name)

    assert json.loads(line, parse_constant=refuse)["measured"]["losses"] == [6.9, None, None]


def test_a_torn_line_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "s.jsonl"
    results_file.append(path, {"status": "ok", "run_id": "a"})
    with open(path, "ab") as f:
        f.write(b'{"status": "ok", "run_id": "\xe2\x82')  # torn inside a multi-byte character
    with pytest.warns(UserWarning, match="skipped a torn record"):
        assert [r["run_id"] for r in results_file.read(path)] == ["a"]


def test_a_dry_run_and_a_real_run_of_one_config_have_different_run_ids():
    """A dry run records bytes on fake tensors, not a run: resume must not take one for the other."""
    from harness.config import as_dict, compose_run

    base = ["strategy=fsdp", "parallel.dp=2", "model=tiny"]
    real, dry = (rec.run_id(as_dict(compose_run(base + extra))) for extra in ([], ["launcher=dryrun"]))
    assert real != dry
    assert real == rec.run_id(as_dict(compose_run(base + ["launcher.timeout_s=60"])))  # launcher knobs stay out


def test_fidelity_table_takes_the_latest_or_with_best_the_fastest_record():
    """Three passes of a study: by default each config's latest ok record, with best its fastest."""
    import copy

    from harness.fidelity import table

    src = Path(__file__).parents[1] / "results" / "reference" / "fidelity_epyc_slower_host.jsonl"
    single = next(r for r in results_file.read(src) if r["config"]["strategy"]["name"] == "single")
    passes = []
    for step in (1.5, 1.2, 1.8):
        r = copy.deepcopy(single)
        r["measured"]["step_time_s"] = step
        r.pop("fidelity", None)
        passes.append(r)
    failed = {**copy.deepcopy(passes[0]), "status": "failed"}
    failed["measured"]["step_time_s"] = 0.5  # faster than any pass, but not ok: never chosen
    assert "| single | 1.800 /" in table(passes)
    assert "| single | 1.200 /" in table(passes + [failed], best=True)


def test_fidelity_predicts_records_again_on_their_own_or_another_profile():
    """--repredict: the committed demo records predicted again from their own configs; on the profile they
    were recorded on (cpu_reference) the same as from the copy in each record, on another its figures, and
    the ratios made again from the new predictions; three configs or more get a rank correlation."""
    from harness.fidelity import predict_again, rank_line
    from harness.run.record import ratios

    src = Path(__file__).parents[1] / "results" / "reference" / "demo.jsonl"
    recs = results_file.read(src)
    own, errors = predict_again(recs)
    assert not errors and len(own) == sum(r["status"] == "ok" for r in recs) == 6
    named, _ = predict_again(recs, "cpu_reference")
    other, _ = predict_again(recs, "cpu")
    steps = lambda rs: [r["predicted"]["step_time_s"] for r in rs]  # noqa: E731
    assert steps(named) == steps(own) != steps(other)
    assert {r["config"]["hardware"]["name"] for r in other} == {"cpu"}
    assert all(r["fidelity"] == ratios(r["measured"], r["predicted"]) for r in other)
    assert [r["measured"] for r in other] == [r["measured"] for r in recs]  # measurements untouched
    line = rank_line(own)
    assert line.startswith("Spearman rho of predicted vs measured tokens/s over these 6 configs: ")
    assert rank_line(own[:2]) == ""


def test_a_reader_waits_for_an_append_in_progress(tmp_path):
    """read() takes the append's flock shared: while a writer holds it, the reader waits rather than see
    the part of a record the kernel has copied so far (a torn last line, seen by a lockless poll)."""
    import fcntl
    import threading

    path = tmp_path / "s.jsonl"
    path.write_text('{"run_id": "a"}\n{"run_id": "b", "half": ')  # what a lockless reader could see mid-append
    got = []
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the writer, mid-append
    reader = threading.Thread(target=lambda: got.append(results_file.read(path)))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive() and not got  # waiting on the lock, not reading
    os.lseek(fd, 0, os.SEEK_END)
    os.write(fd, b'1}\n')
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    reader.join(5)
    assert [r["run_id"] for r in got[0]] == ["a", "b"]


def test_write_atomic_syncs_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    from harness.rundir import write_atomic

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b)))
    target = tmp_path / "progress"
    write_atomic(target, "3 10")
    assert target.read_text() == "3 10"
    (sync_file, tmp_name), replaced, synced_dir = events
    assert sync_file == "fsync" and Path(tmp_name).parent == tmp_path and tmp_name != str(target)
    assert replaced == ("replace", str(target)) and synced_dir == ("fsync", str(tmp_path))


def test_write_atomic_that_fails_leaves_the_old_file_and_no_partial_one(tmp_path):
    from harness.rundir import write_atomic

    target = tmp_path / "measurement.json"
    write_atomic(target, b"old")
    os.chmod(tmp_path, 0o500)  # the temporary file cannot be created: the write fails
    try:
        if os.access(tmp_path, os.W_OK):
            pytest.skip("root ignores directory permissions")
        with pytest.raises(OSError):
            write_atomic(target, b"new")
    finally:
        os.chmod(tmp_path, 0o700)
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["measurement.json"]


def test_a_renamed_key_keeps_run_ids_and_reads_as_its_new_name():
    """strategy.dp_shard is now strategy.data_parallel (harness/config.py: RENAMED): the old key is read as the
    new one, and a record written under the old name keeps its run_id when its config is read today."""
    from omegaconf import OmegaConf

    from harness.config import as_dict, compose_run, to_run_config

    base = ["strategy=3d", "parallel.dp=2", "parallel.pp=2"]
    new, old = (compose_run([*base, f"strategy.{k}=ddp"]) for k in ("data_parallel", "dp_shard"))
    assert new.strategy.data_parallel == old.strategy.data_parallel == "ddp" and old.strategy.dp_shard is None
    assert rec.run_id(as_dict(new)) == rec.run_id(as_dict(old)) != rec.run_id(as_dict(compose_run(base)))
    with pytest.raises(ValueError, match="dp_shard is the old name of data_parallel"):
        compose_run([*base, "strategy.dp_shard=ddp", "strategy.data_parallel=zero1"])
    # two dry-run records brigade wrote under the old name (results/reference/dryrun_scale.jsonl before it was
    # made again), with a value other than the default
    written = results_file.read(Path(__file__).parent / "fixtures" / "records" / "old_key_dp_shard.jsonl")
    assert len(written) == 2 and all(r["config"]["strategy"]["dp_shard"] in ("ddp", "zero1") for r in written)
    for r in written:
        assert rec.run_id(as_dict(to_run_config(OmegaConf.create(r["config"])))) == r["run_id"]
