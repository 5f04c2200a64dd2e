"""The parent side of calibrate's collective timings: launch the worker on n ranks with torchrun
(harness/tools/calibrate_collectives.py), and fit t(S) = α + factor * S / B to its times per collective
and group ("<n>": all n ranks; "2@<n>": the pairs, timed at once)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.config import CONF_DIR
from harness.tools.calibrate_collectives import FACTOR

REPO = CONF_DIR.parent

def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Fit t = α + x / B to (x = factor * bytes, t seconds), least squares in relative error:
    minimise Σ ((α + x_i β - t_i) / t_i)^2 over α >= 0 and β = 1/B > 0. Returns (α s, B bytes/s)."""
    w = [1.0 / t**2 for _, t in points]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
    st = sum(wi * t for wi, (_, t) in zip(w, points))
    sxt = sum(wi * x * t for wi, (x, t) in zip(w, points))
    det = sw * sxx - sx * sx
    if det <= 0:
        x, t = max(points)
        return 0.0, x / t
    alpha = (sxx * st - sx * sxt) / det
    beta = (sw * sxt - sx * st) / det
    if alpha > 0 and beta > 0:
        return alpha, 1.0 / beta
    # Noise (a loaded machine: the 8 B message slower than the 1 MB one) left no physical line. Every
    # message pays α, so the shortest time measured bounds it from above and is its best estimate here;
    # β from the weighted ratio of what remains, and no bandwidth above what some message achieved.
    alpha = min(t for _, t in points)
    beta = sum(wi * x * max(t - alpha, 0.0) for wi, (x, t) in zip(w, points)) / sxx
    fastest = max(x / t for x, t in points)
    return alpha, min(1.0 / beta, fastest) if beta > 0 else fastest


def run_collectives(n: int, sizes, budget_s: float, on_poll, backend: str = "gloo") -> dict:
    """Start the worker on n ranks with torchrun; return its results."""
    with tempfile.TemporaryDirectory(prefix="brigade-calibrate-") as tmp:
        out, progress = Path(tmp) / "out.json", Path(tmp) / "progress"
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(REPO) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                "-m", "harness.tools.calibrate_collectives", str(out), ",".join(map(str, sizes)), str(budget_s), str(progress),
                backend]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
        t0 = time.monotonic()
        while proc.poll() is None:
            try:
                done, total = map(int, progress.read_text().split())  # may be mid-write: skip then
                on_poll(done, total)
            except (OSError, ValueError):
                pass
            if time.monotonic() - t0 > 600:
                proc.kill()
                raise RuntimeError(f"collective calibration at {n} ranks took over 600 s")
            time.sleep(0.2)
        log = proc.stdout.read().decode(errors="replace")
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"torchrun at {n} ranks failed (exit {proc.returncode}):\n{log[-3000:]}")
        return json.loads(out.read_text())


def tables(res: dict) -> dict:
    """{collective: {key: summary}} of one run_collectives result, keyed as the worker timed them:
    "<n>" over all n ranks, "2@<n>" over the pairs at once; the group size is the key's first number."""
    out: dict = {}
    for key, results in res["results"].items():
        for coll, rows in results.items():
            out.setdefault(coll, {})[key] = summarise(coll, int(key.partition("@")[0]), rows)
    return out


def summarise(coll: str, n: int, rows: list[dict]) -> dict:
    f = FACTOR[coll](n)
    alpha, bw = fit_alpha_beta([(f * r["bytes"], r["time_s"]) for r in rows])
    return {"bus_bw_GBps": round(bw / 1e9, 4), "latency_us": round(alpha * 1e6, 1),
            "busbw_GBps_by_bytes": {str(r["bytes"]): round(f * r["bytes"] / r["time_s"] / 1e9, 4) for r in rows},
            "time_us_by_bytes": {str(r["bytes"]): round(r["time_s"] * 1e6, 1) for r in rows}}
