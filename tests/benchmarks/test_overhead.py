"""Benchmark (not a test): what brigade costs on top of the steps it times.

    make bench

One benchmark, three sides interleaved round by round so machine noise hits them alike: a bare
torchrun script training the same model, data, world and steps with DDP and nothing else
(tests/benchmarks/bare_ddp.py), brigade lean (`logger=none workload.profile_steps=0`: the same work),
and brigade with the defaults a user gets (W&B offline, the 2-step profiled window). Each side's wall
time is split by the loop's own wall-clock stamps into

    start-up   process start -> first step    (Python, Hydra compose, validate, predict, torchrun, worker set-up),
               itself split at rank 0's worker process start and at the end of its imports
    steps      first step -> last step        (warm-up + timed [+ profiled] steps)
    teardown   last step -> process exit      (gather, measurement.json, aggregation, record [+ W&B])

and reported as the per-step ratio (brigade's steps / the bare script's, goal <= 1.01 lean: the steps
are at parity) and the fixed cost per run (brigade's start-up + teardown minus the bare script's: what
a run costs beyond its steps, reported, not a goal), with the whole wall-time ratio beside them.
Medians over ROUNDS; the figures depend on the machine's load: give `uptime` with them.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PRESET, WARMUP, STEPS = "small", 3, 10
ROUNDS = int(os.environ.get("BRIGADE_BENCH_ROUNDS", "5"))  # fewer for a quick look
STEP_GOAL = 1.01  # brigade's steps / bare torchrun's, lean


def _timed(argv: list[str], stamps) -> dict:
    """Run argv; return start-up / steps / teardown / wall seconds from the loop stamps `stamps()` reads."""
    t0 = time.time()
    subprocess.run(argv, cwd=REPO, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    t1 = time.time()
    s = stamps()
    up = s["startup_unix"]  # rank 0's worker: when its process started, when its imports were done
    return {"wall_s": t1 - t0, "startup_s": s["loop_start_unix"] - t0, "steps_s": s["loop_end_unix"] - s["loop_start_unix"],
            "teardown_s": t1 - s["loop_end_unix"], "launch_s": up["process_start"] - t0,
            "imports_s": up["imported"] - up["process_start"], "setup_s": s["loop_start_unix"] - up["imported"]}


def _brigade_stamps(results_dir: Path):
    """The loop stamps of the run brigade just recorded (rank 0's, from its measurement.json)."""
    def read() -> dict:
        last = json.loads((results_dir / "adhoc.jsonl").read_text().splitlines()[-1])
        assert last["status"] == "ok", last.get("error")
        ranks = json.loads((Path(last["run_dir"]) / "measurement.json").read_text())["ranks"]
        return {"loop_start_unix": min(r["loop_start_unix"] for r in ranks),
                "loop_end_unix": max(r["loop_end_unix"] for r in ranks),
                "startup_unix": next(r for r in ranks if r["rank"] == 0)["startup_unix"]}
    return read


@pytest.mark.timeout(3600)  # 3 sides x ROUNDS runs: minutes on a quiet machine, far more under load
def test_harness_overhead_vs_bare_torchrun(benchmark, tmp_path):
    stamps = tmp_path / "bare_stamps.json"
    bare_argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 str(REPO / "tests/benchmarks/bare_ddp.py"), str(WARMUP + STEPS), PRESET, str(stamps)]
    common = [sys.executable, "-m", "harness", f"model={PRESET}", "strategy=ddp", "parallel.dp=2",
              f"workload.warmup_steps={WARMUP}", f"workload.steps={STEPS}"]
    lean_dir, default_dir = tmp_path / "lean", tmp_path / "defaults"
    sides = {
        "bare": (bare_argv, lambda: json.loads(stamps.read_text())),
        "lean": ([*common, "logger=none", "workload.profile_steps=0", f"results_dir={lean_dir}"],
                 _brigade_stamps(lean_dir)),
        "defaults": ([*common, f"results_dir={default_dir}"], _brigade_stamps(default_dir)),
    }
    runs: dict[str, list[dict]] = {k: [] for k in sides}

    def one_round():  # the benchmark's own timing is brigade lean; the other two are timed beside it
        for name in ("bare", "defaults"):
            runs[name].append(_timed(*sides[name]))
        runs["lean"].append(_timed(*sides["lean"]))

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in runs.items()}
    load = os.getloadavg()
    lines = [f"\noverhead vs bare torchrun (model={PRESET}, ddp dp2, {WARMUP}+{STEPS} steps, median of {ROUNDS} rounds, "
             f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores):"]
    for k in ("bare", "lean", "defaults"):
        m = med[k]
        lines.append(f"  {k:9s} wall {m['wall_s']:6.2f} s = start-up {m['startup_s']:5.2f} + steps {m['steps_s']:5.2f} "
                     f"+ teardown {m['teardown_s']:5.2f}; start-up = launch {m['launch_s']:5.2f} (command -> "
                     f"rank 0's process) + imports {m['imports_s']:5.2f} + set-up {m['setup_s']:5.2f} (-> first step)")
    for k in ("lean", "defaults"):
        ratio = med[k]["wall_s"] / med["bare"]["wall_s"]
        steps = med[k]["steps_s"] / med["bare"]["steps_s"]
        fixed = (med[k]["startup_s"] + med[k]["teardown_s"]) - (med["bare"]["startup_s"] + med["bare"]["teardown_s"])
        goal = f" (goal <= {STEP_GOAL})" if k == "lean" else " (W&B offline + profiled window: not the same work)"
        lines.append(f"  {k}: fixed cost {fixed:+.2f} s per run over bare (start-up "
                     f"{med[k]['startup_s'] - med['bare']['startup_s']:+.2f} s, teardown "
                     f"{med[k]['teardown_s'] - med['bare']['teardown_s']:+.2f} s); steps {steps:.3f} x bare's{goal}; "
                     f"whole wall time {ratio:.3f} x bare's")
        benchmark.extra_info[f"{k}_step_ratio"] = steps
        benchmark.extra_info[f"{k}_overhead_ratio"] = ratio
        benchmark.extra_info[f"{k}_fixed_cost_s"] = fixed
    benchmark.extra_info.update({f"{k}_{f}": v for k, m in med.items() for f, v in m.items()})
    print("\n".join(lines))


@pytest.mark.timeout(1800)
def test_fixed_cost_of_a_tiny_single_run(benchmark, tmp_path):
    """The smallest run there is (model=tiny, single, lean): its wall time is nearly all fixed cost."""
    argv = [sys.executable, "-m", "harness", "model=tiny", "strategy=single", f"workload.warmup_steps={WARMUP}",
            f"workload.steps={STEPS}", "logger=none", "workload.profile_steps=0", f"results_dir={tmp_path}"]
    runs: list[dict] = []
    benchmark.pedantic(lambda: runs.append(_timed(argv, _brigade_stamps(tmp_path))), rounds=ROUNDS, iterations=1,
                       warmup_rounds=0)
    med = {f: statistics.median(r[f] for r in runs) for f in runs[0]}
    load = os.getloadavg()
    print(f"\nfixed cost of a run (model=tiny single, {WARMUP}+{STEPS} steps, logger=none, no profiled window; median "
          f"of {ROUNDS}, load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores): wall "
          f"{med['wall_s']:.2f} s = start-up {med['startup_s']:.2f} s (compose -> first step) + steps "
          f"{med['steps_s']:.2f} s + teardown {med['teardown_s']:.2f} s (last step -> record, exit); start-up = launch "
          f"{med['launch_s']:.2f} s (command -> rank 0's process: Python, Hydra, validate, predict, torchrun) + "
          f"imports {med['imports_s']:.2f} s + set-up {med['setup_s']:.2f} s (process group, mesh, model, strategy)")
    benchmark.extra_info.update(med)
