"""DeepSpeed's pipeline (pp > 1 on strategy.engine=deepspeed, ZeRO 0/1).

A DeepSpeed PipelineModule over the same model's layers [embedding, block 0..L-1, final norm +
head], split by block count (partition "type:Block"), driven by `engine.train_batch` over an
iterator of this rank's micro-batches (DeepSpeed's 1F1B schedule; activations and their gradients
go point-to-point between neighbouring stages).

Its bubble is measured as torch's pipelines' is (harness/strategies/pipeline_timeline.py): the engine
runs each instruction of its schedule through `_INSTRUCTION_MAP`, so this engine instance gets a copy
whose ForwardPass and BackwardPass entries are timed ("F" / "B", micro-batches counted in order; the
last stage's loss is computed inside its forward); receives wait outside them, so they count as idle;
the pipeline ends where the gradient reduction or the optimizer step begins.
"""
from __future__ import annotations

import torch

from harness.strategies.deepspeed.engine import DeepSpeedStrategy
from harness.strategies.pipeline_timeline import Timeline, measured_bubble

# Imports inside functions: the parts of torch, DeepSpeed and brigade that only some strategies, devices or
# modes use.


class DeepSpeedPipeline(DeepSpeedStrategy):
    def build_module(self, model):
        from deepspeed.pipe import PipelineModule

        layers = [Embedding(model), *model.blocks.values(), Head(model)]
        full = self.run.workload.activation_checkpointing == "full"
        return PipelineModule(layers=layers, num_stages=self.dims.pp, loss_fn=self.loss_fn, partition_method="type:Block",
                              activation_checkpoint_interval=1 if full else 0)

    def setup(self, model):
        super().setup(model)
        self.timeline = Timeline(self.device)
        self._counts = {"F": 0, "B": 0}
        self.engine._INSTRUCTION_MAP = self._timed_instructions(type(self.engine)._INSTRUCTION_MAP)

    def _timed_instructions(self, base: dict) -> dict:
        from deepspeed.runtime.pipe import schedule

        def timed(action: str, fn):
            def run(engine, **kwargs):
                mb = self._counts[action]
                self._counts[action] += 1
                return self.timeline.timed(engine.stage_id, mb, action, fn, engine, **kwargs)
            return run

        def ends_pipeline(fn):
            def run(engine, **kwargs):
                self.timeline.end_pipeline_once()
                return fn(engine, **kwargs)
            return run

        out = dict(base)
        out[schedule.ForwardPass] = timed("F", base[schedule.ForwardPass])
        out[schedule.BackwardPass] = timed("B", base[schedule.BackwardPass])
        for instr in (schedule.ReduceTiedGrads, schedule.ReduceGrads, schedule.OptimizerStep):
            out[instr] = ends_pipeline(base[instr])
        return out

    def train_step(self, microbatches):
        # DeepSpeed's pipeline engine pulls gradient_accumulation_steps micro-batches from the iterator:
        # the first stage the inputs, the last the targets; it steps the optimizer once at the end.
        self._counts = {"F": 0, "B": 0}
        self.timeline.begin_step()
        self.engine.train_batch(data_iter=iter(microbatches))
        self.timeline.end_pipeline_once()
        self.timeline.end_step()
        self._close_capture()
        if not self.engine.is_last_stage():
            return None
        return self.engine.dp_group_loss  # this replica's mean over its micro-batches (before the dp average)

    def extra_measurements(self) -> dict:
        header = {"schedule": self.run.strategy.schedule, "pp": self.dims.pp, "vpp": 1,
                  "num_microbatches": self.num_microbatches, "stages": [self.engine.stage_id]}
        return {**super().extra_measurements(), **measured_bubble(self.timeline, self.run, header, self.run_dir)}

    def gpt_name(self, name):
        # PipelineModule names layer k of [Embedding, block 0..L-1, Head] "<k>."
        k, rest = name.split(".", 1)
        k, n_layers = int(k), self.run.model.n_layers
        return rest if k in (0, n_layers + 1) else f"blocks.{k - 1}.{rest}"


class Embedding(torch.nn.Module):
    """The first pipeline layer: token + position embeddings of the GPT (the same modules, so the same weights)."""

    def __init__(self, gpt):
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop = gpt.tok_emb, gpt.pos_emb, gpt.drop

    def forward(self, tokens):
        pos = torch.arange(tokens.size(1), device=tokens.device)
        return self.drop(self.tok_emb(tokens) + self.pos_emb(pos))


class Head(torch.nn.Module):
    """The last pipeline layer: final LayerNorm and the (untied) output projection."""

    def __init__(self, gpt):
        super().__init__()
        self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x):
        return self.head(self.ln_f(x))


STRATEGY = DeepSpeedPipeline
