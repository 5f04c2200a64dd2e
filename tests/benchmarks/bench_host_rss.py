"""Host memory at the end of setup, one FSDP rank, before and after meta-device construction.

    PYTHONPATH=. python tests/benchmarks/bench_host_rss.py gpt2_350m 4 [gpt_1_3b 2 ...]

Rank 0 of an FSDP dp=N layout on torch's fake process group (no other process needed; sharding
and allocation are a real run's, collectives are no-ops), each measurement in a fresh forked child
(launch/fork.py) so ru_maxrss is its own:
    before  the old path: the whole model built and initialised in fp32 on the host, then fully_shard
    after   the model built on meta, fully_shard, then only the local shards allocated (models/gpt.py)
Prints peak RSS at the end of setup, the local parameter bytes and the criterion
(peak <= local parameter bytes + 1 GiB). Not a timed test: give `uptime` with the figures.
"""
from __future__ import annotations

import sys

GiB = 1024**3


def one_rank(model_name: str, dp: int, path: str) -> dict:
    import resource

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from harness import strategies
    from harness.config import compose_run
    from harness.strategies.fsdp import apply_fsdp, fsdp_mesh
    from harness.validate import validate
    from harness.worker import measure
    from models.gpt import build_model

    torch.set_num_threads(1)
    run = compose_run([f"model={model_name}", "strategy=fsdp", f"parallel.dp={dp}", f"workload.global_batch_size={dp}",
                       "workload.micro_batch_size=1"])
    dims = validate(run)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp)
    mesh = dims.build_mesh("cpu")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if path == "before":
        model = apply_fsdp(build_model(run.model, run.workload.seed), fsdp_mesh(mesh, dims), run)
    else:
        s = strategies.load(run, dims)(run, dims, mesh, torch.device("cpu"))
        s.setup(build_model(run.model, device="meta"))
        model = s.model
    return {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss_before_model": base,
            "local_param_bytes": measure.tensor_bytes(list(model.parameters()))}


def main(args: list[str]) -> None:
    from launch.fork import run_forked

    for model_name, dp in zip(args[::2], map(int, args[1::2])):
        for path in ("before", "after"):
            r = run_forked(one_rank, model_name, dp, path)
            ok = r["peak_rss"] <= r["local_param_bytes"] + GiB
            print(f"{model_name} fsdp dp={dp} {path:6}: peak RSS at end of setup {r['peak_rss'] / GiB:.2f} GiB "
                  f"(before the model {r['rss_before_model'] / GiB:.2f}), local params {r['local_param_bytes'] / GiB:.2f} GiB, "
                  f"peak <= local + 1 GiB: {ok}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
