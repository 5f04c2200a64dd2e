"""Expert parallel has a dry run: a fake tensor has no routing, so a dry run routes at the balanced load
(harness/strategies/ep_fake.py), and a real run with model.routing=balanced routes so too: its
LiveTensors peak on every rank equals the dry run's, in bytes, step, phase and live bytes by kind.
Balanced routing is topk's operators with the choices overwritten (models/moe.py), at the load
`balanced_load` computes on the host."""
from __future__ import annotations

import pytest
import torch

from harness.validate import MODEL_OPTIONS
from harness.worker.measure import LiveTensors
from models.moe import ROUTINGS, balanced_load, route
from tests.helpers import run
from tests.test_moe import moe_tiny_state_bytes

BASE = ["model=moe_tiny", "workload.global_batch_size=8", "workload.micro_batch_size=2", "logger=none"]
REAL = ["workload.live_tensors=true", "workload.warmup_steps=2", "workload.steps=1", "workload.profile_steps=0"]
# gloo runs a collective on its own thread, which can free the collective's buffer after the step has moved
# on (the fake group holds none): on a loaded machine a real rank then holds one gradient reduction's flat
# buffer more, at most moe_tiny's dense gradients in fp32 (seen: ep dp4 ep2 +1,048,576 B, the expert flat
# buffer still held when AdamW makes its two (V, h) temporaries for the embedding), as the data-parallel
# families of tests/test_live_tensors.py
REDUCTION = moe_tiny_state_bytes(n_experts_held=0)[0]
# each costs a real and a dry run of every rank: ep dp2 ep2 in CI, the rest in `make test-all`
CI = {"ep"}
LAYOUTS = {
    "ep": ["strategy=ep", "parallel.dp=2", "parallel.ep=2"],
    "ep top_k 3": ["strategy=ep", "parallel.dp=2", "parallel.ep=2", "model.top_k=3", "model.capacity_factor=0.75"],
    "ep dp4 capacity recompute": ["strategy=ep", "parallel.dp=4", "parallel.ep=2", "model.capacity_factor=0.5",
                                  "workload.activation_checkpointing=full"],
    "3d ep pp": ["strategy=3d", "parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "strategy.data_parallel=ddp"],
    "3d ep tp": ["strategy=3d", "parallel.dp=2", "parallel.ep=2", "parallel.tp=2", "strategy.data_parallel=ddp"],
}


def test_the_routings_are_the_ones_validate_accepts():
    assert set(ROUTINGS) == set(MODEL_OPTIONS["routing"])


def test_deepspeeds_gate_refuses_balanced_routing(tmp_path):
    rec = run([*BASE, "strategy=ep", "parallel.dp=2", "parallel.ep=2", "strategy.engine=deepspeed",
               "strategy.zero_stage=2", "model.routing=balanced"], tmp_path)
    assert rec["status"] == "invalid" and "DeepSpeed's gate routes by its router" in rec["error"]


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("capacity_factor", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("num_tokens", [128, 100])  # 100: E does not divide S
def test_balanced_routing_keeps_the_load_the_dry_run_assumes(k, capacity_factor, num_tokens):
    E = 8
    logits = torch.randn(num_tokens, E, generator=torch.Generator().manual_seed(k))
    experts, weights, kept, _, _ = route(logits, k, capacity_factor, balanced=True)
    assert torch.bincount(experts[kept], minlength=E).tolist() == balanced_load(num_tokens, k, E, capacity_factor)
    assert (experts == (torch.arange(num_tokens).view(-1, 1) + torch.arange(k)) % E).all()
    # the router still weights the routes it is given: by its probabilities, renormalised for k >= 2
    gates = logits.softmax(dim=1).gather(1, experts) * kept
    expected = gates if k == 1 else gates / gates.sum(dim=1, keepdim=True).clamp(min=torch.finfo(gates.dtype).eps)
    assert torch.allclose(weights, expected)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
def test_balanced_routing_allocates_as_the_routers_choice(k, capacity_factor):
    """The choices are overwritten in place: the same storages, so the same live bytes at every point."""
    logits = torch.randn(128, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    peaks = []
    for balanced in (False, True):
        with LiveTensors() as tracker:
            out = route(logits, k, capacity_factor, balanced=balanced)
        peaks.append((tracker.peak, tracker.current))
        del out
    assert peaks[0] == peaks[1]


def _real_and_dry(layout: list[str], tmp_path) -> tuple[dict, dict]:
    real = run([*BASE, *layout, "model.routing=balanced", *REAL], tmp_path)
    assert real["status"] == "ok", real["error"]
    world = real["dims"]["world_size"]
    dry = run([*BASE, *layout, "model.routing=balanced", "launcher=dryrun", "study=dry",
               f"launcher.ranks=[{','.join(map(str, range(world)))}]"], tmp_path)
    assert dry["status"] == "ok", dry["error"]
    assert "dryrun_step_error" not in dry["measured"], dry["measured"].get("dryrun_step_error")
    return real["measured"], dry["measured"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [pytest.param(k, marks=[] if k in CI else [pytest.mark.heavy]) for k in LAYOUTS])
def test_a_balanced_real_run_peaks_where_and_as_high_as_its_dry_run(layout, tmp_path):
    m, d = _real_and_dry(LAYOUTS[layout], tmp_path)
    if "expert_load" in m:  # strategy=ep records it: the real run routed at the balanced load
        assert all(r == 1.0 for step in m["expert_load"]["max_mean_ratio"] for r in step)
    assert d["dryrun_ranks"] == list(range(len(m["live_peak_bytes_per_rank"])))  # every rank simulated
    more = [real - dry for real, dry in zip(m["live_peak_bytes_per_rank"], d["peak_mem_bytes_per_rank"])]
    if any(more):  # a reduction gloo's thread had not yet freed (see REDUCTION)
        assert all(0 <= x <= REDUCTION for x in more), more
        return
    at = m["live_peak_at_per_rank"][d["peak_rank"]]
    assert (at["step"], at["phase"], at["live_by_kind"]) == (d["peak_step"], d["peak_phase"], d["peak_live_by_kind"])
    assert at["step"] == 2


@pytest.mark.slow
def test_a_dry_run_routes_at_the_balanced_load_whatever_the_routing(tmp_path):
    """A fake tensor has no router values: model.routing=topk dry-runs as balanced does."""
    peaks = []
    for routing in ROUTINGS:
        dry = run([*BASE, *LAYOUTS["ep"], f"model.routing={routing}", "launcher=dryrun", "study=dry"], tmp_path)
        assert dry["status"] == "ok" and "dryrun_step_error" not in dry["measured"], dry["measured"]
        peaks.append((dry["measured"]["peak_mem_bytes"], dry["measured"]["peak_live_by_kind"]))
    assert peaks[0] == peaks[1]
