"""launcher=slurm end to end, against a real SLURM cluster on this machine.

The session fixture starts the cluster with launch/slurm/local_cluster.sh (2 virtual nodes, munge,
MariaDB, slurmdbd, slurmctld, 2 slurmd; it installs the Debian packages if they are missing) in a
fresh state dir, and the last test stops it and checks that no daemon it started is left. Sweeps
run through the real `brigade` CLI, so Hydra's submitit launcher submits real sbatch jobs.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers import FAST, REPO, assert_losses_match, cli, records

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SCRIPT = REPO / "launch" / "slurm" / "local_cluster.sh"
# The W&B test sets its own logger; the HTML report has its own tests.
SLURM_FAST = [o for o in FAST if not o.startswith("logger")] + ["report=false"]


def _free_port_base() -> int:
    """A base with base..base+12 free (the cluster's ports), away from the script's default 17810
    so a developer's own cluster keeps running beside the tests'."""
    for base in range(17850, 18800, 20):
        ok = True
        for port in range(base, base + 13):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range for the test cluster")


def _script(*args: str, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=timeout)


def _pids(state: Path) -> list[tuple[str, int, str]]:
    path = state / "pids"
    if not path.exists():
        return []
    return [(n, int(p), e) for n, p, e in (line.split() for line in path.read_text().splitlines() if line.strip())]


def _alive(pid: int, exe: str) -> bool:
    try:
        return os.path.realpath(f"/proc/{pid}/exe") == exe
    except OSError:
        return False


class Cluster:
    def __init__(self, state: Path, env: dict):
        self.state, self.env = state, env
        self.pids = _pids(state)

    def run(self, *argv: str, timeout: float = 60) -> str:
        out = subprocess.run(list(argv), capture_output=True, text=True, env=self.env, timeout=timeout)
        assert out.returncode == 0, (argv, out.stderr)
        return out.stdout


@pytest.fixture(scope="session")
def slurm_cluster():
    needs_install = shutil.which("slurmctld", path="/usr/sbin:/usr/bin") is None
    if needs_install and os.geteuid() != 0:
        pytest.skip("SLURM packages missing and not root: local_cluster.sh cannot apt-get install them")
    # mkdtemp makes a 0700 dir; the script opens it to the munge user.
    state = Path(tempfile.mkdtemp(prefix="brigade-slurm-test-", dir="/tmp"))
    env = {**os.environ, "BRIGADE_SLURM_DIR": str(state), "BRIGADE_SLURM_PORT_BASE": str(_free_port_base())}
    started = _script("start", "--nodes", "2", env=env)
    assert started.returncode == 0, started.stderr
    assert started.stdout.strip() == f"export SLURM_CONF={state}/etc/slurm.conf", started.stdout
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = env["SLURM_CONF"] = f"{state}/etc/slurm.conf"
    cluster = Cluster(state, env)
    try:
        yield cluster
    finally:
        _script("stop", env=env)  # idempotent: the last test has normally stopped it already
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        left = [(n, p) for n, p, e in cluster.pids if _alive(p, e)]
        if not left:
            shutil.rmtree(state, ignore_errors=True)
        assert not left, f"daemons left running: {left}"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return tmp_path_factory.mktemp("slurm_results")


def test_cluster_started_from_nothing(slurm_cluster):
    names = sorted(n for n, _, _ in slurm_cluster.pids)
    assert names == ["mariadbd", "munged", "slurmctld", "slurmd-bn1", "slurmd-bn2", "slurmdbd"], names
    assert all(_alive(p, e) for _, p, e in slurm_cluster.pids)
    nodes = slurm_cluster.run("sinfo", "-h", "-N", "-o", "%N %t").split("\n")
    assert sorted(l for l in nodes if l) == ["bn1 idle", "bn2 idle"], nodes
    # sacct answers (through slurmdbd and MariaDB): submitit reads job states from it.
    slurm_cluster.run("sacct", "-n", "-X")
    # Idempotent: a second start finds it running and starts nothing.
    again = _script("start", "--nodes", "2", env=slurm_cluster.env)
    assert again.returncode == 0 and "already running" in again.stderr, again.stderr
    assert _pids(slurm_cluster.state) == slurm_cluster.pids
    status = _script("status", env=slurm_cluster.env)
    assert status.returncode == 0, status.stderr


def _wandb_run_record(record: dict):
    from tests.wandb_file import records as wandb_records

    files = list(Path(record["run_dir"]).glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    runs = [r.run for r in wandb_records(files[0]) if r.WhichOneof("record_type") == "run"]
    assert runs, files[0]
    return runs[0]


def test_two_configs_then_resume(slurm_cluster, results, single_reference):
    args = ["-m", "launcher=slurm", *SLURM_FAST, "logger=wandb", "study=slurm2",
            "hydra.sweeper.runs=[['strategy=single'],['strategy=ddp','parallel.dp=2']]"]
    p = cli(args, results, timeout=420)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = records(results, "slurm2")
    assert sorted((r["strategy"], r["status"]) for r in recs) == [("ddp", "ok"), ("single", "ok")], \
        [(r["strategy"], r["status"], r["error"]) for r in recs]
    single, ddp = sorted(recs, key=lambda r: r["strategy"], reverse=True)
    local = single_reference()  # the same config as `single`, run by launcher=local
    assert single["run_id"] == local["run_id"]  # the launcher is not part of what is measured
    assert set(single["measured"]) == set(local["measured"]), set(single["measured"]) ^ set(local["measured"])
    assert set(local["measured"]) <= set(ddp["measured"])
    assert single["measured"]["losses"] == local["measured"]["losses"]  # same worker code, same numbers
    assert_losses_match(ddp["measured"]["losses"], local["measured"]["losses"])
    for r in (single, ddp):
        assert r["env"]["slurm_job"] and r["run_dir"].endswith(f".slurm{r['env']['slurm_job']}")
        assert r["config"]["launcher"]["name"] == "slurm"
        # W&B: one group per study, the run named for what it is (its label), job type slurm.
        w = _wandb_run_record(r)
        assert (w.run_group, w.job_type, w.display_name) == ("slurm2", "slurm", r["wandb"]["name"])
        assert w.display_name == ("ddp dp2" if r["strategy"] == "ddp" else "single")

    # Re-running the study submits no job and appends no record for configs already done.
    jobs_before = slurm_cluster.run("sacct", "-n", "-X", "-o", "JobID").split()
    again = cli(args, results, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert records(results, "slurm2") == recs
    assert again.stderr.count("skip ") == 2, again.stderr[-3000:]
    assert slurm_cluster.run("sacct", "-n", "-X", "-o", "JobID").split() == jobs_before


def test_two_node_run(slurm_cluster, results, single_reference):
    p = cli(["launcher=slurm", "launcher.nodes=2", *SLURM_FAST, "logger=none", "study=twonode", "strategy=ddp",
             "parallel.dp=4"], results, timeout=420)
    assert p.returncode == 0, p.stderr[-3000:]
    [r] = records(results, "twonode")  # one record, though both nodes' tasks ran the job function
    assert r["status"] == "ok", r["error"]
    assert r["dims"]["world_size"] == 4
    assert r["env"]["nodes"] == ["bn1", "bn2"] and r["env"]["num_nodes"] == 2, r["env"]
    assert r["env"]["slurm_job_nodelist"] == "bn[1-2]"
    assert sorted(p.name for p in Path(r["run_dir"]).glob("workers.*.log")) == ["workers.bn1.log", "workers.bn2.log"]
    assert_losses_match(r["measured"]["losses"], single_reference()["measured"]["losses"])


def _processes_with(text: str) -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(proc.name))
            except OSError:
                continue
    return out


def test_scancel_becomes_failed_record(slurm_cluster, results):
    """One job of a 2-job sweep hangs (rank 1 sleeps) and is scancelled mid-run: its config gets a
    `failed` record within 60 s, its ranks are gone, the other job is ok and the sweep ends."""
    study_runs = results / "runs" / "kill"
    sweep = subprocess.Popen(
        [sys.executable, "-m", "harness", "-m", "launcher=slurm", *SLURM_FAST, "logger=none", "study=kill",
         "strategy=ddp", "parallel.dp=2", "fault=none,hang_rank1", f"results_dir={results}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
    try:
        # Mid-run: the hanging job's torchrun has started its ranks (their log exists).
        deadline, hung = time.monotonic() + 300, None
        while hung is None and time.monotonic() < deadline:
            for cfg in study_runs.glob("*.slurm*/config.yaml"):
                if "fault: hang_rank1" in cfg.read_text() and (cfg.parent / "workers.log").exists():
                    hung = cfg.parent
            time.sleep(0.5)
        assert hung is not None, "the hanging job never started"
        time.sleep(3)
        job = hung.name.rsplit(".slurm", 1)[1]
        t0 = time.monotonic()
        slurm_cluster.run("scancel", job)
        failed = None
        while failed is None and time.monotonic() - t0 < 60:
            failed = next((r for r in records(results, "kill") if r["config"]["fault"] == "hang_rank1"), None)
            time.sleep(0.5)
        assert failed is not None, "no record within 60 s of scancel"
        assert failed["status"] == "failed", failed
        out, _ = sweep.communicate(timeout=300)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 1, out[-3000:]  # a failed run
    recs = records(results, "kill")
    assert sorted((r["config"]["fault"], r["status"]) for r in recs) == [("hang_rank1", "failed"), ("none", "ok")]
    assert not _processes_with(str(hung)), "ranks of the cancelled job are still running"


def test_calibrate_fabric_across_two_nodes_writes_a_fabric_profile(slurm_cluster, tmp_path):
    """`python -m harness.calibrate --fabric` in a 2-node allocation: gloo across bn1 and bn2 (srun, one
    rank a node), the profile written, composed beside a node profile and priced from."""
    import yaml

    from harness.costmodel.fabric import Fabric

    out = tmp_path / "fabric" / "local_2n.yaml"
    p = subprocess.run(["salloc", "-N", "2", "--ntasks-per-node=1", "--time=10", sys.executable, "-m",
                        "harness.calibrate", "--fabric", "--quick", "--output", str(out)],
                       cwd=REPO, capture_output=True, text=True, env=slurm_cluster.env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = yaml.safe_load(out.read_text())
    assert doc["latency_nodes"] == 2 and doc["latency_gpus_per_node"] == 1 and doc["transport"] == "gloo"
    assert "SLURM job" in doc["source"]["calibrate"] and "bn[1-2]" in doc["source"]["calibrate"]
    assert set(doc["curves"]) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"}
    for runs in doc["curves"].values():
        assert [(r["nodes"], r["gpus_per_node"]) for r in runs] == [(2, 1)]
        assert [b for b, _ in runs[0]["busbw_GBps"]] == [4096, 262144, 2**20]  # --quick's sizes
        assert all(bw > 0 for _, bw in runs[0]["busbw_GBps"])
    fabric = Fabric.of(doc)
    # a measured point is priced as measured: 1 MiB all-reduce over 2 ranks on 2 nodes
    bw = dict(doc["curves"]["all_reduce"][0]["busbw_GBps"])[2**20]
    assert fabric.call_s("all_reduce", 2, 1, 2**20) == pytest.approx(2**20 / (bw * 1e9), rel=1e-6)


def test_two_invocations_of_one_study_submit_and_run_each_config_once(slurm_cluster, results):
    """Two invocations of one study started together: each config is submitted once and runs once
    (the first to claim its run_id submits it and holds the claim for its SLURM job; the other
    skips it), so the study has one record per config and SLURM saw one job per config."""
    def study_jobs() -> set[str]:  # this study's jobs only (launch/slurm.py names them brigade-<study>-...):
        # another test's allocation may reach the accounting database after this test began
        lines = slurm_cluster.run("sacct", "-n", "-X", "-P", "-o", "JobID,JobName%200").split()
        return {line.split("|")[0] for line in lines if "|brigade-twice-" in line}

    jobs_before = study_jobs()
    argv = [sys.executable, "-m", "harness", "-m", "launcher=slurm", *SLURM_FAST, "logger=none", "study=twice",
            "strategy=single", "workload.seed=1,2", f"results_dir={results}"]
    a, b = (subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for _ in range(2))
    outs = [p.communicate(timeout=420)[0] for p in (a, b)]
    assert a.returncode == b.returncode == 0, [o[-2000:] for o in outs]
    recs = records(results, "twice")
    assert sorted((r["config"]["workload"]["seed"], r["status"]) for r in recs) == [(1, "ok"), (2, "ok")], \
        [(r["config"]["workload"]["seed"], r["status"], r["env"].get("slurm_job")) for r in recs]
    new_jobs = study_jobs() - jobs_before
    assert len(new_jobs) == 2, (new_jobs, [o[-1500:] for o in outs])
    said = " ".join(" ".join(outs).split())
    assert "holds it" in said or "already ok" in said, said[-3000:]


# A run long enough to be caught mid-run (tiny takes tens of ms a step): SLURM's faults below land on it.
LONG_RUN = [o for o in SLURM_FAST if not o.startswith("workload.steps")] + ["workload.steps=300", "strategy=ddp",
                                                                              "parallel.dp=2"]


def _sweep(results, study: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "harness", "-m", "launcher=slurm", *LONG_RUN, f"study={study}", f"results_dir={results}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy())


def _running(results, study: str, timeout: float = 300) -> tuple[Path, str]:
    """The run dir and SLURM job of the study's run once its ranks have started (their log exists)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for log in (results / "runs" / study).glob("*.slurm*/workers.log"):
            time.sleep(3)  # into the timed steps
            return log.parent, log.parent.name.rsplit(".slurm", 1)[1]
        time.sleep(0.5)
    raise AssertionError(f"no run of study {study} started within {timeout:.0f} s")


def _start_now(cluster, job: str, timeout: float = 240) -> None:
    """SLURM holds a requeued job back (its begin time 2 min on): let it start now, once it is pending."""
    deadline = time.monotonic() + timeout
    while cluster.run("squeue", "-h", "-j", job, "-o", "%T").strip() != "PENDING":
        assert time.monotonic() < deadline, cluster.run("sacct", "-n", "-X", "-D", "-j", job)
        time.sleep(1)
    cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")


def _attempts(results, study: str) -> list[tuple[int, str, str]]:
    return [(r["env"].get("slurm_restarts"), r["status"], r["error"] or "") for r in records(results, study)]


def test_a_requeued_job_is_recorded_interrupted_and_runs_again(slurm_cluster, results):
    """`scontrol requeue` of a running job (what preemption in REQUEUE mode does): SLURM signals every
    process of the job and queues it again under the same id. The attempt is recorded `interrupted`,
    "preempted/requeued by SLURM (job J)", not `failed`; the job's second attempt runs the config to ok."""
    sweep = _sweep(results, "requeue")
    try:
        first_dir, job = _running(results, "requeue")
        slurm_cluster.run("scontrol", "requeue", job)
        _start_now(slurm_cluster, job)
        out, _ = sweep.communicate(timeout=420)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 0, out[-3000:]  # the config ended ok, in the job's second attempt
    (a0, s0, e0), (a1, s1, e1) = _attempts(results, "requeue")
    assert (a0, s0, a1, s1) == (0, "interrupted", 1, "ok"), _attempts(results, "requeue")
    assert e0.startswith(f"preempted/requeued by SLURM (job {job})"), e0
    assert {r["env"]["slurm_job"] for r in records(results, "requeue")} == {job}
    assert not _processes_with(str(first_dir)), "ranks of the requeued attempt are still running"


def _descendants(pids: list[int]) -> list[int]:
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) if proc.name.isdigit() else None
        except (OSError, IndexError, ValueError):
            continue
        if ppid is not None:
            children.setdefault(ppid, []).append(int(proc.name))
    out, todo = [], list(pids)
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def test_a_job_lost_with_its_node_says_which_node(slurm_cluster, results):
    """The node a job runs on dies: its slurmd and every process of the job are killed. SLURM marks the
    node down after SlurmdTimeout (60 s), ends the job NODE_FAIL and requeues it (JobRequeue=1, its
    default). The lost attempt is recorded `interrupted`, "node bnN failed (SLURM state NODE_FAIL)", by
    the job's next attempt, on the other node, which then runs the config to ok."""
    import signal

    sweep = _sweep(results, "nodefail")
    node = None
    try:
        run_dir, job = _running(results, "nodefail")
        node = slurm_cluster.run("squeue", "-h", "-j", job, "-o", "%N").strip()
        slurmd, = [p for n, p, e in _pids(slurm_cluster.state) if n == f"slurmd-{node}" and _alive(p, e)]
        os.kill(slurmd, signal.SIGKILL)
        ours = set(_processes_with(str(run_dir)))  # torchrun and the ranks name the run dir
        # this job's slurmstepd (another cluster on the machine may run a job of the same number)
        stepds = [p for p in _processes_with(f"slurmstepd: [{job}.") if ours & set(_descendants([p]))]
        assert stepds, f"no slurmstepd of job {job} above the run's processes"
        for pid in _descendants(stepds):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 240
        while "NODE_FAIL" not in slurm_cluster.run("sacct", "-n", "-X", "-D", "-P", "-j", job, "-o", "State"):
            assert time.monotonic() < deadline, "SLURM never declared the node failed"
            time.sleep(2)
        _start_now(slurm_cluster, job)
        out, _ = sweep.communicate(timeout=420)
    finally:
        if sweep.poll() is None:
            sweep.kill()
        if node:  # the node back, for the tests after this one
            up = _script("restart-node", node, env=slurm_cluster.env)
            slurm_cluster.pids = _pids(slurm_cluster.state)
            assert up.returncode == 0, up.stderr
    assert sweep.returncode == 0, out[-3000:]
    (a0, s0, e0), (a1, s1, e1) = _attempts(results, "nodefail")
    assert (a0, s0, a1, s1) == (0, "interrupted", 1, "ok"), _attempts(results, "nodefail")
    assert e0.startswith(f"node {node} failed (SLURM state NODE_FAIL)"), e0
    assert not _processes_with(str(run_dir)), "processes of the lost attempt are still running"


def test_cluster_stops_cleanly(slurm_cluster):
    """Last in this file: stop kills exactly the recorded daemons, and a second stop is a no-op."""
    stopped = _script("stop", env=slurm_cluster.env)
    assert stopped.returncode == 0, stopped.stderr
    left = [(n, p) for n, p, e in slurm_cluster.pids if _alive(p, e)]
    assert not left, left
    assert not (slurm_cluster.state / "pids").exists()
    assert _script("stop", env=slurm_cluster.env).returncode == 0
    assert _script("status", env=slurm_cluster.env).returncode == 1
