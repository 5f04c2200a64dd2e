"""model.loss (models/gpt.py): chunked equals fp32 in loss and every gradient, holds the bytes the
cost model counts (measured tensor by tensor on CPU), is refused where it cannot run, keeps old
run_ids, and runs through brigade."""
from __future__ import annotations

import pytest
import torch

from harness.config import as_dict, compose_run
from harness.costmodel import activations as act
from harness.dims import ConfigError
from harness.run.record import run_id
from harness.validate import MODEL_OPTIONS, validate
from harness.worker.measure import LiveTensors
from models.gpt import LOSSES, build_model, chunked_cross_entropy, cross_entropy, loss_function


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("loss,chunk", [("fp32", 0), ("chunked", 128), ("chunked", 1024)])
def test_the_loss_holds_the_bytes_the_cost_model_counts(dtype, loss, chunk):
    """Peak bytes from the logits' creation through backward (the dry run's storage counter: CPU backward
    ops run on this thread, under the same mode) = harness/costmodel/activations.py's loss terms (what
    is held to backward + the transient at the loss), within 2 %."""
    b, s, V = 4, 256, 4096  # N = 1024 tokens
    e = torch.finfo(dtype).bits // 8
    leaf = torch.randn(b, s, V).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (b, s))
    f = cross_entropy if loss == "fp32" else (lambda x, y: chunked_cross_entropy(x, y, chunk))
    with LiveTensors() as mode:
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


@pytest.mark.slow
def test_chunked_runs_through_brigade_with_the_fp32_losses(tmp_path, single_reference):
    """strategy=single, model=tiny: 128 tokens per micro-batch in chunks of 50 (not a divisor)."""
    from tests.helpers import assert_losses_match, run

    rec = run(["strategy=single", "model.loss=chunked", "model.loss_chunk_tokens=50"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert rec["config"]["model"]["loss"] == "chunked"
    assert_losses_match(rec["measured"]["losses"], single_reference()["measured"]["losses"], rtol=1e-5)


# A vocabulary share large enough to see: model=small at V = 32768, 2048 tokens per micro-batch
LARGE_VOCAB = ["model=small", "model.vocab_size=32768", "strategy=single", "workload.global_batch_size=16",
               "workload.micro_batch_size=16", "model.loss_chunk_tokens=512"]


@pytest.mark.parametrize("precision,e", [("fp32", 4), ("bf16-mixed", 2)])
def test_the_prediction_holds_each_loss_s_bytes(precision, e):
    """activations + transient of the prediction differ by exactly the loss terms: fp32 holds 12 N V,
    chunked 2 e N V + 4 N (lse) + 4 c V (harness/costmodel/activations.py)."""
    from harness.costmodel import predict

    terms = {}
    for loss in LOSSES:
        run = compose_run([*LARGE_VOCAB, "logger=none", f"workload.precision={precision}", f"model.loss={loss}"])
        p = predict(run, validate(run))
        terms[loss] = p["activations_bytes"] + p["transient_bytes"]
    N, V, c = 16 * 128, 32768, 512
    assert terms["fp32"] - terms["chunked"] == (12 - 2 * e) * N * V - 4 * N - 4 * c * V


@pytest.mark.slow
@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=pytest.mark.heavy),  # CI: the bf16 case
                                       "bf16-mixed"])
def test_chunked_lowers_the_dry_run_peak_as_predicted(tmp_path, precision):
    """The worker's step on fake tensors (launcher=dryrun: the peak of the storages it allocates) drops
    from fp32 to chunked by what the cost model predicts, within 1 % (measured: 192.0 vs 192.0 MiB in fp32,
    448.0 vs 448.0 under bf16-mixed)."""
    from tests.helpers import run

    recs = {loss: run([*LARGE_VOCAB, "launcher=dryrun", f"workload.precision={precision}", f"model.loss={loss}",
                       f"study={loss}"], tmp_path) for loss in LOSSES}
    assert all(r["status"] == "ok" for r in recs.values()), [r["error"] for r in recs.values()]
    measured = {k: r["measured"]["peak_mem_bytes"] for k, r in recs.items()}
    predicted = {k: r["predicted"]["peak_mem_bytes"] for k, r in recs.items()}
    drop, predicted_drop = measured["fp32"] - measured["chunked"], predicted["fp32"] - predicted["chunked"]
    assert drop > 0 and drop == pytest.approx(predicted_drop, rel=0.01), (measured, predicted)


@pytest.mark.slow
# DeepSpeed heavy; CI: its PipelineModule in tests/test_deepspeed_pp_moe.py, the loss's math in-process above
@pytest.mark.parametrize("engine", ["torch", pytest.param("deepspeed", marks=pytest.mark.heavy)])
def test_chunked_on_the_last_pipeline_stage_gives_single_s_losses(tmp_path, single_reference, engine):
    """pp=2: torch's ZB-V schedule (its backward split into input- and weight-gradient halves through
    the loss's autograd Function) and DeepSpeed's PipelineModule (loss_fn = the chunked loss)."""
    from tests.helpers import assert_losses_match, run

    layout = ["strategy=pp", "parallel.pp=2", "model.loss=chunked", "model.loss_chunk_tokens=50"]
    if engine == "torch":
        rec = run([*layout, "parallel.vpp=2", "strategy.schedule=zbv_zero_bubble"], tmp_path)
        assert rec["status"] == "ok", rec["error"]
    else:
        from tests.test_deepspeed import run_deepspeed

        rec = run_deepspeed([*layout, "strategy.zero_stage=1"], tmp_path)
    assert_losses_match(rec["measured"]["losses"], single_reference()["measured"]["losses"])


@pytest.mark.slow
@pytest.mark.heavy  # 30 s; CI: the bytes in test_chunked_lowers_the_dry_run_peak_as_predicted, the row in test_published
def test_a_published_mpt_run_fits_on_its_80_gb_as_brigade_runs_it(tmp_path):
    """llm-foundry's mpt_760m on 8 H100 80 GB (FSDP, 24 x 2048 tokens per micro-batch, bf16; a row of
    lab/published_runs.yaml), rank 0 dry-run at its real shapes: the peak of the tensors brigade's
    step allocates (84.7 GiB with the fp32 loss) is 66.7 GiB with chunked, the prediction within 2 %."""
    from lab import published
    from tests.helpers import run

    models, rows = published.load()
    row = next(r for r in rows if r["source"] == "mpt_h100" and r["model"] == "mpt_760m"
               and r["gpus"] == 8 and r["micro_batch_size"] == 24)
    assert row["loss"] == "chunked"
    rec = run([*published.overrides(row, models["mpt_760m"]), "launcher=dryrun", "launcher.ranks=[0]"], tmp_path,
              fast=False)
    assert rec["status"] == "ok", rec["error"]
    measured, predicted = rec["measured"]["peak_mem_bytes"], rec["predicted"]["peak_mem_bytes"]
    assert measured == pytest.approx(predicted, rel=0.02) and measured < 80 * 1024**3, (measured, predicted)
