"""DeepSpeed ZeRO over torch's fake process group (launcher=dryrun): deepspeed.initialize and the step
on fake tensors.

`deepspeed.initialize` runs on the worker's process group (deepspeed.init_distributed wraps it,
`dist_init_required=False`) under `strategy.allocation()`, FakeTensorMode in a dry run: its flat
low-precision groups, fp32 master partitions, reduce buckets, contiguous gradient partitions and
stage 3's parameter partitions are fake tensors of their exact shapes, and every collective completes
at once over the fake group, with the allocations DeepSpeed makes around it (its flattened buckets,
the casts to the communication dtype, stage 3's gathered parameters). What needs more than that:
- the engine asserts LOCAL_RANK, which torchrun sets: the dry-run child sets it (the dry run's device
  is the CPU, where the local rank names no device); DeepSpeed's accelerator is its CPU one;
- the engine moves the module to its device (`module.to(device)`). The parameters are already there,
  so in a real run that call changes nothing and allocates nothing; on fake parameters torch's
  Module._apply swaps each parameter for a new one and refuses (fake tensors carry weak references).
  During initialize the module's `to` returns it unchanged where every tensor is already on that
  device, as torch's does for real tensors (`device_kept`);
- DeepSpeed reads values where a dry run has none (FakeTensorMode raises DataDependentOutputException
  on aten._local_scalar_dense). Each read is answered by what a healthy real run reads, around
  DeepSpeed's own code, which still makes every allocation it makes (`_Answering`):
    the ZeRO optimizer's step reads overflow and invalid-norm flags (stages 1/2: `has_overflow` under
    bf16, `is_invalid_grad_norm` on the global norm; stage 3: the latter): a one-element bool or
    uint8 tensor, read as False (no overflow, a finite norm); any other read in the step still raises;
    stage 3 checks that every rank recorded the same module and parameter order
    (`zero.utils.assert_ints_same_as_other_ranks`: a broadcast from rank 0 read element by element):
    over the fake group every rank is this one running the same code, so rank 0's list is read as this
    rank's own.
A real run is untouched. DeepSpeed's pipeline engine, MoE layers, ZeRO-Offload (per-gradient overflow
trackers and norms in host memory) and stage 0's unfused bf16/fp16 optimizer (the gradient norm's value)
read more values and are refused in a dry run (harness/validate.py).
torch 2.13 warns where stage 1/2 assert a partition's alignment by its data_ptr() (0 on a fake tensor, so
the assert holds); a torch that raises there instead needs a stand-in for that assert.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Imports inside functions: DeepSpeed, which only the deepspeed engine loads.

_VALUE_READ = torch.ops.aten._local_scalar_dense.default
_FLAG_DTYPES = (torch.bool, torch.uint8)


def prepare() -> None:
    """What deepspeed.initialize needs in a dry-run child before it runs (see the module docstring)."""
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    os.environ.setdefault("LOCAL_RANK", "0")
    if get_accelerator().device_name() != "cpu":  # the fake tensors live on the CPU (launch/dryrun.py)
        set_accelerator(CPU_Accelerator())


@contextlib.contextmanager
def device_kept(module: torch.nn.Module):
    """module.to(device) returns the module unchanged where every parameter and buffer is already on
    `device` (what torch's `to` amounts to for real tensors); torch's own `to` otherwise."""
    own = module.to

    @functools.wraps(own)
    def to(*args, **kwargs):
        # DeepSpeed calls module.to(self.device): one device, no dtype
        if not kwargs and len(args) == 1 and isinstance(args[0], (str, torch.device)):
            device = torch.device(args[0])
            if all(t.device == device for t in (*module.parameters(), *module.buffers())):
                return module
        return own(*args, **kwargs)

    module.to = to  # an instance attribute: shadows nn.Module.to for this module only, during initialize
    try:
        yield
    finally:
        del module.to


class _Answering(TorchDispatchMode):
    """Answers a value read (aten._local_scalar_dense: .item(), bool()) of a tensor that `accepts` with
    the next of `answers`; every other operator, and any other read, runs as usual."""

    def __init__(self, answers, accepts):
        super().__init__()
        self.answers, self.accepts = iter(answers), accepts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _VALUE_READ and self.accepts(args[0]):
            return next(self.answers)
        return func(*args, **(kwargs or {}))


def _answered(fn, answers, accepts):
    """`fn` with its value reads answered: answers(*args, **kwargs) -> the values, in order."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with _Answering(answers(*args, **kwargs), accepts):
            return fn(*args, **kwargs)

    run.dryrun_answered = True
    return run


def _is_flag(t: torch.Tensor) -> bool:
    return t.numel() == 1 and t.dtype in _FLAG_DTYPES


def answer_reads(zero_optimizer) -> None:
    """Install the answers to DeepSpeed's value reads in this dry-run child (see the module docstring)."""
    from deepspeed.runtime.zero import utils as zero_utils

    # the step's overflow and invalid-norm flags: False, as in a step whose gradients are finite
    zero_optimizer.step = _answered(zero_optimizer.step, lambda *a, **k: itertools.repeat(False), _is_flag)
    # stage 3's order check across ranks: rank 0's list is this rank's own (module globals, which
    # assert_ints_same_as_other_ranks looks up at each call; set once per process)
    if not getattr(zero_utils.get_lst_from_rank0, "dryrun_answered", False):
        is_int = lambda t: not t.dtype.is_floating_point  # noqa: E731
        zero_utils.get_lst_from_rank0 = _answered(zero_utils.get_lst_from_rank0, lambda lst: iter(lst), is_int)
        zero_utils.assert_lst_len_same_as_other_ranks = _answered(
            zero_utils.assert_lst_len_same_as_other_ranks, lambda lst: iter([len(lst)]), is_int)
