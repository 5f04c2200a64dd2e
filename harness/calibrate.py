"""`python -m harness.calibrate hardware=cpu`: measure this machine's constants and write a hardware
profile for it: conf/hardware/local/cpu_<hostname>.yaml (ignored by git, so a record's git_dirty stays
false), selected as `hardware=local/cpu_<hostname>`. conf/hardware/cpu_calibrated.yaml is the committed
profile of the machine this repository's reference figures come from.

    python -m harness.calibrate hardware=cpu                  # ~1-2 minutes
    python -m harness.calibrate hardware=cpu --quick          # a few seconds: fewer sizes, 2 ranks only
    python -m harness.calibrate hardware=cpu --name my_box --output /some/dir/hardware/my_box.yaml
    python -m harness.calibrate hardware=h100_sxm             # on a GPU: its GEMMs by shape, memory,
                                                              # element-wise ops, attention (~2 minutes;
                                                              # harness/tools/calibrate_gpu.py)
    salloc -N 2 python -m harness.calibrate --fabric          # inside a SLURM allocation: the collectives across
                                                              # its nodes, a fabric profile (calibrate_fabric.py)

What is measured (the methods of all_reduce_bench and mamf-finder in stas00/ml-engineering, nccl-tests
definitions; the collectives part is harness/tools/calibrate_collectives.py, launched and fitted by
calibrate_collectives_fit.py):
  - memory bandwidth of one device: STREAM triad a = b + s*c on one thread, the median of repeats ->
    memory_bw_GBps (the cost model's memory-bound work: element-wise ops, gradient accumulation, AdamW).
  - matmul rate of one device: an (n x n) @ (n x n) product, 2n^3 FLOP, on one thread (a CPU device
    is one core: launch/local.py runs one thread per rank); fp32, and bf16 briefly (slow where the
    CPU has no bf16 units). The best over repeats -> achievable_tflops.
  - the GEMM rate by shape, sustained (an nn.Linear's three training GEMMs per shape, each the median of
    interleaved rounds of several calls), and the per-operator dispatch cost (harness/tools/calibrate_compute.py)
    -> compute.gemm.<dtype>.shapes and compute.op_dispatch_us (harness/costmodel/compute.py reads them).
  - the element-wise operators' bandwidth and the SDPA kernel's fraction of peak on brigade's own model
    (harness/tools/calibrate_elementwise.py) -> compute.elementwise_GBps, compute.attention_efficiency.fp32 and
    compute.attention_backward_efficiency.fp32 (the fused kernel's forward and backward timed apart).
  - DTensor's dispatch per operator at tp 2 and the DTensor operators of a block, of the rest of the
    model and of the AdamW step, and how a block's operator grows at model=small's tensors (priced against
    the kernels just measured) (harness/tools/calibrate_dtensor.py) -> compute.dtensor; FSDP2's host
    work per block, micro-batch and step (harness/tools/calibrate_fsdp.py) -> compute.fsdp2.
  - how much slower a core computes (GEMMs) and streams memory while every core does
    (harness/tools/calibrate_corun.py) -> compute.corun.
  - collectives on gloo, launched with torchrun at 2 and 4 ranks (--quick: 2), message sizes
    4 B ... 64 MB: all_reduce, all_gather, reduce_scatter, all_to_all, send_recv (a ring: each rank
    sends to r+1 and receives from r-1); and all_reduce_in_step, all_gather_in_step and
    reduce_scatter_in_step, tensor parallelism's collectives as a step meets them (with and without
    sequence parallelism; harness/tools/calibrate_collectives.py IN_STEP: the time DTensor's
    functional collective adds to a burst of each rank's own compute). At 4 ranks every one of these is
    timed a second time over the two pairs of ranks at once, as a dp 2 x tp 2 step's 2-rank collectives
    meet the node's other ranks (collectives.<name>."2@4"). For a message of S bytes and time t (the
    slowest rank's median over iterations): algbw = S / t, busbw = algbw * factor, factor 2(n-1)/n for
    all_reduce, (n-1)/n for all_gather / reduce_scatter / all_to_all, 1 for send_recv.
  - the α-β fit: t(S) = α + factor * S / B, least squares in relative error over the sizes (so the
    small messages pin α, the large ones B). B and α go to collectives.<name>."<n>" as bus_bw_GBps
    and latency_us (with the per-size busbw curve), the pairs' to collectives.<name>."2@4"; intra_node
    takes all_reduce at 2 ranks.
The written profile is composed and validated (a `single` config on it is predicted) before this
command reports success.
"""
from __future__ import annotations

import argparse
import platform
import re
import socket
import statistics
import sys
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from harness.config import CONF_DIR, as_dict, compose_run, register_configs, to_run_config
from harness.costmodel import predict
from harness.tools import (
    calibrate_corun,
    calibrate_dtensor,
    calibrate_elementwise,
    calibrate_fabric,
    calibrate_fsdp,
    calibrate_gpu,
)
from harness.tools.calibrate_collectives import COLLECTIVES, IN_STEP
from harness.tools.calibrate_collectives_fit import run_collectives, tables
from harness.tools.calibrate_compute import cpu_clock
from harness.tools.calibrate_compute import measure as measure_compute
from harness.validate import validate

# Imports inside functions: torch and what imports it, which the parent process never loads; Hydra (only the
# parent composes configs).

HW_DIR = CONF_DIR / "hardware"
LOCAL = "local"  # conf/hardware/local/: this machine's calibrated profiles, ignored by git (.gitignore)

FULL = {"ranks": (2, 4), "sizes": (4, 4096, 262144, 4 * 2**20, 64 * 2**20), "budget_s": 0.25,
        "matmul_n": 1024, "matmul_reps": 12, "bf16_n": 512, "bf16_reps": 4, "triad_mib": 64, "triad_reps": 12,
        "dtensor_rounds": 30, "corun_rounds": 3, "corun_window_s": 1.0, "elementwise_rounds": 7}
QUICK = {"ranks": (2,), "sizes": (4, 65536, 2**20), "budget_s": 0.05, "matmul_n": 512, "matmul_reps": 3,
         "bf16_n": 128, "bf16_reps": 1, "triad_mib": 16, "triad_reps": 3,
         "dtensor_rounds": 3, "corun_rounds": 1, "corun_window_s": 0.2, "elementwise_rounds": 1}


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
    """STREAM triad (McCalpin 1995) a = b + s*c on one thread, 3 arrays of `mib` MiB: the median GB/s
    over `reps` in this thread's CPU time (STREAM reports the best time; the median is the sustained figure a training step's
    element-wise work meets, as for the GEMM sweep, harness/tools/calibrate_compute.py). The bandwidth
    memory-bound work (element-wise ops, AdamW) gets on one device."""
    import torch

    torch.set_num_threads(1)
    n = mib * 2**20 // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    torch.add(b, c, alpha=3.0, out=a)  # warm-up: pages touched
    times = []
    for _ in range(reps):
        t0 = cpu_clock()
        torch.add(b, c, alpha=3.0, out=a)
        times.append(cpu_clock() - t0)
    return 3 * 4 * n / statistics.median(times) / 1e9


def calibrate(base_hw: dict, name: str, mode: dict, console=None) -> dict:
    """Measure and return the new profile (a plain dict in the HardwareConfig schema)."""
    console = console or Console(stderr=True)
    per_run = len(COLLECTIVES) * len(mode["sizes"])
    steps = 6 + per_run * len(mode["ranks"])
    collectives: dict = {name_: {} for name_ in (*COLLECTIVES, *IN_STEP.values())}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as bar:
        task = bar.add_task("matmul fp32", total=steps)
        fp32 = matmul_tflops("fp32", mode["matmul_n"], mode["matmul_reps"])
        bar.update(task, advance=1, description="matmul bf16")
        bf16 = matmul_tflops("bf16", mode["bf16_n"], mode["bf16_reps"])
        bar.update(task, advance=1, description="memory bandwidth (triad)")
        mem_bw = triad_GBps(mode["triad_mib"], mode["triad_reps"])
        bar.update(task, advance=1, description="GEMM sweep, dispatch")
        compute, compute_source = measure_compute(mode is QUICK)
        # a datasheet peak below what was just measured is wrong for this CPU: never report MFU > 100 %
        achievable = {"fp32": round(fp32, 5), "bf16": round(bf16, 5)}
        peak = {k: max(v, achievable.get(k, 0.0)) for k, v in dict(base_hw["peak_tflops"]).items()}
        bar.update(task, description="element-wise ops and attention (model=small)")
        compute.update(calibrate_elementwise.measure(mode["elementwise_rounds"], peak["fp32"]))
        bar.update(task, advance=1, description="DTensor dispatch (tp 2, fake group)")
        so_far = {**dict(base_hw), "peak_tflops": peak, "achievable_tflops": achievable,
                  "memory_bw_GBps": mem_bw, "compute": compute, "collectives": {}}  # prices kappa
        compute["dtensor"] = calibrate_dtensor.measure(mode["dtensor_rounds"], so_far)
        compute["fsdp2"] = calibrate_fsdp.measure(mode["dtensor_rounds"])
        bar.update(task, advance=1, description=f"co-running ({base_hw['devices_per_node']} cores at once)")
        compute["corun"] = calibrate_corun.measure(base_hw["devices_per_node"], mode["corun_rounds"],
                                                   mode["corun_window_s"])
        bar.update(task, advance=1)
        for i, n in enumerate(mode["ranks"]):
            bar.update(task, description=f"collectives at {n} ranks")
            base = 6 + i * per_run
            res = run_collectives(n, mode["sizes"], mode["budget_s"],
                                  lambda d, t, base=base: bar.update(task, completed=base + per_run * d / t))
            for coll, by_key in tables(res).items():
                collectives[coll].update(by_key)
            bar.update(task, completed=base + per_run)
    import torch

    ar2 = collectives["all_reduce"][str(mode["ranks"][0])]
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
        "compute": compute,
        "precisions": list(base_hw["precisions"]),
        "source": {
            "calibrated": f"python -m harness.calibrate hardware={base_hw['name']}"
                          f"{' --quick' if mode is QUICK else ''} on {platform.node()} at {when}",
            "achievable_tflops": f"best of {mode['matmul_reps']} fp32 {mode['matmul_n']}^3 and {mode['bf16_reps']} "
                                 f"bf16 {mode['bf16_n']}^3 matmuls, one thread (torch {torch.__version__})",
            "collectives": "gloo via torchrun, nccl-tests busbw; α-β fit t = α + factor*S/B per collective and "
                           "group size (relative least squares); sizes in bytes",
            "intra_node": f"all_reduce at {mode['ranks'][0]} ranks (fit)",
            "memory_bw_GBps": f"median STREAM triad of {mode['triad_reps']} over 3 x {mode['triad_mib']} MiB fp32, one thread",
            "inter_node": "same as intra_node: one machine (local SLURM 'nodes' share its loopback)",
            "peak_tflops": (base_hw.get("source", {}).get("peak_tflops", f"from hardware={base_hw['name']}")
                            + (f"; raised to the measured rate for {', '.join(raised)} (this CPU is faster than "
                               f"hardware={base_hw['name']} assumes)" if raised else "")),
            "memory_GiB": f"from hardware={base_hw['name']}",
            **compute_source,
            "compute.dtensor": calibrate_dtensor.SOURCE.format(rounds=mode["dtensor_rounds"]),
            "compute.fsdp2": calibrate_fsdp.SOURCE.format(rounds=mode["dtensor_rounds"]),
            "compute.elementwise_GBps": calibrate_elementwise.SOURCE.format(
                model=calibrate_elementwise.MODEL, mb=calibrate_elementwise.MICRO_BATCH, rounds=mode["elementwise_rounds"]),
            "compute.corun": calibrate_corun.SOURCE.format(window_s=mode["corun_window_s"], rounds=mode["corun_rounds"]),
        },
    }


def write_profile(profile: dict, path: Path, command: str) -> None:
    header = (f"# Measured by `{command}` (harness/calibrate.py); regenerate rather than edit.\n"
              f"# collectives.<name>.\"<ranks>\": α-β fit (bus_bw_GBps, latency_us) and the measured busbw per size;\n"
              f"# \"2@<ranks>\": the same over pairs of ranks, all <ranks> ranks timing their pairs at once.\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(profile, sort_keys=False, allow_unicode=True, width=110))


def hardware_option(path: Path) -> str:
    """What `hardware=` selects the profile at `path` with: its path under conf/hardware without .yaml
    (`local/cpu_myhost`), or its file name for a profile in another `hardware` folder."""
    path = Path(path).resolve()
    if path.is_relative_to(HW_DIR.resolve()):
        return path.relative_to(HW_DIR.resolve()).with_suffix("").as_posix()
    return path.stem


def default_name(base: str) -> str:
    """`<base>_<host>`: a profile per machine, so calibrating never rewrites a tracked file."""
    return f"{base}_{re.sub(r'[^A-Za-z0-9_-]', '_', socket.gethostname().split('.')[0])}"


def check_profile(path: Path) -> dict:
    """Compose `hardware=<name>` from the profile's folder and predict a `single` run on it."""
    from hydra import compose, initialize_config_dir

    register_configs()
    conf = CONF_DIR
    overrides = ["strategy=single", "model=tiny", f"hardware={hardware_option(path)}"]
    if not path.resolve().is_relative_to(HW_DIR.resolve()):  # a profile elsewhere: add its folder's parent
        overrides.append(f"hydra.searchpath=[file://{path.parent.parent.resolve()}]")
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        run = to_run_config(compose("config", overrides=overrides))
    return predict(run, validate(run))


def _group(key: str) -> str:
    """A collectives key in words: "4" -> "4 ranks", "2@4" -> "pairs of 4 ranks at once"."""
    n, _, among = key.partition("@")
    return f"pairs of {among} ranks at once" if among else f"{n} ranks"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--fabric" in argv:  # inside a SLURM allocation of several nodes: the fabric part (calibrate_fabric.py)
        return calibrate_fabric.main([a for a in argv if a != "--fabric"])
    p = argparse.ArgumentParser(prog="python -m harness.calibrate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides; hardware=<base profile> (default cpu)")
    p.add_argument("--quick", action="store_true", help="a few seconds: 2 ranks, 3 sizes, short matmuls")
    p.add_argument("--name", default=None, help="profile name (default <base>_<hostname>)")
    p.add_argument("--output", default=None, help="YAML path (default conf/hardware/local/<name>.yaml, ignored by "
                                                  "git, selected as hardware=local/<name>); elsewhere its folder "
                                                  "must be named hardware to compose")
    args = p.parse_intermixed_args(argv)

    base = as_dict(compose_run(args.overrides))["hardware"]
    gpu = base["device"] != "cpu"
    if gpu:
        import torch

        if not torch.cuda.is_available():
            print(f"hardware={base['name']} is a {base['device']} profile: calibrate measures it on a CUDA device, "
                  f"and torch {torch.__version__} here sees none (a CPU build, or no GPU). Calibrate a CPU with "
                  f"hardware=cpu", file=sys.stderr)
            return 2
    name = args.name or default_name(base["name"])
    path = Path(args.output) if args.output else HW_DIR / LOCAL / f"{name}.yaml"
    name = path.stem  # `hardware=<stem>` is how it is composed
    if path.parent.name != "hardware" and not path.resolve().is_relative_to(HW_DIR.resolve()):  # before measuring
        p.error(f"--output {path}: a profile composes as hardware=<name> only from a folder named hardware, "
                f"e.g. --output {path.parent / 'hardware' / path.name}")
    t0 = time.monotonic()
    if gpu:
        profile = calibrate_gpu.calibrate(base, name, calibrate_gpu.QUICK if args.quick else calibrate_gpu.FULL)
    else:
        profile = calibrate(base, name, QUICK if args.quick else FULL)
    command = "python -m harness.calibrate " + " ".join(argv)
    write_profile(profile, path, command.strip())
    pred = check_profile(path)
    if gpu:
        print(calibrate_gpu.summary(profile, base, f"wrote {path} in {time.monotonic() - t0:.0f} s; composes as "
                                    f"hardware={hardware_option(path)}", pred))
        return 0
    ar = profile["collectives"]["all_reduce"]
    print(f"wrote {path} in {time.monotonic() - t0:.0f} s: fp32 {profile['achievable_tflops']['fp32'] * 1e3:.1f} "
          f"GFLOP/s, bf16 {profile['achievable_tflops']['bf16'] * 1e3:.2f} GFLOP/s per device; all_reduce "
          + ", ".join(f"{_group(n)} {v['bus_bw_GBps']:.3f} GB/s busbw, {v['latency_us']:.0f} us" for n, v in ar.items())
          + f"; memory {profile['memory_bw_GBps']:.1f} GB/s; composes as hardware={hardware_option(path)} (single model=tiny predicted {pred['step_time_s'] * 1e3:.1f} ms/step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
