"""`python -m harness.calibrate hardware=cpu`: measure this machine's constants and write a hardware
profile (conf/hardware/cpu_calibrated.yaml, usable as `hardware=cpu_calibrated`).

    python -m harness.calibrate hardware=cpu                  # ~1-2 minutes
    python -m harness.calibrate hardware=cpu --quick          # a few seconds: fewer sizes, 2 ranks only
    python -m harness.calibrate hardware=cpu --name my_box --output /some/dir/my_box.yaml

What is measured (stas00/ml-engineering's all_reduce_bench and mamf-finder, nccl-tests definitions):
  - memory bandwidth of one device: STREAM triad a = b + s*c on one thread -> memory_bw_GBps (the
    cost model's memory-bound work: element-wise ops, gradient accumulation, AdamW).
  - matmul rate of one device: an (n x n) @ (n x n) product, 2n^3 FLOP, on one thread (a CPU device
    is one core: launch/local.py runs one thread per rank); fp32, and bf16 briefly (slow where the
    CPU has no bf16 units). The best over repeats -> achievable_tflops.
  - collectives on gloo, launched with torchrun at 2 and 4 ranks (--quick: 2), message sizes
    4 B ... 64 MB: all_reduce, all_gather, reduce_scatter, all_to_all, send_recv (a ring: each rank
    sends to r+1 and receives from r-1). For a message of S bytes and time t (the slowest rank's,
    averaged over iterations): algbw = S / t, busbw = algbw * factor, factor 2(n-1)/n for
    all_reduce, (n-1)/n for all_gather / reduce_scatter / all_to_all, 1 for send_recv.
  - the α-β fit: t(S) = α + factor * S / B, least squares in relative error over the sizes (so the
    small messages pin α, the large ones B). B and α go to collectives.<name>."<n>" as bus_bw_GBps
    and latency_us (with the per-size busbw curve); intra_node takes all_reduce at 2 ranks.
The written profile is composed and validated (a `single` config on it is predicted) before this
command reports success.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HW_DIR = REPO / "conf" / "hardware"
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
          "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
          "send_recv": lambda n: 1.0}
FULL = {"ranks": (2, 4), "sizes": (4, 4096, 262144, 4 * 2**20, 64 * 2**20), "budget_s": 0.25,
        "matmul_n": 1024, "matmul_reps": 12, "bf16_n": 512, "bf16_reps": 4, "triad_mib": 64, "triad_reps": 12}
QUICK = {"ranks": (2,), "sizes": (4, 65536, 2**20), "budget_s": 0.05, "matmul_n": 512, "matmul_reps": 3,
         "bf16_n": 128, "bf16_reps": 1, "triad_mib": 16, "triad_reps": 3}


# -- the worker: one process per rank under torchrun ---------------------------------------------

def _buffers(coll: str, size: int, n: int, torch):
    """(callable, bytes as nccl-tests counts them) for one message size."""
    import torch.distributed as dist

    elems = max(1, size // 4)
    if coll in ("all_gather", "reduce_scatter", "all_to_all"):
        elems = max(n, elems // n * n)  # divisible into n equal chunks
    rank = dist.get_rank()
    if coll == "all_reduce":
        x = torch.ones(elems)
        return (lambda: dist.all_reduce(x)), 4 * elems
    if coll == "all_gather":  # S = the gathered output
        out, inp = torch.empty(elems), torch.ones(elems // n)
        return (lambda: dist.all_gather_into_tensor(out, inp)), 4 * elems
    if coll == "reduce_scatter":  # S = the input
        out, inp = torch.empty(elems // n), torch.ones(elems)
        return (lambda: dist.reduce_scatter_tensor(out, inp)), 4 * elems
    if coll == "all_to_all":  # S = one rank's buffer
        out, inp = torch.empty(elems), torch.ones(elems)
        return (lambda: dist.all_to_all_single(out, inp)), 4 * elems
    send, recv = torch.ones(elems), torch.empty(elems)

    def ring():
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, (rank + 1) % n),
                                       dist.P2POp(dist.irecv, recv, (rank - 1) % n)])
        for r in reqs:
            r.wait()
    return ring, 4 * elems


def _slowest(t: float, torch) -> float:
    import torch.distributed as dist

    x = torch.tensor([t], dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return float(x.item())


def worker(out_path: str, sizes: list[int], budget_s: float, progress_path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    results: dict = {}
    done, total = 0, len(COLLECTIVES) * len(sizes)
    for coll in COLLECTIVES:
        for size in sizes:
            fn, nbytes = _buffers(coll, size, n, torch)
            fn()  # warm-up (connection set-up, allocation)
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            first = _slowest(time.perf_counter() - t0, torch)
            iters = int(min(50, max(2, budget_s / max(first, 1e-6))))  # the same count on every rank
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            t = _slowest((time.perf_counter() - t0) / iters, torch)
            results.setdefault(coll, []).append({"bytes": nbytes, "time_s": t, "iters": iters})
            done += 1
            if rank == 0:
                Path(progress_path).write_text(f"{done} {total}")
    if rank == 0:
        Path(out_path).write_text(json.dumps({"world_size": n, "results": results}))
    dist.barrier()
    dist.destroy_process_group()


# -- the parent ---------------------------------------------------------------------------------

def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Fit t = α + x / B to (x = factor * bytes, t seconds), least squares in relative error:
    minimise Σ ((α + x_i β - t_i) / t_i)^2 over α >= 0 and β = 1/B > 0. Returns (α s, B bytes/s)."""
    w = [1.0 / t**2 for _, t in points]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
    st = sum(wi * t for wi, (_, t) in zip(w, points))
    sxt = sum(wi * x * t for wi, (x, t) in zip(w, points))
    det = sw * sxx - sx * sx
    if det <= 0:
        x, t = max(points)
        return 0.0, x / t
    alpha = (sxx * st - sx * sxt) / det
    beta = (sw * sxt - sx * st) / det
    if alpha < 0 or beta <= 0:  # refit the constrained edge: α = 0 (β from the weighted ratio)
        alpha = max(alpha, 0.0)
        beta = max(sum(wi * x * (t - alpha) for wi, (x, t) in zip(w, points)) / sxx, 1e-15)
    return alpha, 1.0 / beta


def matmul_tflops(dtype_name: str, n: int, reps: int) -> float:
    """Best rate of an n x n matmul on one thread over `reps` repeats, TFLOP/s (mamf-finder reports
    the maximum achievable: on a shared machine the best repeat is the one that was not preempted)."""
    import torch

    torch.set_num_threads(1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / min(times) / 1e12


def triad_GBps(mib: int, reps: int) -> float:
    """STREAM triad (McCalpin 1995) a = b + s*c on one thread, 3 arrays of `mib` MiB: best GB/s over
    `reps` (STREAM reports the best time). The bandwidth memory-bound work (element-wise ops, AdamW)
    gets on one device."""
    import torch

    torch.set_num_threads(1)
    n = mib * 2**20 // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    torch.add(b, c, alpha=3.0, out=a)  # warm-up: pages touched
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        times.append(time.perf_counter() - t0)
    return 3 * 4 * n / min(times) / 1e9


def run_collectives(n: int, sizes, budget_s: float, on_poll) -> dict:
    """Start the worker on n ranks with torchrun; return its results."""
    with tempfile.TemporaryDirectory(prefix="brigade-calibrate-") as tmp:
        out, progress = Path(tmp) / "out.json", Path(tmp) / "progress"
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(REPO) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                "-m", "harness.calibrate", "_worker", str(out), ",".join(map(str, sizes)), str(budget_s), str(progress)]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
        t0 = time.monotonic()
        while proc.poll() is None:
            try:
                done, total = map(int, progress.read_text().split())  # may be mid-write: skip then
                on_poll(done, total)
            except (OSError, ValueError):
                pass
            if time.monotonic() - t0 > 600:
                proc.kill()
                raise RuntimeError(f"collective calibration at {n} ranks took over 600 s")
            time.sleep(0.2)
        log = proc.stdout.read().decode(errors="replace")
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"torchrun at {n} ranks failed (exit {proc.returncode}):\n{log[-3000:]}")
        return json.loads(out.read_text())


def summarise(coll: str, n: int, rows: list[dict]) -> dict:
    f = FACTOR[coll](n)
    alpha, bw = fit_alpha_beta([(f * r["bytes"], r["time_s"]) for r in rows])
    return {"bus_bw_GBps": round(bw / 1e9, 4), "latency_us": round(alpha * 1e6, 1),
            "busbw_GBps_by_bytes": {str(r["bytes"]): round(f * r["bytes"] / r["time_s"] / 1e9, 4) for r in rows},
            "time_us_by_bytes": {str(r["bytes"]): round(r["time_s"] * 1e6, 1) for r in rows}}


def calibrate(base_hw: dict, name: str, mode: dict, console=None) -> dict:
    """Measure and return the new profile (a plain dict in the HardwareConfig schema)."""
    import platform

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console(stderr=True)
    per_run = len(COLLECTIVES) * len(mode["sizes"])
    steps = 3 + per_run * len(mode["ranks"])
    collectives: dict = {name_: {} for name_ in COLLECTIVES}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as bar:
        task = bar.add_task("matmul fp32", total=steps)
        fp32 = matmul_tflops("fp32", mode["matmul_n"], mode["matmul_reps"])
        bar.update(task, advance=1, description="matmul bf16")
        bf16 = matmul_tflops("bf16", mode["bf16_n"], mode["bf16_reps"])
        bar.update(task, advance=1, description="memory bandwidth (triad)")
        mem_bw = triad_GBps(mode["triad_mib"], mode["triad_reps"])
        bar.update(task, advance=1)
        for i, n in enumerate(mode["ranks"]):
            bar.update(task, description=f"collectives at {n} ranks")
            base = 3 + i * per_run
            res = run_collectives(n, mode["sizes"], mode["budget_s"],
                                  lambda d, t, base=base: bar.update(task, completed=base + d))
            for coll, rows in res["results"].items():
                collectives[coll][str(n)] = summarise(coll, n, rows)
            bar.update(task, completed=base + per_run)
    import torch

    ar2 = collectives["all_reduce"][str(mode["ranks"][0])]
    achievable = {"fp32": round(fp32, 5), "bf16": round(bf16, 5)}
    # a datasheet peak below what was just measured is wrong for this CPU: never report MFU > 100 %
    peak = {k: max(v, achievable.get(k, 0.0)) for k, v in dict(base_hw["peak_tflops"]).items()}
    raised = sorted(k for k in peak if peak[k] > base_hw["peak_tflops"][k])
    link = {"bus_bw_GBps": ar2["bus_bw_GBps"], "latency_us": ar2["latency_us"]}
    when = time.strftime("%Y-%m-%d %H:%M:%S %z")
    return {
        "name": name,
        "device": base_hw["device"],
        "devices_per_node": base_hw["devices_per_node"],
        "memory_GiB": base_hw["memory_GiB"],
        "peak_tflops": peak,
        "achievable_tflops": achievable,
        "intra_node": link,
        "inter_node": dict(link),
        "collectives": collectives,
        "memory_bw_GBps": round(mem_bw, 3),
        "precisions": list(base_hw["precisions"]),
        "source": {
            "calibrated": f"python -m harness.calibrate hardware={base_hw['name']}"
                          f"{' --quick' if mode is QUICK else ''} on {platform.node()} at {when}",
            "achievable_tflops": f"best of {mode['matmul_reps']} fp32 {mode['matmul_n']}^3 and {mode['bf16_reps']} "
                                 f"bf16 {mode['bf16_n']}^3 matmuls, one thread (torch {torch.__version__})",
            "collectives": "gloo via torchrun, nccl-tests busbw; α-β fit t = α + factor*S/B per collective and "
                           "group size (relative least squares); sizes in bytes",
            "intra_node": f"all_reduce at {mode['ranks'][0]} ranks (fit)",
            "memory_bw_GBps": f"best STREAM triad over 3 x {mode['triad_mib']} MiB fp32, one thread",
            "inter_node": "same as intra_node: one machine (local SLURM 'nodes' share its loopback)",
            "peak_tflops": (base_hw.get("source", {}).get("peak_tflops", f"from hardware={base_hw['name']}")
                            + (f"; raised to the measured rate for {', '.join(raised)} (this CPU is faster than "
                               f"hardware={base_hw['name']} assumes)" if raised else "")),
            "memory_GiB": f"from hardware={base_hw['name']}",
        },
    }


def write_profile(profile: dict, path: Path, command: str) -> None:
    import yaml

    header = (f"# Measured by `{command}` (harness/tools/calibrate.py); regenerate rather than edit.\n"
              f"# collectives.<name>.\"<ranks>\": α-β fit (bus_bw_GBps, latency_us) and the measured busbw per size.\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(profile, sort_keys=False, allow_unicode=True, width=110))


def check_profile(path: Path) -> dict:
    """Compose `hardware=<name>` from the profile's folder and predict a `single` run on it."""
    from hydra import compose, initialize_config_dir

    from harness.config import register_configs, to_run_config
    from harness.costmodel import predict
    from harness.validate import validate

    register_configs()
    conf = REPO / "conf"
    overrides = ["strategy=single", "model=tiny", f"hardware={path.stem}"]
    if path.parent.resolve() != (conf / "hardware").resolve():  # a profile elsewhere: add its folder's parent
        overrides.append(f"hydra.searchpath=[file://{path.parent.parent.resolve()}]")
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        run = to_run_config(compose("config", overrides=overrides))
    return predict(run, validate(run))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        worker(argv[1], [int(x) for x in argv[2].split(",")], float(argv[3]), argv[4])
        return 0
    p = argparse.ArgumentParser(prog="python -m harness.calibrate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides; hardware=<base profile> (default cpu)")
    p.add_argument("--quick", action="store_true", help="a few seconds: 2 ranks, 3 sizes, short matmuls")
    p.add_argument("--name", default=None, help="profile name (default <base>_calibrated)")
    p.add_argument("--output", default=None, help="YAML path (default conf/hardware/<name>.yaml); its folder "
                                                  "must be named hardware to compose")
    args = p.parse_intermixed_args(argv)
    from harness.config import compose_run
    from harness.config import as_dict

    base = as_dict(compose_run(args.overrides))["hardware"]
    if base["device"] != "cpu":
        print(f"calibrate runs collectives on gloo and matmuls on this CPU; hardware={base['name']} is "
              f"{base['device']}: calibrate a cpu profile", file=sys.stderr)
        return 2
    name = args.name or f"{base['name']}_calibrated"
    path = Path(args.output) if args.output else HW_DIR / f"{name}.yaml"
    if path.stem != name:
        name = path.stem  # `hardware=<stem>` is how it is composed
    t0 = time.monotonic()
    profile = calibrate(base, name, QUICK if args.quick else FULL)
    command = "python -m harness.calibrate " + " ".join(argv)
    write_profile(profile, path, command.strip())
    pred = check_profile(path)
    ar = profile["collectives"]["all_reduce"]
    print(f"wrote {path} in {time.monotonic() - t0:.0f} s: fp32 {profile['achievable_tflops']['fp32'] * 1e3:.1f} "
          f"GFLOP/s, bf16 {profile['achievable_tflops']['bf16'] * 1e3:.2f} GFLOP/s per device; all_reduce "
          + ", ".join(f"{n} ranks {v['bus_bw_GBps']:.3f} GB/s busbw, {v['latency_us']:.0f} us" for n, v in ar.items())
          + f"; memory {profile['memory_bw_GBps']:.1f} GB/s; composes as hardware={name} (single model=tiny predicted {pred['step_time_s'] * 1e3:.1f} ms/step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
