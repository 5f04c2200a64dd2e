"""Run brigade configs from tests: composed in-process with Hydra's compose API (the real conf/),
executed by the real job function, whose ranks are real torchrun subprocesses."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from harness.config import register_configs

REPO = Path(__file__).resolve().parent.parent
CONF_DIR = str(REPO / "conf")
register_configs()

# Small and quick: 1 warm-up + 5 timed steps, no profiling, no W&B.
FAST = ["model=tiny", "logger=none", "workload.warmup_steps=1", "workload.steps=5", "workload.profile_steps=0",
        "launcher.timeout_s=240"]


def compose_config(overrides: list[str], results_dir: Path):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=[*overrides, f"results_dir={results_dir}"])


def run(overrides: list[str], results_dir: Path, fast: bool = True) -> dict:
    """Run one config; return its record (also appended to <results_dir>/<study>.jsonl)."""
    from harness.run.job import run_job

    return run_job(compose_config([*(FAST if fast else []), *overrides], results_dir))


def cli(args: list[str], results_dir: Path, timeout: float = 600, env: dict | None = None):
    """The `brigade` CLI as a user runs it, in a subprocess."""
    return subprocess.run([sys.executable, "-m", "harness", *args, f"results_dir={results_dir}"], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def records(results_dir: Path, study: str = "adhoc") -> list[dict]:
    path = Path(results_dir) / f"{study}.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def assert_losses_match(losses, reference, rtol=1e-5):
    assert len(losses) == len(reference) >= 5, (losses, reference)
    for i, (a, b) in enumerate(zip(losses, reference)):
        assert abs(a - b) <= rtol * abs(b), f"step {i}: {a} vs reference {b} (rtol {rtol})\n{losses}\n{reference}"


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def device_overrides(device: str) -> list[str]:
    """Overrides that run a test body on `device`: "cpu" (gloo, the default hardware) or "cuda"
    (NCCL, one GPU per rank)."""
    return [] if device == "cpu" else ["hardware=h100_sxm"]


# Parametrise a multi-process test body over devices: `@pytest.mark.parametrize("device", DEVICES)`.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    _gpu_count() < 2, reason="needs 2 CUDA GPUs (world 2, one GPU per rank); this machine has fewer")])]


STATE_KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "model_states_bytes")


def assert_states_as_predicted(rec: dict) -> None:
    """The model-state bytes every rank measured equal the cost model's prediction exactly (==):
    params, grads, optimizer state and their sum, rank by rank."""
    m, p = rec["measured"], rec["predicted"]
    for key in STATE_KEYS:
        assert m[f"{key}_per_rank"] == p[f"{key}_per_rank"], (key, m[f"{key}_per_rank"], p[f"{key}_per_rank"])
