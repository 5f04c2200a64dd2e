"""scripts/gpu_wheels.sh and the offline set-up of scripts/gpu_check.sh, on this CPU.

A GPU machine that reaches no package registry gets brigade's dependencies as wheels made here. The
python there is stood in for by the interpreter this repository's .venv was made from (no torch, none of
brigade's dependencies): the set-up must install what it lacks from the wheels alone, then stop at the
missing torch with a sentence, not a traceback.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wheels_made_here_install_offline_beside_a_bare_python(tmp_path):
    base = Path(sys.base_prefix) / "bin" / "python3"
    ver = subprocess.run([base, "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
                         capture_output=True, text=True, check=True).stdout.strip()
    wheels, site = tmp_path / "whl", tmp_path / "site"
    made = subprocess.run(["bash", "scripts/gpu_wheels.sh"], cwd=REPO, capture_output=True, text=True, timeout=500,
                          env={**os.environ, "DEST": str(wheels), "PYVER": ver, "PY": sys.executable})
    assert made.returncode == 0, made.stdout + made.stderr
    roots = (wheels / "requirements.txt").read_text().split()
    assert "hydra-core==1.3.8" in roots and any(r.startswith("wandb==") for r in roots)
    assert not list(wheels.glob("torch-*")) and not list(wheels.glob("numpy-*"))  # the GPU machine's own

    bin_dir = tmp_path / "bin"  # `python3` is the bare interpreter, as on the GPU machine
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(base)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", WHEELS=str(wheels), SITE=str(site), PIP_NO_INDEX="1")
    copy = tmp_path / "repo" / "scripts"  # the script alone, in a folder without .venv
    copy.mkdir(parents=True)
    (copy / "gpu_check.sh").write_text((REPO / "scripts" / "gpu_check.sh").read_text())
    p = subprocess.run(["bash", str(copy / "gpu_check.sh")], capture_output=True, text=True, timeout=300, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert f"from {wheels}/ into {site}: hydra-core==1.3.8" in out, out
    assert "python3 has no torch: install a CUDA build of torch" in out and "Traceback" not in out, out
    imported = subprocess.run([base, "-c", "import hydra, omegaconf, submitit, wandb, plotly; print(hydra.__version__)"],
                              capture_output=True, text=True, env={**env, "PYTHONPATH": str(site)})
    assert imported.stdout.strip() == "1.3.8", imported.stderr
    hta = subprocess.run([base, "-c", "import hta, networkx, psutil; print('hta')"], capture_output=True, text=True,
                         env={**env, "PYTHONPATH": str(site)})
    assert hta.stdout.strip() == "hta", hta.stderr  # step 5's side-by-side, carried too


def _python_blocks(script: str) -> list[str]:
    """The python programs scripts/gpu_check.sh feeds to $PY through `<<'PYEOF'` here-documents."""
    blocks, cur = [], None
    for line in script.splitlines():
        if cur is None and line.rstrip().endswith("<<'PYEOF'"):
            cur = []
        elif cur is not None and line == "PYEOF":
            blocks.append("\n".join(cur))
            cur = None
        elif cur is not None:
            cur.append(line)
    return blocks


@pytest.mark.slow
def test_gpu_checks_tables_read_a_real_profiled_record(tmp_path, single_reference):
    """A device's minutes are few: the check's tables (step 3) and its predictions on the measured profile
    (step 4) run here on a real profiled CPU record, so a broken table shows up before a GPU run."""
    import json

    rec = json.loads(json.dumps(single_reference("workload.profile_steps=1")))
    # what a CUDA record adds (harness/collect/compute_classes.py top_kernels)
    rec["measured"]["compute_top_kernels"] = [{"name": "nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NNT", "kind": "gemm",
                                               "time_s": 0.0123, "count": 96.0}]
    (tmp_path / "gpu_single.jsonl").write_text(json.dumps(rec) + "\n")
    script = (REPO / "scripts" / "gpu_check.sh").read_text()
    (tables,) = _python_blocks(script)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-", str(tmp_path)], input=tables, text=True, capture_output=True,
                         cwd=REPO, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"single {rec['config']['model']['name']}" in out.stdout
    assert "gemm" in out.stdout and "12.30 ms x96  nvjet_hsh_128x256" in out.stdout, out.stdout
    # step 4: the same record predicted again on another profile, as the script calls it
    assert '$PY -m harness.fidelity "$RESULTS/gpu_single.jsonl" --repredict "hardware=$MEASURED"' in script
    out = subprocess.run([sys.executable, "-m", "harness.fidelity", str(tmp_path / "gpu_single.jsonl"), "--repredict",
                          "hardware=cpu"], text=True, capture_output=True, cwd=REPO, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("predicted again by this checkout's cost model, on hardware=cpu"), out.stdout
    assert "1 records, hardware cpu;" in out.stdout, out.stdout
    for kind in ("gemm", "attention", "elementwise", "optimizer"):
        assert f"{kind} meas/pred" in out.stdout, out.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_check_rehearses_every_step_without_cuda_on_this_cpu(tmp_path):
    """HW=cpu: the single-device study (model=tiny, fp32), its tables and fidelity, then step 5: the profiled
    steps' own traces through python -m harness.trace, and HTA beside brigade on a public GPU trace."""
    env = {**os.environ, "HW": "cpu", "LOGGER": "none", "RESULTS": str(tmp_path), "PY": sys.executable}
    p = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=580, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "== rehearsal on the CPU (HW=cpu): model tiny, precision fp32" in out
    assert "gpu_single: strategy model compile" in out and "single tiny False |" in out
    assert "== gpu_single: measured / predicted" in out
    assert "steps from brigade's `brigade/step` annotations" in out and "trace_rank0.json: rank 0 of 1, cpu" in out
    assert "| nccl_data.json.gz | 0 |" in out, out[-4000:]
