"""Pure tier: another runtime's behaviour as the cost model prices it (conf/runtime/nanotron.yaml)."""
from __future__ import annotations

import pytest

from harness.config import compose_run
from harness.costmodel import predict
from harness.dims import ConfigError
from harness.validate import validate
from models.pipeline_split import compute_balanced_split, nanotron_block_costs

# the Playbook sweep's 1B: 16 layers, h 2048, d_ff 8192, V 131072 (lab/playbook_dev_runs.csv)
ONE_B = ["model=gpt_7b", "model.n_layers=16", "model.d_model=2048", "model.n_heads=32", "model.d_ff=8192",
         "model.vocab_size=131072", "model.seq_len=4096", "model.norm=rmsnorm", "model.mlp=swiglu",
         "model.position=rope", "hardware=h100_sxm", "workload.precision=bf16-mixed", "logger=none"]


def test_nanotron_split_as_its_build_model_places_blocks():
    """A decoder layer costs 4h^2 + 3h d_ff = 2^26 and the head V h = 2^28 (4 layers): 20 units. pp 2 closes rank 0
    once 11 > 10 units; pp 4 leaves the last rank the head alone; pp 8 puts the head on rank 6, cast and loss on 7."""
    layer, head = nanotron_block_costs(2048, 8192, 131072)
    assert (layer, head) == (2.0**26, 2.0**28)
    assert compute_balanced_split(16, 2, layer, head) == ((11, 5), 1, 1, 1, 1)
    assert compute_balanced_split(16, 4, layer, head) == ((6, 5, 5, 0), 3, 3, 3, 3)
    assert compute_balanced_split(16, 8, layer, head) == ((3, 3, 2, 3, 2, 3, 0, 0), 6, 7, 7, 7)
    counts, *_, last = compute_balanced_split(16, 16, layer, head)
    assert sum(counts) == 16 and last == 14  # rank 15 holds nothing


def test_another_runtime_is_priced_not_launched_and_its_empty_stage_refused():
    run = compose_run(ONE_B + ["runtime=nanotron", "strategy=pp", "parallel.pp=8", "workload.global_batch_size=16",
                               "workload.micro_batch_size=1", "strategy.schedule=1f1b"])
    with pytest.raises(ConfigError, match="priced by the cost model only"):
        validate(run)
    assert predict(run, validate(run, torch_runs=False))["step_time_s"] > 0
    deep = compose_run(ONE_B + ["runtime=nanotron", "strategy=pp", "parallel.pp=16", "workload.global_batch_size=16",
                                "workload.micro_batch_size=1", "strategy.schedule=1f1b"])
    with pytest.raises(ConfigError, match="ranks 15..15 without a block"):
        validate(deep, torch_runs=False)


@pytest.mark.parametrize("key", ["pipeline_split", "tp_collectives", "tp_saved_inputs", "grad_accumulation",
                                 "ddp_grad_buckets"])
def test_a_runtime_key_outside_its_domain_is_refused_naming_the_choices(key):
    from harness.validate import RUNTIME_CHOICES

    run = compose_run(ONE_B + ["runtime=nanotron", f"runtime.{key}=bogus", "strategy=ddp", "parallel.dp=8",
                               "workload.global_batch_size=8", "workload.micro_batch_size=1"])
    with pytest.raises(ConfigError, match=f"unknown runtime.{key} 'bogus'; available: " + ", ".join(RUNTIME_CHOICES[key])):
        validate(run, torch_runs=False)


def test_the_head_where_the_runtime_puts_it_and_the_logits_hop_priced():
    """pp 8: nanotron's head on rank 6 with no decoder layer, rank 7 a relay for the logits; brigade's even
    split puts 2 layers and the head on rank 7 and has no logits hop."""
    base = ONE_B + ["strategy=pp", "parallel.pp=8", "workload.global_batch_size=16", "workload.micro_batch_size=1",
                    "strategy.schedule=1f1b"]
    nano = compose_run(base + ["runtime=nanotron"])
    ours = compose_run(base)
    p_nano, p_ours = (predict(r, validate(r, torch_runs=False)) for r in (nano, ours))
    logits = 4096 * 131072 * 2  # one micro-batch's bf16 logits, there and their gradient back, 16 micro-batches
    assert p_nano["comm_pp_bytes"] - p_ours["comm_pp_bytes"] == pytest.approx(2 * 16 * logits, rel=1e-9)
    # the slowest stage: 3 layers (nanotron) against 2 layers + the head (4 layers' estimated cost) under brigade's
    assert p_nano["compute_time_s"] < p_ours["compute_time_s"]


def test_a_host_bound_micro_batch_takes_its_layers_host_time():
    """1B tp 8 at micro-batch 1: the device needs ~1.3 ms a layer, nanotron's host 4.6 ms (host_layer_us): each
    micro-batch takes 16 x host_layer_us; brigade's own runtime prices no host term."""
    base = ONE_B + ["strategy=tp", "parallel.tp=8", "strategy.sequence_parallel=true", "workload.global_batch_size=4",
                    "workload.micro_batch_size=1"]
    nano, ours = compose_run(base + ["runtime=nanotron"]), compose_run(base)
    p_nano, p_ours = (predict(r, validate(r, torch_runs=False)) for r in (nano, ours))
    host = nano.runtime.host_layer_us * 1e-6
    assert p_nano["compute_time_s"] == pytest.approx(4 * 16 * host + p_nano["optimizer_time_s"], rel=1e-9)
    assert p_ours["compute_time_s"] < p_nano["compute_time_s"] / 2
    assert p_nano["comm_tp_exposed_time_s"] == 0.0  # the TP collectives run while the device waits for the host


def test_a_ring_only_collective_across_efa_waits_at_every_step():
    """efa_p5's ring_step_latency_us: an all-gather over 16 ranks on 2 nodes of 1 MiB a rank pays 15 steps of it;
    the same over 32 ranks on 4 nodes 31; an all-reduce (NCCL's tree or ring, node profile hops) does not."""
    from harness.costmodel.inputs import Hardware
    hw = Hardware.of(compose_run(["hardware=h100_sxm", "hardware/fabric=efa_p5", "logger=none"]).hardware)
    step = hw.fabric.ring_step_s
    assert step == pytest.approx(40.5e-6)
    small = 16 * 2**20  # 1 MiB a rank over 16
    t16, t32 = hw.fabric.call_s("all_gather", 16, 8, small), hw.fabric.call_s("all_gather", 32, 8, 2 * small)
    assert 15 * step < t16 < 15 * step * 1.3 and 31 * step < t32 < 31 * step * 1.3
    assert hw.fabric.call_s("all_reduce", 16, 8, small) < 15 * step


def test_nanotron_tp_overlaps_what_its_async_linears_overlap():
    """tp 8 in a node at micro-batch 8 (device-bound): exposed = the forward reduce-scatters whole, the rest only
    where a collective outlasts the GEMM it runs under; brigade's DTensor TP exposes every collective."""
    base = ONE_B + ["strategy=tp", "parallel.tp=8", "strategy.sequence_parallel=true", "workload.global_batch_size=8",
                    "workload.micro_batch_size=8"]
    nano = compose_run(base + ["runtime=nanotron", "runtime.host_layer_us=0"])
    ours = compose_run(base)
    p_nano, p_ours = (predict(r, validate(r, torch_runs=False)) for r in (nano, ours))
    assert 0.2 * p_nano["comm_tp_time_s"] < p_nano["comm_tp_exposed_time_s"] < 0.75 * p_nano["comm_tp_time_s"]
    assert p_ours["comm_tp_exposed_time_s"] == p_ours["comm_tp_time_s"]


def test_tp_rings_slow_where_the_pipeline_crosses_nodes():
    """tp 4 pp 2 on 8 ranks (one node) against dp 2 tp 4 pp 2 on 16 (the pipeline's sends cross nodes): only the
    second's layers take at least host_layer_us + 10 rings x 3 steps x tp_ring_step_remote_pp_us a micro-batch,
    whatever its size, the device computing meanwhile. At micro-batch 1 that floor sets the micro-batch (11 layers
    on stage 0); at micro-batch 64 the device's own work is longer, and the floor changes nothing."""
    def pair(mbs: int):
        base = ONE_B + ["runtime=nanotron", "strategy=3d", "strategy.data_parallel=ddp",
                        "strategy.sequence_parallel=true", "strategy.low_precision_params=true", "parallel.tp=4",
                        "parallel.pp=2", "strategy.schedule=1f1b", f"workload.micro_batch_size={mbs}"]
        near = compose_run(base + ["parallel.dp=1", f"workload.global_batch_size={2 * mbs}"])
        far = compose_run(base + ["parallel.dp=2", f"workload.global_batch_size={4 * mbs}"])
        return far.runtime, [predict(r, validate(r, torch_runs=False)) for r in (near, far)]
    runtime, (near, far) = pair(1)
    floor = 11 * (runtime.host_layer_us + 10 * 3 * runtime.tp_ring_step_remote_pp_us) * 1e-6
    assert near["compute_time_s"] < 2 * floor * 0.8  # the host alone bounds the one-node layout less
    assert far["compute_time_s"] - far["optimizer_time_s"] == pytest.approx(2 * floor, rel=1e-3)  # 2 micro-batches
    runtime, (near, far) = pair(64)
    assert far["compute_time_s"] == pytest.approx(near["compute_time_s"], rel=1e-3)
