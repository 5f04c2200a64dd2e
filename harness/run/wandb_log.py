"""W&B logging: one W&B run per benchmark run, logged by the parent after the ranks are done.

Offline unless the user says otherwise (WANDB_MODE wins over logger.mode); every W&B file lives under
the run directory (WANDB_DIR and friends), nothing in the home directory. A W&B failure is reported
and swallowed: the local record never depends on W&B. It is appended after logging, so it names its
W&B run (`wandb`) only once that run exists, and says why not (`wandb_error`) when logging failed.

Identity: the run id is unique per attempt (study, run_id and a random part), so W&B runs from two
results dirs or machines synced into one project never collide; the group is the study, and for
ad-hoc runs (no study named) the invocation, so each `brigade ...` command is its own group.
"""
from __future__ import annotations

import os
import re
import time
import uuid
from pathlib import Path

from harness.config import ADHOC_STUDY, flatten

# Imports inside functions: wandb (only when a run logs to W&B).

# The metric keys every run logs once more against its scaling axes (the x axis: `devices`), so a W&B
# workspace plots tokens/s against devices grouped by series, study, commit or cluster with no set-up.
SCALING_METRICS = ("tokens_per_s", "tokens_per_s_ci95_lo", "tokens_per_s_ci95_hi", "step_time_s", "mfu_pct",
                   "tokens_per_s_per_device", "model_states_bytes", "peak_mem_bytes", "comm_share_pct")


def _scalars(d: dict) -> dict:
    """Flat scalar fields; a 95 % interval [lo, hi] (`<key>_ci95`) becomes `<key>_ci95_lo` and `_hi`."""
    out = {}
    for k, v in flatten(d).items():
        if k.endswith("_ci95") and isinstance(v, list) and len(v) == 2:
            out[f"{k}_lo"], out[f"{k}_hi"] = v
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[k] = v
    return out


def scaling_axes(record: dict) -> dict:
    """What a scaling curve is drawn against and grouped by: devices (the world size), and the series,
    study, commit and cluster the run belongs to (the environment fingerprint: harness/collect/aggregate.py)."""
    env, cfg = record.get("env") or {}, record.get("config") or {}
    return {"devices": (record.get("dims") or {}).get("world_size") or env.get("world_size"),
            "series": cfg.get("series") or "", "study": record.get("study"), "commit": env.get("git_commit"),
            "cluster": env.get("cluster"), "repeat": record.get("repeat", 0)}


def wandb_env(run_dir: Path, mode: str) -> dict[str, str]:
    wdir = Path(run_dir).resolve()
    return {"WANDB_MODE": os.environ.get("WANDB_MODE", mode), "WANDB_DIR": str(wdir),
            "WANDB_CACHE_DIR": str(wdir / "wandb" / ".cache"), "WANDB_CONFIG_DIR": str(wdir / "wandb" / ".config"),
            "WANDB_DATA_DIR": str(wdir / "wandb" / ".data"), "WANDB_SILENT": "true",
            "WANDB_DISABLE_GIT": "true"}


def invocation() -> str:
    """This `brigade` command: one id for every job it starts (set once in the parent; SLURM jobs
    inherit it through the environment sbatch exports)."""
    return os.environ.setdefault("BRIGADE_INVOCATION", f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")


def group(study: str) -> str:
    """The W&B group: the study, or `adhoc-<invocation>` for runs started without one."""
    return f"{ADHOC_STUDY}-{invocation()}" if study == ADHOC_STUDY else study


def run_identity(record: dict, run_dir: Path, logger_cfg, name: str) -> dict:
    """The W&B run this record is logged as, named `name` (its label: harness/labels.py)."""
    attempt = uuid.uuid4().hex[:8]
    run_id = re.sub(r"[^A-Za-z0-9_-]", "-", f"{record['study'][:30]}-{record['run_id']}-{attempt}")
    return {"id": run_id, "project": logger_cfg.project, "group": group(record["study"]), "name": name,
            "mode": os.environ.get("WANDB_MODE", logger_cfg.mode), "dir": str(Path(run_dir) / "wandb")}


def log_record(record: dict, ident: dict, run_dir: Path, logger_cfg, job_type: str) -> str | None:
    """Log one record as the W&B run `ident` (run_identity); None once that run exists, else why not."""
    os.environ.update(wandb_env(run_dir, logger_cfg.mode))
    axes = scaling_axes(record)
    try:
        import wandb

        run = wandb.init(project=ident["project"], entity=logger_cfg.entity, group=ident["group"], id=ident["id"],
                         job_type=job_type, name=ident["name"],
                         config={**flatten(record.get("config") or {}), **{f"axes/{k}": v for k, v in axes.items()}},
                         dir=str(run_dir), reinit="finish_previous",
                         settings=wandb.Settings(console="off", x_disable_stats=True))
        # per step: loss and step time against `step`; per run: SCALING_METRICS against `devices`
        run.define_metric("step")
        run.define_metric("loss", step_metric="step")
        run.define_metric("step_time_s", step_metric="step")
        run.define_metric("devices")
        run.define_metric("scaling/*", step_metric="devices")
        m = record.get("measured") or {}
        for i, (loss, t) in enumerate(zip(m.get("losses", []), [None] * m.get("warmup_steps", 0)
                                          + m.get("step_times_s", []))):
            row = {"step": i, "loss": loss}
            if t is not None:
                row["step_time_s"] = t
            run.log(row, step=i)
        flat = _scalars(m)
        run.log({"devices": axes["devices"], **{f"scaling/{k}": flat[k] for k in SCALING_METRICS
                                                  if isinstance(flat.get(k), (int, float))}},
                step=len(m.get("losses", [])))  # a row of its own, after the steps
        summary = {"status": record["status"], "run_id": record["run_id"], **{f"axes/{k}": v for k, v in axes.items()}}
        for prefix in ("measured", "predicted", "fidelity"):
            summary.update({f"{prefix}/{k}": v for k, v in _scalars(record.get(prefix) or {}).items()})
        run.summary.update(summary)
        run.finish()
        return None
    except Exception as e:  # noqa: BLE001 - W&B must never lose a local record
        print(f"W&B logging failed ({type(e).__name__}: {e}); the local record is unaffected")
        return f"W&B logging failed: {type(e).__name__}: {str(e)[:500]}"
