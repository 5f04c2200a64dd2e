"""launcher=dryrun: the real worker code path at any world size, on torch's fake process group.

For each selected rank (default: the first rank of every pipeline-rank group, harness/dims.py's placement;
`launcher.ranks=[...]` to choose), a child forked from one fork server (launch/fork.py; never more
children than selected ranks, as many at once as there are cores) does what harness/worker/main.py does:

    init_process_group("fake", FakeStore(), rank, world_size)   no socket, collectives are no-ops
    dims.build_mesh("cpu")                                      the real (pp, dp, tp) DeviceMesh
    build_model(device="meta") -> strategy.setup(model)         the same parallelize code, TP/FSDP/
                                                                pipeline split on meta, then the
                                                                strategy's materialize()
under FakeTensorMode, so materialising allocates nothing: every parameter, gradient and optimizer
tensor is a fake tensor with this rank's exact local shape and dtype. Then two training steps of the
real `strategy.train_step` on this rank's real micro-batch shapes, under harness/worker/measure.py's
LiveTensors, which gives the peak of the tensor storages alive, its step and phase, and what was live
then (the first step has no optimizer state until its end; the second is every later step).
Model-state bytes are counted after the first step by harness/worker/measure.py, as in a real run
(params, grads and AdamW state exist then).
If the step itself cannot run on fake tensors (reported in measured.dryrun_step_error), grads are
set to zeros_like(param) and only the optimizer step runs, so the state bytes are still exact.

The result is an ordinary measurement (measurement.json, kind "dryrun") that harness/collect/dryrun.py
turns into the record's `measured`; no step time exists, so no time is reported.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

from harness import rundir, strategies
from harness.validate import num_microbatches
from launch.fork import ChildError, Forked
from launch.local import LaunchResult

# Imports inside functions: torch and what imports it, which the parent process never loads.


def selected_ranks(run, dims) -> list[int]:
    if run.launcher.ranks:
        return sorted(set(int(r) for r in run.launcher.ranks))
    return [p * dims.dp * dims.tp for p in range(dims.pp)]


def execute(run, dims, run_dir: Path, log_path: Path, on_poll=None) -> LaunchResult:
    t0 = time.monotonic()
    ranks, results = selected_ranks(run, dims), {}
    pending, running = list(ranks), {}
    # simulated ranks are independent: as many at once as this process may use cores (each child
    # runs torch on one thread), so a 4-stage dry run takes one stage's time on 4 free cores
    slots = max(1, len(os.sched_getaffinity(0)))
    with open(log_path, "w") as log, _killing(running):
        while pending or running:
            while pending and len(running) < slots:
                rank = pending.pop(0)
                running[rank] = Forked(simulate_rank, run, dims, rank)
            finished = [r for r, child in running.items() if child.done(0.2)]
            if time.monotonic() - t0 > run.launcher.timeout_s and not finished:
                log.write(f"ranks {sorted(running)}: timed out\n")
                return LaunchResult(None, True, time.monotonic() - t0, log_path)
            for rank in finished:
                try:
                    result = running.pop(rank).result()
                except ChildError as e:
                    log.write(f"rank {rank}: {e}\n{e.child_traceback}\n")
                    error = {"rank": rank, "time": time.time(), "type": e.kind, "message": e.message[:4000],
                             "out_of_memory": False, "traceback": e.child_traceback[-8000:]}
                    rundir.write_atomic(run_dir / rundir.error_file(rank), json.dumps(error, indent=1))
                    return LaunchResult(1, False, time.monotonic() - t0, log_path)
                log.write(f"rank {rank}: {result['wall_s']:.2f} s\n")
                results[rank] = result
                rundir.write_atomic(run_dir / rundir.PROGRESS, f"{len(results)} {len(ranks)}")
            if on_poll:
                on_poll()
    measurement = {"kind": "dryrun", "num_microbatches": num_microbatches(run, dims),
                   "ranks": [results[r] for r in ranks]}
    rundir.write_atomic(run_dir / rundir.MEASUREMENT, json.dumps(measurement, indent=1))
    return LaunchResult(0, False, time.monotonic() - t0, log_path)


@contextlib.contextmanager
def _killing(running: dict):
    """Take the children still running down with the launcher (timeout, error, Ctrl-C)."""
    try:
        yield
    finally:
        for child in running.values():
            child.kill()


def simulate_rank(run, dims, rank: int) -> dict:
    """In the forked child: rank `rank` of the config on the fake backend (see the module docstring)."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from harness.worker import measure
    from harness.worker.loop import local_microbatches
    from models.gpt import build_model

    t0 = time.monotonic()
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    device = torch.device("cpu")
    mesh = dims.build_mesh(device.type)
    model = build_model(run.model, device="meta")
    model.set_activation_checkpointing(run.workload.activation_checkpointing)
    strategy = strategies.load(run, dims)(run, dims, mesh, device, None)
    nmb = num_microbatches(run, dims)
    # real token ids of this rank's micro-batches, made before the fake mode (they are inputs)
    mbs = local_microbatches(0, run, dims.coords(rank)["dp"], dims.dp, nmb, device)
    out = {"rank": rank, "coords": dims.coords(rank), "num_threads": 1,
           "env": {"torch": torch.__version__, "hostname": socket.gethostname(), "device_type": "fake",
                   "device_name": "torch fake process group + FakeTensorMode", "cpu_count": None}}
    # Meshes and sharding run as in a real run (on meta); only allocation and the step are fake.
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    strategy.allocation = lambda: fake
    strategy.setup(model)
    with fake:
        out.update(_steps(strategy, mbs))
        if "memory" not in out:  # the step failed: the states as they are after the optimizer step
            out["memory"] = measure.model_state_bytes(strategy.state_tensors())
    out["memory"].update(out.pop("peak", {}))
    dist.destroy_process_group()
    out["wall_s"] = time.monotonic() - t0
    return out


def _steps(strategy, mbs) -> dict:
    """Two real train_steps, counting the bytes of every tensor storage they hold -> the peak. Two: the
    first has no optimizer state until its end and makes FSDP's lazy-init copies, the second is every
    later step. On failure, grads by hand so the optimizer state still exists."""
    import torch

    from harness.worker import measure

    try:
        tracker = measure.LiveTensors(strategy.model, strategy.state_tensors())
        with tracker:
            loss = strategy.train_step(mbs)  # kept, as the loop keeps every step's loss for its statistics
        tracker.next_step()
        # the model-state bytes after the first step, between the counted steps, as the real loop takes them
        # (harness/worker/loop.py): an engine that captured its states during the step (DeepSpeed) lets them
        # go here, not a step later
        states = measure.model_state_bytes(strategy.state_tensors())
        with tracker:
            strategy.train_step(mbs)
        del loss
        live = tracker.summary()
        return {"memory": states,
                "peak": {"peak_mem_bytes": live.pop("peak_bytes"), "peak_mem_kind": "fake_tensor_storages", **live}}
    except Exception as e:  # noqa: BLE001 - reported in the record; the state bytes still follow
        for p in strategy.model.parameters():
            p.grad = torch.zeros_like(p)
        strategy.optimizer_step()
        return {"measured": {"dryrun_step_error": f"{type(e).__name__}: {str(e)[:500]}"}}
