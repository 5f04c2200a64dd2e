"""Gradient and SGD-loss parity with `single`: the machinery behind tests/test_grad_parity.py.

One run per layout does both checks (so a layout costs one multi-process run):
  - the worker dumps every parameter's full gradient of step 0 (harness/worker/main.py, enabled by
    BRIGADE_GRAD_DUMP=1): taken at the entry of the first optimizer step, so after every
    micro-batch's backward and the data-parallel reduction; each rank writes the gradients it holds,
    gathered from FSDP shards and TP slices (full_tensor) or DeepSpeed partitions;
  - the run trains with plain SGD (tests/inject/sitecustomize.py, BRIGADE_TEST_OPTIMIZER=sgd), so a
    wrong gradient scale moves the later losses in proportion (AdamW normalises it away).
A layout is one row of LAYOUTS; a planted bug (tests/inject/sitecustomize.py PLANTS) is one env var.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from harness import catalog, rundir
from tests.helpers import REPO, run

INJECT = REPO / "tests" / "inject"
# SGD's step must be large enough that a wrong gradient scale shows in the next losses: at lr 0.5
# the tiny model's loss moves by 0.3-0.7 % per step (6.948, 6.925, 6.944, 6.897; a new batch each step),
# 300x the tolerance or more.
PARITY = ["model=tiny", "logger=none", "workload.warmup_steps=1", "workload.steps=3", "workload.profile_steps=0",
          "workload.lr=0.5", "launcher.timeout_s=300"]
RTOL = 1e-5  # fp32: the layouts differ from single only in reduction order (~1e-7 relative measured)


@dataclass(frozen=True)
class Layout:
    overrides: tuple[str, ...]
    model: str = "tiny"  # the single reference it is compared with


def ds(*overrides: str, model: str = "tiny") -> Layout:
    return Layout(("strategy.engine=deepspeed", *overrides), model)


# One row per layout. Adding a layout = one row here (and, for a new family, one fixture's worth of
# time in CI): the test parametrises over this table.
LAYOUTS: dict[str, Layout] = {
    "ddp": Layout(("strategy=ddp", "parallel.dp=2")),
    "zero1": Layout(("strategy=zero1", "parallel.dp=2")),
    "fsdp": Layout(("strategy=fsdp", "parallel.dp=2", "workload.activation_checkpointing=full")),
    "zero2": Layout(("strategy=zero2", "parallel.dp=2")),
    "zero3": Layout(("strategy=zero3", "parallel.dp=2")),
    "tp_loss_parallel": Layout(("strategy=tp", "parallel.tp=2", "strategy.loss_parallel=true")),
    # loss_parallel=false: the logits gathered over the vocabulary, a plain cross-entropy (with sp on, one launch)
    "tp_sp_gathered_loss": Layout(("strategy=tp", "parallel.tp=2", "strategy.sequence_parallel=true",
                                   "strategy.loss_parallel=false")),
    # every schedule of the catalog, at the vpp it needs (2 where it takes any vpp >= 2)
    **{f"pp_{name}": Layout(("strategy=pp", "parallel.pp=2", f"parallel.vpp={row.vpp or 2}",
                             f"strategy.schedule={name}"))
       for name, row in catalog.SCHEDULES.items()},
    "3d_fsdp_2x2x2": Layout(("strategy=3d", "parallel.dp=2", "parallel.tp=2", "parallel.pp=2")),
    "3d_ddp_dp2_pp2_interleaved": Layout(("strategy=3d", "parallel.dp=2", "parallel.pp=2", "parallel.vpp=2",
                                          "strategy.data_parallel=ddp", "strategy.schedule=interleaved_1f1b")),
    "ep": Layout(("strategy=ep", "model=moe_tiny", "parallel.dp=2", "parallel.ep=2"), "moe_tiny"),
    # dp > ep: 2 replicas of each expert, whose gradients are reduced over dp_rep (harness/strategies/ep.py)
    "ep_dp4_ep2": Layout(("strategy=ep", "model=moe_tiny", "parallel.dp=4", "parallel.ep=2"), "moe_tiny"),
    # the layouts of the 4D issue: HSDP, context parallel, FSDP's sharded accumulation, MoE inside 3d
    "hsdp_dp4_replicate2": Layout(("strategy=fsdp", "parallel.dp=4", "parallel.dp_replicate=2")),
    # ZeRO-2 (FSDP2, reshard_after_forward=false) as HSDP: both families in one launch of 4 ranks
    "zero2_hsdp_dp4_replicate2": Layout(("strategy=zero2", "parallel.dp=4", "parallel.dp_replicate=2")),
    "zero3_sharded_accumulation": Layout(("strategy=zero3", "parallel.dp=2", "strategy.fsdp_accumulate=sharded")),
    "3d_dp2_pp2_sharded_accumulation": Layout(("strategy=3d", "parallel.dp=2", "parallel.pp=2",
                                               "strategy.fsdp_accumulate=sharded")),
    "3d_cp2": Layout(("strategy=3d", "parallel.cp=2")),
    "zero1_distributed": Layout(("strategy=zero1", "parallel.dp=2", "strategy.zero1_impl=distributed")),
    "3d_distributed_optimizer_2x2x2": Layout(("strategy=3d", "parallel.dp=2", "parallel.tp=2", "parallel.pp=2",
                                              "strategy.data_parallel=zero1")),
    "3d_moe_dp2_ep2_pp2": Layout(("model=moe_tiny", "strategy=3d", "parallel.dp=2", "parallel.ep=2", "parallel.pp=2",
                                  "strategy.data_parallel=ddp"), "moe_tiny"),
    "ds_zero0": ds("strategy=ddp", "parallel.dp=2"),
    "ds_zero1": ds("strategy=zero1", "parallel.dp=2"),
    "ds_zero2": ds("strategy=zero2", "parallel.dp=2"),
    "ds_zero3": ds("strategy=zero3", "parallel.dp=2"),
    "ds_pp": ds("strategy=pp", "parallel.pp=2", "strategy.zero_stage=1"),
    "ds_moe_ep2": ds("model=moe_tiny", "strategy=ep", "parallel.dp=2", "parallel.ep=2", "strategy.zero_stage=2",
                     model="moe_tiny"),
}

# CI (`make test`, not heavy) runs one SGD gradient row per layout family: every pipeline schedule,
# ddp, zero1 (both implementations), zero2 and HSDP (one row), zero3 (with sharded accumulation too),
# fsdp, tp (loss parallel; sequence parallel with the gathered loss), ep with dp > ep, context
# parallel, 3d, and DeepSpeed ZeRO 0 to 3, its pipeline and its MoE. These rows check a mechanism
# that a CI row above already holds, composed another way; they run in `make test-all`.
HEAVY = {"zero2", "hsdp_dp4_replicate2",  # zero2_hsdp_dp4_replicate2
         "ep",  # ep_dp4_ep2: the same all-to-all, plus the expert replicas' reduction
         "3d_ddp_dp2_pp2_interleaved",  # 3d_fsdp_2x2x2, ddp and pp_interleaved_1f1b
         "3d_dp2_pp2_sharded_accumulation",  # zero3_sharded_accumulation and 3d_fsdp_2x2x2
         "3d_distributed_optimizer_2x2x2",  # zero1_distributed and 3d_fsdp_2x2x2
         "3d_moe_dp2_ep2_pp2"}  # ep_dp4_ep2 and the pipeline rows


@contextlib.contextmanager
def _env(**values: str | None):
    """Set environment variables for the runs started inside (workers inherit os.environ)."""
    old = {k: os.environ.get(k) for k in values}
    try:
        _apply(values)
        yield
    finally:
        _apply(old)


def _apply(values: dict) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def parity_run(overrides, results_dir: Path, plant: str | None = None) -> dict:
    """One run with the gradient dump and plain SGD (and a planted bug if asked); its record."""
    path = os.pathsep.join(p for p in (str(INJECT), os.environ.get("PYTHONPATH")) if p)
    with _env(BRIGADE_GRAD_DUMP="1", BRIGADE_TEST_OPTIMIZER="sgd", BRIGADE_TEST_PLANT=plant, PYTHONPATH=path):
        rec = run([*PARITY, *overrides], results_dir, fast=False)
    assert rec["status"] == "ok", rec["error"]
    return rec


def gradients(rec: dict) -> dict[str, list[torch.Tensor]]:
    """{parameter name: [the full gradient from every rank that holds it]}."""
    files = sorted(Path(rec["run_dir"]).glob(rundir.GRADS_GLOB))
    assert len(files) == rec["dims"]["world_size"], f"{len(files)} gradient dumps for {rec['dims']}"
    out: dict[str, list[torch.Tensor]] = {}
    for f in files:
        for name, g in torch.load(f).items():
            out.setdefault(name, []).append(g)
    return out


def worst(values) -> float:
    """The largest value, NaN if any is NaN: Python's max() keeps whichever of NaN and a number
    comes first (every comparison with NaN is false), so a NaN copy after a finite one would vanish."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def gradient_errors(grads: dict, reference: dict) -> dict[str, float]:
    """Per parameter, the worst relative error ||g - g_single|| / ||g_single|| over the ranks that
    hold it (the norm of the difference alone where single's gradient is zero); NaN or inf where a
    copy, or single's gradient, is not finite."""
    errors = {}
    for name, copies in grads.items():
        ref = reference[name][0]
        scale = ref.norm().item() or 1.0
        errors[name] = worst((g - ref).norm().item() / scale for g in copies)
    return errors


def check_gradients(rec: dict, ref: dict, rtol: float = RTOL) -> float:
    """Every parameter's gradient equals single's within rtol; returns the worst relative error."""
    grads, reference = gradients(rec), gradients(ref)
    missing, extra = sorted(set(reference) - set(grads)), sorted(set(grads) - set(reference))
    assert not missing and not extra, f"gradients missing: {missing}; not in single's model: {extra}"
    for name, copies in grads.items():
        assert all(g.shape == reference[name][0].shape for g in copies), (name, [g.shape for g in copies])
    errors = gradient_errors(grads, reference)
    bad = {n: e for n, e in errors.items() if not e <= rtol}  # not `e > rtol`: NaN must fail too
    ranked = sorted(bad.items(), key=lambda x: -math.inf if math.isnan(x[1]) else -x[1])  # NaN first
    assert not bad, (f"{len(bad)} of {len(errors)} gradients differ from single's by more than {rtol:g} "
                     f"(relative L2, NaN included); worst {ranked[0][0]}: {ranked[0][1]:.3g}; " +
                     ", ".join(f"{n}: {e:.3g}" for n, e in ranked[:6]))
    return worst(errors.values())


def loss_error(rec: dict, ref: dict) -> float:
    a, b = rec["measured"]["losses"], ref["measured"]["losses"]
    assert len(a) == len(b), (a, b)
    return worst(abs(x - y) / abs(y) for x, y in zip(a, b))


def check_losses(rec: dict, ref: dict, rtol: float = RTOL) -> float:
    """The SGD run's losses, step by step, equal single's within rtol (NaN fails); returns the worst
    relative error."""
    err = loss_error(rec, ref)
    assert err <= rtol, f"SGD losses differ from single's by {err:.3g} relative (> {rtol:g}): " \
                        f"{rec['measured']['losses']} vs {ref['measured']['losses']}"
    return err
