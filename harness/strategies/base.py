"""The strategy interface: how one optimizer step is executed over this rank's share of the batch.

The timed loop (harness/worker/loop.py) is the same for every strategy. It calls:

    strategy.setup(model)            # wrap / shard / split the model and build the optimizer together
                                     # (DeepSpeed needs both at once, so they are not separate calls)
    strategy.train_step(microbatches) -> local loss or None
    strategy.state_tensors()         # the local tensors of params, grads and optimizer state
                                     # (counted by tensor_bytes: distinct storages, a DTensor's shard)

`Strategy` itself is plain single-device training with gradient accumulation; subclasses override
`setup`, `accumulating` (e.g. DDP's no_sync) or the whole `train_step` (pipelines, DeepSpeed).
"""
from __future__ import annotations

import contextlib
import re

import torch
from torch.distributed.tensor import DTensor

from models.gpt import loss_function

# Imports inside functions: the parts of torch, DeepSpeed and brigade that only some strategies, devices or
# modes use.

AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}  # also FSDP2's param_dtype


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (the tensor itself otherwise), read by the traceable-subclass protocol
    (`__tensor_flatten__` names its inner tensor first): `to_local()` would build an autograd node per call,
    which costs more than the operator whose output LiveTensors counts (a tenth of a dry run's time)."""
    if isinstance(t, DTensor):
        return getattr(t, t.__tensor_flatten__()[0][0])
    return t


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (tied or aliased tensors count once)."""
    seen, total = set(), 0
    for t in tensors:
        t = local_tensor(t)
        if t is None or t.device.type == "meta":
            continue
        # the StorageImpl, not data_ptr: fake tensors (launcher=dryrun) have no data pointer
        key = (t.device, t.untyped_storage()._cdata, t.storage_offset(), t.numel())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


class Strategy:
    def __init__(self, run, dims, mesh, device: torch.device, run_dir=None):
        self.run, self.dims, self.mesh, self.device = run, dims, mesh, device
        self.run_dir = run_dir  # where a strategy may leave files of its own (e.g. a pipeline timeline)
        # the context local shards are allocated in: a dry run (launch/dryrun.py) sets FakeTensorMode
        self.allocation = contextlib.nullcontext
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.precision = run.workload.precision
        self.loss_fn = loss_function(run.model)  # model.loss: fp32 | chunked (models/gpt.py)
        # fp16 needs loss scaling; bf16 and fp32 do not (GradScaler is CUDA-only here)
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16-mixed" else None

    # -- what a rank contributes -------------------------------------------------------------
    @property
    def loss_owner(self) -> bool:
        """Whether this rank's loss enters the reported global mean: one rank per data-parallel
        replica (tp replicas hold the same loss; only the last pipeline stage computes it)."""
        c = self.dims.coords(torch.distributed.get_rank())
        return c["tp"] == 0 and c["pp"] == self.dims.pp - 1

    # -- building ----------------------------------------------------------------------------
    def setup(self, model: torch.nn.Module) -> None:
        self.model = self.materialize(model)
        self.optimizer = self.make_optimizer(self.model.parameters())

    def materialize(self, module: torch.nn.Module) -> torch.nn.Module:
        """The model arrives on the meta device (nothing allocated). Every strategy calls this once per
        module, after its sharding (TP, FSDP, pipeline split, expert placement) and before any wrapper
        that needs real tensors (DDP): it allocates this rank's local shards on the device and
        initialises them so the full weights equal `single`'s (models/gpt.py). In a dry run
        (launch/dryrun.py) the same call runs under FakeTensorMode and allocates nothing."""
        from models.gpt import materialize

        with self.allocation():
            return materialize(module, self.device, self.run.workload.seed)

    def make_optimizer(self, params, foreach: bool | None = None) -> torch.optim.Optimizer:
        w = self.run.workload
        return torch.optim.AdamW(params, lr=w.lr, weight_decay=w.weight_decay, betas=(0.9, 0.95), foreach=foreach)

    def param_dtype(self) -> torch.dtype | None:
        """The dtype the distributed optimizer holds the params in (strategy.low_precision_params), or
        None: the params stay fp32 and autocast casts per operator."""
        if self.run.strategy.low_precision_params:
            return AUTOCAST_DTYPES[self.precision]
        return None

    # -- one optimizer step -----------------------------------------------------------------
    def autocast(self):
        dtype = AUTOCAST_DTYPES.get(self.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def accumulating(self, last: bool):
        """Context for one micro-batch's forward+backward; `last` is the one whose backward syncs."""
        return contextlib.nullcontext()

    def forward_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            logits = self.model(inputs)
            loss = self.loss_fn(logits, targets)
        aux = getattr(getattr(self.model, "module", self.model), "aux_loss", None)  # DDP wraps in .module
        aux = aux() if callable(aux) else None
        if aux is not None:
            loss = loss + self.run.model.aux_loss_coef * aux
        return loss

    def train_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        self.optimizer.zero_grad(set_to_none=True)
        n = len(microbatches)
        total = torch.zeros((), device=self.device)
        for i, (inputs, targets) in enumerate(microbatches):
            with self.accumulating(last=i == n - 1):
                loss = self.forward_loss(inputs, targets) / n  # mean over the rank's micro-batches
                self.backward(loss)
            total += loss.detach()
        self.optimizer_step()
        return total

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def optimizer_step(self) -> None:
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    # -- measurement ---------------------------------------------------------------------------
    def extra_measurements(self) -> dict:
        """Figures only this strategy can measure (e.g. a pipeline's bubble), called once after the
        timed steps; merged into this rank's result under "measured" (see harness/collect/aggregate.py)."""
        return {}

    def sync_disabled(self):
        """A context under which train_step skips gradient synchronisation, or None where the strategy
        has no such switch. Used only by the A/B measurement of exposed communication, after the timed
        steps (harness/worker/measure.py). Default: DDP's no_sync. Not FSDP: without gradient sync FSDP2
        leaves the sharded grads empty, so the optimizer step is skipped too and the difference
        would not be communication alone."""
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            return self.model.no_sync()
        return None

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Local tensors of the model states, for exact per-rank byte counts (DTensors are
        unwrapped by the caller). Override when an engine keeps them elsewhere (DeepSpeed)."""
        params = list(self.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        opt = [v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        return {"params": params, "grads": grads, "optimizer": opt}


    # -- gradients, for the parity tests (harness/worker/main.py) ----------------------------------
    def stepping_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer whose step() runs once per optimizer step with every gradient final
        (reduced, averaged): a step pre-hook on it sees the step's gradients. An optimizer that
        reduces inside its own step (harness/strategies/distributed_optimizer.py) names the inner
        optimizer it then steps."""
        return getattr(self.optimizer, "inner", self.optimizer)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """{name in the single-process model: full fp32 gradient} of every parameter this rank holds.
        A collective where grads are DTensors (FSDP shards, TP slices: full_tensor() gathers them),
        so every rank of the mesh calls it at the same point. Call between the last backward and
        the optimizer step (or after it: torch optimizers leave grads in place)."""
        reduced = getattr(self.optimizer, "reduced_local_grads", None)
        reduced = reduced() if callable(reduced) else {}
        out = {}
        for name, p in self.model.named_parameters():
            g = reduced.get(id(p), p.grad)
            if g is None:
                continue
            if id(p) in reduced and hasattr(p, "placements"):  # a TP shard: make it a DTensor again
                from torch.distributed.tensor import DTensor

                g = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False)
            full = getattr(g, "full_tensor", None)
            out[canonical_name(name)] = (full() if callable(full) else g).detach().float().cpu().clone()
        return out


# Wrappers that prefix parameter names: DDP's "module.", torch.compile's "_orig_mod.", checkpoint
# wrappers, and the pipeline's ModuleList of stages ("0.", "1.": a model's own names never start
# with a digit).
_WRAPPER_PREFIX = re.compile(r"(?:(?:^|(?<=\.))(?:module|_orig_mod|_checkpoint_wrapped_module)\.|^\d+\.)")


def over_fake_group(group) -> bool:
    """Whether `group` is torch's fake process group: a dry run (launch/dryrun.py), whose stand-ins for
    what needs values live in the *_fake.py modules beside each strategy."""
    import torch.distributed as dist

    return dist.get_backend(group) == "fake"


def canonical_name(name: str) -> str:
    """A parameter's name as the unwrapped single-process model names it."""
    return _WRAPPER_PREFIX.sub("", name)


STRATEGY = Strategy
