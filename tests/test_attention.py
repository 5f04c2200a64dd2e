"""model.attention=fused_softmax (Megatron-LM's FusedScaleMaskSoftmax: the scale on q, mask + softmax in
one kernel) computes what eager computes, moves fewer bytes over the scores, and keeps the same activations."""
from __future__ import annotations

import pytest
import torch

from harness.config import compose_run
from harness.costmodel import activations, traffic


def _loss_and_grads(attention: str, dropout: float):
    from models.gpt import build_model, cross_entropy

    m = compose_run(["model=tiny", f"model.attention={attention}", f"model.dropout={dropout}"]).model
    model = build_model(m, 3)
    idx = torch.randint(0, m.vocab_size, (2, m.seq_len), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)  # the same dropout draws for both implementations
    loss = cross_entropy(model(idx), idx)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_fused_softmax_matches_eager(dropout):
    l_eager, g_eager = _loss_and_grads("eager", dropout)
    l_fused, g_fused = _loss_and_grads("fused_softmax", dropout)
    assert l_fused == pytest.approx(l_eager, rel=1e-6)
    for a, b in zip(g_eager, g_fused):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_fused_softmax_moves_fewer_score_bytes_and_holds_the_same():
    run = {a: compose_run(["model=gpt_7b", f"model.attention={a}", "model.dropout=0.1"]).model
           for a in ("eager", "fused_softmax", "sdpa")}
    per_token = {a: traffic.layer_bytes_per_token(m, 1, False, 2, 4, "none") for a, m in run.items()}
    m = run["eager"]
    scores = m.n_heads * m.seq_len * 2  # bytes of one pass over a token's (a, s) scores in bf16
    assert per_token["eager"] - per_token["sdpa"] == pytest.approx(3 * 6 * scores)  # 18 passes
    assert per_token["fused_softmax"] - per_token["sdpa"] == pytest.approx(10 * scores)  # 10 passes
    assert (activations.layer_bytes(run["fused_softmax"], 1, 1, False, "bf16-mixed", "none")
            == activations.layer_bytes(m, 1, 1, False, "bf16-mixed", "none"))
