"""Pure tier: the cost model reproduces published figures and holds its invariants (no processes,
except two `python -m harness.predict` subprocesses that check the CLI and that torch stays out)."""
from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from harness.config import compose_run
from harness.costmodel import activations, comm, pipeline
from harness.costmodel.estimate import evaluate
from harness.costmodel.flops import hardware_flops_per_step, model_flops_per_step
from harness.costmodel.inputs import Hardware, Model, StrategyKnobs
from harness.costmodel.params import numel, rank_inventory
from harness.predict import predict_overrides
from tests.helpers import REPO

GB = 1e9


def predicted(*overrides: str) -> dict:
    out = predict_overrides(list(overrides))
    assert out["status"] == "ok", out.get("error")
    return out


# -- published figures ----------------------------------------------------------------------------

ZERO_FIGURE_1 = [("ddp", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9)]  # GB per device


@pytest.mark.parametrize("strategy,paper_gb", ZERO_FIGURE_1)
def test_zero_paper_figure_1(strategy, paper_gb):
    """Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, Nd = 64, mixed precision (K = 12)."""
    p = predicted("model=gpt_7b", "model.n_layers=35", "hardware=a100_80g", f"strategy={strategy}",
                  "parallel.dp=64", "workload.global_batch_size=64", "workload.micro_batch_size=1",
                  "workload.precision=bf16-mixed")
    psi = p["params_total"]
    assert abs(psi / 7.5e9 - 1) < 0.01, psi  # a GPT-3-shaped model with Ψ within 1 % of 7.5B
    per_param = p["model_states_bytes_ideal"] / psi
    assert round(per_param * 7.5e9 / GB, 1) == paper_gb
    if strategy in ("ddp", "zero1"):  # torch autocast keeps fp32 params and grads: more than the ideal
        assert p["model_states_bytes"] > p["model_states_bytes_ideal"]


def test_seed_pipeline_bubble():
    """The seed's example: 4 stages, 8 micro-batches, 1F1B -> (p-1)/(m+p-1) = 3/11."""
    assert round(pipeline.bubble_pct("1f1b", 4, 1, 8), 2) == 27.27
    # memory-bound time off: the optimizer step runs after the pipeline and is not part of its bubble;
    # on a GPU each stage has its own device (4 ranks on the 2-core cpu profile time-share, and the
    # fill and drain, with fewer ranks computing, run faster: test_costmodel_cpu.py)
    p = predicted("model=tiny", "strategy=pp", "parallel.pp=4", "workload.global_batch_size=16",
                  "workload.micro_batch_size=2", "hardware=a100_80g", "hardware.memory_bw_GBps=0")
    assert p["num_microbatches"] == 8
    assert round(p["bubble_pct_schedule"], 2) == 27.27
    # in time: idle / (busy + idle) of the compute, i.e. the same 3/11 once exposed comm is set aside
    assert p["bubble_time_s"] / (p["bubble_time_s"] + p["compute_time_s"]) == pytest.approx(3 / 11)


def test_korthikanti_constants():
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B, Korthikanti et al. 2022 Table 2's shape
    assert activations.korthikanti_layer_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert activations.korthikanti_layer_bytes(s, b, h, a, t=8) == s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert activations.korthikanti_layer_bytes(s, b, h, a, t=8, sp=True) == s * b * h * (34 + 5 * a * s / h) / 8
    assert activations.korthikanti_layer_bytes(s, b, h, a, t=8, sp=True, recompute="selective") == s * b * h * 34 / 8
    assert activations.korthikanti_layer_bytes(s, b, h, a, recompute="full") == 2 * s * b * h


def test_brigade_activation_constants():
    """SDPA, dropout 0: 16 elements per b*s*h and layer (64 B fp32), 40 B under bf16 autocast, plus the
    (fp32) logsumexp and LayerNorm statistics; no (s, s) term."""
    s, b, h, a = 128, 2, 256, 8
    extra = 4 * b * a * s + 2 * 8 * b * s
    fp32 = activations.brigade_layer_bytes(s, b, h, a, 4 * h, 1, False, "fp32", "sdpa", 0.0, "none")
    bf16 = activations.brigade_layer_bytes(s, b, h, a, 4 * h, 1, False, "bf16-mixed", "sdpa", 0.0, "none")
    assert fp32 == 64 * s * b * h + extra
    assert bf16 == 40 * s * b * h + extra
    eager = activations.brigade_layer_bytes(s, b, h, a, 4 * h, 1, False, "fp32", "eager", 0.0, "none")
    assert eager - fp32 == 4 * b * a * s * s - 4 * b * a * s + 4 * s * b * h  # scores in, logsumexp out, o's copy


# -- FLOPs ------------------------------------------------------------------------------------------

shapes = hs.builds(lambda L, h64, s_pow, V, B: SimpleNamespace(
    n_layers=L, d_model=64 * h64, d_ff=4 * 64 * h64, n_heads=h64, vocab_size=V, seq_len=2**s_pow, n_experts=0,
    top_k=2, B=B), hs.integers(1, 96), hs.integers(1, 192), hs.integers(6, 13), hs.integers(1000, 260000),
    hs.integers(1, 4096))


@given(shapes)
def test_megatron_flops_formula(m):
    """Narayanan et al. 2021 eq. 3 and its recompute variant, for d_ff = 4h."""
    B, s, L, h, V = m.B, m.seq_len, m.n_layers, m.d_model, m.vocab_size
    megatron = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    assert model_flops_per_step(m, B) == pytest.approx(megatron, rel=1e-12)
    recompute = 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    assert hardware_flops_per_step(m, B, "full") == pytest.approx(recompute, rel=1e-12)


# -- memory: per-engine placement -------------------------------------------------------------------

def test_single_model_states_match_the_exact_count():
    """tests/test_ddp.py::test_model_state_bytes_are_exact's arithmetic, predicted without running."""
    p = predicted("model=tiny")
    h, L, V, s = 128, 4, 1024, 64
    n = L * (4 * h * h + 2 * h * 4 * h + 4 * h) + 2 * V * h + s * h + 2 * h
    assert p["params_total"] == n
    assert (p["params_bytes"], p["grads_bytes"], p["optimizer_bytes"]) == (4 * n, 4 * n, 8 * n + 4 * (L * 10 + 5))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_inventory_agrees_with_the_tp_plan(tp):
    from models.tp_plan import local_param_numel

    run = compose_run(["model=small"])
    m = Model.of(run.model)
    assert numel(rank_inventory(m.shape, tp, 1, 1, 1, "1f1b", 0)) == local_param_numel(run.model, tp, 0)


def test_zero1_greedy_is_uneven_and_complete():
    """ZeroRedundancyOptimizer assigns whole tensors: per-rank optimizer bytes differ but sum to the whole."""
    p = predicted("model=tiny", "strategy=zero1", "parallel.dp=4")
    single = predicted("model=tiny")
    per_rank = p["optimizer_bytes_per_rank"]
    assert sum(per_rank) == single["optimizer_bytes"]
    assert max(per_rank) > min(per_rank) and p["optimizer_bytes"] == max(per_rank)
    assert p["params_bytes"] == single["params_bytes"]


def test_fsdp_shards_by_torch_chunk():
    p = predicted("model=tiny", "strategy=zero3", "parallel.dp=4")
    single = predicted("model=tiny")
    assert sum(p["params_bytes_per_rank"]) == single["params_bytes"]  # chunks partition every tensor
    assert p["params_bytes"] == max(p["params_bytes_per_rank"]) == p["params_bytes_per_rank"][0]


def test_deepspeed_holds_an_fp32_master_partition():
    """docs/notes.md#deepspeed-master: ZeRO-1 at world 2 in fp32 keeps params whole, master/grads half, Adam half."""
    p = predicted("model=tiny", "strategy=zero1", "strategy.engine=deepspeed", "parallel.dp=2")
    n = p["params_total"]
    assert p["params_bytes"] == 4 * n
    assert p["master_bytes"] == p["grads_bytes"] == pytest.approx(2 * n, abs=8)
    assert p["optimizer_bytes"] == pytest.approx(4 * n, abs=16)


def test_pipeline_stages_hold_their_layers():
    p = predicted("model=tiny", "strategy=pp", "parallel.pp=2")
    single = predicted("model=tiny")
    first, last = p["params_per_rank_list"]
    assert first + last == single["params_total"]
    h, s = 128, 64
    assert first - last == s * h - 2 * h  # both hold 2 blocks; the embedding (V*h) matches the head (V*h)


# -- properties ------------------------------------------------------------------------------------

HW = Hardware.of(compose_run(["hardware=h100_sxm"]).hardware)


def _strategy(name, **kw):
    base = compose_run([f"strategy={name}"]).strategy
    for k, v in kw.items():
        setattr(base, k, v)
    return StrategyKnobs.of(base)


STAGES = [_strategy("ddp"), _strategy("zero1"), _strategy("zero2"), _strategy("zero3")]
THREE_D = _strategy("3d", data_parallel="ddp", schedule="1f1b")
DS_STAGES = [_strategy("ddp", engine="deepspeed", zero_stage=z) for z in range(4)]
models = hs.builds(lambda L, heads, hd, V, s: Model.of(SimpleNamespace(
    name="m", n_layers=L, d_model=heads * hd, n_heads=heads, d_ff=4 * heads * hd, vocab_size=V, seq_len=s,
    dropout=0.0, attention="sdpa", n_experts=0, top_k=2)),
    hs.sampled_from([4, 8, 16, 32]), hs.sampled_from([8, 16, 32]), hs.sampled_from([16, 64, 128]),
    hs.integers(256, 60000), hs.sampled_from([128, 512, 2048]))
precisions = hs.sampled_from(["fp32", "bf16-mixed"])


@settings(max_examples=60, deadline=None)
@given(models, hs.sampled_from([2, 4, 8, 64]), precisions)
def test_memory_never_increases_with_zero_stage(md, dp, precision):
    for engine in (STAGES, DS_STAGES):
        states = [evaluate(md, HW, st, dp, 1, 1, 1, 1, 1, 1, precision, "none", detail=False) for st in engine]
        held = [p["model_states_bytes"] for p in states]
        ideal = [p["model_states_bytes_ideal"] for p in states]
        assert held == sorted(held, reverse=True), held
        assert ideal == sorted(ideal, reverse=True), ideal


@settings(max_examples=60, deadline=None)
@given(models, hs.sampled_from([1, 4]), precisions, hs.sampled_from(["none", "selective", "full"]))
def test_memory_never_increases_with_tp_or_pp(md, dp, precision, ckpt):
    def mem(tp, pp):
        # the most states any rank holds (model_states_bytes is the peak rank's: with unequal stages the
        # rank with the loss can peak holding fewer states than the first), and the worst peak
        p = evaluate(md, HW, THREE_D, dp, tp, pp, 1, 1, 1, 4, precision, ckpt, detail=True)
        return max(p["model_states_bytes_per_rank"]), p["peak_mem_bytes"] - p["comm_buffer_bytes"]
    tps = [t for t in (1, 2, 4, 8) if md.a % t == 0]
    pps = [p for p in (1, 2, 4) if md.L % p == 0]
    by_tp = [mem(t, 1) for t in tps]
    by_pp = [mem(1, p) for p in pps]
    for by in (by_tp, by_pp):
        assert [x[0] for x in by] == sorted((x[0] for x in by), reverse=True)
    # the peak, by tp only: a 1F1B pipeline's first stage holds pp micro-batches of L / pp layers (the
    # layers' activations of one micro-batch through all L) plus torch's receive buffers, one per
    # micro-batch, so where the states are small beside the activations its peak rises with pp
    assert [x[1] for x in by_tp] == sorted((x[1] for x in by_tp), reverse=True)


@given(hs.integers(2, 64), hs.integers(1, 8), hs.integers(1, 256),
       hs.sampled_from(["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble",
                        "zbv_zero_bubble", "dualpipev"]))
def test_bubble_decreases_with_microbatches(p, v, m, schedule):
    a, b = pipeline.bubble_pct(schedule, p, v, m), pipeline.bubble_pct(schedule, p, v, m + 1)
    if schedule in ("zbv_zero_bubble", "dualpipev"):
        assert b <= a
    else:
        assert b < a


@settings(max_examples=40, deadline=None)
@given(models, hs.sampled_from([2, 4, 8, 16, 256]), hs.sampled_from([1, 2, 4]))
def test_comm_volume_scaling(md, n, m):
    """Relations the literature states between layouts, not the model's own formula (which the
    measured flight-recorder counts check, in-sample in test_fidelity and held out in
    test_comm_heldout): DDP all-reduces once per optimizer step whatever the accumulation, and at 2
    ranks a ring all-reduce sends the gradient once (nccl-tests); ZeRO-2 moves what DDP moves, ZeRO-3
    at most 1.5x (Rajbhandari et al. 2020, section 7: 2Ψ vs 3Ψ) and more with every micro-batch
    that gathers again; TP and PP traffic is per micro-batch."""
    psi_b = 4 * md.params_total
    at = lambda stage, mbs: evaluate(md, HW, STAGES[stage], n, 1, 1, 1, 1, 1, mbs, "fp32", "none",  # noqa: E731
                                     detail=False)["comm_dp_bytes"]
    ddp = at(0, m)
    assert at(0, 2 * m) == ddp
    assert (ddp == pytest.approx(psi_b, rel=1e-12)) if n == 2 else (psi_b < ddp < 2 * psi_b)
    assert at(2, m) == pytest.approx(ddp, rel=1e-12)
    assert ddp < at(3, 1) <= 1.5 * ddp
    assert at(3, 2 * m) > at(3, m)
    one = evaluate(md, HW, THREE_D, 1, 2, 2, 1, 1, 1, m, "fp32", "none", detail=False)
    two = evaluate(md, HW, THREE_D, 1, 2, 2, 1, 1, 1, 2 * m, "fp32", "none", detail=False)
    assert two["comm_tp_bytes"] == pytest.approx(2 * one["comm_tp_bytes"])
    assert two["comm_pp_bytes"] == pytest.approx(2 * one["comm_pp_bytes"])
    assert comm.volume("all_reduce", n, 1.0) == pytest.approx(2 * comm.volume("reduce_scatter", n, 1.0))


def test_cpu_ranks_time_share_the_cores():
    """cpu has 2 cores: ddp at 4 ranks computes each rank's half batch at half the rate.
    FLOPs only (memory-bound time off): ddp replicates the optimizer step, it does not halve it."""
    p2 = predicted("model=small", "strategy=ddp", "parallel.dp=2", "hardware.memory_bw_GBps=0")
    p4 = predicted("model=small", "strategy=ddp", "parallel.dp=4", "hardware.memory_bw_GBps=0")
    assert p4["cpu_time_sharing_factor"] == 2.0 and p2["cpu_time_sharing_factor"] == 1.0
    assert p4["compute_time_s"] == pytest.approx(p2["compute_time_s"])  # half the work, half the rate


# -- the command --------------------------------------------------------------------------------------

def documented_keys(section: str, column: int = 1) -> set[str]:
    """The names results/README.md's `section` table documents: backticked names in the first
    column (`comm_{dp,tp}_bytes` expanded, "(+ `_per_rank`)" adding the *_per_rank twins) and the
    backticked keys its descriptions name."""
    text = (REPO / "results" / "README.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for row in body.splitlines():
        cells = row.split("|")
        if not row.startswith("| `") or len(cells) < 3:
            continue
        first = re.findall(r"`([^`]+)`", cells[column])
        for name in first:
            parts = re.split(r"\{([^}]*)\}", name)
            names |= {"".join(c) for c in itertools.product(*[p.split(",") if i % 2 else [p]
                                                              for i, p in enumerate(parts)])}
        if "(+ `_per_rank`)" in cells[column]:
            names |= {n + "_per_rank" for n in first if not n.startswith("_")}
        names |= set(re.findall(r"`([a-z_]+)[`:]", "|".join(cells[column + 1:])))
    return names


def test_predict_cli_prints_one_json_without_torch():
    code = ("import sys, json; from harness.predict import main; rc = main(['parallel.dp=1024', 'strategy=ddp', "
            "'hardware=h100_sxm', 'workload.global_batch_size=2048', 'workload.micro_batch_size=2', '--json']); "
            "assert 'torch' not in sys.modules, 'cost model imported torch'; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout)
    assert p["dims"]["dp"] == 1024 and p["config"]["parallel"]["dp"] == 1024
    # the record's schema (results/README.md): every key predict prints is a documented predicted
    # metric or a record field, and every number is finite and not negative
    record_fields = documented_keys("Record (schema_version 1)", column=1)
    undocumented = sorted(set(p) - documented_keys("predicted") - record_fields)
    assert not undocumented, f"predict prints keys results/README.md does not document: {undocumented}"
    numbers = {k: v for k, v in p.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert all(math.isfinite(v) and v >= 0 for v in numbers.values()), numbers
    # and its figures obey the identities the schema states
    seq = p["config"]["model"]["seq_len"]
    assert p["tokens_per_step"] == 2048 * seq
    assert p["tokens_per_s"] == pytest.approx(2048 * seq / p["step_time_s"], rel=1e-9)
    assert p["step_time_s"] == pytest.approx(p["compute_time_s"] + p["bubble_time_s"] + p["comm_exposed_time_s"],
                                             rel=1e-9)
    assert p["num_microbatches"] == 2048 // (1024 * 2)
    bad = subprocess.run([sys.executable, "-m", "harness.predict", "parallel.dp=3", "strategy=ddp", "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not divisible" in json.loads(bad.stdout)["error"]


def test_predict_prices_a_layout_only_brigades_runtime_refuses():
    """Megatron-LM's bf16 module under DDP is priced (the published set's Megatron-LM rows), with the refusal a
    launch would give in `not_run`; a config the cost model itself refuses stays invalid."""
    ok = predict_overrides(["hardware=a100_80g", "model=gpt_1_3b", "strategy=ddp", "parallel.dp=8",
                            "workload.global_batch_size=16", "workload.micro_batch_size=2",
                            "workload.precision=bf16-mixed", "strategy.low_precision_params=true"])
    assert ok["status"] == "ok" and ok["step_time_s"] > 0 and "not run" in ok["not_run"]
    assert "not_run" not in predict_overrides(["hardware=a100_80g", "model=gpt_1_3b", "strategy=ddp", "parallel.dp=8",
                                               "workload.global_batch_size=16", "workload.micro_batch_size=2"])
    bad = predict_overrides(["strategy=ddp", "parallel.dp=2", "strategy.low_precision_params=true"])  # fp32
    assert bad["status"] == "invalid" and "needs workload.precision=bf16-mixed" in bad["error"]
