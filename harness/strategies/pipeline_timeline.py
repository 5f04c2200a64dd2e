"""The pipeline timeline: when each forward / backward / weight-grad action of each micro-batch ran on
this rank, and the measured bubble (idle fraction) that follows from it.

How the times are taken, without copying torch's schedules: every torch.distributed.pipelining
schedule (GPipe, 1F1B, the looped, zero-bubble and V runtimes) executes an action by calling one of
three methods of the stage it belongs to,

    stage.forward_one_chunk(mb, ...)                    -> "F"
    stage.backward_one_chunk(mb, full_backward=...)     -> "B" (full backward, or the input-grad half
                                                           "I" of a zero-bubble split, reported as B)
    stage.backward_weight_one_chunk(mb, ...)            -> "W" (weight-grad half, zero-bubble only)

so `instrument(stage)` wraps those three methods of the stage instance with two time stamps each.
The waits for received activations/gradients happen outside these methods, so they count as idle,
which is what a bubble is. The last stage's loss is computed right after its forward; `loss_done()`
stretches that forward's end over it.

Times: CPU: time.perf_counter; CUDA: events on the current stream (no host sync inside the step;
they are resolved after the timed steps). All are seconds since the step started, i.e. since
`begin_step()`, which the strategy calls first thing in train_step (after the loop's barrier).

Bubble of one rank in one step: 1 - busy / pipeline_s, where busy is the summed duration of its
actions and pipeline_s the time from the step start to the end of the schedule (the optimizer step
after it is not part of the pipeline, so it is excluded from both).
"""
from __future__ import annotations

import functools
import json
import statistics
import time
from pathlib import Path

import torch

from harness import rundir
from harness.rundir import write_atomic

# Imports inside functions: the parts of torch, DeepSpeed and brigade that only some strategies, devices or
# modes use.


class _Clock:
    """Time stamps: floats (perf_counter) on CPU, recorded CUDA events on CUDA."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def stamp(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def seconds(self, t0, t) -> float:
        return t0.elapsed_time(t) / 1e3 if self.cuda else t - t0


class Timeline:
    def __init__(self, device: torch.device, forward_context=None):
        self.clock = _Clock(device)
        self.forward_context = forward_context  # e.g. autocast, entered around each stage forward
        self.steps: list[dict] = []  # raw stamps per train_step call
        self._cur: dict | None = None
        # called with (action, stage, mb) as an action starts and ("gap",) as it ends: a dry run's LiveTensors.mark
        self.observer = None

    # -- instrumentation ----------------------------------------------------------------------
    def instrument(self, stage) -> None:
        """Wrap this stage instance's three compute methods so each call leaves an event."""
        s = stage.stage_index
        fwd, bwd, wgt = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

        @functools.wraps(fwd)
        def forward_one_chunk(mb, *args, **kwargs):
            if self.forward_context is None:
                return self.timed(s, mb, "F", fwd, mb, *args, **kwargs)
            with self.forward_context():
                return self.timed(s, mb, "F", fwd, mb, *args, **kwargs)

        @functools.wraps(bwd)
        def backward_one_chunk(mb, *args, **kwargs):
            return self.timed(s, mb, "B", bwd, mb, *args, **kwargs)

        @functools.wraps(wgt)
        def backward_weight_one_chunk(mb, *args, **kwargs):
            return self.timed(s, mb, "W", wgt, mb, *args, **kwargs)

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk

    def timed(self, stage: int, mb: int, action: str, fn, *args, **kwargs):
        """Run fn as one action (F / B / W) of micro-batch mb on this rank's stage, leaving its event."""
        if self.observer is not None:
            self.observer((action, stage, mb))
        start = self.clock.stamp()
        out = fn(*args, **kwargs)
        if self._cur is not None:
            self._cur["events"].append([stage, mb, action, start, self.clock.stamp()])
        if self.observer is not None:
            self.observer(("gap",))
        return out

    # -- per step (called by the strategy) ------------------------------------------------------
    def begin_step(self) -> None:
        self._cur = {"t0": self.clock.stamp(), "events": []}

    def loss_done(self) -> None:
        """The loss of the forward just recorded was computed: count it as part of that forward."""
        if self._cur and self._cur["events"] and self._cur["events"][-1][2] == "F":
            self._cur["events"][-1][4] = self.clock.stamp()

    def end_pipeline(self) -> None:
        self._cur["pipeline_end"] = self.clock.stamp()

    def end_pipeline_once(self) -> None:
        """end_pipeline unless this step's pipeline end is stamped already (DeepSpeed's engine: the
        first of its gradient-reduction / optimizer-step instructions, then once more after train_batch)."""
        if self._cur is not None and "pipeline_end" not in self._cur:
            self.end_pipeline()

    def end_step(self) -> None:
        self._cur["step_end"] = self.clock.stamp()
        self.steps.append(self._cur)
        self._cur = None

    # -- after the timed steps -----------------------------------------------------------------
    def resolve(self, index: int) -> dict:
        """Step `index` (train_step call number) in seconds since its start."""
        raw = self.steps[index]
        t0, sec = raw["t0"], self.clock.seconds
        events = [{"stage": s, "mb": mb, "action": a, "start_s": sec(t0, a0), "end_s": sec(t0, a1)}
                  for s, mb, a, a0, a1 in raw["events"]]
        events.sort(key=lambda e: e["start_s"])
        return {"step_time_s": sec(t0, raw["pipeline_end"]),
                "optimizer_s": sec(raw["pipeline_end"], raw["step_end"]), "events": events}

    @staticmethod
    def bubble_pct(resolved: dict) -> float:
        busy = sum(e["end_s"] - e["start_s"] for e in resolved["events"])
        return 100.0 * (1.0 - busy / resolved["step_time_s"])

    def summary(self, timed: range, header: dict, run_dir: Path | None) -> float:
        """Median bubble % of this rank over the timed steps; writes the last timed step's timeline
        to <run_dir>/timeline_rank<r>.json."""
        if self.clock.cuda:
            torch.cuda.synchronize()  # every event of the timed steps has completed
        steps = [i for i in timed if i < len(self.steps)]
        resolved = {i: self.resolve(i) for i in steps}
        if run_dir is not None and steps:
            last = steps[-1]
            doc = {**header, "step": last, **resolved[last]}
            write_atomic(Path(run_dir) / rundir.timeline_file(header["rank"]), json.dumps(doc, indent=1))
        return statistics.median(self.bubble_pct(r) for r in resolved.values())


def measured_bubble(timeline: Timeline, run, header: dict, run_dir: Path | None) -> dict:
    """The pipeline strategies' extra measurement: this rank's median bubble over the timed steps (its
    timeline file written), gathered from every rank after timing, and their mean."""
    import torch.distributed as dist

    w = run.workload
    mine = timeline.summary(range(w.warmup_steps, w.warmup_steps + w.steps), {**header, "rank": dist.get_rank()},
                            run_dir)
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)  # after timing: every rank returns the same figures
    return {"bubble_pct": statistics.fmean(per_rank), "bubble_pct_per_rank": per_rank}
