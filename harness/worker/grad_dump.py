"""Gradient dump for the parity tests: every parameter's full gradient of the first optimizer step.

Enabled by the environment variable BRIGADE_GRAD_DUMP=1 (the test suite sets it; nothing in a
config or a record changes). The hook wraps the step() of the strategy's stepping optimizer
(`Strategy.stepping_optimizer`) once, before the first step: at the entry of that step() every
gradient of step 0 is final (accumulated over the micro-batches, reduced over data parallel, the
pipeline's stages done), and the optimizer has not yet read or freed it. There each rank calls
`strategy.full_gradients()` (a collective: FSDP shards and TP slices are gathered, DeepSpeed's
partitions assembled) and writes {single-process parameter name: fp32 tensor} to
<run_dir>/grads_rank<r>.pt (harness/rundir.py); then the wrapper removes itself. Step 0 is a warm-up
step (not timed), and the timed loop's code is the same with or without the hook.
"""
from __future__ import annotations

import os
from pathlib import Path

GRAD_DUMP_ENV = "BRIGADE_GRAD_DUMP"


def grad_dump_enabled() -> bool:
    return os.environ.get(GRAD_DUMP_ENV, "") not in ("", "0")


class GradDump:
    def __init__(self, strategy, run_dir):
        import torch.distributed as dist

        from harness import rundir

        self.path = Path(run_dir) / rundir.grads_file(dist.get_rank())
        optimizer = strategy.stepping_optimizer()
        original = optimizer.step

        def step(*args, **kwargs):
            optimizer.step = original  # once: later steps run the optimizer's own step()
            self._dump(strategy)
            return original(*args, **kwargs)

        optimizer.step = step  # an instance attribute: shadows the class's step() for this object only

    def _dump(self, strategy) -> None:
        import io

        import torch

        from harness.rundir import write_atomic

        buf = io.BytesIO()
        torch.save(strategy.full_gradients(), buf)
        write_atomic(self.path, buf.getvalue())

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass

    def finish(self, strategy, batch, steps_done: int) -> dict:
        return {}
