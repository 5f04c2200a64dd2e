"""`python -m harness.calibrate --fabric` inside a SLURM allocation of N >= 2 nodes: the collectives across
the nodes, nccl-tests style, written as the fabric part of a measured profile (conf/hardware/fabric/,
harness/costmodel/fabric.py reads it).

    salloc -N 2 --ntasks-per-node=8 --gpus-per-node=8 python -m harness.calibrate --fabric hardware=h100_sxm
    salloc -N 2 python -m harness.calibrate --fabric --quick        # CPU: gloo, one rank a node

The parent starts one task per rank with srun (--ntasks-per-node G: the allocation's, else 1; on a GPU
profile one per device), each a process of the world N x G, rendezvous on the first node (env://,
MASTER_ADDR = its name). Every rank times every collective of calibrate (all_reduce, all_gather,
reduce_scatter, all_to_all, send/recv as a ring) at each message size over the whole world, the slowest
rank's median (harness/tools/calibrate_collectives.py _time_team). Sizes: a tensor-parallel activation of
one sequence at model=small's shape up to DDP's 25 MiB bucket, the sizes brigade's layouts hand the
fabric (--sizes to choose). The profile holds, per collective, the measured busbw per size at (N nodes, G
per node); the all-reduce's quickest call (its small-message time) as latency_us; send/recv's busbw at
the largest size as the rail rate (one rank's link to the next node). Written to conf/hardware/fabric/local/<name>.yaml
(ignored by git), selected as hardware/fabric=local/<name>.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from harness.config import CONF_DIR, compose_run
from harness.costmodel import comm
from harness.tools.calibrate_collectives import Team, _Progress, _time_team

# Imports inside functions: torch and what imports it, which the parent process never loads; launch.slurm,
# which only a SLURM allocation needs.

FABRIC_DIR = CONF_DIR / "hardware" / "fabric"
SIZES = (4096, 262144, 2**20, 4 * 2**20, 25 * 2**20)  # 256 KiB: model=small's b s h fp32 activation; 25 MiB: DDP
QUICK_SIZES = (4096, 262144, 2**20)


def worker(out_path: str, sizes: list[int], budget_s: float, backend: str) -> None:
    """One rank: the world from SLURM's task variables, every collective over it (rank 0 writes)."""
    import torch
    import torch.distributed as dist


    os.environ.setdefault("RANK", os.environ["SLURM_PROCID"])
    os.environ.setdefault("WORLD_SIZE", os.environ["SLURM_NTASKS"])
    os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    n = dist.get_world_size()
    progress = _Progress(out_path + ".progress", 5 * len(sizes), dist.get_rank())
    results = _time_team(Team(list(range(n)), None), sizes, budget_s, torch, device, progress, in_step=False)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps({"world_size": n, "results": results}))
    dist.barrier()
    dist.destroy_process_group()


def measure(nodes: int, per_node: int, sizes, budget_s: float, backend: str, timeout_s: float) -> dict:
    """srun the worker on nodes x per_node tasks; its results."""
    from launch.slurm import first_node

    with tempfile.TemporaryDirectory(prefix="brigade-fabric-", dir=os.environ.get("BRIGADE_FABRIC_TMP")) as tmp:
        out = Path(tmp) / "out.json"
        env = {**os.environ, "MASTER_ADDR": first_node(), "MASTER_PORT": str(_port()), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(CONF_DIR.parent) + (os.pathsep + os.environ["PYTHONPATH"]
                                                     if os.environ.get("PYTHONPATH") else "")}
        argv = ["srun", f"--nodes={nodes}", f"--ntasks-per-node={per_node}", f"--ntasks={nodes * per_node}",
                "--kill-on-bad-exit=1", sys.executable, "-m", "harness.tools.calibrate_fabric", "--worker",
                str(out), ",".join(map(str, sizes)), str(budget_s), backend]
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=CONF_DIR.parent, timeout=timeout_s)
        if proc.returncode or not out.exists():
            raise RuntimeError(f"srun of the fabric worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def _port() -> int:
    """A port every task agrees on without talking: from the job id, apart from launcher=slurm's."""
    return 30000 + int(os.environ["SLURM_JOB_ID"]) % 10000


def profile(name: str, nodes: int, per_node: int, nics: int, measured: dict, backend: str) -> dict:
    """The fabric profile of what measure() returned (conf/hardware/fabric/*.yaml's format)."""
    n = measured["world_size"]
    curves = {coll: [{"nodes": nodes, "gpus_per_node": per_node, "source": "calibrate",
                      "busbw_GBps": [[row["bytes"], round(comm.FACTOR[coll](n) * row["bytes"] / row["time_s"] / 1e9, 6)]
                                     for row in rows if row["time_s"] > 0]}]
              for coll, rows in measured["results"].items() if coll in comm.FACTOR}
    # the latency: the all-reduce's quickest call, its smallest message's unless a larger one measured
    # quicker (that median caught a loaded machine busy); fabric.py prices a size as the latency plus what
    # its measured time adds, so a latency above a measured time would price that point above it
    quickest = min((row for row in measured["results"]["all_reduce"] if row["time_s"] > 0), key=lambda row: row["time_s"])
    largest = max(measured["results"]["send_recv"], key=lambda row: row["bytes"])
    rail_GBps = largest["bytes"] / largest["time_s"] / 1e9
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    how = (f"python -m harness.calibrate --fabric on {nodes} nodes x {per_node} ranks ({backend}), SLURM job "
           f"{os.environ.get('SLURM_JOB_ID')} on {os.environ.get('SLURM_JOB_NODELIST')}, {when}")
    return {"name": name, "transport": backend, "in_network": False, "nics_per_node": nics,
            "rail_Gbps": round(rail_GBps * 8, 6), "latency_us": round(quickest["time_s"] * 1e6, 3),
            "latency_nodes": nodes, "latency_gpus_per_node": per_node, "curves": curves,
            "source": {"calibrate": how, "rails": f"send/recv busbw at {largest['bytes']} B in a ring over the nodes "
                       f"(one rank's link to the next node), {how}",
                       "latency_us": f"all_reduce of {quickest['bytes']} B (the quickest size), {how}",
                       "thin": f"one node count ({nodes}) and {per_node} ranks a node: other placements by "
                               f"harness/costmodel/fabric.py's rules"}}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.calibrate --fabric", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides; hardware=<node profile> (default cpu)")
    p.add_argument("--quick", action="store_true", help="3 sizes, short timings")
    p.add_argument("--sizes", default=None, help="comma-separated message sizes in bytes")
    p.add_argument("--nics", type=int, default=1, help="NICs (rails) per node the profile states")
    p.add_argument("--name", default=None, help="profile name (default <slurm cluster>_<nodes>n)")
    p.add_argument("--output", default=None, help="YAML path (default conf/hardware/fabric/local/<name>.yaml)")
    args = p.parse_intermixed_args(argv)
    if "SLURM_JOB_ID" not in os.environ or int(os.environ.get("SLURM_JOB_NUM_NODES", "1")) < 2:
        print(f"calibrate --fabric measures across nodes: run it inside a SLURM allocation of 2 or more nodes "
              f"(salloc -N 2 ...); here SLURM_JOB_NUM_NODES = {os.environ.get('SLURM_JOB_NUM_NODES', 'unset')}",
              file=sys.stderr)
        return 2

    hw = compose_run([*args.overrides, "logger=none"]).hardware
    nodes = int(os.environ["SLURM_JOB_NUM_NODES"])
    gpu = hw.device != "cpu"
    per_node = hw.devices_per_node if gpu else int(os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else list(QUICK_SIZES if args.quick else SIZES)
    name = args.name or f"{os.environ.get('SLURM_CLUSTER_NAME', socket.gethostname())}_{nodes}n"
    path = Path(args.output) if args.output else FABRIC_DIR / "local" / f"{name}.yaml"
    backend = "nccl" if gpu else "gloo"
    measured = measure(nodes, per_node, sizes, 0.05 if args.quick else 0.25, backend, timeout_s=900)

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(profile(path.stem, nodes, per_node, args.nics, measured, backend), sort_keys=False))
    print(f"wrote {path} (hardware/fabric={path.relative_to(FABRIC_DIR).with_suffix('') if path.is_relative_to(FABRIC_DIR) else path})")
    return 0


if __name__ == "__main__":
    from harness.worker.main import leave  # the rank's exit; the parent process never imports the worker

    if sys.argv[1:2] == ["--worker"]:
        out, sizes, budget, backend = sys.argv[2:6]
        worker(out, [int(s) for s in sizes.split(",")], float(budget), backend)
        leave()  # written and destroyed: no teardown beside gloo's threads (harness/worker/main.py leave)
    else:
        sys.exit(main(sys.argv[1:]))
