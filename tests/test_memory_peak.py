"""The peak of one step on fake tensors (launcher=dryrun) for the layouts whose step used to fail there
(pipelines, every schedule, and 3d), the peak counter's handling of FSDP's storage resizes, and the
cost model's activation bytes of one Llama block against the tensors autograd actually saves."""
from __future__ import annotations

import weakref

import pytest
import torch

from harness.config import compose_run
from harness.costmodel.activations import brigade_layer_bytes
from harness.costmodel.params import kv_dim
from harness.worker.measure import LiveTensors
from models.gpt import Block
from tests.helpers import run

SMALL_LLAMA = ["model=llama3_8b", "model.d_model=256", "model.n_heads=4", "model.n_kv_heads=1", "model.d_ff=896",
               "model.seq_len=256"]


@pytest.mark.parametrize("param_dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_a_llama_block_saves_what_the_cost_model_counts(param_dtype, autocast):
    """Every storage autograd saves in one block's forward, parameters excluded, in bytes == the formula
    (bf16 params without autocast is FSDP's mixed precision: RMSNorm keeps the bf16 input and an fp32
    rstd per row, as CUDA's fused kernel does, models/layers.py)."""
    m = compose_run(SMALL_LLAMA).model
    block = Block(m).to(param_dtype)
    params = {p.untyped_storage()._cdata for p in block.parameters()}
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in params:
            saved[st._cdata] = st.nbytes()
        return t

    x = torch.randn(1, m.seq_len, m.d_model, dtype=param_dtype, requires_grad=True)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        block(x)
    precision = "fp32" if param_dtype == torch.float32 and not autocast else "bf16-mixed"
    expected = brigade_layer_bytes(m.seq_len, 1, m.d_model, m.n_heads, m.d_ff, 1, False, precision, "sdpa", 0.0, "none",
                                   autocast=autocast or precision == "fp32", kv=kv_dim(m), mlp="swiglu",
                                   norm="rmsnorm", rope=True)
    if autocast:  # autocast's bf16 copy of every matmul weight, saved for backward: held per micro-batch in
        # flight from forward to backward (memory_peak.autocast_copies_bytes, not a per-layer activation)
        expected += 2 * sum(mod.weight.numel() for mod in block.modules() if isinstance(mod, torch.nn.Linear))
    assert sum(saved.values()) == expected


def test_the_peak_counter_follows_storage_resizes():
    """FSDP2 frees a gathered unit by resizing its storage to 0 and gathers into it again by resizing
    it back: two units gathered one after the other peak at one unit, not two."""
    n = 1 << 20
    with LiveTensors() as tracker:
        a = torch.empty(n, dtype=torch.uint8)
        a.untyped_storage().resize_(0)
        b = torch.empty(n, dtype=torch.uint8)
        b.untyped_storage().resize_(0)
        a.untyped_storage().resize_(n)
        assert tracker.current == n
    assert tracker.peak == n


PIPELINES = [["strategy=pp", "parallel.pp=2", f"strategy.schedule={s}"] for s in ("gpipe", "1f1b")] + [
    ["strategy=pp", "parallel.pp=2", "parallel.vpp=2", f"strategy.schedule={s}"]
    for s in ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")] + [
    ["strategy=3d", "parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "strategy.sequence_parallel=true"],
    ["strategy=3d", "parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "strategy.data_parallel=zero1"],
    ["strategy=3d", "parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "strategy.fsdp_accumulate=sharded"],
    ["strategy=3d", "parallel.dp=2", "parallel.cp=2", "parallel.pp=2"]]

# Where llama_tiny's prediction misses its dry run by more than 5 %: 3d dp2 tp2 pp2 with sequence parallel
# (the end of backward's FSDP terms, measured on llama3 70B and 405B dry runs, overcount at this size) and
# 3d dp2 cp2 pp2 (not yet explained). Their errors are rows of docs/memory.md's dryrun_scale table,
# generated from conf/experiment/dryrun_scale.yaml's records (tests/test_dryrun_scale.py).
UNMODELLED_AT_TINY = {"strategy.sequence_parallel=true", "parallel.cp=2"}


@pytest.mark.slow
@pytest.mark.parametrize("layout", PIPELINES, ids=lambda o: " ".join(x.split("=")[1] for x in o))
def test_every_pipeline_schedule_and_3d_dry_runs_to_a_peak(layout, tmp_path):
    rec = run(["launcher=dryrun", "model=llama_tiny", "workload.global_batch_size=8", "workload.micro_batch_size=2",
               *layout], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    m = rec["measured"]
    assert "dryrun_step_error" not in m, m["dryrun_step_error"]
    assert m["peak_mem_kind"] == "fake_tensor_storages"
    assert all(peak > states for peak, states in zip(m["peak_mem_bytes_per_rank"], m["model_states_bytes_per_rank"]))
    if not any(o in UNMODELLED_AT_TINY for o in layout):  # the predicted peak explains the dry run's
        assert rec["predicted"]["peak_mem_bytes"] == pytest.approx(max(m["peak_mem_bytes_per_rank"]), rel=0.05)


@pytest.mark.slow
def test_torchs_pipeline_stages_hold_a_receive_buffer_for_every_microbatch(tmp_path):
    """torch's stages make a receive buffer per micro-batch of the step when the schedule starts (the
    first stage's for its output's gradient): with 8 micro-batches on 2 stages, 8 at the first stage's
    peak, where 2 micro-batches are in flight. The prediction holds them (memory_peak.stage_boundary_terms);
    Megatron-LM's one-per-transfer (pp_recv_buffers=in_flight) holds one, m - 1 fewer."""
    from harness.predict import predict_overrides

    layout = ["model=llama_tiny", "strategy=pp", "parallel.pp=2", "workload.global_batch_size=16", "workload.micro_batch_size=2"]
    rec = run(["launcher=dryrun", *layout], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    md = rec["config"]["model"]
    one = 2 * md["seq_len"] * md["d_model"] * 4  # (mb, s, h) in fp32
    assert rec["measured"]["peak_rank"] == 0
    assert rec["measured"]["peak_live_by_op"]["aten.empty_strided"] == 8 * one
    step, megatron = (predict_overrides([*layout, f"strategy.pp_recv_buffers={b}"]) for b in ("step", "in_flight"))
    assert "not_run" in megatron and "not_run" not in step
    assert step["peak_mem_bytes"] - megatron["peak_mem_bytes"] == pytest.approx(7 * one)


@pytest.mark.parametrize("ckpt", ["none", "selective", "full", "selective_op"])
def test_checkpointed_blocks_keep_no_autocast_weight_copies_between_microbatches(ckpt):
    """autocast's bf16 copy of a weight is saved by the matmul that used it, one set per micro-batch in
    flight, unless the block is checkpointed: then its copies live in autocast's cache until the forward's
    autocast region ends, and none stay for backward (memory_peak.autocast_copies_bytes and
    autocast_cache_bytes). Two llama_tiny blocks, three micro-batches forward, each in its own region as a
    pipeline stage runs them (harness/strategies/pipeline_timeline.py)."""
    from torch.utils.checkpoint import checkpoint

    from models.gpt import selective_op_context

    m = compose_run(["model=llama_tiny"]).model
    blocks = torch.nn.ModuleList([Block(m), Block(m)])
    for b in blocks:
        b.attn.checkpoint_core = ckpt == "selective"
    weights = {id(mod.weight) for mod in blocks.modules() if isinstance(mod, torch.nn.Linear)}
    one_set = 2 * sum(mod.weight.numel() for mod in blocks.modules() if isinstance(mod, torch.nn.Linear))
    casts = []  # the storages of the weights' bf16 copies, as autocast makes them

    def stage_forward(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for b in blocks:
                if ckpt in ("full", "selective_op"):
                    ctx = {"context_fn": selective_op_context} if ckpt == "selective_op" else {}
                    x = checkpoint(b, x, use_reentrant=False, **ctx)
                else:
                    x = b(x)
            during = sum(t.untyped_storage().nbytes() for t in casts if t.untyped_storage().nbytes())
        return x, during

    class WeightCasts(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func == torch.ops.aten._to_copy.default and id(args[0]) in weights:
                casts.append(out.detach())  # a detached alias: watches the storage, keeps it no longer than torch does
            return out

    outs, alive = [], []
    with WeightCasts():
        for _ in range(3):
            casts.clear()
            y, during = stage_forward(torch.randn(1, m.seq_len, m.d_model, requires_grad=True))
            outs.append(y)
            assert during == one_set  # the forward holds one set, cached
            alive += [weakref.ref(t.untyped_storage()) for t in casts]
            casts.clear()
    held = sum(r().nbytes() for r in alive if r() is not None)
    assert held == (0 if ckpt in ("full", "selective_op") else 3 * one_set), held
    # the cost model's: copies per micro-batch in flight, and the forward's cache (a block's norm weights,
    # which autocast does not cast, are 0.3 % of its parameters)
    from harness.costmodel.inputs import Hardware, Model, StrategyKnobs
    from harness.costmodel.layout import layout
    from harness.costmodel.memory_peak import CHECKPOINTED_BLOCKS, autocast_cache_bytes, autocast_copies_bytes

    one = compose_run(["model=llama_tiny", "model.n_layers=2", "model.tie_embeddings=true"])
    lo = layout(Model.of(one.model), Hardware.of(one.hardware), StrategyKnobs.of(one.strategy), 1, 1, 1, 1, 1, "bf16-mixed")
    assert autocast_copies_bytes(lo, lo.ranks[0], 1, ckpt) == pytest.approx(held / 3, rel=0.01)
    if ckpt in CHECKPOINTED_BLOCKS:
        assert autocast_cache_bytes(lo, 2) == pytest.approx(one_set, rel=0.01)


@pytest.mark.slow
def test_a_deep_checkpointed_pipeline_under_autocast_peaks_as_predicted(tmp_path):
    """1F1B on 4 stages of two llama_tiny blocks, 16 micro-batches, full recompute under bf16 autocast: the
    first stage holds 4 micro-batches in flight, but no weight copies for any of them (above): predicted
    within 3 % of the dry run's peak (measured: +1.0 %, the last stage)."""
    rec = run(["launcher=dryrun", "model=llama_tiny", "model.n_layers=8", "strategy=pp", "parallel.pp=4",
               "workload.global_batch_size=16", "workload.micro_batch_size=1", "workload.activation_checkpointing=full",
               "workload.precision=bf16-mixed"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert rec["predicted"]["peak_mem_bytes"] == pytest.approx(max(rec["measured"]["peak_mem_bytes_per_rank"]), rel=0.03)


def _torch_order(schedule: str, pp: int, m: int) -> dict:
    """torch 2.13's own action lists of a split-backward schedule (vpp 2), rank -> actions, computed as its
    __init__ does, from the ranks' sizes alone (`_calculate_single_rank_operations` reads no stage)."""
    import types

    import torch.distributed.pipelining.schedules as S

    cls = {"interleaved_zero_bubble": S.ScheduleInterleavedZeroBubble, "zbv_zero_bubble": S.ScheduleZBVZeroBubble,
           "dualpipev": S.ScheduleDualPipeV}[schedule]
    rounds = max(1, m // pp)
    self = types.SimpleNamespace(pp_group_size=pp, n_local_stages=2, _n_microbatches=m, num_stages=2 * pp,
                                 number_of_rounds=rounds, microbatches_per_round=m // rounds)
    return {r: cls._calculate_single_rank_operations(self, r) for r in range(pp)}


def _peaks(actions: list) -> tuple[set, set]:
    """Over a rank's actions, a chunk held from its forward to its weight pass (or its full backward),
    deferred from its input pass to its weight pass: (the Pareto front of (held, deferred), the stages
    with a gradient when most are held)."""
    held = deferred = 0
    points, most, grads = set(), (0, 0, set()), set()
    flat = [sub for action in actions if action is not None for sub in (getattr(action, "sub_actions", None) or [action])]
    for a in flat:
        kind = a.computation_type.name
        step = 1 if kind == "FORWARD" else -1 if kind in ("FULL_BACKWARD", "BACKWARD_WEIGHT") else 0
        held += step
        deferred += 1 if kind == "BACKWARD_INPUT" else -1 if kind == "BACKWARD_WEIGHT" else 0
        grads |= {a.stage_index} if step < 0 else set()
        points.add((held, deferred))
        if held > most[0]:
            most = (held, set(grads))
    front = {p for p in points if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in points)}
    return front, most[1]


@pytest.mark.parametrize("schedule", ["interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"])
def test_split_backward_peaks_are_torchs(schedule):
    """The chunks held and weight passes deferred at which a rank can peak (harness/costmodel/activations.py
    split_backward_front) are the Pareto front of torch's own action lists, and the micro-batches in
    flight its most held."""
    from harness import catalog
    from harness.costmodel import activations as act

    row = catalog.schedule(schedule)
    for pp in (2, 3, 4, 8):
        for m in range(pp if schedule == "dualpipev" else 1, 4 * pp + 1):
            if row.torch_microbatches == "rounds" and m % max(1, m // pp):
                continue  # torch refuses it (harness/validate.py)
            for r, actions in _torch_order(schedule, pp, m).items():
                front, grads = _peaks(actions)
                ours = set(act.split_backward_front(schedule, pp, 2, m, r))
                if schedule == "zbv_zero_bubble" and pp < m < 2 * pp - 1:
                    assert max(front) in ours, (pp, m, r)  # only its most held is priced there
                else:
                    assert ours == front, (pp, m, r, sorted(front))
                assert act.in_flight(schedule, pp, 2, m, r) == max(front)[0] / 2, (pp, m, r)
                if schedule == "dualpipev":  # memory_peak.grads_at_loss_bytes: the first chunk has none yet
                    assert r not in grads, (pp, m, r)
