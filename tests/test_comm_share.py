"""Synthetic check with known answers: the profiled window's comm share and exposed share.

Two real gloo ranks run a step whose communication is controlled: K all-reduces of a known size on
the dp group, either after the compute (serial: every collective blocks the step) or launched before
the compute and waited for after it (overlapped: long compute hides them; partial: a short compute
hides part of them). The truth is clocked inside the same steps by other instruments than the
profiler: each all-reduce spans launch -> completion (stamped by a callback on its future, on gloo's
thread), each compute chunk is timed with the wall clock; comm = |union of the all-reduces|,
exposed = |that union less the compute chunks| (the definition trace_analysis applies to traces).
The test checks what the window counts (calls, bytes, axis) and that it tells the serial case from the
overlapped one; how closely harness/worker/measure.py's window and harness/collect/trace_analysis.py agree
with the clocked truth is a benchmark (tests/benchmarks/test_bench_comm_share.py).

    python -m torch.distributed.run --nproc_per_node 2 tests/test_comm_share.py <out.json>
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
K, NUMEL = 2, 2_000_000  # 2 all-reduces of 8 MB (fp32): ~13 ms each at 0.6 GB/s bus bandwidth
N = 320  # compute: chunks of a 320x320 matmul chain (~3 ms each on one core)
CASES = {"serial": (False, 12), "overlap": (True, 12), "partial": (True, 2)}  # (overlapped?, compute chunks)


class SyntheticStep:
    """The part of the Strategy interface the profiled window uses: train_step, device, mesh."""

    def __init__(self, mesh, overlap: bool, chunks: int):
        import torch

        self.mesh, self.device, self.overlap, self.chunks = mesh, torch.device("cpu"), overlap, chunks
        self.group = mesh["dp"].get_group()
        self.bufs = [torch.ones(NUMEL) for _ in range(K)]
        self.a = torch.randn(N, N)
        self.truth: list[dict] = []  # per step: step, comm and exposed seconds by the wall clock

    def compute_chunk(self):
        x = self.a
        for _ in range(6):
            x = (x @ self.a).tanh()
        return x

    def train_step(self, microbatches):
        import torch.distributed as dist

        from harness.collect.trace_analysis import length, subtract, union

        ops: list[list[float]] = []  # [launch, completion] per all-reduce, completion stamped on gloo's thread
        compute: list[tuple[float, float]] = []

        def launch(buf):
            ops.append([time.perf_counter(), None])
            work = dist.all_reduce(buf, group=self.group, async_op=True)
            slot = ops[-1]
            work.get_future().add_done_callback(lambda _: slot.__setitem__(1, time.perf_counter()))
            return work

        def compute_all():
            for _ in range(self.chunks):
                c0 = time.perf_counter()
                self.compute_chunk()
                compute.append((c0, time.perf_counter()))

        t0 = time.perf_counter()
        if self.overlap:
            works = [launch(b) for b in self.bufs]
            compute_all()
            for w in works:
                w.wait()
        else:
            compute_all()
            for b in self.bufs:
                launch(b).wait()
        t1 = time.perf_counter()
        while any(done is None for _, done in ops):  # the callback may run just after wait() returns
            time.sleep(1e-4)
        comm = union((a, b) for a, b in ops)
        self.truth.append({"step": t1 - t0, "comm": length(comm), "exposed": length(subtract(comm, union(compute)))})
        return None

    def sync_disabled(self):
        return None


def _worker(out: str) -> None:
    import os

    import torch
    import torch.distributed as dist

    from harness.config import RunConfig, StrategyConfig, WorkloadConfig
    from harness.dims import ParallelDims
    from harness.worker.measure import FR_BUFFER_SIZE, ProfiledWindow

    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FR_BUFFER_SIZE))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dims = ParallelDims(dp=2, world_size=2)
    mesh = dims.build_mesh("cpu")
    run = RunConfig(strategy=StrategyConfig(name="synthetic"), workload=WorkloadConfig(profile_steps=2))
    results = {}
    for case, (overlap, chunks) in CASES.items():
        run_dir = Path(out).parent / case
        run_dir.mkdir(exist_ok=True)
        step = SyntheticStep(mesh, overlap, chunks)
        window = ProfiledWindow(run, dims, run_dir)
        step.train_step(None)  # warm the collectives up outside the window
        figures = window.finish(step, lambda i: None, 0)["comm_profile"]
        truth = step.truth[-run.workload.profile_steps:]  # the recorded steps (after the window's warm-up)
        tot = sum(t["step"] for t in truth)
        results[case] = {
            "trace": figures, "truth_comm_pct": 100 * sum(t["comm"] for t in truth) / tot,
            "truth_exposed_pct": 100 * sum(t["exposed"] for t in truth) / tot, "truth_step_s": tot / len(truth)}
    gathered = [None, None]
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def run_cases(tmp_path) -> list[dict]:
    """Both ranks' results of the three cases (the script below, under torchrun), each case's line printed."""
    out = tmp_path / "comm_share.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--standalone", str(Path(__file__)), str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    for rank, res in enumerate(results):
        for case, r in res.items():
            tr = r["trace"]
            print(f"rank {rank} {case}: trace {tr['comm_share_pct']:.1f}% / exposed {tr['comm_exposed_pct']:.1f}%, "
                  f"truth {r['truth_comm_pct']:.1f}% / {r['truth_exposed_pct']:.1f}% "
                  f"(step {tr['profiled_step_time_s'] * 1e3:.1f} ms traced, {r['truth_step_s'] * 1e3:.1f} ms clocked)")
    return results


@pytest.mark.slow
def test_comm_share_matches_known_answers(tmp_path):
    """What the profiled window counts and tells apart, whatever the load. How closely its shares agree with
    the wall-clock truth is timing: under load gloo's completion callback is stamped late and the truth's
    comm grows (34.6 % traced against 45.1 % clocked was seen beside two busy processes), so that agreement is
    a benchmark (tests/benchmarks/test_bench_comm_share.py), not a test."""
    results = run_cases(tmp_path)
    for res in results:
        for r in res.values():
            tr = r["trace"]
            # every collective is the dp group's all-reduce, K per step, 2(n-1)/n * 4 MB each
            assert set(tr["comm_by_axis"]) == {"dp"}, tr["comm_by_axis"]
            ar = tr["comm_by_axis"]["dp"]["all_reduce"]
            assert ar["count"] == K and ar["calls"] == K, ar
            assert ar["bytes"] == K * 4 * NUMEL, ar
        # The two cases differ as designed, by mechanism rather than by speed. Serial: the main thread computes
        # nothing while it waits, so all communication is exposed (the 10 % allows the few operators of the
        # launch itself). Overlapped: the all-reduces are enqueued before ~36 ms of compute (longer under load),
        # and gloo's thread starts each as soon as it is scheduled, a few ms at most, so part of it lies inside
        # the compute. How much it hides depends on the load: that is the benchmark's.
        serial, overlap = res["serial"]["trace"], res["overlap"]["trace"]
        assert serial["comm_exposed_pct"] >= 0.9 * serial["comm_share_pct"], serial
        assert overlap["comm_overlapped_time_s"] > 0, overlap


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from harness.worker.main import leave

    _worker(sys.argv[1])
    leave()  # a torchrun rank like the worker's (harness/worker/main.py leave)
