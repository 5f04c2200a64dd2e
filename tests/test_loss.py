"""model.loss (models/loss.py): chunked equals fp32 in loss and every gradient, holds the bytes the
cost model counts (measured tensor by tensor on CPU), is refused where it cannot run, keeps old
run_ids, and runs through brigade."""
from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from harness.config import as_dict, compose_run
from harness.costmodel import activations as act
from harness.dims import ConfigError
from harness.run.record import run_id
from harness.validate import MODEL_OPTIONS, validate
from models.gpt import build_model
from models.loss import LOSSES, chunked_cross_entropy, cross_entropy, loss_function


def tiny_batch(run, b=2):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, run.model.vocab_size, (b, run.model.seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def loss_and_grads(run, loss_fn):
    model = build_model(run.model, seed=1, device="cpu")
    inputs, targets = tiny_batch(run)
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("chunk", [7, 64, 128, 1000])  # 128 tokens: 7 and 1000 do not divide them
def test_chunked_gives_the_fp32_loss_and_every_gradient(chunk):
    run = compose_run(["model=tiny", "logger=none", "model.loss=chunked", f"model.loss_chunk_tokens={chunk}"])
    ref_loss, ref = loss_and_grads(run, cross_entropy)
    loss, grads = loss_and_grads(run, loss_function(run.model))
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
    assert grads.keys() == ref.keys()
    for name, g in grads.items():
        err = ((g - ref[name]).norm() / ref[name].norm()).item()
        assert err <= 1e-6, f"{name}: |chunked - fp32| / |fp32| = {err:.2e}"


def test_chunked_keeps_bf16_logits_and_writes_their_gradient_in_bf16():
    """Under bf16 the fp32 math is the same; only the gradient's final cast to the logits' dtype is shared."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, 301, generator=g).to(torch.bfloat16)
    targets = torch.randint(0, 301, (3, 50), generator=g)
    grads = []
    for f in (cross_entropy, lambda a, b: chunked_cross_entropy(a, b, 16)):
        x = logits.clone().requires_grad_()
        loss = f(x, targets)
        loss.backward()
        grads.append((loss.detach(), x.grad))
    (ref_loss, ref_grad), (loss, grad) = grads
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
    # both are an fp32 gradient rounded once to bf16: at most one bf16 ulp apart (8-bit significand: 2^-7)
    assert torch.all((grad.float() - ref_grad.float()).abs() <= 2 ** -7 * ref_grad.float().abs())


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created under this mode and still alive (forward and
    backward: autograd runs CPU backward ops on this thread, under the same mode)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() and t.untyped_storage().data_ptr() not in self.seen:
                st = t.untyped_storage()
                self.seen.add(st.data_ptr())
                self.live += st.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(st, self._free, st.data_ptr(), st.nbytes())
        return out

    def _free(self, ptr: int, nbytes: int) -> None:
        self.seen.discard(ptr)
        self.live -= nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("loss,chunk", [("fp32", 0), ("chunked", 128), ("chunked", 1024)])
def test_the_loss_holds_the_bytes_the_cost_model_counts(dtype, loss, chunk):
    """Peak bytes from the logits' creation through backward = harness/costmodel/activations.py's
    loss terms (what is held to backward + the transient at the loss), within 2 %."""
    b, s, V = 4, 256, 4096  # N = 1024 tokens
    e = torch.finfo(dtype).bits // 8
    leaf = torch.randn(b, s, V).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (b, s))
    f = cross_entropy if loss == "fp32" else (lambda x, y: chunked_cross_entropy(x, y, chunk))
    with LiveBytes() as mode:
        logits = leaf * 1  # the head's output: allocated here, as in the model's forward
        out = f(logits, targets)
        del logits  # Strategy.forward_loss returns the loss only
        out.backward()
    held = act.head_bytes(s, b, 0, V, 1, True, loss, e)  # h = 0: the ln_f terms are not in this graph
    predicted = held + b * act.loss_grad_bytes(s, V, 1, loss, e) + act.loss_chunk_bytes(loss, chunk, b * s, V)
    assert mode.peak == pytest.approx(predicted, rel=0.02), (mode.peak / (b * s * V), predicted / (b * s * V))


def test_loss_names_agree_and_bad_ones_are_refused():
    assert set(LOSSES) == set(MODEL_OPTIONS["loss"])
    with pytest.raises(ConfigError, match="model.loss"):
        validate(compose_run(["model=tiny", "logger=none", "model.loss=fused"]))
    with pytest.raises(ConfigError, match="loss_chunk_tokens"):
        validate(compose_run(["model=tiny", "logger=none", "model.loss=chunked", "model.loss_chunk_tokens=0"]))


def test_chunked_is_refused_with_vocab_sharded_logits_and_runs_without():
    tp = ["model=tiny", "logger=none", "strategy=tp", "parallel.tp=2", "model.loss=chunked"]
    with pytest.raises(ConfigError, match="strategy.loss_parallel=false"):
        validate(compose_run([*tp, "strategy.loss_parallel=true"]))
    validate(compose_run([*tp, "strategy.loss_parallel=false"]))


def test_the_default_loss_keeps_every_existing_run_id():
    cfg = as_dict(compose_run(["model=tiny", "logger=none"]))
    old = {**cfg, "model": {k: v for k, v in cfg["model"].items() if k not in ("loss", "loss_chunk_tokens")}}
    assert run_id(cfg) == run_id(old)
    assert run_id({**cfg, "model": {**cfg["model"], "loss": "chunked"}}) != run_id(cfg)
