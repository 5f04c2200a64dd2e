"""The root cause of a failed run from what its processes left (error files, torchrun's summary as
torch 2.13 prints it, the OOM-kill counter), and the exit status of an invocation. Pure: files only."""
from __future__ import annotations

import json
import time
from pathlib import Path

from harness.run import cause
from harness.run.ending import Ending
from launch.local import LaunchResult

SUMMARY = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
harness.worker FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : {t0}
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 12857)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 12857
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : {t1}
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : {code} (pid: 12858)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 12858
=======================================================
"""


def stamp(t: float) -> str:
    return time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime(t))


def run_dir_with(tmp_path: Path, errors: list[dict], summary_at: float | None = None, code: int = -9) -> Path:
    for e in errors:
        error = {"type": "RuntimeError", "out_of_memory": False, **e}
        (tmp_path / f"error_rank{e['rank']}.json").write_text(json.dumps(error))
    log = SUMMARY.format(t0=stamp(summary_at), t1=stamp(summary_at), code=code) if summary_at else "no summary"
    (tmp_path / "workers.log").write_text(log)
    return tmp_path


def result(tmp_path, **kw) -> LaunchResult:
    return LaunchResult(**{"returncode": 1, "timed_out": False, "wall_s": 9.0, "log_path": tmp_path / "workers.log", **kw})


class Run:  # the two fields verdict reads
    class launcher:
        timeout_s = 30.0


def test_a_sigkilled_rank_is_the_cause_not_the_peer_that_lost_its_connection(tmp_path):
    t = float(int(time.time()))
    d = run_dir_with(tmp_path, [{"rank": 0, "time": t + 0.4, "message": "Connection reset by peer"}], summary_at=t)
    assert cause.verdict(Run, d, result(tmp_path)) == ("failed", "rank 1: killed by SIGKILL (exit code -9)")


def test_sigkill_while_the_kernel_oom_killed_is_oom(tmp_path):
    t = float(int(time.time()))
    d = run_dir_with(tmp_path, [{"rank": 0, "time": t + 0.4, "message": "Connection reset by peer"}], summary_at=t)
    status, error = cause.verdict(Run, d, result(tmp_path, oom_kills=1))
    assert status == "oom" and "the kernel OOM-killed 1 process(es) during the run" in error


def test_a_peer_that_noticed_before_torchrun_stamped_the_death_is_still_a_consequence(tmp_path):
    t = float(int(time.time()))  # observed under load: the peer's error 0.08 s before the stamped second
    d = run_dir_with(tmp_path, [{"rank": 0, "time": t - 0.08, "message": "Connection closed by peer"}], summary_at=t)
    assert cause.verdict(Run, d, result(tmp_path)) == ("failed", "rank 1: killed by SIGKILL (exit code -9)")


def test_an_error_well_before_the_signal_death_is_the_cause(tmp_path):
    t = float(int(time.time()))
    d = run_dir_with(tmp_path, [{"rank": 0, "time": t - 5, "message": "boom"}], summary_at=t)
    assert cause.verdict(Run, d, result(tmp_path)) == ("failed", "rank 0: RuntimeError: boom")


def test_sigterm_deaths_are_torchruns_teardown_and_never_the_cause_when_a_rank_raised(tmp_path):
    t = float(int(time.time()))
    d = run_dir_with(tmp_path, [{"rank": 1, "time": t + 0.5, "message": "crashed on purpose"}], summary_at=t, code=1)
    assert cause.verdict(Run, d, result(tmp_path)) == ("failed", "rank 1: RuntimeError: crashed on purpose")


def test_an_error_file_written_before_the_deadline_wins_over_timeout(tmp_path):
    now = time.time()
    d = run_dir_with(tmp_path, [{"rank": 1, "time": now - 5, "message": "crashed before the deadline"}])
    r = result(tmp_path, returncode=None, timed_out=True, ended_at=now)
    assert cause.verdict(Run, d, r) == ("failed", "rank 1: RuntimeError: crashed before the deadline")
    late = run_dir_with(tmp_path, [{"rank": 1, "time": now + 1, "message": "killed by the parent"}])
    assert cause.verdict(Run, late, r)[0] == "timeout"


def test_a_run_slurm_took_away_is_interrupted_whatever_its_ranks_left(tmp_path):
    """SLURM signalled every process (a requeue): the ranks' error files and torchrun's summary are its
    doing, so the run is `interrupted` with SLURM's reason, not `failed` by the first rank that died."""
    t = float(int(time.time()))
    d = run_dir_with(tmp_path, [{"rank": 0, "time": t + 0.2, "message": "got signal: 15"}], summary_at=t, code=-15)
    assert cause.verdict(Run, d, result(tmp_path))[0] == "failed"
    taken = result(tmp_path, taken_away="preempted/requeued by SLURM (job 7)")
    assert cause.verdict(Run, d, taken) == (
        "interrupted", "preempted/requeued by SLURM (job 7); every process of the run ended")


def test_an_oom_error_file_is_oom(tmp_path):
    d = run_dir_with(tmp_path, [{"rank": 0, "time": time.time(), "type": "OutOfMemoryError", "message": "CUDA out of memory", "out_of_memory": True}])
    assert cause.verdict(Run, d, result(tmp_path))[0] == "oom"


def test_the_first_non_finite_loss_is_named_with_its_step():
    assert cause.divergence([6.9, 6.1, float("nan"), float("nan")]).startswith("loss is nan at step 2 (of 4")
    assert cause.divergence([6.9, float("inf")]).startswith("loss is inf at step 1")
    assert cause.divergence([6.9, 6.1]) is None


def test_exit_status_tells_ok_invalid_and_failed_apart():
    def status(*ended):
        run_ends = Ending()
        run_ends.outcomes = list(ended)
        return run_ends.exit_status()

    assert status(("ok", False), ("ok", False)) == 0 and status() == 0
    assert status(("ok", False), ("invalid", False)) == 2
    assert status(("invalid", False), ("timeout", False)) == 1
    for s in ("failed", "timeout", "oom", "diverged", "interrupted", "unrecorded"):
        assert status(("ok", False), (s, False)) == 1, s
    assert status(("failed", True), ("invalid", True)) == 0  # allow_failures
    assert status(("interrupted", True)) == 1  # never relaxed
