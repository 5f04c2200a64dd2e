"""Records: every run ends in exactly one JSON line in <results_dir>/<study>.jsonl; how a record is
made (make_record: config, environment, measured, predicted, fidelity) and how a resumed study finds
what is already done (already_done).

Appends are all or nothing: one line under an exclusive flock, with O_APPEND, so concurrent jobs
(SLURM arrays) never interleave; a short write (disk full, file size limit) is continued, and on an
error the file is truncated back to where it was, under the lock, and the error raised (the caller
reports the run as not recorded). Readers take the same flock shared (locked_bytes), so a reader
polling a live study never sees half of an append in progress: the kernel grows the file page by page
during one write(2), and a lockless read of a ~20 KB record mid-write saw a torn last line (the fault
test's poll, at load 2-4, 12-02). Records are never rewritten; a reader skips a torn line (a writer
killed mid-line) with a warning. Lines are strict JSON: a non-finite number is written as null.
"""
from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import json
import os
import platform
import re
import socket
import subprocess
import tempfile
import time
import uuid
import warnings
from enum import StrEnum
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from omegaconf import OmegaConf

from harness import catalog
from harness.collect.aggregate import host_fingerprint, key
from harness.collect.aggregate import ratios as fidelity_ratios
from harness.config import ADHOC_STUDY, NON_SEMANTIC_KEYS, RunConfig

# Imports inside functions: wandb (only when a run logs to W&B).

REPO = Path(__file__).resolve().parents[2]

SCHEMA_VERSION = 1


class Status(StrEnum):
    """A record's status: the one list of them (results/README.md says what each means)."""
    OK = "ok"
    INVALID = "invalid"  # refused before launch
    FAILED = "failed"
    TIMEOUT = "timeout"
    OOM = "oom"
    DIVERGED = "diverged"  # ran to the end with a non-finite loss
    INTERRUPTED = "interrupted"  # brigade got SIGTERM/SIGINT/SIGHUP


FAILURES = frozenset({Status.FAILED, Status.TIMEOUT, Status.OOM, Status.DIVERGED})  # launched, not ok: exit 1
UNFINISHED = frozenset({Status.INVALID, Status.INTERRUPTED})  # never ran to an end: a resumed study runs them


def run_id(config: dict) -> str:
    """Hash of the resolved config, less the fields that do not change what is measured and less
    the values equal to the schema's defaults, so that adding a field with a default to the schema
    keeps every existing run_id (a resumed study still finds its done runs)."""
    defaults = _schema_defaults()
    flat = {**_retired_keys(config), **flatten(config)}
    semantic = {k: v for k, v in flat.items()
                if k.split(".")[0] not in NON_SEMANTIC_KEYS and defaults.get(k, _ABSENT) != v}
    if (config.get("launcher") or {}).get("name") == "dryrun":  # measures bytes, not a run: never the same record
        semantic["launcher.name"] = "dryrun"
    return hashlib.sha256(json.dumps(semantic, sort_keys=True, default=str).encode()).hexdigest()[:12]


_ABSENT = object()
# Schema fields that left the config for harness/catalog.py, with their old defaults: a config is
# hashed as the old schema would have hashed it, so studies recorded before keep resuming.
_RETIRED_DEFAULTS = {"strategy.axes": ["dp"], "strategy.impl": ""}


def _retired_keys(config: dict) -> dict:
    old = catalog.SCHEMA_1_STRATEGY_FIELDS.get((config.get("strategy") or {}).get("name"))
    if old is None or "axes" in config["strategy"]:
        return {}
    return {k: v for k, v in zip(("strategy.axes", "strategy.impl"), old) if v != _RETIRED_DEFAULTS[k]}


def flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1} (an empty dict stays a value)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@functools.lru_cache(maxsize=1)
def _schema_defaults() -> dict:

    return flatten(OmegaConf.to_container(OmegaConf.structured(RunConfig), throw_on_missing=False))


def records_path(results_dir: str | Path, study: str) -> Path:
    return Path(results_dir) / f"{study}.jsonl"


# Letters, digits, _ . - and no leading dot: a study names <results_dir>/<study>.jsonl and
# <results_dir>/runs/<study>/, so it must stay one plain entry inside results_dir.
_SAFE_STUDY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")


def study_problem(study: str) -> str | None:
    if _SAFE_STUDY.fullmatch(study):
        return None
    return (f"study {study!r} is not a safe name: letters, digits, '_', '.', '-' (1-128, no leading dot); "
            f"it names <results_dir>/<study>.jsonl")


def results_problem(results_dir: str, study: str) -> str | None:
    """One line saying why records cannot go to <results_dir>/<study>.jsonl, or None."""
    problem = study_problem(study)
    if problem or not results_dir:
        return problem or "results_dir is empty: give a directory for the records"
    try:
        Path(results_dir).mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".brigade-probe-", dir=results_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"results_dir {results_dir!r} is not a writable directory: {e.strerror or e} ({e.filename or results_dir})"
    return None


def append(path: Path, record: dict) -> None:
    """Append one record as one line, all or nothing (raises OSError when it could not be written)."""
    assert record["status"] in set(Status), record["status"]
    line = (json.dumps(finite(record), default=str, allow_nan=False) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        # A previous writer killed mid-line would leave no newline: start ours on a fresh line.
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line
        try:
            done = 0
            while done < len(line):  # write(2) may write less than asked (disk full, RLIMIT_FSIZE)
                n = os.write(fd, line[done:])
                if n == 0:
                    raise OSError(errno.ENOSPC, f"wrote 0 of {len(line) - done} bytes", str(path))
                done += n
            os.fsync(fd)
        except BaseException:
            os.ftruncate(fd, size)  # nothing of ours stays behind; the lock keeps others out meanwhile
            raise
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def finite(obj):
    """obj with every NaN/Inf float replaced by None (strict JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def locked_bytes(path: Path) -> bytes:
    """The file's bytes under a shared flock: whole appends only (append holds it exclusive)."""
    with open(path, "rb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_SH)
        try:
            return f.read()
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def read(path: Path) -> list[dict]:
    if not Path(path).exists():
        return []
    out = []
    for i, line in enumerate(locked_bytes(Path(path)).splitlines(), 1):
        try:
            out.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError):
            # a torn line from a writer that was killed: skipped, never repaired in place
            warnings.warn(f"{path}:{i}: skipped a torn record ({len(line)} bytes, not valid JSON)", stacklevel=2)
    return out


def claim_key(rid: str, repeat: int | None) -> str:
    """What one invocation claims while it runs a config (harness/run/ending.py): its run_id, and the
    repeat after the first, so two invocations of a study never run the same repeat twice."""
    return rid + (f".r{repeat}" if repeat else "")


def latest_by_run_id(records: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in records:
        out[r["run_id"]] = r
    return out


# -- making a record and resuming a study ------------------------------------------------------

_GIT = (["rev-parse", "HEAD"], ["status", "--porcelain", "--untracked-files=no"])
_git_probe: list = []


def start_git_probe() -> None:
    """Ask git for the commit and dirty state now (as the ranks start: the code that runs), so that
    the record after the run does not wait for it (git status: ~0.1 s of a run's fixed cost)."""
    try:
        _git_probe[:] = [subprocess.Popen(["git", "-C", str(REPO), *a], stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True) for a in _GIT]
    except OSError:
        _git_probe.clear()


def _git_state() -> tuple[str | None, bool | None]:
    """The probe's answers (started now if no run started one); None, None without git."""
    if not _git_probe:
        start_git_probe()
    procs, _git_probe[:] = list(_git_probe), []
    try:
        commit, status = (p.communicate(timeout=5)[0] for p in procs)
    except (ValueError, subprocess.SubprocessError):  # ValueError: no probe (git missing)
        for p in procs:
            p.kill()
        return None, None
    return commit.strip() or None, bool(status.strip())


def parent_env() -> dict:
    def v(pkg):
        try:
            return version(pkg)
        except PackageNotFoundError:
            return None

    commit, dirty = _git_state()
    return {"python": platform.python_version(), "torch": v("torch"), "deepspeed": v("deepspeed"),
            "hostname": socket.gethostname(), "platform": platform.platform(), "git_commit": commit,
            "git_dirty": dirty, "brigade": v("brigade"), **host_fingerprint()}


def make_record(config: dict, run, dims, status: str, error: str | None,
                measured: dict | None = None, predicted: dict | None = None, env: dict | None = None,
                run_dir: Path | None = None, wall_s: float | None = None) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id(config),
        "repeat": int(config.get("repeat") or 0),  # repeats=N: the same run_id N times (harness/collect/aggregate.py)
        "study": config.get("study", ADHOC_STUDY),
        "strategy": (config.get("strategy") or {}).get("name"),
        "dims": dims.as_dict() if dims else None,
        "status": status,
        "error": error,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": wall_s,
        "run_dir": str(run_dir) if run_dir else None,
        "config": config,
        "env": {**parent_env(), **(env or {}), "world_size": dims.world_size if dims else None},
        "measured": measured or {},
        "predicted": predicted or {},
        # measured/predicted for every metric both have (harness/collect/aggregate.py); W&B logs fidelity/*
        "fidelity": fidelity_ratios(measured or {}, predicted or {}) if status == Status.OK else {},
    }


def already_done(config: dict, run) -> dict | None:
    """Resume: in a named study, a config that already has a finished record is not run again
    (rerun=failed re-runs failed/timeout/oom/diverged ones, rerun=all everything). An invalid or
    interrupted run never finished, so it is always run again. Each repeat is its own run."""
    if run.study == ADHOC_STUDY or run.rerun == "all":
        return None
    mine = (run_id(config), int(config.get("repeat") or 0))
    done = next((r for r in reversed(read(records_path(run.results_dir, run.study))) if key(r) == mine), None)
    if done is None or done["status"] in UNFINISHED:
        return None
    if run.rerun == "failed" and done["status"] != Status.OK:
        return None
    return done


# -- wandb log -------------------------------------------------------------------------------------
# One W&B run per benchmark run, logged by the parent after the ranks are done.
#
# Offline unless the user says otherwise (WANDB_MODE wins over logger.mode); every W&B file lives under
# the run directory (WANDB_DIR and friends), nothing in the home directory. A W&B failure is reported
# and swallowed: the local record never depends on W&B. It is appended after logging, so it names its
# W&B run (`wandb`) only once that run exists, and says why not (`wandb_error`) when logging failed.
#
# Identity: the run id is unique per attempt (study, run_id and a random part), so W&B runs from two
# results dirs or machines synced into one project never collide; the group is the study, and for
# ad-hoc runs (no study named) the invocation, so each `brigade ...` command is its own group.

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
