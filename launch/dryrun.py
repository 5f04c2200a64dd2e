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
tensor is a fake tensor with this rank's exact local shape and dtype. Then one training step of the
real `strategy.train_step` on this rank's real micro-batch shapes, under torch.distributed._tools'
MemTracker, which gives the peak of tensor memory in that step.
Model-state bytes are counted after the step by harness/worker/measure.py, as in a real run
(params, grads and AdamW state exist then; AdamW's state is created by that step's optimizer.step()).
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
import weakref
from pathlib import Path

from harness import strategies
from harness.run import record
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
                             "oom": False, "traceback": e.child_traceback[-8000:]}
                    record.write_atomic(run_dir / record.error_file(rank), json.dumps(error, indent=1))
                    return LaunchResult(1, False, time.monotonic() - t0, log_path)
                log.write(f"rank {rank}: {result['wall_s']:.2f} s\n")
                results[rank] = result
                record.write_atomic(run_dir / record.PROGRESS, f"{len(results)} {len(ranks)}")
            if on_poll:
                on_poll()
    measurement = {"kind": "dryrun", "num_microbatches": num_microbatches(run, dims),
                   "ranks": [results[r] for r in ranks]}
    record.write_atomic(run_dir / record.MEASUREMENT, json.dumps(measurement, indent=1))
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
        out.update(_one_step(strategy, mbs))
        out["memory"] = measure.model_state_bytes(strategy.state_tensors())
    out["memory"].update(out.pop("peak", {}))
    dist.destroy_process_group()
    out["wall_s"] = time.monotonic() - t0
    return out


def _one_step(strategy, mbs) -> dict:
    """One real train_step, counting the bytes of every tensor storage it allocates -> its peak; on
    failure, grads by hand so the optimizer state still exists."""
    import torch

    from harness.worker import measure

    start = measure.model_state_bytes(strategy.state_tensors())["model_states_bytes"]  # params at rest
    try:
        with PeakBytes() as tracker:
            strategy.train_step(mbs)
        return {"peak": {"peak_mem_bytes": start + tracker.peak, "peak_mem_kind": "fake_tensor_storages"}}
    except Exception as e:  # noqa: BLE001 - reported in the record; the state bytes still follow
        for p in strategy.model.parameters():
            p.grad = torch.zeros_like(p)
        strategy.optimizer_step()
        return {"measured": {"dryrun_step_error": f"{type(e).__name__}: {str(e)[:500]}"}}


def _peak_bytes_mode():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.weak import WeakIdKeyDictionary

    from harness.worker import measure

    class PeakBytesMode(TorchDispatchMode):
        """Live bytes of the storages created since entry (each counted once, until it is freed) and
        their peak. torch.distributed._tools' MemTracker/FSDPMemTracker do this with per-module
        attribution but refuse a module that runs twice in one step ("multiple iterative calls"), i.e.
        any gradient accumulation or pipeline schedule (torch 2.13), hence this plain counter.
        FSDP2 frees a gathered parameter by resizing its storage to 0 bytes and gathers into it again
        by resizing it back (UntypedStorage.resize_, which no dispatch mode sees): the counter follows
        those resizes too, else every unit's gathered parameters would count as held to the step's end."""

        def __init__(self):
            super().__init__()
            self.live, self.current, self.peak = WeakIdKeyDictionary(), 0, 0

        def _free(self, size):
            self.current -= size[0]

        def _resized(self, st, nbytes: int) -> None:
            size = self.live.get(st)
            if size is None:  # created before entry: counted from its first resize on
                self.live[st] = size = [0]
                weakref.finalize(st, self._free, size)
            self.current += nbytes - size[0]
            size[0] = nbytes
            self.peak = max(self.peak, self.current)

        def __enter__(self):
            resize, mode = torch.UntypedStorage.resize_, self

            def tracked_resize(st, nbytes):
                out = resize(st, nbytes)
                mode._resized(st, st.nbytes())
                return out

            self._resize, torch.UntypedStorage.resize_ = resize, tracked_resize
            return super().__enter__()

        def __exit__(self, *exc):
            torch.UntypedStorage.resize_ = self._resize
            return super().__exit__(*exc)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if not isinstance(t, torch.Tensor):
                    continue
                st = measure.local_tensor(t).untyped_storage()
                if st in self.live:
                    continue
                self.live[st] = size = [st.nbytes()]
                self.current += size[0]
                weakref.finalize(st, self._free, size)
                self.peak = max(self.peak, self.current)
            return out

    return PeakBytesMode


def PeakBytes():
    return _peak_bytes_mode()()
