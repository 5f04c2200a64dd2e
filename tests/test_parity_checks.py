"""The gradient and loss checks of tests/parity.py on hand-made dumps (pure: no run, no process group).

A check that lets a NaN through passes a layout whose gradients are garbage: NaN compares false with
everything, so `error > rtol` is false for it, and max() over the ranks that hold a parameter keeps
a finite copy that comes before a NaN one.
"""
from __future__ import annotations

import math

import pytest
import torch

from harness import catalog
from harness.rundir import grads_file
from tests.parity import HEAVY, LAYOUTS, check_gradients, check_losses, worst

GRADS = {"wte.weight": torch.tensor([[1.0, -2.0], [0.5, 3.0]]), "ln_f.bias": torch.tensor([0.25, -0.75])}


def record(tmp_path, name: str, per_rank: list[dict], losses=(6.9, 6.8, 6.7)) -> dict:
    """A record whose run directory holds one gradient dump per rank, as the worker writes them."""
    run_dir = tmp_path / name
    run_dir.mkdir()
    for rank, grads in enumerate(per_rank):
        torch.save(grads, run_dir / grads_file(rank))
    return {"run_dir": str(run_dir), "dims": {"world_size": len(per_rank)}, "measured": {"losses": list(losses)}}


def with_value(name: str, value: float) -> dict:
    grads = {k: v.clone() for k, v in GRADS.items()}
    grads[name].view(-1)[1] = value
    return grads


@pytest.fixture
def single(tmp_path):
    return record(tmp_path, "single", [GRADS])


def test_equal_gradients_and_losses_pass(tmp_path, single):
    rec = record(tmp_path, "ddp", [GRADS, GRADS])
    assert check_gradients(rec, single) == 0.0
    assert check_losses(rec, single) == 0.0


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("bad_rank", [0, 1])  # rank 1: after a finite copy, where max() hid a NaN
def test_a_non_finite_gradient_on_any_rank_fails(tmp_path, single, value, bad_rank):
    per_rank = [GRADS, GRADS]
    per_rank[bad_rank] = with_value("ln_f.bias", value)
    rec = record(tmp_path, "ddp", per_rank)
    with pytest.raises(AssertionError, match=r"1 of 2 gradients differ from single's.*worst ln_f.bias: (nan|inf)"):
        check_gradients(rec, single)


def test_a_nan_in_single_s_gradient_fails(tmp_path):
    """The reference itself broken: no layout can be said to match it."""
    ref = record(tmp_path, "single", [with_value("wte.weight", math.nan)])
    with pytest.raises(AssertionError, match="worst wte.weight: nan"):
        check_gradients(record(tmp_path, "ddp", [GRADS, GRADS]), ref)


@pytest.mark.parametrize("losses", [(math.nan, 6.8, 6.7), (6.9, math.nan, 6.7), (6.9, 6.8, math.inf)])
def test_a_non_finite_loss_fails(tmp_path, single, losses):
    with pytest.raises(AssertionError, match="SGD losses differ from single's by (nan|inf)"):
        check_losses(record(tmp_path, "ddp", [GRADS, GRADS], losses), single)


def test_worst_is_nan_wherever_the_nan_is():
    assert math.isnan(worst([0.0, math.nan])) and math.isnan(worst([math.nan, 0.0]))
    assert worst([1e-7, 3e-6, 2e-7]) == 3e-6


def test_every_layout_family_has_a_gradient_row_in_ci():
    """`make test` (not heavy) checks the gradients of every family with SGD: each strategy of the
    catalog, each pipeline schedule, DeepSpeed's ZeRO stages 0-3 (ddp is stage 0), HSDP, ep with
    dp > ep (the expert replicas' reduction) and tp with the gathered loss. A new strategy or
    schedule without its row fails here."""
    rows = [dict(o.split("=", 1) for o in layout.overrides) for name, layout in LAYOUTS.items() if name not in HEAVY]
    torch_rows = [r for r in rows if r.get("strategy.engine", "torch") == "torch"]
    assert set(catalog.STRATEGIES) - {"single"} <= {r["strategy"] for r in torch_rows}
    assert {r["strategy.schedule"] for r in torch_rows if r["strategy"] == "pp"} == set(catalog.SCHEDULES)
    assert {"ddp", "zero1", "zero2", "zero3"} <= {r["strategy"] for r in rows if r.get("strategy.engine") == "deepspeed"}
    assert any(int(r.get("parallel.dp_replicate", 1)) > 1 for r in torch_rows)
    assert any(r["strategy"] == "ep" and int(r["parallel.dp"]) > int(r["parallel.ep"]) for r in torch_rows)
    assert any(r["strategy"] == "tp" and r.get("strategy.loss_parallel") == "false" for r in torch_rows)
