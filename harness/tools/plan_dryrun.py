"""`python -m harness.plan ... --dryrun-top K`: confirm the memory of the planner's best K distinct
layouts by dry runs (launcher=dryrun: the real sharding code on torch's fake process group at the
layout's full world size) and print, per layout, predicted vs dry-run model-state bytes and peak.
Each dry run is an ordinary brigade job whose record lands in the study (default plan_dryrun_<time>)."""
from __future__ import annotations

import time

from omegaconf import OmegaConf

from harness.config import compose_run
from harness.run.job import run_job
from harness.run.record import Status
from harness.run.signals import received
from harness.tools import plan_check

GiB = 1024**3


def dryrun_top(cands, k: int, overrides: list[str], by: str = "degrees") -> int:
    keep = [o for o in overrides if not o.startswith(("plan.", "strategy", "parallel.", "workload.micro_batch_size",
                                                       "workload.activation_checkpointing", "launcher"))]
    if not any(o.startswith("study=") for o in keep):
        keep.append(f"study=plan_dryrun_{time.strftime('%Y%m%d_%H%M%S')}")
    rows, rc = [], 0
    for c in plan_check.distinct_layouts(cands, k, by):
        rec = run_job(OmegaConf.structured(compose_run([*keep, *c.overrides(), "launcher=dryrun"])))
        m, p = rec.get("measured") or {}, rec.get("predicted") or {}
        device = rec["config"]["hardware"]["memory_GiB"] * GiB
        verdict = rec["status"]
        if m.get("peak_mem_bytes") is not None and m["peak_mem_bytes"] > device:
            verdict = f"dropped: the dry run's peak {_gib(m['peak_mem_bytes'])} > the device's {_gib(device)} GiB"
        rows.append((" ".join(c.overrides()), verdict, p.get("model_states_bytes"), m.get("model_states_bytes"),
                     p.get("peak_mem_bytes"), m.get("peak_mem_bytes")))
        rc |= rec["status"] != Status.OK
        if received():  # stopped (harness/plan.py installs the handlers): no further layout starts
            rows.append(("the layouts after it", f"not run: {received()}", None, None, None, None))
            break
    print("layout | status | states predicted | states dry run | peak predicted | peak dry run (GiB per rank, max)")
    for layout, status, ps, ms, pp, mp in rows:
        print(f"{layout} | {status} | {_gib(ps)} | {_gib(ms)} | {_gib(pp)} | {_gib(mp)}")
    if any(status.startswith("dropped") for _, status, *_ in rows):
        print("note: a dropped layout's dry run (fake tensors, the real step) needs more than the device holds; "
              "the planner's prediction of it is low (docs/memory.md)")
    return rc


def _gib(v) -> str:
    return "-" if v is None else f"{v / GiB:.3f}"
