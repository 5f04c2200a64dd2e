"""The MoE layer: gating equals DeepSpeed 0.19.8's TopKGate / MOELayer on the same weights (pure, in
process), moe_tiny trains under `single` with exact model-state bytes, and ep configs that cannot
run are refused before launch with their arithmetic."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from models.layers import MLP
from models.moe import MIN_CAPACITY, MoE
from tests.helpers import run

# In-process: one GPU is enough.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                  reason="needs CUDA")])]


def moe_tiny_state_bytes(n_experts_held: int) -> tuple[int, int]:
    """(params, optimizer) bytes of moe_tiny (conf/model/moe_tiny.yaml) holding n_experts_held experts per
    layer, counted from the shapes: fp32 params; AdamW: exp_avg + exp_avg_sq + a 0-d fp32 step per tensor."""
    h, L, V, s, f, E = 128, 4, 1024, 64, 512, 8
    block = 4 * h * h + 4 * h + E * h + n_experts_held * 2 * h * f  # attn, 2 LayerNorms, router, experts
    n = L * block + 2 * V * h + s * h + 2 * h  # + tok/pos embeddings, head, ln_f
    n_tensors = L * (4 + 4 + 1 + 2 * n_experts_held) + 5  # q,k,v,o, ln1/ln2 w,b, router, fc1/fc2 per expert
    return 4 * n, 8 * n + 4 * n_tensors


def _deepspeed_layer(moe: MoE, k: int, capacity_factor: float):
    """DeepSpeed's own MOELayer (ep_size 1) around copies of `moe`'s router and expert weights."""
    from deepspeed.moe.experts import Experts
    from deepspeed.moe.sharded_moe import MOELayer, TopKGate

    d_model, E = moe.router.weight.shape[1], moe.n_experts
    gate = TopKGate(d_model, E, k, capacity_factor if capacity_factor > 0 else 1.0, 1.0, MIN_CAPACITY,
                    noisy_gate_policy=None, drop_tokens=capacity_factor > 0, use_rts=False,
                    top2_2nd_expert_sampling=False)
    experts = Experts(MLP(d_model, moe.experts["0"].fc1.weight.shape[0], 0.0), E)
    layer = MOELayer(gate, experts, "ep_size_1", 1, E).to(moe.router.weight.device)
    with torch.no_grad():
        gate.wg.weight.copy_(moe.router.weight)
        for e in range(E):
            experts.deepspeed_experts[e].load_state_dict(moe.experts[str(e)].state_dict())
    return layer


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
def test_gating_matches_deepspeed(k, capacity_factor, device):
    torch.manual_seed(k)
    cfg = SimpleNamespace(d_model=32, d_ff=64, dropout=0.0, n_experts=8, top_k=k, capacity_factor=capacity_factor,
                          mlp="gelu", bias=False)
    moe = MoE(cfg).to(device)
    with torch.no_grad():
        for p in moe.parameters():  # a peaked router, so routing is uneven and capacity bites
            p.normal_(0, 0.3)
    ds = _deepspeed_layer(moe, k, capacity_factor)
    x = torch.randn(3, 40, 32, device=device)

    y, y_ds = moe(x), ds(x, None)
    torch.testing.assert_close(y, y_ds, rtol=1e-5, atol=1e-6)
    assert y.abs().max() > 0.1
    torch.testing.assert_close(moe.aux_loss, ds.l_aux, rtol=1e-6, atol=0)
    assert moe.last_load["tokens_per_expert"].tolist() == ds.exp_counts.tolist()
    assert int(moe.last_load["tokens_per_expert"].sum()) == 120 * k
    # the same routes dropped: DeepSpeed flags a dropped route with expert index -1
    _, _, _, indices, _, _, _ = ds.gate(x.reshape(-1, 32), None, True)
    assert int(moe.last_load["dropped"]) == int((indices < 0).sum())
    assert (int(moe.last_load["dropped"]) > 0) == (capacity_factor > 0)

    # and the same gradients, through router and experts
    w = torch.randn_like(y)
    ((y * w).sum() + moe.aux_loss).backward()
    ((y_ds * w).sum() + ds.l_aux).backward()
    torch.testing.assert_close(moe.router.weight.grad, ds.gate.wg.weight.grad, rtol=1e-4, atol=1e-6)
    for e in range(cfg.n_experts):
        for name in ("fc1", "fc2"):
            torch.testing.assert_close(getattr(moe.experts[str(e)], name).weight.grad,
                                       getattr(ds.experts.deepspeed_experts[e], name).weight.grad, rtol=1e-4, atol=1e-6)


def test_moe_tiny_single_trains_with_exact_bytes(single_reference):
    rec = single_reference("model=moe_tiny")
    m = rec["measured"]
    assert m["losses"][-1] < m["losses"][0], m["losses"]
    params, optimizer = moe_tiny_state_bytes(n_experts_held=8)
    assert (m["params_bytes"], m["grads_bytes"], m["optimizer_bytes"]) == (params, params, optimizer)


@pytest.mark.parametrize("overrides,message", [
    (["model=moe_tiny", "parallel.dp=3", "parallel.ep=3"],
     "n_experts 8 not divisible by ep 3 (8 % 3 = 2): each ep rank holds n_experts/ep experts"),
    (["model=tiny", "parallel.dp=2", "parallel.ep=2"],
     "ep 2 needs a MoE model (model.n_experts > 0, e.g. model=moe_tiny); model tiny has n_experts 0"),
    (["model=moe_tiny", "parallel.dp=3", "parallel.ep=2"], "dp 3 not divisible by ep 2"),
])
def test_ep_refused_before_launch(overrides, message, tmp_path):
    rec = run(["strategy=ep", *overrides], tmp_path)
    assert rec["status"] == "invalid"
    assert message in rec["error"], rec["error"]
    assert rec["run_dir"] is None and not (tmp_path / "runs").exists()  # nothing was launched
