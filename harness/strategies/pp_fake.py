"""Pipeline stages over torch's fake process group (launcher=dryrun): boundary metadata and the
warm-up vote decided on this rank.

On its first step a torch 2.13 pipeline schedule decides whether the shapes crossing its stage
boundaries are known up front (STATIC) or must be inferred by running a micro-batch and sending each
stage's output metadata to the next (DYNAMIC). It decides by a vote around the pp group: each stage
multiplies a 0/1 tensor received from its neighbour by its own vote and passes it on, and the result
is read with `.item()`. Over the fake group no data crosses ranks, so the received tensor has no value
(FakeTensorMode: DataDependentOutputException on aten._local_scalar_dense), and DYNAMIC inference
would unpickle an empty receive buffer.

So in a dry run every stage gets complete boundary metadata (its input and output tensors, and
their gradients where they are DTensors), computed on this rank by running the stage's own module
on fake tensors, and each stage votes STATIC without receiving anything: with every stage's metadata
complete every stage votes 1, which is the product the group would compute. A real run is untouched
(it keeps torch's vote and its DYNAMIC inference).

The metadata is what the neighbours would send: stage 0's input is the token ids; every boundary
carries the embedding's output type (B, T, h) (models/pipeline_split.py), taken from running the
first stage's embedding (on this rank even when stage 0 lives elsewhere: the embedding alone is
built and parallelised like stage 0, on fake tensors).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from models.pipeline_split import StageSplit, stage_module


def local_vote_stage(stage_class: type, hold_sends: bool, step_microbatches: int) -> type:
    """`stage_class` whose warm-up vote is STATIC, decided on this rank (see the module docstring), and,
    with `hold_sends`, that keeps every tensor it sends until `release_sends`: torch's multi-stage
    schedules wait on their sends when the step ends, and until then gloo's and NCCL's work holds each
    sent tensor (a stage output after its backward, an input gradient), where the fake group's holds none.
    Its receive buffers are made for the step's `step_microbatches` micro-batches, as a real run's are,
    also when a shortened schedule runs fewer (harness/strategies/pp_shorten.py)."""

    class LocalVoteStage(stage_class):
        sent: list = []

        def _prepare_forward_infra(self, num_microbatches, *args, **kwargs):
            return super()._prepare_forward_infra(step_microbatches, *args, **kwargs)

        def _prepare_backward_infra(self, num_microbatches, *args, **kwargs):
            return super()._prepare_backward_infra(step_microbatches, *args, **kwargs)

        def get_fwd_send_ops(self, fwd_chunk_id):
            return self._held(super().get_fwd_send_ops(fwd_chunk_id))

        def get_bwd_send_ops(self, bwd_chunk_id):
            return self._held(super().get_bwd_send_ops(bwd_chunk_id))

        def _held(self, ops):
            if hold_sends:
                self.sent = [*self.sent, *(op.tensor for op in ops)]
            return ops

        def release_sends(self):
            self.sent = []

        def _warmup_forward_vote(self, has_backward, received_acc=None):
            # a constant: FakeTensorMode keeps its value, so the schedule's .item() reads 1
            return torch.tensor([1], dtype=torch.int32, device=self.device)

        def _warmup_backward_result(self, received_result=None):
            return torch.tensor([1], dtype=torch.int32, device=self.device)

    LocalVoteStage.__name__ = f"LocalVote{stage_class.__name__}"
    return LocalVoteStage


def embedding_piece(strategy, model) -> torch.nn.Module:
    """The first stage's embeddings alone, parallelised as stage 0 is (TP, FSDP/DDP, on fake tensors)."""
    return strategy.parallelize_stage(stage_module(model, StageSplit(index=0, layers=(), embeddings=True, head=False)))


def boundary_metadata(strategy, modules: dict[int, torch.nn.Module], embedding, tokens: torch.Tensor) -> dict:
    """stage index -> PipelineStage keyword arguments (input_args, output_args, and the gradients'
    when a boundary is a DTensor) for this rank's stages; `tokens` is one micro-batch of token ids."""
    out = {}
    with torch.no_grad(), strategy.autocast():
        first = modules[0](tokens) if 0 in modules else None
        hidden = first if first is not None else embedding(tokens)
        for index, module in modules.items():
            inp = tokens if index == 0 else hidden.detach().requires_grad_(True)
            res = first if index == 0 else module(inp)
            kwargs = {"input_args": (inp,), "output_args": (res.detach().requires_grad_(True),)}
            if isinstance(inp, DTensor) or isinstance(res, DTensor):
                kwargs["output_grads"] = (res.detach(),)
                kwargs["input_grads"] = (None,) if index == 0 else (inp.detach(),)
            out[index] = kwargs
    return out
