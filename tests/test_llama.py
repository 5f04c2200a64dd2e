"""Llama-family options, pure tier and one process: published parameter counts, the tensor-parallel
plan and the cost model's inventory agree with the model torch builds, the FLOPs convention, bad
input refused with the arithmetic, and meta-device construction whose local shards hold exactly
the slices of `single`'s weights (fake process group, several ranks of one layout in this process)."""
from __future__ import annotations

import math

import pytest
import torch

from harness.config import compose_run
from harness.costmodel.flops import layer_forward_flops_per_token
from harness.costmodel.params import model_shape, numel, params_total, rank_inventory
from harness.dims import ConfigError
from harness.validate import MODEL_OPTIONS, validate

# Parameter counts of the released checkpoints (sum of the tensors in their safetensors index)
PUBLISHED = {"llama2_7b": 6_738_415_616, "llama2_13b": 13_015_864_320, "llama3_8b": 8_030_261_248,
             "llama3_70b": 70_553_706_496, "llama3_405b": 405_853_388_800}


def model_cfg(*overrides: str):
    return compose_run(list(overrides)).model


@pytest.mark.parametrize("preset,count", PUBLISHED.items())
def test_presets_have_the_published_parameter_count(preset, count):
    m = model_cfg(f"model={preset}")
    assert params_total(m) == count
    with torch.device("meta"):
        from models.gpt import GPT

        assert sum(p.numel() for p in GPT(m).parameters()) == count


def test_llama_tiny_is_a_small_llama():
    m = model_cfg("model=llama_tiny")
    assert 1e6 <= params_total(m) <= 2e6
    assert (m.norm, m.mlp, m.position) == ("rmsnorm", "swiglu", "rope") and m.n_kv_heads < m.n_heads


OPTION_SETS = [[], ["model=llama_tiny"], ["model=llama_tiny", "model.bias=true"],
               ["model=llama_tiny", "model.tie_embeddings=true"], ["model=llama_tiny", "model.norm=layernorm",
                                                                   "model.position=learned", "model.mlp=gelu"],
               ["model=moe_tiny", "model.mlp=swiglu", "model.bias=true"]]


@pytest.mark.parametrize("overrides", OPTION_SETS)
@pytest.mark.parametrize("tp", [1, 2])
def test_plan_inventory_and_model_agree(overrides, tp):
    """models/tp_plan.py's names and shapes = the built model's; the cost model's per-rank count =
    the plan's local count (the plan covers dense models; the MoE set checks tp=1 inventory only)."""
    from models.gpt import GPT
    from models.tp_plan import local_param_numel, param_shapes

    m = model_cfg("model=tiny", *overrides)
    with torch.device("meta"):
        built = {n: tuple(p.shape) for n, p in GPT(m).named_parameters()}
    inventory = numel(rank_inventory(model_shape(m), tp, 1, 1, 1, "1f1b", 0))
    if m.n_experts:
        assert tp == 1 or inventory < sum(math.prod(s) for s in built.values())
        assert params_total(m) == sum(math.prod(s) for s in built.values())
        return
    assert param_shapes(m) == built
    assert inventory == local_param_numel(m, tp, 0)


def test_option_names_agree_with_the_model_layers():
    from models.layers import MLPS, NORMS

    assert set(MODEL_OPTIONS["norm"]) == set(NORMS) and set(MODEL_OPTIONS["mlp"]) == set(MLPS)


def test_flops_count_swiglu_three_matmuls_and_gqa_smaller_kv():
    m = model_cfg("model=llama3_8b")
    h, kv, f, s = 4096, 1024, 14336, 8192
    assert layer_forward_flops_per_token(m) == 4 * h * h + 4 * h * kv + 4 * s * h + 6 * h * f
    gpt = model_cfg("model=gpt_7b")  # the Megatron form with d_ff = 4h, MHA, GELU
    assert layer_forward_flops_per_token(gpt) == 24 * 4096**2 + 4 * 2048 * 4096


@pytest.mark.parametrize("overrides,message", [
    (["model.n_kv_heads=3"], r"n_heads 4 not divisible by n_kv_heads 3 \(4 % 3 = 1\)"),
    (["strategy=tp", "parallel.tp=4"], r"n_kv_heads 2 not divisible by tp 4 \(2 % 4 = 2\)"),
    (["model.d_model=132", "model.n_heads=4", "model.n_kv_heads=4"], r"head_dim d_model 132 / n_heads 4 = 33 is odd"),
    (["model.tie_embeddings=true", "strategy=pp", "parallel.pp=2"], r"pp 2 \* vpp 1 = 2 stages"),
    (["model.mlp=relu"], r"unknown model.mlp 'relu'; available: gelu, swiglu"),
])
def test_bad_llama_options_are_refused_with_the_arithmetic(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_run(["model=llama_tiny", *overrides]))


# -- meta-device construction ----------------------------------------------------------------------

def test_meta_build_allocates_nothing_and_materialize_matches_the_eager_build():
    from models.gpt import build_model, materialize

    m = model_cfg("model=llama_tiny", "model.tie_embeddings=true")
    meta = build_model(m, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    materialize(meta, "cpu", 7)
    eager = build_model(m, 7)
    assert meta.head.weight is meta.tok_emb.weight  # the tie survives to_empty
    for (n, a), (_, b) in zip(meta.named_parameters(), eager.named_parameters()):
        assert torch.equal(a, b), n
    assert not torch.equal(build_model(m, 8).blocks["0"].attn.q.weight, eager.blocks["0"].attn.q.weight)
    std = eager.blocks["1"].mlp.down.weight.std().item()  # residual projection: 0.02 / sqrt(2 L)
    assert std == pytest.approx(0.02 / math.sqrt(8), rel=0.05)


def _rank_shards(run, rank: int) -> list[tuple[str, tuple, torch.Tensor]]:
    """In a forked child: rank `rank` of the layout on the fake process group sets up the strategy
    from a meta model; returns (full-model name, global offset, local values) per parameter."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from harness import strategies
    from models.gpt import _local_view, build_model

    dims = validate(run)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    s = strategies.load(run, dims)(run, dims, dims.build_mesh("cpu"), torch.device("cpu"))
    s.setup(build_model(run.model, device="meta"))
    out = []
    for name, p in s.model.named_parameters():
        name = name.removeprefix("module.")  # 3d with ddp: DDP's prefix
        if name.split(".")[0].isdigit():  # pp: the ModuleList of this rank's stages
            name = name.split(".", 1)[1]
        local, _, offset = _local_view(p)
        out.append((name, offset, local.detach().numpy().copy()))  # numpy: pickled by value, not by fd
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("layout", ["fsdp dp2", "tp2", "pp2", "3d 2x2x2"])
def test_local_shards_are_slices_of_the_single_weights(layout):
    """Each rank of the layout (fake process group, one forked process per rank) materialises only
    its shards; every shard equals the same slice of the weights `single` builds, and together they
    cover every element."""
    from launch.fork import run_forked
    from models.gpt import build_model

    strategy, dp, tp, pp = {"fsdp dp2": ("fsdp", 2, 1, 1), "tp2": ("tp", 1, 2, 1), "pp2": ("pp", 1, 1, 2),
                            "3d 2x2x2": ("3d", 2, 2, 2)}[layout]
    run = compose_run(["model=llama_tiny", f"strategy={strategy}", f"parallel.dp={dp}", f"parallel.tp={tp}",
                       f"parallel.pp={pp}", "workload.global_batch_size=8", "workload.micro_batch_size=2"])
    world = dp * tp * pp
    reference = {n: p.detach() for n, p in build_model(run.model, run.workload.seed).named_parameters()}
    covered = {n: torch.zeros(p.shape, dtype=torch.int32) for n, p in reference.items()}
    for rank in range(world):
        for name, offset, local in run_forked(_rank_shards, run, rank):
            local = torch.from_numpy(local)
            index = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
            assert torch.equal(local, reference[name][index]), (rank, name)
            covered[name][index] += 1
    for name, count in covered.items():
        assert count.min() >= 1, name  # every element lives on some rank
    assert any(c.max() < world for c in covered.values()), "no parameter was sharded"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_torch_and_keeps_only_the_fused_kernels_tensors(dtype):
    """models/layers.py's RMSNorm off CUDA: torch's values and gradients, and for backward only what CUDA's
    fused kernel keeps (the input and an fp32 rstd per row; the weight is a parameter), no fp32 copies."""
    from models.layers import RMSNorm, _FusedRMSNorm

    torch.manual_seed(0)
    ours, ref = RMSNorm(64, eps=1e-5).to(dtype), torch.nn.RMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(64))
        ref.weight.copy_(ours.weight)
    x = torch.randn(3, 5, 64, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = ours(x)
    y_ref = ref(x_ref)
    grad = torch.randn_like(y)
    y.backward(grad)
    y_ref.backward(grad)
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0, "rtol": 0}
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, **tol)
    assert [(tuple(t.shape), t.dtype) for t in saved] == [((3, 5, 64), dtype), ((64,), dtype),
                                                          ((3, 5, 1), torch.float32)]
    x64, w64 = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True), torch.randn(8, dtype=torch.float64,
                                                                                            requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w: _FusedRMSNorm.apply(a, w, 1e-5), (x64, w64))
