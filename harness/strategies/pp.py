"""pp: pipeline parallel with torch.distributed.pipelining, every schedule torch ships.

The model's layers are cut into S = pp * vpp stages (models/pipeline_split.py: even by layer count,
embeddings on the first stage, ln_f + head on the last). Rank r of the pp axis holds vpp of them:

    one stage per rank (gpipe, 1f1b)                        stage r
    looped (interleaved_1f1b, looped_bfs,
            interleaved_zero_bubble)                        stages r, r + pp, ..., r + (vpp-1) pp
    V-shaped (zbv_zero_bubble, dualpipev; vpp = 2)          stages r and 2 pp - 1 - r

so in a V schedule the first and the last stage are both on pp rank 0 (that rank owns the loss).

Communication: per micro-batch, each stage boundary sends one activation (B, T, h) forward and its
gradient back, point to point on the pp group (`mesh["pp"]`); nothing else crosses stages. A
schedule orders the F / B (/ W: weight-grad half of zero-bubble schedules) actions of the m
micro-batches; a rank idles while it waits for a neighbour: the bubble, about (pp - 1) / (m + pp - 1)
of the step for GPipe and 1F1B, less with vpp virtual stages per rank or zero-bubble schedules.

Gradient scaling: one train_step is one `schedule.step()` over all m = num_microbatches micro-batches
of this rank's share of the global batch. The loss function returns each micro-batch's mean
cross-entropy divided by m, and the schedule runs with scale_grads=False, so the accumulated
gradient is d(mean over the rank's micro-batches)/dw whatever the schedule or the number of step()
calls (torch's scale_grads=True divides by m on every step(), which is only right for one step()
per optimizer step). Data parallel (3D) then averages over dp replicas: the gradient of the global
batch mean, as `single` computes it.
"""
from __future__ import annotations

import contextlib
import gc

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from harness import catalog
from harness.strategies import pp_derive, pp_fake, pp_shorten
from harness.strategies.base import Strategy, over_fake_group
from harness.strategies.pipeline_timeline import Timeline, measured_bubble
from harness.validate import num_microbatches
from models.pipeline_split import stage_module, stage_splits

# schedule name -> torch class; what each schedule is (placement, vpp rule, loss rank) is in harness/catalog.py
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "looped_bfs": ScheduleLoopedBFS, "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
             "zbv_zero_bubble": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}


class PipelineStrategy(Strategy):
    stage_class = PipelineStage  # 3d swaps in a stage that reduce-scatters every micro-batch (fsdp_accumulate)
    shorten = True  # a dry run may run the micro-batches that decide the peak (harness/strategies/pp_shorten.py)
    splice: pp_shorten.Splice | None = None  # how it did: the full step is extrapolated from it
    in_flight: list[int] | None = None  # a dry run: forwards each pp rank holds at most (pp_derive)

    @property
    def loss_owner(self) -> bool:
        c = self.dims.coords(dist.get_rank())
        return c["tp"] == 0 and c["pp"] == catalog.loss_rank(self.run.strategy.schedule, self.dims.pp)

    # -- building ----------------------------------------------------------------------------
    def parallelize_stage(self, module: torch.nn.Module) -> torch.nn.Module:
        """What happens to one stage's module before it becomes a PipelineStage (3D: TP, AC, FSDP/DDP)."""
        return self.materialize(module)

    def step_context(self):
        """Context around one schedule.step() (3D with loss-parallel TP: torch's loss_parallel)."""
        return contextlib.nullcontext()

    def setup(self, model):
        s, d = self.run.strategy, self.dims
        self.num_microbatches = num_microbatches(self.run, d)  # m = global / (dp * micro)
        pp_rank = d.coords(dist.get_rank())["pp"]
        splits = stage_splits(self.run.model.n_layers, d.num_stages, tuple(s.stage_layers))
        self.stage_ids = list(catalog.stages_of_rank(s.schedule, pp_rank, d.pp, d.vpp))
        modules = [self.parallelize_stage(stage_module(model, splits[i])) for i in self.stage_ids]
        self.timeline = Timeline(self.device, forward_context=self.autocast)
        self.has_first = 0 in self.stage_ids
        self.has_last = d.num_stages - 1 in self.stage_ids
        self.model = torch.nn.ModuleList(modules)  # every parameter this rank holds, for the optimizer
        self.optimizer = self.make_optimizer(self.model.parameters(), foreach=self.foreach())
        self.schedule = None
        if over_fake_group(self.mesh["pp"].get_group()):  # a dry run: stages built on the first step
            self.embedding = None if self.has_first else pp_fake.embedding_piece(self, model)
        else:
            self.build_schedule({})
        del model  # each stage module is a pruned copy; the worker's full model is not used again

    def build_schedule(self, metadata: dict) -> None:
        """The PipelineStages of this rank's modules and the schedule over them; `metadata`: stage
        index -> the stage's static boundary metadata (a dry run, harness/strategies/pp_fake.py)."""
        s, d, pp_group = self.run.strategy, self.dims, self.mesh["pp"].get_group()
        one = catalog.schedule(s.schedule).placement == "one"  # else multi-stage: sends waited at the step's end
        m = self.num_microbatches
        stage_class = pp_fake.local_vote_stage(self.stage_class, not one, m) if metadata else self.stage_class
        stages = [stage_class(module, i, d.num_stages, self.device, group=pp_group, **metadata.get(i, {}))
                  for module, i in zip(self.model, self.stage_ids)]
        self.stages = stages
        for st in stages:
            self.timeline.instrument(st)

        def make(n: int):
            return SCHEDULES[s.schedule](stages[0] if one else stages, n, loss_fn=self._microbatch_loss, scale_grads=False)

        full = make(m)
        if metadata:  # a dry run: what each pp rank holds in flight, by torch's order (pp_derive)
            self.in_flight = [pp_derive.in_flight(pp_shorten.local_order(full, r, m)) for r in range(d.pp)]
        if metadata and self.shorten:  # a dry run: the micro-batches that decide the peak (pp_shorten)
            chunks = d.pp * catalog.chunks_per_rank(s.schedule, d.vpp)
            self.splice = pp_shorten.plan(make, m, d.coords(dist.get_rank())["pp"], chunks, full)
        self.schedule = make(self.splice.microbatches) if self.splice else full

    def foreach(self) -> bool | None:
        return None

    def _microbatch_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # / m: the schedule sums gradients over micro-batches (scale_grads=False); see the docstring
        loss = self.loss_fn(logits, targets) / self.num_microbatches
        self.timeline.loss_done()
        return loss

    # -- one optimizer step -----------------------------------------------------------------
    def train_step(self, microbatches):
        if self.schedule is None:  # a dry run's first step: boundary metadata from one micro-batch
            self.build_schedule(pp_fake.boundary_metadata(self, dict(zip(self.stage_ids, self.model)),
                                                          self.embedding, microbatches[0][0]))
            self.embedding = None
            gc.collect()  # the embedding piece and its FSDP state refer to each other: its storages go now
        self.timeline.begin_step()
        self.optimizer.zero_grad(set_to_none=True)
        # The schedule splits the rank's batch into m micro-batches along dim 0 again (same chunks).
        args = (torch.cat([x for x, _ in microbatches]),) if self.has_first else ()
        target = torch.cat([y for _, y in microbatches]) if self.has_last else None
        if self.splice:  # a shortened dry run: the step's whole batch is made, its first micro-batches run
            rows = self.splice.microbatches * len(microbatches[0][0])
            args, target = tuple(a[:rows] for a in args), None if target is None else target[:rows]
        losses: list | None = [] if self.has_last else None
        with self.step_context():
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        for stage in self.stages:  # a dry run's sends end with the step, as the schedule's wait ends a real one's
            getattr(stage, "release_sends", lambda: None)()
        self.timeline.end_pipeline()
        self.optimizer_step()
        self.timeline.end_step()
        if not self.has_last:
            return None
        total = torch.stack([_full(l).detach() for l in losses]).sum()  # mean over the rank's micro-batches
        return total

    # -- measurement ---------------------------------------------------------------------------
    def extra_measurements(self) -> dict:
        header = {"schedule": self.run.strategy.schedule, "pp": self.dims.pp, "vpp": self.dims.vpp,
                  "num_microbatches": self.num_microbatches, "stages": self.stage_ids}
        return measured_bubble(self.timeline, self.run, header, self.run_dir)


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)  # a loss-parallel loss is a replicated DTensor
    return full() if callable(full) else t


STRATEGY = PipelineStrategy
