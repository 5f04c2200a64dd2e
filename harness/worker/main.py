"""The worker: what every rank runs under torchrun.

    python -m torch.distributed.run ... -m harness.worker <run_dir>     (harness/worker/__main__.py)

It reads the frozen, resolved config from <run_dir>/config.yaml (it never re-enters Hydra), builds
the mesh, the model and the strategy, runs the timed loop, and rank 0 writes
<run_dir>/measurement.json with every rank's figures. A rank that fails writes
<run_dir>/error_rank<r>.json (type, message, traceback) before re-raising, so the parent can say
why in the record; torchrun then stops the other ranks, so a crash never becomes a hang.
"""
from __future__ import annotations

import datetime
import io
import json
import os
import platform
import resource
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import NoReturn

from omegaconf import OmegaConf

from harness import rundir, strategies
from harness.collect.environment import rank_fingerprint
from harness.config import to_run_config
from harness.rundir import write_atomic
from harness.validate import num_microbatches, validate

# Imports inside functions: torch and what imports it, which the parent process never loads; importlib (the
# strategy module is named by the config).


def _write_json(path: Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=1))


def _environment(device) -> dict:
    import torch

    env = {"torch": torch.__version__, "hostname": socket.gethostname(), "device_type": device.type,
           "cpu_count": os.cpu_count()}
    # Under SLURM the node a rank ran on: two virtual nodes of one machine share a hostname.
    env["slurm_node"] = os.environ.get("SLURMD_NODENAME")
    env["slurm_job_nodelist"] = os.environ.get("SLURM_JOB_NODELIST")
    try:
        from importlib.metadata import version

        env["deepspeed"] = version("deepspeed")
    except Exception:  # noqa: BLE001 - deepspeed is optional for people who bring their own stack
        env["deepspeed"] = None

    env.update(rank_fingerprint(device))  # CUDA, NCCL, driver, GPUs, interconnect, SLURM job
    env["device_name"] = env["gpu_name"] if device.type == "cuda" else _cpu_name()
    return env


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass

    return platform.processor() or "cpu"


def main(run_dir: str) -> None:
    run_dir = Path(run_dir)
    rank = int(os.environ.get("RANK", "0"))
    try:
        _run(run_dir, rank)
    except BaseException as e:  # noqa: BLE001 - recorded, then re-raised for torchrun
        _write_json(run_dir / rundir.error_file(rank),
                    {"rank": rank, "time": time.time(), "type": type(e).__name__, "message": str(e)[:4000],
                     "out_of_memory": _is_oom(e), "traceback": traceback.format_exc()[-8000:]})
        raise


def _current_rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _host_rss_at_setup(strategy, device, rss_before_model: int) -> dict:
    """Peak host RSS of this rank at the end of setup (before the first step), beside its prediction:
    the RSS before the model was built (interpreter, torch, process groups: measured) + the bytes of
    the parameters this rank holds in host memory (its local shards on CPU; 0 on a GPU). Not
    modelled: the init's transient (a few row blocks of one parameter, models/gpt.py) and the
    allocator's slack."""
    from harness.worker import measure

    params = measure.tensor_bytes(strategy.state_tensors()["params"]) if device.type == "cpu" else 0
    return {"host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "host_peak_rss_predicted_bytes": rss_before_model + params}


def _slow_steps(strategy, pct: float, device) -> None:
    """slow_step_pct: a regression on purpose. Each training step, once done (device synchronised),
    busy-waits pct % of its own time, inside the timed region: the step is 1 + pct/100 times as long.
    A busy wait, not a sleep: the kernel's scheduler favours a process that slept, so on a loaded CPU a
    sleeping rank won the cores back from other jobs and computed faster (ddp dp2 at load 10 ran its
    steps faster with a 30 % sleep than without); a spinning rank competes as the work it stands for."""
    import torch

    step = strategy.train_step

    def slowed(microbatches):
        t0 = time.perf_counter()
        loss = step(microbatches)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        end = time.perf_counter()
        end += (end - t0) * pct / 100
        while time.perf_counter() < end:
            pass
        return loss

    strategy.train_step = slowed


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower()


def _process_start_unix() -> float:
    """When this process started (Linux: /proc/self/stat's start time after boot), so a run's
    start-up can be split at the worker's own beginning; the current time where /proc is absent."""
    try:
        after_boot = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + after_boot
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def _run(run_dir: Path, rank: int) -> None:
    stamps = {"process_start": _process_start_unix()}
    import torch
    import torch.distributed as dist

    from harness.worker.loop import run_steps
    from models.gpt import build_model

    stamps["imported"] = time.time()
    run = to_run_config(OmegaConf.load(run_dir / rundir.CONFIG))
    dims = validate(run)
    nmb = num_microbatches(run, dims)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if run.hardware.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    # The c10d flight recorder logs every collective (group, sizes) for the profiled window's byte
    # counts and axis attribution (harness/worker/measure.py); it must be sized before the group exists.
    # Only when there is a profiled window: otherwise it would cost every timed step for nothing.
    if run.workload.profile_steps > 0:
        from harness.worker.measure import FR_BUFFER_SIZE

        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FR_BUFFER_SIZE))
    # A collective that never completes (a lost peer) raises after this, instead of hanging.
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=max(60, run.launcher.timeout_s / 2)))
    assert dist.get_world_size() == dims.world_size, (dist.get_world_size(), dims.world_size)
    stamps["process_group"] = time.time()
    mesh = dims.build_mesh(device.type)
    stamps["mesh"] = time.time()

    rss_before_model = _current_rss_bytes()
    model = build_model(run.model, device="meta")  # the strategy shards it, then materialises its shards
    model.set_activation_checkpointing(run.workload.activation_checkpointing)
    strategy = strategies.load(run, dims)(run, dims, mesh, device, run_dir)
    stamps["model"] = time.time()
    strategy.setup(model)
    stamps["strategy"] = time.time()
    host = _host_rss_at_setup(strategy, device, rss_before_model)
    if run.workload.compile:  # in place, after wrapping/sharding: the strategy keeps its module
        strategy.model.compile()
    if run.fault == "crash_rank1" and rank == 1:
        raise RuntimeError("fault injection: rank 1 crashed on purpose (fault=crash_rank1)")
    if run.fault == "oom_rank1" and rank == 1:  # touch up to 4 GiB: the tests run it in a memory cgroup
        hog = [bytearray(64 << 20) for _ in range(64)]  # noqa: F841 - zero-filled, so every page is resident
        time.sleep(10**6)
    if run.fault == "hang_rank1" and rank == 1:
        time.sleep(10**6)
    if run.slow_step_pct:
        _slow_steps(strategy, run.slow_step_pct, device)

    progress_file = run_dir / rundir.PROGRESS

    def progress(done: int, total: int) -> None:
        if rank == 0:
            write_atomic(progress_file, f"{done} {total}")  # outside the timed region (loop.py)

    hooks = make_hooks(run, dims, run_dir, strategy)
    t0, start_unix = time.perf_counter(), time.time()
    result = run_steps(strategy, run, dims, nmb, device, progress=progress, hooks=hooks)
    result["loop_wall_s"] = time.perf_counter() - t0
    # wall-clock ends of the loop, comparable with the parent's clock: a run's fixed cost (start-up
    # before the first step, collection after the last) is what the rest of its wall time is
    result["loop_start_unix"], result["loop_end_unix"] = start_unix, time.time()
    # the worker's start-up by phase (wall-clock instants; `make bench` prints the intervals)
    result["startup_unix"] = stamps
    result["rank"] = rank
    result["memory"].update(host)
    result["coords"] = dims.coords(rank)
    result["env"] = _environment(device)
    result["num_threads"] = torch.get_num_threads()
    gathered = [None] * dims.world_size
    dist.all_gather_object(gathered, result)
    if rank == 0:
        _write_json(run_dir / rundir.MEASUREMENT, {"num_microbatches": nmb, "ranks": gathered})
    dist.barrier()
    dist.destroy_process_group()



def leave() -> NoReturn:
    """Exit 0 now, without the interpreter's teardown: what a rank process started by torchrun or srun
    (this worker, calibrate's collective and fabric timings) does once its result is written and its
    process group destroyed. The teardown after that can only cost time or fail:
      - functional collectives (DTensor's, and calibrate's IN_STEP timings) leave the gloo process group
        referenced past destroy_process_group, so its worker threads live on into the interpreter's
        finalization, and one that takes the GIL then aborts the process ("terminate called without an
        active exception", exit -6 after the main thread has left Python). calibrate's quick collective
        timings (2 gloo ranks) beside two busy processes: 2 aborts in 19 launches before this, none in 60
        with it;
      - it takes about 1 s per rank on a 2-core CPU (torchrun exits 2.1 s after destroy_process_group,
        1.1 s with this), which every run's fixed cost paid.
    A failure raised before this point keeps the normal exit, so torchrun sees its exit code and traceback."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

# -- hooks -----------------------------------------------------------------------------------------
# Hooks around the timed loop for measurements that must not distort the timings.
#
# A hook has before_step(step), after_step(step) (cheap: they run inside the loop, outside the timed
# region) and finish(strategy, batch, steps_done) -> dict merged into the rank's result (runs after the
# timed steps, e.g. a profiled window). Measurement features register here, not in the loop.

def make_hooks(run, dims, run_dir, strategy=None) -> list:
    hooks = []
    if grad_dump_enabled():  # the parity tests' gradient dump (before the first optimizer step)
        hooks.append(GradDump(strategy, run_dir))
    if run.workload.profile_steps > 0:
        from harness.worker.measure import ProfiledWindow

        hooks.append(ProfiledWindow(run, dims, run_dir))  # A/B and profiled steps, after the timed ones
    return hooks


# -- grad dump -------------------------------------------------------------------------------------
# Gradient dump for the parity tests: every parameter's full gradient of the first optimizer step.
#
# Enabled by the environment variable BRIGADE_GRAD_DUMP=1 (the test suite sets it; nothing in a
# config or a record changes). The hook wraps the step() of the strategy's stepping optimizer
# (`Strategy.stepping_optimizer`) once, before the first step: at the entry of that step() every
# gradient of step 0 is final (accumulated over the micro-batches, reduced over data parallel, the
# pipeline's stages done), and the optimizer has not yet read or freed it. There each rank calls
# `strategy.full_gradients()` (a collective: FSDP shards and TP slices are gathered, DeepSpeed's
# partitions assembled) and writes {single-process parameter name: fp32 tensor} to
# <run_dir>/grads_rank<r>.pt (harness/rundir.py); then the wrapper removes itself. Step 0 is a warm-up
# step (not timed), and the timed loop's code is the same with or without the hook.

GRAD_DUMP_ENV = "BRIGADE_GRAD_DUMP"


def grad_dump_enabled() -> bool:
    return os.environ.get(GRAD_DUMP_ENV, "") not in ("", "0")


class GradDump:
    def __init__(self, strategy, run_dir):
        import torch.distributed as dist


        self.path = Path(run_dir) / rundir.grads_file(dist.get_rank())
        optimizer = strategy.stepping_optimizer()
        original = optimizer.step

        def step(*args, **kwargs):
            optimizer.step = original  # once: later steps run the optimizer's own step()
            self._dump(strategy)
            return original(*args, **kwargs)

        optimizer.step = step  # an instance attribute: shadows the class's step() for this object only

    def _dump(self, strategy) -> None:
        import torch

        buf = io.BytesIO()
        torch.save(strategy.full_gradients(), buf)
        write_atomic(self.path, buf.getvalue())

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass

    def finish(self, strategy, batch, steps_done: int) -> dict:
        return {}
