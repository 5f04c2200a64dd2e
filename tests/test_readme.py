"""Every command in README.md runs as written (issue: a newcomer's first hour).

The commands are the lines of README.md's ```bash blocks (continuations joined, `# ...` comments
cut). Each runs in a subprocess from the repository root, with `.venv/bin/brigade` and `python` meaning
this interpreter (the venv the tests run in), and:
  - brigade commands that train get `model=tiny` (unless the line names a model or a study, whose
    runs name theirs), few steps, no W&B and a temporary results_dir appended, so the whole README
    costs minutes, not hours;
  - predict and plan run exactly as written;
  - calibrate gets `--quick` (the full run takes minutes); it writes its default target, this host's
    profile under conf/hardware/local/, which must be ignored by git (a record's git_dirty stays false);
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
        "python3 -m venv": "installs a CUDA torch (GPU machines)",
        "harness.calibrate hardware=h100_sxm": "measures a CUDA device (tests/test_calibrate.py runs its path on this CPU)",
        "scripts/gpu_check.sh": "needs a CUDA device (tests/test_gpu_scripts.py runs its offline set-up on this CPU)"}


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
            args.append("--quick")
        return [sys.executable, *args]
    raise AssertionError(f"README command not understood by this test (add it here or to SKIP): {cmd}")


COMMANDS = readme_commands()


def test_the_readme_has_commands_and_this_test_knows_each():
    assert len(COMMANDS) >= 15, COMMANDS
    for cmd, _ in COMMANDS:
        if not _skip_reason(cmd):
            _argv(cmd, Path("/tmp"))  # understood (raises otherwise)


def _param(cmd: str, comment: str):
    # A named study runs its every config (dp_vs_3d: 27): minutes each even at model tiny, so these
    # lines run in `make test-all`; each config they contain is tested on its own by the suite.
    heavy = [pytest.mark.heavy] if "experiment=" in cmd else []
    return pytest.param(cmd, comment, id=cmd, marks=heavy)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # above the command's own 1500 s: a whole study (dp_vs_3d) takes 10-25 min on 2 cores
@pytest.mark.parametrize("cmd,comment", [_param(c, m) for c, m in COMMANDS])
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
    if "harness.calibrate" in cmd:
        written = Path(re.search(r"wrote (\S+\.yaml)", out).group(1))
        assert written.parent == REPO / "conf" / "hardware" / "local", written
        assert subprocess.run(["git", "check-ignore", "-q", str(written)], cwd=REPO).returncode == 0
    for f in tmp_path.glob("*.jsonl"):  # every run a README command starts ends ok
        bad = [(r["status"], r.get("error")) for r in map(json.loads, f.read_text().splitlines()) if r["status"] != "ok"]
        assert not bad, bad


def test_readme_predictions_print_a_short_summary():
    # pure (no torch, nothing launched): quick enough for every run of the suite
    for cmd, _ in COMMANDS:
        if "harness.predict" not in cmd:
            continue
        p = subprocess.run(_argv(cmd, Path("/tmp")), cwd=REPO, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        assert p.stdout.startswith(("3d ", "zero3 ")) and "step time" in p.stdout and "MFU" in p.stdout, p.stdout
        # a summary (and the peak, a line per term), not the whole JSON (that is --json)
        assert "= peak" in p.stdout and len(p.stdout.splitlines()) < 30, p.stdout


def test_help_describes_brigade_and_hides_the_schema():
    p = subprocess.run([sys.executable, "-m", "harness", "--help"], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("brigade: a config-driven benchmark harness"), p.stdout[:300]
    assert "powered by Hydra" not in p.stdout and "_schema" not in p.stdout
    assert "brigade strategy=ddp parallel.dp=2" in p.stdout  # an example
    groups = dict(l.split(": ", 1) for l in p.stdout.splitlines() if re.match(r"^(model|strategy|hardware): ", l))
    assert "ddp" in groups["strategy"] and "tiny" in groups["model"] and "cpu" in groups["hardware"]
    # what was offered as an option and failed (strategy=strategy_schema) is not an option any more
    bad = subprocess.run([sys.executable, "-m", "harness", "strategy=strategy_schema", "--cfg", "job"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "strategy_schema" in bad.stderr
