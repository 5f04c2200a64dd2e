"""The DeepSpeed engine, shared by the three DeepSpeed strategy modules beside it (zero.py: ddp as
ZeRO-0 and zero1/2/3; pipeline.py: a PipelineModule, ZeRO 0/1; moe.py: DeepSpeed MoE layers). Which
one runs a config is harness/catalog.py's `module_of` (pipeline when pp > 1, moe when the model has
experts, zero otherwise).

The harness writes the DeepSpeed config (harness/strategies/deepspeed/config.py) into the run directory and hands
`deepspeed.initialize` the model and a client torch AdamW (same lr/betas/eps/weight_decay as every
native strategy), so nothing is JIT-compiled.

One optimizer step is the base strategy's: the same micro-batches, `engine.backward` (which divides
the loss by gradient_accumulation_steps, as the base divides by the micro-batch count) and
`engine.step` after each (DeepSpeed steps only at its accumulation boundary).

Model-state bytes are captured from a step post-hook on the client optimizer during the first
step (DeepSpeed's ZeRO optimizers call its step once per param group): at each call the group's
master, its fp32 gradient partition and its optimizer state are alive, so the capture holds every
state at its peak. DeepSpeed's reduce buffers (the bucket, stage 3's contiguous low-precision
gradient partition it flattens the fp32 one from) are reported apart, under measured.deepspeed.

In a dry run (launcher=dryrun) initialize and the step run on fake tensors over torch's fake process
group, as harness/strategies/ds_fake.py says.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from harness.strategies import ds_fake
from harness.strategies.base import Strategy, canonical_name, over_fake_group, tensor_bytes
from harness.strategies.deepspeed import config as ds_config
from harness.validate import num_microbatches

# Imports inside functions: the parts of torch, DeepSpeed and brigade that only some strategies, devices or
# modes use.


def import_deepspeed():
    """Import DeepSpeed with the ops it would JIT-compile on first use switched off.

    `deepspeed.initialize` builds a shared-memory comm op (~110 s compile on this CPU) that
    training over gloo does not need; marking it incompatible skips the build (docs/notes.md)."""
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def loaded_ops() -> dict[str, str]:
    """Every DeepSpeed op loaded in this process -> "prebuilt" or "jit" (compiled at run time).
    OpBuilder keeps one class-level registry of loaded ops, whichever builder loaded them."""
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder.builder import OpBuilder

    return {name: "prebuilt" if installed_ops.get(name) else "jit" for name in OpBuilder._loaded_ops}


class DeepSpeedStrategy(Strategy):
    """The DeepSpeed engine; the pipeline and MoE strategies differ in the module they build."""

    engine = None

    # -- building ----------------------------------------------------------------------------
    def setup(self, model: torch.nn.Module) -> None:
        deepspeed = import_deepspeed()
        deepspeed.init_distributed(dist_backend=dist.get_backend())  # wraps the worker's process group

        self.num_microbatches = num_microbatches(self.run, self.dims)
        self.config = ds_config.build(self.run, self.dims.dp, self.num_microbatches)
        if self.run_dir is not None:
            ds_config.write(self.config, self.run_dir)
        model = self.build_module(self.materialize(model))  # no deepspeed.zero.Init: see materialize
        self.client_optimizer = self.make_client_optimizer(self.optimizer_groups(model))
        # over the fake group (a dry run) initialize allocates fake tensors and its value reads are answered
        # as harness/strategies/ds_fake.py says; a real run gets none of that (allocation() does nothing)
        dry = over_fake_group(dist.group.WORLD)
        if dry:
            ds_fake.prepare()
        with self.allocation(), ds_fake.device_kept(model) if dry else contextlib.nullcontext():
            # dist_init_required=False: the worker's process group, as init_distributed wrapped it above
            self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=self.client_optimizer,
                                                        config=self.config, dist_init_required=False)
        if dry:
            ds_fake.answer_reads(self.engine.optimizer)
        self.model = self.engine  # forward_loss calls self.model(inputs); aux losses via .module
        self.optimizer = self.engine.optimizer
        self._captured: dict[str, list[torch.Tensor]] | None = None
        self._pending: dict[str, dict[int, torch.Tensor]] = {}  # the capture step's tensors, by id
        self._host_bytes: dict[str, int] = {}
        self._grad_buffers_bytes = 0
        self._ds_timer_steps: list[dict[str, float]] = []  # DeepSpeed's timers, one dict per step
        self._capture = True
        self.client_optimizer.register_step_post_hook(self._capture_states)

    def build_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module DeepSpeed wraps (pipeline and MoE subclasses rebuild it)."""
        return model

    def optimizer_groups(self, model: torch.nn.Module):
        return [{"params": [p for p in model.parameters() if p.requires_grad], "name": "dense"}]

    def make_client_optimizer(self, groups) -> torch.optim.Optimizer:
        """The native strategies' torch AdamW (base.make_optimizer: same lr, betas, eps, weight decay);
        DeepSpeedCPUAdam with those hyper-parameters when strategy.ds.cpu_adam (prebuilt op only:
        validate refuses it otherwise, since loading it would JIT-compile it)."""
        opt = self.make_optimizer(groups)
        if self.run.strategy.ds.cpu_adam:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            d = opt.defaults
            opt = DeepSpeedCPUAdam(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
                                   adamw_mode=True)
        return opt

    # -- one optimizer step -----------------------------------------------------------------
    def autocast(self):
        return contextlib.nullcontext()  # DeepSpeed's bf16/fp16 sections cast the module itself

    def train_step(self, microbatches):
        total = torch.zeros((), device=self.device)
        for inputs, targets in microbatches:
            loss = self.forward_loss(inputs, targets)
            self.engine.backward(loss)  # scaled by 1/gradient_accumulation_steps inside
            self.engine.step()  # an optimizer step only at the accumulation boundary (the last one)
            total += loss.detach().float()
        self._close_capture()
        if self.run.strategy.ds.wall_clock_breakdown:
            self._ds_timer_steps.append(self.read_ds_timers())
        assert self.engine.global_steps > 0 and self.engine.micro_steps % self.num_microbatches == 0
        return total / len(microbatches)  # mean over this rank's micro-batches, as the base returns

    def sync_disabled(self):
        # DeepSpeed's no_sync() forbids engine.step() inside it, which every micro-batch here calls
        # (the engine decides the boundary), and stages 2/3 refuse it: no A/B window on this engine.
        return None

    # -- gradients, for the parity tests -------------------------------------------------------
    def stepping_optimizer(self):
        # the ZeRO optimizer (or the client one at stage 0): at the entry of its step() the reduced
        # gradients are still readable; inside it, ZeRO 1/2 free them group by group
        return self.engine.optimizer

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """DeepSpeed's safe_get_full_grad per parameter: the gradient itself at stage 0, the fp32
        partitions gathered over the parameter's data-parallel group at stages 1-3 (a collective:
        every rank calls it, in the same parameter order)."""
        from deepspeed.utils import safe_get_full_grad

        out = {}
        for name, p in self.engine.module.named_parameters():
            g = safe_get_full_grad(p)
            if g is not None:
                out[self.gpt_name(name)] = g.detach().float().cpu().clone()
        return out

    def gpt_name(self, name: str) -> str:
        """The single-process GPT's name of the engine module's parameter `name`."""
        return canonical_name(name)

    # -- measurement ---------------------------------------------------------------------------
    def _capture_states(self, optimizer, args, kwargs) -> None:
        """Step post-hook of the client optimizer. ZeRO 1-3 step one parameter group at a time (a
        group's fp32 gradient partition exists only around its own step), so during the captured
        step every call adds what it sees; the end of train_step closes the capture."""
        if not self._capture:
            return
        for key, tensors in self.optimizer_states().items():
            seen = self._pending.setdefault(key, {})
            for t in tensors:
                seen.setdefault(id(t), t)  # the reference held keeps the id unique until closed
        self._grad_buffers_bytes = max(self._grad_buffers_bytes, tensor_bytes(self.grad_buffers()))

    def _close_capture(self) -> None:
        if not (self._capture and self._pending):
            return
        states = {"params": self.module_states(), **{k: list(v.values()) for k, v in self._pending.items()}}
        self._captured, host = self.split_offloaded(states)
        self._host_bytes = {f"{k}_bytes": tensor_bytes(v) for k, v in host.items()}
        self._pending, self._capture = {}, False

    def module_states(self) -> list[torch.Tensor]:
        """The module's parameters as this rank holds them."""
        module_params = list(self.engine.module.parameters())
        if self.run.strategy.zero_stage == 3:  # the partition (ds_tensor), plus params it keeps whole
            return ([p.ds_tensor for p in module_params] +
                    [p.data for p in module_params if getattr(p, "ds_persist", False)])
        return module_params

    def optimizer_states(self) -> dict[str, list[torch.Tensor]]:
        """What the client optimizer holds now: the tensors it steps (a separate fp32 master copy,
        or, at stage 0 in fp32, the module's own params), their gradients, its state."""
        opt = self.client_optimizer
        stepped = [p for g in opt.param_groups for p in g["params"]]
        # storages by their StorageImpl, not data_ptr: a dry run's fake tensors have no data pointer
        module_storages = {p.untyped_storage()._cdata for p in self.engine.module.parameters()}
        return {"master": [p for p in stepped if p.untyped_storage()._cdata not in module_storages],
                "grads": [p.grad for p in stepped if p.grad is not None],
                "optimizer": [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]}

    def split_offloaded(self, states: dict) -> tuple[dict, dict]:
        """(states on the device, states strategy.offload keeps in host memory)."""
        host = self.offloaded_keys()
        return ({k: v for k, v in states.items() if k not in host}, {k: v for k, v in states.items() if k in host})

    def offloaded_keys(self) -> tuple[str, ...]:
        """States that strategy.offload keeps in host memory instead of on the device."""
        return {"none": (), "optimizer": ("master", "grads", "optimizer"),
                "optimizer+params": ("params", "master", "grads", "optimizer")}[self.run.strategy.offload]

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        states, self._captured = self._captured, None  # release the references held since the step
        if states is None:  # asked again later: what is alive now (grads are freed between steps)
            states = self.split_offloaded({"params": self.module_states(), **self.optimizer_states()})[0]
        return states

    def extra_measurements(self) -> dict:
        out = {"zero_stage": self.run.strategy.zero_stage, "ops_loaded": loaded_ops()}
        if self.run.strategy.offload != "none":
            out["offloaded_bytes"] = self._host_bytes  # captured with the device states, at the step
        out["grad_buffers_bytes"] = self._grad_buffers_bytes  # at the step, beside the captured states
        if self.run.strategy.ds.wall_clock_breakdown:
            out["timers_ms"] = self.engine_timers()
        if self.run.strategy.ds.comms_logger:
            out["comms"] = self.comms_summary()
        return {"deepspeed": out}

    def grad_buffers(self) -> list[torch.Tensor]:
        """Gradient buffers DeepSpeed reduces into, besides the fp32 gradient partition the optimizer
        steps: the reduce bucket (ipg), the contiguous low-precision gradient partition that stage 2
        (grads_in_partition) and stage 3 (grad_partitions_flat_buffer) flatten a fresh fp32 copy from."""
        opt = self.engine.optimizer
        out = []
        for name in ("ipg_buffer", "grads_in_partition", "grad_partitions_flat_buffer"):
            v = getattr(opt, name, None)
            out += [t for t in (v if isinstance(v, (list, tuple)) else [v]) if torch.is_tensor(t)]
        return out

    def read_ds_timers(self) -> dict[str, float]:
        """DeepSpeed's global timers for the step just run, ms. The engine logs and resets them at
        each accumulation boundary after caching their values (get_wall_clock_timers)."""
        cache = self.engine.get_wall_clock_timers()
        return {name: cache[name] for name in self.engine.engine_timers.global_timers if name in cache}

    def engine_timers(self) -> dict[str, float]:
        """DeepSpeed's own timers (wall_clock_breakdown): mean ms per optimizer step over the timed steps."""
        w = self.run.workload
        timed = self._ds_timer_steps[w.warmup_steps:w.warmup_steps + w.steps]
        names = sorted({n for step in timed for n in step})
        return {f"{n}_ms": sum(step.get(n, 0.0) for step in timed) / len(timed) for n in names} if timed else {}

    def comms_summary(self) -> dict:
        """DeepSpeed's comms logger (every collective through deepspeed.comm, timed synchronously):
        per op and message size, calls and mean latency / bus bandwidth, over all steps so far."""
        from deepspeed.comm import comm as ds_comm

        out = {"steps_covered": self.engine.global_steps}
        for op, sizes in ds_comm.comms_logger.comms_dict.items():
            for size, (count, lats, _algbws, busbws) in sorted(sizes.items()):
                out.setdefault(op, {})[f"{size}B"] = {
                    "count": count, "latency_ms_mean": sum(lats) / count,
                    "busbw_GBps_mean": sum(busbws) / count / 8}  # DeepSpeed reports Gbit/s
        return out
