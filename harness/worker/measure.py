"""Measurement primitives: device-synchronised step timing, exact local tensor bytes, peak memory.

Model-state memory is counted as the exact bytes of the tensors a rank holds (a DTensor counts its
local shard), which shows sharding exactly; process RSS on CPU does not (allocator caching, the full
model built before sharding), so it is reported only as a labelled sanity figure.
"""
from __future__ import annotations

import json
import resource
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from harness import rundir
from harness.collect import trace_analysis
from harness.dims import COMM_AXES
from harness.rundir import write_atomic
from harness.strategies.base import local_tensor, tensor_bytes

# Imports inside functions: the parts of torch, DeepSpeed and brigade that only some strategies, devices or
# modes use.


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# What a storage is counted as, by the phase that created it (LiveTensors): after the model's forward
# comes the loss (on a pipeline's last stage; elsewhere the stage's send)
TOP_OPS = 12  # the operators whose storages hold most at the peak, kept in the record
KIND_OF_PHASE = {"forward": "forward", "after": "loss", "backward": "backward", "optimizer": "optimizer"}


class LiveTensors(TorchDispatchMode):
    """The live bytes of the tensor storages a step creates, their peak, and what was live at the peak.

    One accounting for a dry run (fake tensors, launch/dryrun.py) and a real run (its first step,
    harness/worker/loop.py): every storage an operator creates counts from its creation until it is
    freed, each once. FSDP2 frees a gathered parameter by resizing its storage to 0 bytes and gathers
    into it again by resizing it back (UntypedStorage.resize_, which no dispatch mode sees): the counter
    follows those resizes too. torch.distributed._tools' MemTracker attributes per module but refuses a
    module that runs twice in one step (any gradient accumulation or pipeline schedule, torch 2.13).

    At the peak it keeps the step's phase (the module whose forward or backward ran last, the loss
    after the model's forward, or the optimizer) and the operator that allocated the peak's last
    storage, and the live bytes by the phase that created them: `forward` (activations, and the
    model's temporaries; a recomputed block's too), `loss` (what the loss made after the model's forward),
    `backward` (gradients and backward's temporaries), `optimizer` (its state,
    created by the first step) and `gathered` (storages resized back: FSDP's unsharded parameters), and
    by the operator that made them (the TOP_OPS largest).
    Model states that exist before the step count as `at_rest` until they are freed; other storages
    made before entry (DDP's buckets, the batch) are not counted."""

    def __init__(self, model=None, resident: dict | None = None):
        super().__init__()
        self.live, self.current, self.peak = WeakIdKeyDictionary(), 0, 0
        self.by_kind: dict[str, int] = {}
        self.by_op: dict[str, int] = {}
        self.peak_at: dict = {}
        self.phase, self.step = "step start", 1
        self._aliasing = False
        self.names = {id(m): n or "model" for n, m in model.named_modules()} if model is not None else {}
        # mark(): per step, the segments between marks, each with its bytes at its start and at its highest
        # (a shortened pipeline step's actions, harness/strategies/pp_shorten.py); None: not kept
        self.segments: list[list[dict]] | None = None
        self._segment: dict | None = None
        # The model states that exist before the step (Strategy.state_tensors(): params, grads, optimizer
        # state), counted as `at_rest` until freed: zero_grad(set_to_none) frees last step's grads.
        for tensors in (resident or {}).values():
            for t in tensors:
                t = local_tensor(t)
                if t is None or t.device.type == "meta":
                    continue
                st = t.untyped_storage()
                if st not in self.live:
                    self.live[st] = slot = [0, "at_rest", "at rest"]
                    weakref.finalize(st, self._free, slot)
                    slot[0] = st.nbytes()
                    self._count(slot, slot[0], "at rest")

    def next_step(self) -> None:
        """The next step begins (a peak then says which step it was in)."""
        self.step += 1
        self.phase = "step start"
        if self.segments is not None:
            self.segments.append([])
            self.mark(("gap",))

    def keep_segments(self) -> None:
        """From now on keep, per step, what each segment between two marks held (see mark)."""
        self.segments = [[]]
        self.mark(("gap",))

    def mark(self, label: tuple) -> None:
        """A new segment begins (a pipeline action, or the gap after one): its label, the bytes live at its
        start by kind and by operator, and, as it runs, its highest bytes and what was live then."""
        if self.segments is None:
            return
        self._segment = {"label": label, "start": self.current, "start_by_kind": dict(self.by_kind),
                         "start_by_op": dict(self.by_op), "max": self.current, "at": self._here("mark")}
        self.segments[-1].append(self._segment)

    def _here(self, op: str) -> dict:
        return {"phase": self.phase, "op": op, "live_by_kind": dict(self.by_kind), "live_by_op": dict(self.by_op)}

    def _count(self, slot: list, delta: int, op: str) -> None:
        """slot: [bytes, kind, the operator that made the storage]; op: what changed it now."""
        self.current += delta
        self.by_kind[slot[1]] = self.by_kind.get(slot[1], 0) + delta
        self.by_op[slot[2]] = self.by_op.get(slot[2], 0) + delta
        if self.current > self.peak:
            self.peak = self.current
            self.peak_at = {"step": self.step, **self._here(op)}
        if self._segment is not None and self.current > self._segment["max"]:
            self._segment["max"], self._segment["at"] = self.current, self._here(op)

    def _free(self, slot):
        self._count(slot, -slot[0], "free")

    def _resized(self, st, nbytes: int) -> None:
        slot = self.live.get(st)
        if slot is None:  # created before entry: counted from its first resize on
            self.live[st] = slot = [0, "gathered", "resize_"]
            weakref.finalize(st, self._free, slot)
        delta, slot[0] = nbytes - slot[0], nbytes
        self._count(slot, delta, "resize_")

    def _hook(self, label: str):
        def hook(module, *_):
            if id(module) in self.names:
                self.phase = f"{label} {self.names[id(module)]}"
        return hook

    def __enter__(self):
        resize, mode = torch.UntypedStorage.resize_, self

        def tracked_resize(st, nbytes):
            out = resize(st, nbytes)
            mode._resized(st, st.nbytes())
            return out

        self._resize, torch.UntypedStorage.resize_ = resize, tracked_resize
        hooks = torch.nn.modules.module
        root = self.names and next(iter(self.names))
        after = self._hook("after forward of")
        self._handles = [
            hooks.register_module_forward_pre_hook(self._hook("forward")),
            hooks.register_module_forward_hook(lambda m, *a: after(m) if id(m) == root else None),
            register_optimizer_step_pre_hook(lambda *_: setattr(self, "phase", "optimizer"))]
        # Backward: a saved tensor carries the phase it was saved in; unpacking it in backward names the
        # module whose backward runs. (Global module backward hooks would wrap every module's output and
        # break torch's split backward of the zero-bubble pipeline schedules.)
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saved.__enter__()
        return super().__enter__()

    def _pack(self, t):
        # A detached alias: the same storage without the tensor's grad_fn. Packing `t` itself would close
        # a reference cycle through autograd's C++ graph wherever a node saves its own output (sdpa, the
        # RMSNorm kernel): a graph that no backward runs through (torch's pipeline metadata inference on
        # the first stage) would then never be freed, which no run without this counter does.
        self._aliasing = True
        try:
            return t.detach(), self.phase
        finally:
            self._aliasing = False

    def _unpack(self, packed):
        t, phase = packed
        self.phase = "backward" + phase.removeprefix("forward") if phase.startswith("forward") else "backward"
        return t

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        for h in self._handles:
            h.remove()
        self._saved.__exit__(*exc)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._aliasing:  # _pack's alias: its storage is counted where it was made, or not at all
            return out
        kind = KIND_OF_PHASE.get(self.phase.split()[0], "forward")
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = local_tensor(t).untyped_storage()
            if st in self.live:
                continue
            op = str(func).removesuffix(".default")
            self.live[st] = slot = [st.nbytes(), kind, op]
            weakref.finalize(st, self._free, slot)
            self._count(slot, slot[0], op)
        return out

    def summary(self) -> dict:
        """The peak, when it came and what was live then."""
        at = self.peak_at
        return {"peak_bytes": self.peak, "peak_step": at.get("step"), "peak_phase": at.get("phase"),
                "peak_op": at.get("op"), "peak_live_by_kind": {k: v for k, v in at.get("live_by_kind", {}).items() if v},
                "peak_live_by_op": dict(sorted(((k, v) for k, v in at.get("live_by_op", {}).items() if v),
                                               key=lambda kv: -kv[1])[:TOP_OPS])}


def model_state_bytes(state: dict[str, list]) -> dict[str, int]:
    out = {f"{k}_bytes": tensor_bytes(v) for k, v in state.items()}
    out.setdefault("params_bytes", 0)
    out.setdefault("grads_bytes", 0)
    out.setdefault("optimizer_bytes", 0)
    out["model_states_bytes"] = sum(out.values())
    return out


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, int | str]:
    if device.type == "cuda":
        return {"peak_mem_bytes": torch.cuda.max_memory_allocated(device),
                "peak_mem_reserved_bytes": torch.cuda.max_memory_reserved(device),
                "peak_mem_kind": "cuda_max_allocated", **nvml_memory(device)}
    # Linux reports ru_maxrss in KiB. Whole-process peak RSS, not tensor memory: a sanity figure.
    return {"peak_mem_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_mem_kind": "cpu_peak_rss"}


def nvml_memory(device: torch.device) -> dict[str, int]:
    """Device memory in use as NVML sees it (allocator reserve + CUDA context + other processes),
    read once after the timed steps (torch.cuda.device_memory_used maps CUDA_VISIBLE_DEVICES to
    NVML's index); {} without nvidia-ml-py, which is optional (`pip install nvidia-ml-py`)."""
    try:
        return {"device_mem_used_nvml_bytes": int(torch.cuda.device_memory_used(device))}
    except Exception:  # noqa: BLE001 - NVML is a cross-check, never a reason to fail a run
        return {}


class Clock:
    """Time of a region with the device synchronised at both ends. On CUDA the elapsed time is the
    device's, from CUDA events recorded around the region (what the GPU spent, launch gaps
    included); the host wall time is kept as `host_elapsed`. On CPU both are the wall time."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        synchronize(self.device)
        if self.device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.events[1].record()
        synchronize(self.device)
        self.host_elapsed = self.elapsed = time.perf_counter() - self.t0
        if self.device.type == "cuda":
            self.elapsed = self.events[0].elapsed_time(self.events[1]) / 1e3  # ms -> s
        return False


# -- profiling -------------------------------------------------------------------------------------
# The profiled window: after the timed steps and apart from them, on every rank.
#
#     A/B:      max(3, profile_steps) pairs of steps, alternating with gradient sync and without it
#               (strategy.sync_disabled(); DDP no_sync, FSDP set_requires_gradient_sync(False)),
#               timed like the loop times them, no profiler: the exposed cost of gradient sync is
#               (T_sync - T_nosync) / T_sync, the honest figure where overlap is not free (2 CPU cores)
#     profile:  one warm-up step, then profile_steps steps under torch.profiler, each step in a
#               record_function("brigade/step"); the Chrome trace goes to <run_dir>/trace_rank<r>.json
#               (open it in Perfetto) with the flight recorder's entries for those steps and the
#               process-group table, so harness/collect/trace_analysis.py can attribute every collective to
#               an axis and count its bytes
#
# The profiler slows steps 1.3-3x on CPU (docs/notes.md#profiler-cost): nothing here is ever inside the timed steps.
# The c10d flight recorder (TORCH_FR_BUFFER_SIZE, set by the worker before the process group exists)
# records every collective with its process group and sizes; on gloo it does not record send/recv.

FR_BUFFER_SIZE = 20_000  # flight-recorder ring buffer (entries); the worker exports it before init
# Gradient-sync groups counted as dp traffic: dp_rep (replicas of an ep group sync expert grads), the
# HSDP shard group, and with context parallel the dp x cp groups FSDP / DDP reduce over
DATA_GROUPS = ("dp", "dp_rep", "dp_shard", "dp_shard_cp", "dp_cp")
AB_MIN_PAIRS = 3  # A/B step pairs at least: a median of 3 resists one noisy step


def flight_recorder_dump() -> list[dict]:
    """Every entry the flight recorder holds, oldest first, fields we use only."""
    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_nccl_trace_json", None) if torch.cuda.is_available() else None
    dump = dump or getattr(c10d, "_dump_fr_trace_json", None)
    if dump is None:
        return []
    try:
        entries = json.loads(dump(includeCollectives=True, onlyActive=False)).get("entries", [])
    except Exception:  # noqa: BLE001 - no recorder (buffer size 0) means no entries, not a failed run
        return []
    keep = ("record_id", "profiling_name", "process_group", "input_sizes", "output_sizes", "input_dtypes",
            "output_dtypes", "time_created_ns", "is_p2p", "collective_seq_id")
    return [{k: e.get(k) for k in keep} for e in entries]


def next_record_id() -> int:
    """The record id the flight recorder gives its next entry (ids count every entry ever made, so a
    step's entries are the ids between the values read before and after it, whatever the clocks say)."""
    entries = flight_recorder_dump()
    return entries[-1]["record_id"] + 1 if entries else 0


def process_groups(mesh, dims) -> dict[str, dict]:
    """Every process group this rank is in: name -> {ranks, axes}. Axes by identity with the mesh's
    groups first (what strategies use), else by rank set against ParallelDims.groups (groups an
    engine made itself, e.g. DeepSpeed's), else "world" for a group spanning several axes."""
    from torch.distributed import distributed_c10d as c10d

    rank = dist.get_rank()
    by_identity: dict[str, list[str]] = {}
    # data groups first: one that is also a mesh axis' group (dp x cp at dp = 1 is the cp axis' ranks)
    # carries gradient traffic; context parallel's K/V exchange has a group of its own (strategies/cp.py)
    for dim in (*DATA_GROUPS, *(mesh.mesh_dim_names or ())) if mesh is not None else ():
        try:
            name = c10d._get_process_group_name(mesh[dim].get_group())
        except Exception:  # noqa: BLE001 - an axis this mesh does not have
            continue
        axis = "dp" if dim in DATA_GROUPS else dim
        if mesh[dim].size() > 1 and axis not in by_identity.get(name, []):
            by_identity.setdefault(name, []).append(axis)
    out = {}
    for pg in list(c10d._world.pg_names):
        name = c10d._get_process_group_name(pg)
        ranks = sorted(dist.get_process_group_ranks(pg))
        axes = by_identity.get(name) or [a for a in COMM_AXES if getattr(dims, a) > 1 and any(
            sorted(g) == ranks for g in dims.groups(a) if rank in g)]
        if not axes and dims.ep > 1 and any(sorted(g) == ranks for g in dims.groups("ep_dp") if rank in g):
            axes = ["dp"]  # an engine's own expert-data group (DeepSpeed MoE): expert gradients are dp traffic
        if not axes and len(ranks) > 1:
            axes = ["world"] if len(ranks) == dims.world_size else ["other"]
        out[name] = {"ranks": ranks, "axes": axes, "desc": getattr(pg, "group_desc", "")}
    return out


class ProfiledWindow:
    """The hook (harness/worker/main.py): nothing per step, everything in finish()."""

    def __init__(self, run, dims, run_dir):
        self.run, self.dims, self.run_dir = run, dims, Path(run_dir)

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass

    def finish(self, strategy, batch, steps_done: int) -> dict:
        n = self.run.workload.profile_steps
        if n <= 0:
            return {}
        step = steps_done
        ab, step = self.ab(strategy, batch, step, max(AB_MIN_PAIRS, n))
        trace, step = self.profile(strategy, batch, step, n)
        try:
            figures = trace_analysis.analyse(trace)
        except Exception as e:  # noqa: BLE001 - a trace we cannot read costs the figure, not the run
            figures = {"error": f"{type(e).__name__}: {e}"}
        return {"comm_profile": figures, "comm_ab": ab}

    # -- A/B ------------------------------------------------------------------------------------
    def ab(self, strategy, batch, step: int, pairs: int) -> tuple[dict, int]:
        if strategy.sync_disabled() is None:
            return {"applicable": False}, step
        clock = Clock(strategy.device)
        times: dict[str, list[float]] = {"sync": [], "nosync": []}
        calls = {"sync": 0, "nosync": 0}
        for _ in range(pairs):
            for mode in ("sync", "nosync"):
                mbs = batch(step)
                step += 1
                dist.barrier()
                first = next_record_id()
                ctx = strategy.sync_disabled() if mode == "nosync" else None
                with clock:
                    if ctx is None:
                        strategy.train_step(mbs)
                    else:
                        with ctx:
                            strategy.train_step(mbs)
                times[mode].append(clock.elapsed)
                calls[mode] += next_record_id() - first
        return {"applicable": True, "sync_s": times["sync"], "nosync_s": times["nosync"],
                "sync_collectives": calls["sync"] / pairs, "nosync_collectives": calls["nosync"] / pairs}, step

    # -- the profiled steps -----------------------------------------------------------------------
    def profile(self, strategy, batch, step: int, n: int) -> tuple[dict, int]:
        from torch.profiler import ProfilerActivity, profile, record_function, schedule

        device = strategy.device
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        rank = dist.get_rank()
        path = self.run_dir / rundir.trace_file(rank)
        tmp = path.with_suffix(".tmp")
        # One warm-up step under the profiler (its start-up cost), then n recorded steps; the trace
        # is written when the active steps end (on_trace_ready), before the profiler drops it.
        # Each recorded step's flight-recorder entries are known by record id, read between the barrier
        # and the step and after the step (outside its annotation, so the reads cost the step nothing).
        fr_steps = []
        with profile(activities=activities, record_shapes=True, schedule=schedule(wait=0, warmup=1, active=n),
                     on_trace_ready=lambda p: p.export_chrome_trace(str(tmp))) as prof:
            for i in range(n + 1):
                mbs = batch(step)
                step += 1
                dist.barrier()
                first = next_record_id()
                with record_function(trace_analysis.STEP_EVENT):
                    strategy.train_step(mbs)
                    synchronize(device)  # the step's device work ends inside its annotation
                if i:  # the first is the profiler's warm-up step
                    fr_steps.append([first, next_record_id()])
                prof.step()
        trace = json.loads(tmp.read_text())
        groups = process_groups(strategy.mesh, self.dims)
        trace["brigade"] = {  # read by trace_analysis; Perfetto ignores unknown top-level keys
            "rank": rank, "dims": self.dims.as_dict(), "strategy": self.run.strategy.name,
            "pg_axes": {k: v["axes"] for k, v in groups.items()},
            "pg_ranks": {k: v["ranks"] for k, v in groups.items()},
            "p2p_axis": "pp" if self.dims.pp > 1 else "other",
            "fr_steps": fr_steps,
            "fr_entries": [e for e in flight_recorder_dump() if any(a <= e["record_id"] < b for a, b in fr_steps)]}
        write_atomic(path, json.dumps(trace))
        tmp.unlink(missing_ok=True)
        return trace, step
