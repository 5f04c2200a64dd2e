"""Every command in README.md runs as written (issue: a newcomer's first hour).

The commands are the lines of README.md's ```bash blocks (continuations joined, `# ...` comments
cut). Each runs in a subprocess from the repository root, with `.venv/bin/brigade` and `python` meaning
this interpreter (the venv the tests run in), and:
  - brigade commands that train get `model=tiny` (unless the line names a model or a study, whose
    runs name theirs), few steps, no W&B and a temporary results_dir appended, so the whole README
    costs minutes, not hours;
  - predict and plan run exactly as written;
  - calibrate gets `--quick --output <tmp>` (the full run takes minutes and writes a profile);
  - a line whose comment says it is refused must be refused before launch: an `invalid` record and
    the arithmetic printed, and no run directory;
  - every other line must exit 0.
Lines that need what a test cannot have are listed in SKIP with the reason (`make demo` is the full
study, `make test` is this suite; the SLURM section needs the cluster tests/test_slurm.py starts).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TRAIN_TAIL = ["logger=none", "workload.warmup_steps=1", "workload.steps=2", "workload.profile_steps=0",
              "launcher.timeout_s=300"]
SKIP = {"make demo": "the full default study (12 min); `make demo` is run by hand and in the lead's checks",
        "make test": "this test suite itself", "make bench": "the benchmarks (tests/benchmarks), minutes of wall time",
        "launch/slurm/": "needs the local SLURM cluster (tests/test_slurm.py starts one and runs these)",
        "launcher=slurm": "needs the local SLURM cluster (tests/test_slurm.py)", "export SLURM_CONF": "SLURM",
        "python3 -m venv": "installs a CUDA torch (GPU machines)"}


def readme_commands() -> list[tuple[str, str]]:
    """(command, its comment) for every line of README.md's bash blocks."""
    text = (REPO / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            cmd, _, comment = line.partition(" #")
            out.append((" ".join(cmd.split()), comment.strip()))
    return list({cmd: (cmd, comment) for cmd, comment in reversed(out)}.values())[::-1]  # each command once


def _skip_reason(cmd: str) -> str | None:
    return next((why for key, why in SKIP.items() if key in cmd), None)


def _argv(cmd: str, tmp: Path) -> list[str]:
    words = shlex.split(cmd)
    if words[0] in (".venv/bin/brigade", "brigade"):
        args = words[1:]
        if not any(a.startswith(("model=", "experiment=")) for a in args):  # a study keeps its own models
            args.append("model=tiny")
        return [sys.executable, "-m", "harness", *args, *TRAIN_TAIL, f"results_dir={tmp}"]
    if words[0] in ("python", "python3", ".venv/bin/python"):
        args = words[1:]
        if args[:2] == ["-m", "harness.calibrate"]:
            args += ["--quick", "--output", str(tmp / "calibrated.yaml")]
        return [sys.executable, *args]
    raise AssertionError(f"README command not understood by this test (add it here or to SKIP): {cmd}")


COMMANDS = readme_commands()


def test_the_readme_has_commands_and_this_test_knows_each():
    assert len(COMMANDS) >= 15, COMMANDS
    for cmd, _ in COMMANDS:
        if not _skip_reason(cmd):
            _argv(cmd, Path("/tmp"))  # understood (raises otherwise)


@pytest.mark.slow
@pytest.mark.parametrize("cmd,comment", COMMANDS, ids=[c for c, _ in COMMANDS])
def test_readme_command_runs_as_written(cmd, comment, tmp_path):
    why = _skip_reason(cmd)
    if why:
        pytest.skip(why)
    argv = _argv(cmd, tmp_path)
    p = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1500,
                       env={**os.environ, "WANDB_MODE": "offline"})
    out = p.stdout + p.stderr
    if comment.startswith("refused"):
        recs = [json.loads(l) for f in tmp_path.glob("*.jsonl") for l in f.read_text().splitlines()]
        assert [r["status"] for r in recs] == ["invalid"], out[-3000:]
        assert "not divisible" in out or "must" in out, out[-3000:]
        assert not (tmp_path / "runs").exists()
        return
    assert p.returncode == 0, f"{cmd}\nexit {p.returncode}\n{out[-4000:]}"
    for f in tmp_path.glob("*.jsonl"):  # every run a README command starts ends ok
        bad = [(r["status"], r.get("error")) for r in map(json.loads, f.read_text().splitlines()) if r["status"] != "ok"]
        assert not bad, bad
