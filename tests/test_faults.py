"""Faults with real processes: a signal to the real parent, a stopped, a killed rank, concurrent
studies. Each asserts that no process of the run is left (ps), that exactly one complete record
names the cause, how long that took, and the exit code."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.run import results_file
from tests.helpers import FAST, REPO

pytestmark = pytest.mark.slow
FOREVER = ["workload.steps=100000"]  # a run that only a fault or the parent ends
# From a signal (or the deadline) to the record: launch/local.py's end_run waits GRACE_S (5 s) after
# SIGTERM and at most 3 s after SIGKILL, fixed waits that load does not lengthen; what is left is well
# under 1 s of CPU (scan /proc, gather, write one record): the 7 s left hold it even at a fifth of a core.
RECORD_WITHIN_S = 15


def start(args: list[str], results_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "harness", *args, f"results_dir={results_dir}"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_steps(results_dir: Path, proc: subprocess.Popen, timeout: float = 180) -> Path:
    """The run dir once rank 0 has reported a step (every rank is then inside the timed loop)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list(Path(results_dir).glob("runs/*/*/progress"))
        if found:
            return found[0].parent
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no step within {timeout} s")


def rank_pids(run_dir: Path) -> dict[int, int]:
    out = {}
    for entry in os.scandir("/proc"):
        try:
            cmd = Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if f"harness.worker {run_dir}" in cmd and "torch.distributed.run" not in cmd:
                env = dict(kv.split("=", 1) for kv in Path(f"/proc/{entry.name}/environ").read_text().split("\0") if "=" in kv)
                out[int(env["RANK"])] = int(entry.name)
        except (OSError, ValueError, KeyError):
            continue
    return out


def leftovers(results_dir: Path) -> list[str]:
    """Processes whose command line names this test's results dir (torchrun and every rank do)."""
    ps = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout.splitlines()
    return [l for l in ps if str(results_dir) in l and "harness.worker" in l and " Z" not in l]


def strict_records(results_dir: Path, study: str = "adhoc") -> list[dict]:
    """Every line parses as strict JSON (no NaN/Infinity), as JavaScript's JSON.parse would."""
    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    path = Path(results_dir) / f"{study}.jsonl"
    text = results_file.locked_bytes(path).decode() if path.exists() else ""  # as every reader: no append half-seen
    assert not text or text.endswith("\n"), "a torn last line"
    return [json.loads(l, parse_constant=refuse) for l in text.splitlines()]


def seconds_until(check, limit: float) -> float:
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < limit, f"not within {limit} s"
        time.sleep(0.1)
    return time.monotonic() - t0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_to_the_parent_ends_every_process_records_interrupted_and_stops_the_sweep(tmp_path, sig):
    p = start(["-m", *FAST, *FOREVER, "strategy=ddp", "parallel.dp=2", "study=sig", "workload.seed=1,2"], tmp_path)
    wait_for_steps(tmp_path, p)
    t0 = time.monotonic()
    p.send_signal(sig)
    gone = seconds_until(lambda: not leftovers(tmp_path), RECORD_WITHIN_S)
    recorded = seconds_until(lambda: strict_records(tmp_path, "sig"), RECORD_WITHIN_S - (time.monotonic() - t0))
    out, _ = p.communicate(timeout=60)
    (r,) = strict_records(tmp_path, "sig")  # the second config was never started
    assert r["status"] == "interrupted" and sig.name in r["error"], r["error"]
    assert p.returncode == 1, out[-2000:]
    assert "the sweep stops; 1 run(s) not started" in " ".join(out.split())
    print(f"{sig.name}: no process after {gone:.1f} s, record after {gone + recorded:.1f} s")


def test_a_stopped_rank_is_ended_at_the_timeout(tmp_path):
    p = start([*FAST, *FOREVER, "strategy=ddp", "parallel.dp=2", "launcher.timeout_s=45"], tmp_path)
    run_dir = wait_for_steps(tmp_path, p)
    os.kill(rank_pids(run_dir)[1], signal.SIGSTOP)  # neither exits nor answers SIGTERM
    out, _ = p.communicate(timeout=120)
    assert leftovers(tmp_path) == []
    (r,) = strict_records(tmp_path)
    assert r["status"] == "timeout" and "launcher.timeout_s=45" in r["error"], r["error"]
    launched = (run_dir / "config.yaml").stat().st_mtime  # written just before torchrun starts
    after = (tmp_path / "adhoc.jsonl").stat().st_mtime - (launched + 45)
    assert after < RECORD_WITHIN_S, f"recorded {after:.1f} s after the deadline"
    assert p.returncode == 1, out[-2000:]
    print(f"SIGSTOP + timeout: record {after:.1f} s after the deadline")


def test_a_sigkilled_rank_is_the_named_cause_not_its_peer(tmp_path):
    # allow_failures: a sweep that expects failures exits 0 once the failure is recorded
    p = start([*FAST, *FOREVER, "strategy=ddp", "parallel.dp=2", "allow_failures=true"], tmp_path)
    run_dir = wait_for_steps(tmp_path, p)
    os.kill(rank_pids(run_dir)[1], signal.SIGKILL)
    t0 = time.monotonic()
    recorded = seconds_until(lambda: strict_records(tmp_path), RECORD_WITHIN_S)
    out, _ = p.communicate(timeout=60)
    assert leftovers(tmp_path) == []
    (r,) = strict_records(tmp_path)
    # the peer's "Connection reset by peer" is a consequence; torchrun's summary names the victim
    assert r["status"] == "failed" and r["error"].startswith("rank 1: killed by SIGKILL (exit code -9)"), r["error"]
    assert p.returncode == 0, out[-2000:]
    print(f"SIGKILL of rank 1: record after {recorded:.1f} s ({time.monotonic() - t0:.1f} s to exit)")


def test_a_non_finite_loss_is_diverged_with_its_step_and_written_as_null(tmp_path):
    p = start([*FAST, "strategy=single", "workload.lr=1e12"], tmp_path)
    out, _ = p.communicate(timeout=300)
    (r,) = strict_records(tmp_path)
    assert r["status"] == "diverged", (r["status"], r["error"])
    losses = r["measured"]["losses"]
    first = next(i for i, v in enumerate(losses) if v is None)
    assert f"at step {first}" in r["error"] and all(v is not None for v in losses[:first])
    assert p.returncode == 1, out[-2000:]


def test_two_invocations_of_one_study_run_each_config_once(tmp_path):
    args = ["-m", *FAST, "strategy=single", "study=twice", "workload.seed=1,2", "report=false"]
    a, b = start(args, tmp_path), start(args, tmp_path)
    outs = [p.communicate(timeout=400)[0] for p in (a, b)]
    rows = strict_records(tmp_path, "twice")
    assert sorted(r["config"]["workload"]["seed"] for r in rows) == [1, 2], [r["run_id"] for r in rows]
    assert all(r["status"] == "ok" for r in rows)
    said = " ".join(" ".join(outs).split())
    assert "another brigade (pid" in said or "already ok" in said, said[-3000:]
    assert a.returncode == b.returncode == 0
    hydra_dirs = list((tmp_path / "hydra" / "twice").iterdir())
    assert len(hydra_dirs) == 2, hydra_dirs  # one per invocation


def test_launcher_master_port_is_the_port_torchrun_listens_on(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = start([*FAST, "strategy=ddp", "parallel.dp=2", f"launcher.master_port={port}"], tmp_path)
        out, _ = p.communicate(timeout=300)
    (r,) = strict_records(tmp_path)
    assert r["status"] == "failed" and f"port: {port}" in r["error"] and "EADDRINUSE" in r["error"], r["error"]
    assert p.returncode == 1


def _memory_cgroup(tmp_path) -> Path | None:
    """A memory cgroup of 2 GiB this test may create (cgroup v1 or v2, as root), else None."""
    for root, limit in (("/sys/fs/cgroup/memory", "memory.limit_in_bytes"), ("/sys/fs/cgroup", "memory.max")):
        cg = Path(root) / f"brigade-test-{tmp_path.name}"
        try:
            cg.mkdir()
            (cg / limit).write_text(str(2 << 30))
            return cg
        except OSError:
            if cg.exists():
                cg.rmdir()
    return None


def test_a_rank_the_kernel_oom_kills_is_oom(tmp_path):
    cg = _memory_cgroup(tmp_path)
    if cg is None:
        pytest.skip("no memory cgroup can be created here (needs root and a writable cgroup hierarchy)")
    try:
        # the whole invocation in the cgroup; rank 1 touches up to 4 GiB, so the kernel kills it at 2 GiB
        argv = [sys.executable, "-m", "harness", *FAST, "strategy=ddp", "parallel.dp=2", "fault=oom_rank1",
                "launcher.timeout_s=120", f"results_dir={tmp_path}"]
        p = subprocess.run(["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh", *argv], cwd=REPO,
                           capture_output=True, text=True, timeout=400)
        (r,) = strict_records(tmp_path)
        assert r["status"] == "oom", (r["status"], r["error"])
        assert r["error"].startswith("rank 1: killed by SIGKILL (exit code -9); the kernel OOM-killed"), r["error"]
        assert leftovers(tmp_path) == []
        assert p.returncode == 1, p.stderr[-2000:]
    finally:
        for _ in range(50):  # the cgroup can be removed once its last process is gone
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.2)


def _on_a_full_disk(runs: Path) -> list[str]:
    """An argv prefix that runs a command with `runs` on a full tmpfs of 8 KiB, in a mount namespace
    of its own (unshare -rm: no root needed where user namespaces are allowed)."""
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("no user and mount namespace here (unshare -rm): cannot mount a full tmpfs")
    runs.mkdir(parents=True)
    fill = f"mount -t tmpfs -o size=8k tmpfs {runs} && (dd if=/dev/zero of={runs}/fill bs=4k 2>/dev/null; true)"
    return ["unshare", "-rm", "sh", "-c", f'{fill} && exec "$@"', "sh"]


@pytest.mark.parametrize("multirun", [False, True], ids=["run", "sweep"])
def test_a_task_that_fails_writing_its_run_dir_is_failed_and_exits_1(tmp_path, multirun):
    # <results_dir>/runs is a full disk, the records file beside it is not: a real ENOSPC in the run dir
    argv = [*_on_a_full_disk(tmp_path / "runs"), sys.executable, "-m", "harness", *(["-m"] if multirun else []),
            *FAST, "strategy=single", f"results_dir={tmp_path}"]
    p = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    (r,) = strict_records(tmp_path)
    assert r["status"] == "failed" and "No space left on device" in r["error"], (r["status"], r["error"])
    assert "write_atomic" in r["error"]  # where it was raised
    assert p.returncode == 1, p.stderr[-2000:]
    assert not [f for f in (tmp_path / "runs").rglob("*.tmp")]  # a failed write leaves no partial file


@pytest.fixture
def signal_handlers():
    """brigade's handlers in this process, as the CLI installs them; pytest's back afterwards."""
    from harness.run import signals

    saved = {s: signal.getsignal(s) for s in signals.HANDLED}
    signals.install_signals()
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)
    signals._received.clear()


def test_a_signal_before_launch_ends_the_run_as_interrupted(tmp_path, signal_handlers):
    from harness.run.ending import Ending
    from harness.run.job import run_job
    from tests.helpers import compose_config

    os.kill(os.getpid(), signal.SIGTERM)  # noted by the handler: the run has not been launched yet
    run_ends = Ending()
    r = run_job(compose_config([*FAST, "strategy=ddp", "parallel.dp=2"], tmp_path), run_ends)
    assert r["status"] == "interrupted" and "SIGTERM before the run was launched" in r["error"], r
    assert strict_records(tmp_path) == [json.loads(json.dumps(r))]
    assert r["run_dir"] is None and not (tmp_path / "runs").exists()  # nothing was started
    assert r["predicted"]["step_time_s"] > 0  # planned, so the record says what it would have been
    assert run_ends.exit_status() == 1


def test_a_signal_between_a_sweeps_runs_ends_the_next_run_as_interrupted(tmp_path, signal_handlers, monkeypatch):
    from hydra.core.global_hydra import GlobalHydra

    from harness.run.invocation import run_invocation
    from harness.run.job import Task

    class SignalledAfterEachRun(Task):
        def __call__(self, cfg):
            record = super().__call__(cfg)
            os.kill(os.getpid(), signal.SIGTERM)  # after the run ended, before the sweep's next one
            return record

    argv = ["-m", *FAST, "strategy=single", "workload.seed=1,2,3", "report=false", f"results_dir={tmp_path}"]
    monkeypatch.setattr(sys, "argv", ["brigade", *argv])  # Hydra's entry point parses sys.argv
    try:
        status = run_invocation(argv, SignalledAfterEachRun())
    finally:
        GlobalHydra.instance().clear()
    rows = strict_records(tmp_path)
    assert [(r["config"]["workload"]["seed"], r["status"]) for r in rows] == [(1, "ok"), (2, "interrupted")]
    assert "SIGTERM before the run was launched" in rows[1]["error"] and rows[1]["run_dir"] is None
    assert status == 1


def test_a_failed_wandb_log_leaves_no_wandb_identity_and_says_why(tmp_path):
    from tests.helpers import FAST, cli

    # W&B itself refuses the mode: a real logging failure. In a process of its own: W&B keeps the settings of
    # an earlier in-process run, so in the test process it would not look at the mode again.
    args = [*[o for o in FAST if not o.startswith("logger")], "logger=wandb", "strategy=single"]
    proc = cli(args, tmp_path, env={"WANDB_MODE": "bogus"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (written,) = strict_records(tmp_path)
    assert written["status"] == "ok", written["error"]
    assert "wandb" not in written, written["wandb"]  # no identity for a W&B run that does not exist
    assert written["wandb_error"].startswith("W&B logging failed: ValidationError"), written["wandb_error"]
    assert not list(Path(written["run_dir"]).glob("wandb/*run-*"))
