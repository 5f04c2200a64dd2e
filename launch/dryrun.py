"""launcher=dryrun: the real worker code path at any world size, on torch's fake process group.

For one rank of every role (`roles`: ranks that hold the same bytes at every moment; `launcher.ranks=[...]`
to choose), but for the middle pipeline ranks derived from two simulated ones (harness/strategies/
pp_derive.py; launcher.derive=false simulates them), a child forked from one fork server (launch/fork.py;
as many at once as there are cores and as the host memory budget admits, `Children`) does what
harness/worker/main.py does:

    init_process_group("fake", FakeStore(), rank, world_size)   no socket, collectives are no-ops
    dims.build_mesh("cpu")                                      the real (pp, dp, tp) DeviceMesh
    build_model(device="meta") -> strategy.setup(model)         the same parallelize code, TP/FSDP/
                                                                pipeline split on meta, then the
                                                                strategy's materialize()
under FakeTensorMode, so materialising allocates nothing: every parameter, gradient and optimizer
tensor is a fake tensor with this rank's exact local shape and dtype. Then two training steps of the
real `strategy.train_step` on this rank's real micro-batch shapes, under harness/worker/measure.py's
LiveTensors, which gives the peak of the tensor storages alive, its step and phase, and what was live
then (the first step has no optimizer state until its end; the second is every later step). A pipeline
runs the micro-batches that decide its peak where its schedule repeats, and the rest is extrapolated
from them (harness/strategies/pp_shorten.py; launcher.shorten=false runs every one).
Model-state bytes are counted after the first step by harness/worker/measure.py, as in a real run
(params, grads and AdamW state exist then).
If the step itself cannot run on fake tensors (reported in measured.dryrun_step_error), grads are
set to zeros_like(param) and only the optimizer step runs, so the state bytes are still exact.

The result is an ordinary measurement (measurement.json, kind "dryrun") that harness/collect/dryrun.py
turns into the record's `measured`; no step time exists, so no time is reported.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

from harness import rundir, strategies
from harness.config import GiB
from harness.run.cause import signal_name
from harness.run.record import Status
from harness.run.signals import received
from harness.strategies import pp_derive
from harness.validate import num_microbatches
from launch.fork import ChildError, Forked
from launch.local import HOST_MEMORY_SHARE, LaunchResult, host_available_bytes, oom_kill_count

# Imports inside functions: torch and what imports it, which the parent process never loads.


STATES = ("params_bytes", "grads_bytes", "optimizer_bytes", "master_bytes")


def roles(run, dims, predicted: dict) -> dict[int, int]:
    """The ranks to simulate, each with how many ranks of the world it stands for (its role's size).

    Ranks that hold the same pipeline stages and the same shard of every tensor run the same operators
    on tensors of the same shapes, so they hold the same bytes at every moment: one of them (the lowest)
    is simulated for all. The shards differ along the data-parallel axes only where a tensor's rows do not
    split evenly (FSDP2's torch.chunk pieces, ZeRO's padded partitions): the cost model's exact per-rank
    state bytes (`predicted`, harness/costmodel/memory.py) tell those ranks apart. Along tp, cp and ep every
    shard is equal (validation requires heads, kv heads, d_ff, the sequence and the experts to divide), but
    for the vocabulary, which tp may split unevenly: then the tp position is part of the role. A dry run
    routes MoE tokens at the balanced load (harness/strategies/ep_fake.py), the same on every ep rank.
    `launcher.ranks` simulates those ranks, each for itself."""
    if run.launcher.ranks:
        return {r: 1 for r in sorted(set(int(r) for r in run.launcher.ranks))}
    key = role_key(run, dims, predicted)
    out: dict[tuple, list[int]] = {}
    for rank in range(dims.world_size):
        out.setdefault(key(rank), []).append(rank)
    return {members[0]: len(members) for members in sorted(out.values())}


def role_key(run, dims, predicted: dict):
    """rank -> (pp coordinate, its shard's state bytes, its tp position where the vocabulary splits
    unevenly): ranks with equal keys hold the same bytes at every moment (`roles`)."""
    lists = [predicted.get(f"{k}_per_rank") for k in STATES]
    exact = all(isinstance(xs, list) and len(xs) == dims.world_size for xs in lists)
    uneven_vocab = run.model.vocab_size % dims.tp != 0

    def key(rank: int) -> tuple:
        c = dims.coords(rank)
        shard = tuple(xs[rank] for xs in lists) if exact else (c["dp"],)  # no per-rank lists: every dp position
        return c["pp"], shard, c["tp"] if uneven_vocab else 0
    return key


POLL_S = 0.2
# A child dead by a signal: how long the parent waits for its own signal before calling the child's death
# the cause (a terminal or coreutils `timeout` signals the whole group; the parent's handler may run a
# moment after the child died).
SIGNAL_GRACE_S = 1.0


def execute(run, dims, run_dir: Path, log_path: Path, on_poll=None) -> LaunchResult:
    t0, oom0 = time.monotonic(), oom_kill_count()
    predicted = json.loads((run_dir / rundir.PREDICTION).read_text())
    stands_for = roles(run, dims, predicted)
    # the middle pipeline ranks between two simulated ones wait: derived from them, or simulated (pp_derive)
    groups = pp_derive.groups(run, dims, role_key(run, dims, predicted), stands_for)
    waiting = {r for group in groups for r in group[1:-1]}
    results, in_full, not_derived, asked = {}, {}, {}, set()  # in_full: rank -> why its step runs whole
    # simulated ranks are independent: as many at once as this process may use cores (each child runs torch
    # on one thread) and as the memory budget admits (Children)
    children = Children(memory_budget(run), max(1, len(os.sched_getaffinity(0))),
                        [r for r in stands_for if r not in waiting])

    def ended(why: str, log) -> LaunchResult:
        log.write(f"ranks {sorted(children.running)}: ended by the parent ({why})\n")
        return LaunchResult(None, why == Status.TIMEOUT, time.monotonic() - t0, log_path,
                            interrupted=None if why == Status.TIMEOUT else why, ended_at=time.time(),
                            oom_kills=max(0, oom_kill_count() - oom0))

    with open(log_path, "w") as log, children:
        while children.pending or children.running:
            why = Status.TIMEOUT if time.monotonic() - t0 > run.launcher.timeout_s else received()
            if why:
                return ended(why, log)
            children.start(lambda rank: Forked(simulate_rank, run, dims, rank, run.launcher.shorten and rank not in in_full))
            over = children.watch_memory(log)
            if over is not None:  # one child alone holds more than the budget
                _write_error(run_dir, over[0], Status.OOM, "MemoryBudget", over[1])
                return LaunchResult(1, False, time.monotonic() - t0, log_path)
            for rank, child in children.finished(POLL_S):
                try:
                    result = child.result()
                except ChildError as e:
                    if e.kind == "ChildDied" and _wait_for_signal():
                        return ended(received(), log)
                    log.write(f"rank {rank}: {e}\n{e.child_traceback}\n")
                    status, kind, message = _death(rank, e, max(0, oom_kill_count() - oom0))
                    _write_error(run_dir, rank, status, kind, message, e.child_traceback)
                    return LaunchResult(1, False, time.monotonic() - t0, log_path)
                if "not_periodic" in result:  # the shortened step did not repeat: every micro-batch runs
                    log.write(f"rank {rank}: shortened step not periodic ({result['not_periodic']}); run whole\n")
                    in_full[rank] = result["not_periodic"]
                    children.pending.insert(0, rank)
                    continue
                result["host_peak_pss_bytes"] = children.peak_pss.get(rank, 0)
                if rank in in_full:
                    result["not_periodic"] = in_full[rank]
                log.write(f"rank {rank}: {result['wall_s']:.2f} s, {result['host_peak_pss_bytes'] / GiB:.2f} GiB\n")
                results[rank] = result
                children.pending.extend(_derive(groups, results, dims, log, not_derived, asked))
                rundir.write_atomic(run_dir / rundir.PROGRESS, f"{len(results)} {len(stands_for)}")
            if on_poll:
                on_poll()
    assert not groups, f"middle pipeline ranks neither derived nor simulated: {groups}"
    measurement = {"kind": "dryrun", "num_microbatches": num_microbatches(run, dims),
                   "ranks": [{**results[r], "stands_for": stands_for[r]} for r in stands_for], "host": children.report(),
                   "not_derived": not_derived}
    rundir.write_atomic(run_dir / rundir.MEASUREMENT, json.dumps(measurement, indent=1))
    return LaunchResult(0, False, time.monotonic() - t0, log_path)


def _derive(groups: list[list[int]], results: dict, dims, log, not_derived: dict, asked: set) -> list[int]:
    """Derive into `results` what the simulated ranks of each group whose ranks are all in prove
    (harness/strategies/pp_derive.py); the ranks to simulate next: a group's middle where its ends alone do not
    prove the rule (`asked`), every rank of a group that breaks it. A group leaves `groups` once derived or
    given up."""
    more = []
    for group in list(groups):
        if any(r not in results for r in (group[0], group[-1], *(asked & set(group)))):
            continue
        try:
            results.update(pp_derive.derive(group, results, dims))
        except pp_derive.NeedWitness as e:
            log.write(f"ranks {group}: simulating rank {e.rank} to test the line through the ends\n")
            asked.add(e.rank)
            more.append(e.rank)
            continue
        except pp_derive.NotDerived as e:
            log.write(f"ranks {group}: not derived ({e}); simulated\n")
            not_derived[group[0]] = str(e)
            more += [r for r in group if r not in results]
        groups.remove(group)
    return more


def memory_budget(run) -> int:
    """Bytes the forked children may hold together: launcher.memory_GiB, or the share of this host's
    available memory that a local run's ranks may use (launch/local.py)."""
    if run.launcher.memory_GiB > 0:
        return int(run.launcher.memory_GiB * GiB)
    return int(HOST_MEMORY_SHARE * (host_available_bytes() or 0)) or 2**62  # no /proc/meminfo: unbounded


class Children:
    """The forked children of one dry run, started as cores and memory allow, their memory watched.

    Memory: each child's proportional set size (PSS: its own pages, and its share of the pages it shares
    with the fork server and its siblings; /proc/<pid>/smaps_rollup), sampled every poll. A child starts
    while the running ones' total plus the most any child of this run has held so far fits the budget; if
    the total goes over it, the child started last is killed and started again once there is room, so
    the total stays within the budget but for one poll's growth. A child alone over the budget ends the
    run as `oom`. On a host with less memory fewer children run at once."""

    def __init__(self, budget: int, slots: int, pending: list[int]):
        self.budget, self.slots, self.pending = budget, slots, pending
        self.running: dict[int, Forked] = {}
        self.pss: dict[int, int] = {}  # running rank -> its PSS now
        self.peak_pss: dict[int, int] = {}  # rank -> the most its (last) child held
        self.peak_total, self.most_at_once, self.restarted = 0, 0, []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for child in self.running.values():  # timeout, a signal, an error, Ctrl-C: no child outlives the launcher
            child.kill()
        self.running.clear()
        return False

    def start(self, fork) -> None:
        largest = max(self.peak_pss.values(), default=0)
        while self.pending and len(self.running) < self.slots and (
                not self.running or sum(self.pss.values()) + largest <= self.budget):
            rank = self.pending.pop(0)
            self.running[rank], self.pss[rank], self.peak_pss[rank] = fork(rank), 0, 0
            self.most_at_once = max(self.most_at_once, len(self.running))

    def watch_memory(self, log) -> tuple[int, str] | None:
        """Sample the children's PSS; over the budget, stop the child started last (to run again later).
        (rank, why) when one child alone holds more than the budget."""
        for rank, child in self.running.items():
            self.pss[rank] = _pss_bytes(child.pid)
            self.peak_pss[rank] = max(self.peak_pss[rank], self.pss[rank])
        total = sum(self.pss.values())
        self.peak_total = max(self.peak_total, total)
        if total <= self.budget:
            return None
        rank = next(reversed(self.running))
        if len(self.running) == 1:
            return rank, (f"the simulation of rank {rank} held {total / GiB:.2f} GiB of host memory (PSS) > the dry "
                          f"run's budget of {self.budget / GiB:.2f} GiB (launcher.memory_GiB, or "
                          f"{HOST_MEMORY_SHARE:.0%} of MemAvailable at launch)")
        log.write(f"rank {rank}: stopped, to start again alone: the children held {total / GiB:.2f} GiB > "
                  f"the budget {self.budget / GiB:.2f} GiB\n")
        self.running.pop(rank).kill()
        del self.pss[rank]
        self.pending.insert(0, rank)
        self.restarted.append(rank)
        return None

    def finished(self, timeout_s: float) -> list[tuple[int, Forked]]:
        deadline = time.monotonic() + timeout_s
        done = []
        while not done and self.running and time.monotonic() < deadline:
            done = [r for r, child in self.running.items() if child.done(0)]
            if not done:
                time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))
        for rank in done:
            self.pss.pop(rank, None)
        return [(rank, self.running.pop(rank)) for rank in done]

    def report(self) -> dict:
        return {"memory_budget_bytes": self.budget, "children_peak_pss_bytes": self.peak_total,
                "children_most_at_once": self.most_at_once, "cores": self.slots, "restarted_ranks": self.restarted}


def _pss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _wait_for_signal() -> bool:
    """Whether the parent got a termination signal, waiting SIGNAL_GRACE_S for one (see SIGNAL_GRACE_S)."""
    deadline = time.monotonic() + SIGNAL_GRACE_S
    while not received() and time.monotonic() < deadline:
        time.sleep(0.05)
    return received() is not None


def _death(rank: int, e: ChildError, oom_kills: int) -> tuple[str, str, str]:
    """(status, kind, message) of a child that raised or died without the parent being told to stop."""
    if e.kind != "ChildDied":
        return Status.FAILED, e.kind, e.message
    code = e.exitcode
    if code == -signal.SIGKILL and oom_kills:
        return Status.OOM, "OOMKilled", (f"its process was killed by SIGKILL while the kernel OOM-killed {oom_kills} "
                                         f"process(es) (/proc/vmstat oom_kill): host memory ran out")
    if code is not None and code < 0:
        return Status.INTERRUPTED, "Killed", (f"its process was killed by {signal_name(code)} (exit code {code}) from "
                                              f"outside brigade, with no OOM kill counted (/proc/vmstat oom_kill)")
    if code == 255:  # multiprocessing's reading when the fork server is gone: the child's own status is lost
        return Status.FAILED, "ForkServerDied", ("its process ended with an unknown status: the fork server it was "
                                                 "forked from (launch/fork.py) died")
    return Status.FAILED, "Exited", e.message


def _write_error(run_dir: Path, rank: int, status: str, kind: str, message: str, tb: str = "") -> None:
    error = {"rank": rank, "time": time.time(), "type": kind, "message": message[:4000], "status": str(status),
             "out_of_memory": status == Status.OOM, "traceback": tb[-8000:]}
    rundir.write_atomic(run_dir / rundir.error_file(rank), json.dumps(error, indent=1))


def simulate_rank(run, dims, rank: int, shorten: bool = True) -> dict:
    """In the forked child: rank `rank` of the config on the fake backend (see the module docstring);
    `shorten`: a pipeline may run the micro-batches that decide its peak (harness/strategies/pp_shorten.py).
    {"rank", "not_periodic": why} when that was tried and the short step's copies did not repeat."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from harness.strategies import pp_shorten
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
    strategy.shorten = shorten
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
        try:
            out.update(_steps(strategy, mbs))
        except pp_shorten.NotPeriodic as e:
            return {"rank": rank, "not_periodic": str(e)}
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

    from harness.strategies import pp_shorten
    from harness.worker import measure

    try:
        tracker = measure.LiveTensors(strategy.model, strategy.state_tensors())
        timeline = getattr(strategy, "timeline", None)  # a pipeline: its actions mark the tracker's segments
        if timeline is not None:
            tracker.keep_segments()
            timeline.observer = tracker.mark
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
        splice = getattr(strategy, "splice", None)
        live = pp_shorten.extrapolate(tracker.segments, splice) if splice else tracker.summary()
        out = {"memory": states,
               "peak": {"peak_mem_bytes": live.pop("peak_bytes"), "peak_mem_kind": "fake_tensor_storages", **live}}
        if getattr(strategy, "in_flight", None):  # a pipeline: what pp_derive reads of this rank
            out.update(in_flight=strategy.in_flight, warmup_bytes=pp_derive.warmup_bytes(tracker.segments[-1]))
        if splice:
            out["shortened"] = {**splice.as_dict(), "simulated_peak_bytes": tracker.peak}
        return out
    except pp_shorten.NotPeriodic:
        raise
    except Exception as e:  # noqa: BLE001 - reported in the record; the state bytes still follow
        for p in strategy.model.parameters():
            p.grad = torch.zeros_like(p)
        strategy.optimizer_step()
        return {"measured": {"dryrun_step_error": f"{type(e).__name__}: {str(e)[:500]}"}}
