"""The overhead benchmark's baseline (tests/benchmarks/bare_ddp.py) still runs: it builds the model
from a preset's YAML outside Hydra, so a new model option without a default there would break
`make bench` while every brigade test stayed green (it did once: `'Cfg' object has no attribute
'position'`)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow


def test_bare_ddp_baseline_trains_and_stamps_its_loop(tmp_path):
    stamps = tmp_path / "stamps.json"
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(REPO / "tests/benchmarks/bare_ddp.py"), "2", "tiny", str(stamps)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    s = json.loads(stamps.read_text())
    assert s["loop_end_unix"] > s["loop_start_unix"] > 0
