"""The baseline for brigade's overhead: the same model, data and steps with DDP and nothing else.

    torchrun --standalone --nproc-per-node 2 tests/benchmarks/bare_ddp.py <n_steps> <preset> [stamps.json]

With a third argument, rank 0 writes the wall-clock start and end of its loop there (as brigade's
worker records loop_start_unix / loop_end_unix), so the benchmark can split each side's wall time
into start-up, steps and teardown.
"""
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from harness.worker.main import _process_start_unix, leave  # noqa: E402  (stdlib only: the same clock as brigade's)

PROCESS_START = _process_start_unix()
import torch  # noqa: E402
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from harness.worker.loop import global_batch  # noqa: E402
from models.gpt import build_model  # noqa: E402
from models.gpt import cross_entropy as loss_fn  # noqa: E402


class Cfg:
    """The preset's YAML over the model schema's defaults (harness/config.py ModelConfig), as Hydra composes it."""
    def __init__(self, d):
        from dataclasses import MISSING, fields

        from harness.config import ModelConfig

        self.__dict__.update({f.name: f.default for f in fields(ModelConfig) if f.default is not MISSING})
        self.__dict__.update(d)


def main(steps: int, preset: str, stamps: str | None = None) -> None:
    imported = time.time()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = Cfg(yaml.safe_load((Path(__file__).resolve().parents[2] / "conf" / "model" / f"{preset}.yaml").read_text()))
    model = DDP(build_model(cfg, 1234))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    gbs, micro = 8, 2
    per_rank = gbs // world
    n_micro = per_rank // micro
    start = time.time()
    for step in range(steps):
        tokens = global_batch(step, 1234, gbs, cfg.seq_len, cfg.vocab_size)[rank * per_rank:(rank + 1) * per_rank]
        opt.zero_grad(set_to_none=True)
        for i, mb in enumerate(tokens.chunk(n_micro)):
            ctx = model.no_sync() if i < n_micro - 1 else torch.enable_grad()
            with ctx:
                (loss_fn(model(mb[:, :-1]), mb[:, 1:]) / n_micro).backward()
        opt.step()
    if stamps and rank == 0:
        Path(stamps).write_text(json.dumps({"loop_start_unix": start, "loop_end_unix": time.time(),
                                            "startup_unix": {"process_start": PROCESS_START, "imported": imported}}))
    dist.destroy_process_group()
    # as brigade's ranks leave (harness/worker/main.py leave()): gloo's threads can outlive the group into
    # the interpreter's teardown and abort the process after its work is done (seen once in a full
    # `make test`: "terminate called without an active exception", exit -6)
    leave()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
