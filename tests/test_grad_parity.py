"""Gradient parity: every strategy and engine computes `single`'s gradients, and trains like it.

For each layout (tests/parity.py LAYOUTS), one run with the worker's gradient dump and plain SGD:
after step 0's backward, every parameter's full gradient (gathered from shards, stages and tp
slices) equals single's within 1e-5 relative (L2 per tensor, fp32), and the SGD losses of the
following steps equal single's within 1e-5 (NaN or inf fails both). The planted-bug tests show that
each check can fail. CI (not heavy) holds one row per layout family (tests/test_parity_checks.py).
"""
from __future__ import annotations

import pytest

from tests.parity import (
    HEAVY,
    LAYOUTS,
    RTOL,
    check_gradients,
    check_losses,
    gradient_errors,
    gradients,
    loss_error,
    parity_run,
)

pytestmark = pytest.mark.slow

_RUNS: dict = {}


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    """The parity record of a layout (or `single:<model>`), run once per module and shared."""
    def get(name: str) -> dict:
        if name not in _RUNS:
            overrides = ["strategy=single", f"model={name.split(':')[1]}"] if name.startswith("single:") \
                else LAYOUTS[name].overrides
            _RUNS[name] = parity_run(overrides, tmp_path_factory.mktemp(name.replace(":", "_")))
        return _RUNS[name]

    return get


@pytest.mark.parametrize("layout", [pytest.param(name, marks=[pytest.mark.heavy] if name in HEAVY else [])
                                    for name in LAYOUTS])
def test_gradients_and_sgd_losses_match_single(layout, parity):
    rec, ref = parity(layout), parity(f"single:{LAYOUTS[layout].model}")
    worst = check_gradients(rec, ref)
    loss = check_losses(rec, ref)
    print(f"{layout}: worst gradient error {worst:.2g}, worst SGD loss error {loss:.2g}")


def test_single_gradients_are_those_of_the_global_batch_mean(parity):
    """The reference itself: its dumped gradients are non-zero for every parameter and its SGD
    losses move every step and fall over the run (so the checks above compare something that moves).
    Each step draws a new batch, so one step may rise: the claim is the size of every move."""
    ref = parity("single:tiny")
    grads = gradients(ref)
    assert len(grads) == 45 and all(len(c) == 1 for c in grads.values())  # tiny: 4 x 10 + 5 tensors
    assert all(c[0].norm() > 0 for c in grads.values())
    losses = ref["measured"]["losses"]
    # SGD moves the loss every step by far more than the tolerance (tiny: 6.948, 6.925, 6.944, 6.897)
    assert all(abs(b - a) > 100 * RTOL * a for a, b in zip(losses, losses[1:])), losses
    assert losses[0] - losses[-1] > 100 * RTOL * losses[0], losses


# Planted bugs (tests/inject/sitecustomize.py PLANTS), each with the layout whose parity it breaks.
# A gradient scale barely moves AdamW's losses (its update is normalised); the gradient check and
# the SGD losses must both see every one of these.
PLANTED = {
    "ddp_sums_over_dp": "ddp",  # gradients x dp
    "fsdp_sums_over_dp": "zero3",  # gradients x dp
    "drop_last_microbatch": "fsdp",  # one of the rank's 2 micro-batches never reaches the gradient
    "pipeline_scales_twice": "pp_1f1b",  # gradients / m
    "expert_grads_not_divided": "ep",  # expert gradients x dp
    "expert_replicas_not_reduced": "ep_dp4_ep2",  # expert gradients / dp_rep (only where dp > ep)
    "deepspeed_scales_twice": "ds_zero2",  # gradients / gradient_accumulation_steps
}


# CI plants one bug per check family (a dp reduction, the pipeline's divisor, the expert replicas'
# reduction, DeepSpeed's accumulation scale); the others in `make test-all`
CI_PLANTS = ("ddp_sums_over_dp", "pipeline_scales_twice", "expert_replicas_not_reduced", "deepspeed_scales_twice")


@pytest.mark.parametrize("plant", [pytest.param(p, marks=[] if p in CI_PLANTS else [pytest.mark.heavy])
                                   for p in PLANTED])
def test_planted_bug_fails_gradient_and_sgd_parity(plant, parity, tmp_path):
    layout = LAYOUTS[PLANTED[plant]]
    ref = parity(f"single:{layout.model}")
    rec = parity_run(layout.overrides, tmp_path, plant=plant)
    with pytest.raises(AssertionError, match="gradients differ from single's"):
        check_gradients(rec, ref)
    with pytest.raises(AssertionError, match="SGD losses differ"):
        check_losses(rec, ref)
    errors = gradient_errors(gradients(rec), gradients(ref))
    moved = sum(e > RTOL for e in errors.values())
    print(f"| {plant} | test_gradients_and_sgd_losses_match_single[{PLANTED[plant]}] | worst gradient "
          f"{max(errors.values()):.3g} relative ({moved} of {len(errors)} tensors over {RTOL:g}); "
          f"SGD loss {loss_error(rec, ref):.3g} relative |")
