"""Test-only changes to the worker, loaded by Python at start-up when this folder is on PYTHONPATH.

Only the test suite puts it there (tests/parity.py, for the one run that asks), so nothing here
ships enabled: the harness has no switch for any of it. Two environment variables select:

BRIGADE_TEST_OPTIMIZER=sgd  plain SGD (no momentum, no normalisation) in place of AdamW everywhere the
    harness builds one (torch, ZeroRedundancyOptimizer, DeepSpeed's client optimizer), so a wrong
    gradient scale moves the loss of the next step in proportion, as AdamW's normalised update does not.

BRIGADE_TEST_PLANT=<name>   one planted bug from PLANTS, to show that the parity tests can fail.

BRIGADE_TEST_IMPORT_LOG=<dir>  every process of the run (parent, torchrun, ranks) writes the names in its
    sys.modules as it exits to <dir>/<pid>.txt (whatever loaded them: import statements, importlib, Hydra's
    plugin scan), so a test can hold the README's list of the files a run reads against what a run holds.
"""
from __future__ import annotations

import os


def _sgd() -> None:
    import torch

    class SGDWithAdamWSignature(torch.optim.SGD):
        def __init__(self, params, lr=1e-3, betas=None, eps=None, weight_decay=0.0, foreach=None, **_):
            super().__init__(params, lr=lr, weight_decay=weight_decay, foreach=foreach)

    torch.optim.AdamW = SGDWithAdamWSignature  # looked up at call time by every optimizer the harness builds


def _ddp_sums_over_dp() -> None:
    """DDP's gradient all-reduce sums over the dp ranks instead of averaging (grads x dp)."""
    import torch.distributed as dist

    from harness.strategies.ddp import DDPStrategy

    setup = DDPStrategy.setup

    def summing(state, bucket):
        fut = dist.all_reduce(bucket.buffer(), group=state, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    def planted(self, model):
        setup(self, model)
        self.model.register_comm_hook(self.mesh["dp"].get_group(), summing)

    DDPStrategy.setup = planted


def _fsdp_sums_over_dp() -> None:
    """FSDP's reduce-scatter sums over the dp ranks instead of averaging (grads x dp)."""
    import harness.strategies.fsdp as fsdp

    apply = fsdp.apply_fsdp

    def planted(model, dp_mesh, run):
        model = apply(model, dp_mesh, run)
        for m in model.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(1.0)  # "divide by 1" ...
                m.set_force_sum_reduction_for_comms(True)  # ... as a plain SUM (gloo has no PREMUL_SUM)
        return model

    fsdp.apply_fsdp = planted


def _drop_last_microbatch() -> None:
    """The accumulation loop skips the rank's last micro-batch (the loss is still a mean)."""
    from harness.strategies.base import Strategy

    train_step = Strategy.train_step
    Strategy.train_step = lambda self, mbs: train_step(self, mbs[:-1] if len(mbs) > 1 else mbs)


def _pipeline_scales_twice() -> None:
    """The pipeline divides by m twice: the loss by m and the schedule's scale_grads=True (grads / m)."""
    import functools

    import harness.strategies.pp as pp

    pp.SCHEDULES = {k: functools.partial(_force_scale_grads, cls) for k, cls in pp.SCHEDULES.items()}


def _force_scale_grads(cls, *args, **kwargs):
    return cls(*args, **{**kwargs, "scale_grads": True})


def _expert_grads_not_divided() -> None:
    """Expert-parallel: the expert gradients are summed over the dp ranks but not divided by dp."""
    from harness.strategies.ep import ExpertParallel

    reduce = ExpertParallel._reduce_grads

    def planted(self, params, group):
        reduce(self, params, group)
        if params is self.expert_params:
            for p in params:
                p.grad.mul_(self.dims.dp)

    ExpertParallel._reduce_grads = planted


def _deepspeed_scales_twice() -> None:
    """DeepSpeed: the harness divides each micro-batch's loss by the accumulation steps before
    engine.backward, which divides it again (grads / gradient_accumulation_steps); the recorded
    losses are the forward's, untouched."""
    from harness.strategies.deepspeed.engine import DeepSpeedStrategy

    setup = DeepSpeedStrategy.setup

    def planted(self, model):
        setup(self, model)
        backward = self.engine.backward
        self.engine.backward = lambda loss, **kwargs: backward(loss / self.num_microbatches, **kwargs)

    DeepSpeedStrategy.setup = planted


def _expert_replicas_not_reduced() -> None:
    """Expert-parallel with dp > ep: the expert gradients are not summed over the replicas (dp_rep)
    of each expert, only divided by dp. Invisible when dp == ep (no replicas)."""
    from harness.strategies.ep import ExpertParallel

    setup = ExpertParallel.setup

    def planted(self, model):
        setup(self, model)
        self.expert_group = None

    ExpertParallel.setup = planted


PLANTS = {"ddp_sums_over_dp": _ddp_sums_over_dp, "fsdp_sums_over_dp": _fsdp_sums_over_dp,
          "drop_last_microbatch": _drop_last_microbatch, "pipeline_scales_twice": _pipeline_scales_twice,
          "expert_grads_not_divided": _expert_grads_not_divided, "deepspeed_scales_twice": _deepspeed_scales_twice,
          "expert_replicas_not_reduced": _expert_replicas_not_reduced}

if os.environ.get("BRIGADE_TEST_OPTIMIZER") == "sgd":
    _sgd()
if os.environ.get("BRIGADE_TEST_PLANT"):
    PLANTS[os.environ["BRIGADE_TEST_PLANT"]]()


def _log_modules_at_exit(folder: str) -> None:
    """Write every module this process holds in sys.modules as it leaves: at the interpreter's exit,
    and from os._exit (the ranks leave without the interpreter's teardown, harness/worker/main.py). The
    entry point run as __main__ is written under its own name (`python -m harness` -> harness.__main__)."""
    import atexit
    import sys

    def write() -> None:
        names = list(sys.modules)  # in the order they were first imported
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        if spec is not None and spec.name:
            names.insert(0, spec.name)
        with open(os.path.join(folder, f"{os.getpid()}.txt"), "w") as f:
            f.write("\n".join(names) + "\n")

    real_exit = os._exit

    def exiting(code):
        write()
        real_exit(code)

    atexit.register(write)
    os._exit = exiting


if os.environ.get("BRIGADE_TEST_IMPORT_LOG"):
    _log_modules_at_exit(os.environ["BRIGADE_TEST_IMPORT_LOG"])
