"""A record's `env`: where it came from. The parent's side (parent_env: the code's commit and whether it
was dirty, the packages' versions, the host), each rank's fingerprint and the run's, folded from the
ranks' (environment)."""
from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_GIT = (["rev-parse", "HEAD"], ["status", "--porcelain", "--untracked-files=no"])
_git_probe: list = []


def start_git_probe() -> None:
    """Ask git for the commit and dirty state now (as the ranks start: the code that runs), so that
    the record after the run does not wait for it (git status: ~0.1 s of a run's fixed cost)."""
    try:
        _git_probe[:] = [subprocess.Popen(["git", "-C", str(REPO), *a], stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True) for a in _GIT]
    except OSError:
        _git_probe.clear()


def _git_state() -> tuple[str | None, bool | None]:
    """The probe's answers (started now if no run started one); None, None without git."""
    if not _git_probe:
        start_git_probe()
    procs, _git_probe[:] = list(_git_probe), []
    try:
        commit, status = (p.communicate(timeout=5)[0] for p in procs)
    except (ValueError, subprocess.SubprocessError):  # ValueError: no probe (git missing)
        for p in procs:
            p.kill()
        return None, None
    return commit.strip() or None, bool(status.strip())


def parent_env() -> dict:
    def v(pkg):
        try:
            return version(pkg)
        except PackageNotFoundError:
            return None

    commit, dirty = _git_state()
    return {"python": platform.python_version(), "torch": v("torch"), "deepspeed": v("deepspeed"),
            "hostname": socket.gethostname(), "platform": platform.platform(), "git_commit": commit,
            "git_dirty": dirty, "brigade": v("brigade"), **host_fingerprint()}


def run_environment(ranks: list[dict]) -> dict:
    """The run's env from every rank's: the first rank's, with hosts, nodes and the merged fingerprint."""
    env = dict(ranks[0]["env"])
    env["hosts"] = sorted({r["env"]["hostname"] for r in ranks})
    env["num_hosts"] = len(env["hosts"])
    # Nodes: SLURM's node names where there are any (virtual nodes share a hostname), else hosts.
    node_of = [r["env"].get("slurm_node") or r["env"]["hostname"] for r in ranks]
    env["nodes"] = sorted(set(node_of))
    env["num_nodes"] = len(env["nodes"])
    env.pop("slurm_node", None)  # per rank, not per run: the list above holds them all
    for key in ("gpu_name", "gpu_count"):  # per node, in `gpus` (merge_fingerprints)
        env.pop(key, None)
    env.update(merge_fingerprints([r["env"] for r in ranks], node_of))
    return env


# -- fingerprint -----------------------------------------------------------------------------------
# The environment fingerprint of a run: what must match before two measurements are compared, and
# what `harness.compare` and the index print when it does not.
#
# Each rank reports its own (`rank_fingerprint`, in the worker, torch imported): CUDA, NCCL, the NVIDIA
# driver, the GPUs its node shows, the interconnect where the machine lets it be read, and the SLURM job.
# The parent folds the ranks into one (`merge`): GPU name and count per node. A field that cannot be
# read is null, and `unavailable` says why (a CPU build of torch has no CUDA; a laptop has no SLURM job):
# never a guess.

# the fields `harness.compare` lists when two records files differ in them, in this order
COMPARED = ("torch", "cuda", "nccl", "driver", "gpus", "num_nodes", "interconnect", "cluster",
            "git_commit", "git_dirty")
_NVIDIA_VERSION = Path("/proc/driver/nvidia/version")
_IB = Path("/sys/class/infiniband")


def _run(cmd: list[str]) -> str | None:
    """A short read-only command's output, None when it is absent or fails (5 s at most)."""
    if not shutil.which(cmd[0]):
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def driver_version() -> tuple[str | None, str | None]:
    """(version, None) or (None, why): the kernel module's own line, else nvidia-smi's answer."""
    try:
        for word in _NVIDIA_VERSION.read_text().split():
            if word[:1].isdigit() and word.count(".") >= 1:
                return word, None
    except OSError:
        pass
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if smi:
        return smi.splitlines()[0].strip(), None
    return None, f"no NVIDIA driver ({_NVIDIA_VERSION} absent, no nvidia-smi)"


def interconnect() -> tuple[dict | None, str | None]:
    """({"infiniband": [{"device", "port", "rate", "state"}], "nvlink": <nvidia-smi topo -m>}, None),
    with only what this node shows, or (None, why) when it shows neither."""
    out: dict = {}
    ports = []
    for port in sorted(_IB.glob("*/ports/*")) if _IB.is_dir() else []:
        def read(name, p=port):
            try:
                return (p / name).read_text().strip()
            except OSError:
                return None
        ports.append({"device": port.parts[-3], "port": port.name, "rate": read("rate"), "state": read("state"),
                      "link_layer": read("link_layer")})
    if ports:
        out["infiniband"] = ports
    topo = _run(["nvidia-smi", "topo", "-m"])
    if topo:
        out["gpu_topology"] = topo  # NV# = NVLink hops, SYS/PHB/PIX = PCIe paths, per GPU pair
    if out:
        return out, None
    return None, f"no InfiniBand device under {_IB} and no nvidia-smi topology"


def slurm() -> tuple[dict, dict]:
    """The SLURM job, partition and cluster from the job's environment; reasons when not under SLURM."""
    job = os.environ.get("SLURM_JOB_ID")
    got = {"slurm_job_id": job, "slurm_partition": os.environ.get("SLURM_JOB_PARTITION"),
           "slurm_cluster": os.environ.get("SLURM_CLUSTER_NAME")}
    why = "not a SLURM job (no SLURM_JOB_ID)" if job is None else "SLURM did not set it"
    return got, {k: why for k, v in got.items() if v is None}


def host_fingerprint() -> dict:
    """What the parent reads without torch, so that a record no rank wrote (invalid, failed at launch)
    still names its machine; the ranks' fingerprint replaces it when they ran."""
    got: dict = {"cuda": None, "nccl": None, "gpus": None}
    why = {k: "read by the ranks, and no rank reported" for k in got}
    got["driver"], reason = driver_version()
    got["interconnect"], reason2 = interconnect()
    why.update({k: r for k, r in (("driver", reason), ("interconnect", reason2)) if r})
    s, s_why = slurm()
    got.update(s)
    why.update(s_why)
    got["cluster"] = s["slurm_cluster"] or socket.gethostname()
    if not s["slurm_cluster"]:
        why["cluster"] = _NO_CLUSTER
    got["unavailable"] = why
    return got


_NO_CLUSTER = "no SLURM cluster name: the first node's hostname stands for it"


def rank_fingerprint(device) -> dict:
    """This rank's fingerprint (in the worker: torch is imported here)."""
    import torch

    got: dict = {}
    why: dict = {}
    got["cuda"] = torch.version.cuda
    if got["cuda"] is None:
        why["cuda"] = f"torch {torch.__version__} is a build without CUDA"
    if device.type == "cuda":
        got["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        got["gpu_name"] = torch.cuda.get_device_name(device)
        got["gpu_count"] = torch.cuda.device_count()
    else:
        got["nccl"] = got["gpu_name"] = None
        got["gpu_count"] = torch.cuda.device_count() if got["cuda"] else 0
        why["nccl"] = f"device {device.type}: NCCL runs only with CUDA devices"
        why["gpu_name"] = f"device {device.type}: no GPU in use"
    got["driver"], reason = driver_version()
    if reason:
        why["driver"] = reason
    got["interconnect"], reason = interconnect()
    if reason:
        why["interconnect"] = reason
    s, s_why = slurm()
    got.update(s)
    why.update(s_why)
    got["unavailable"] = why
    return got


def merge_fingerprints(rank_envs: list[dict], nodes: list[str]) -> dict:
    """The run's fingerprint from every rank's: the first rank's fields, GPU name and count per node,
    and the cluster (SLURM's name for it, else the first node's host)."""
    first = rank_envs[0]
    gpus: dict[str, dict] = {}
    for env, node in zip(rank_envs, nodes):
        gpus.setdefault(node, {"gpu_name": env.get("gpu_name"), "gpu_count": env.get("gpu_count")})
    out = {"gpus": gpus or None, "cluster": first.get("slurm_cluster") or first.get("hostname")}
    if not first.get("slurm_cluster"):
        out.setdefault("unavailable", dict(first.get("unavailable") or {}))
        out["unavailable"]["cluster"] = _NO_CLUSTER
    return out
