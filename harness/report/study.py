"""A study's records, read for the report: the latest record per config, tolerant accessors, and which
run each mode (DP / TP / PP / 3D) explains.

The records are produced by several parts of brigade that grow independently (cost model, strategies,
measurement), so every accessor returns None for a figure a record does not carry, and the page says
"not measured" / "not predicted" instead of failing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from harness import catalog, rundir
from harness.collect.aggregate import config_records
from harness.dims import COMM_AXES, DEGREES, MESH_AXES, degrees, world_size
from harness.labels import base_label, labels
from harness.run import results_file
from harness.run.record import Status

MEMORY_PARTS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes")


def _number(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


@dataclass
class Run:
    r: dict
    label: str = ""  # what the page calls it: set from the whole study by load() (harness/labels.py)

    def __post_init__(self):
        self.label = self.label or base_label(self.r)

    # -- identity --------------------------------------------------------------------------------
    @property
    def run_id(self) -> str:
        return self.r.get("run_id") or "?"

    @property
    def status(self) -> str:
        return self.r.get("status") or "?"

    @property
    def ok(self) -> bool:
        return self.status == Status.OK

    @property
    def strategy(self) -> str:
        return self.r.get("strategy") or "?"

    @property
    def config(self) -> dict:
        return self.r.get("config") or {}

    def cfg(self, *path, default=None):
        d = self.config
        for k in path:
            if not isinstance(d, dict) or k not in d:
                return default
            d = d[k]
        return d

    @property
    def engine(self) -> str:
        return self.cfg("strategy", "engine", default="torch")

    @property
    def dims(self) -> dict:
        d = dict(self.r.get("dims") or {})
        par = self.cfg("parallel", default={}) or {}
        for axis in DEGREES:
            d.setdefault(axis, par.get(axis, 1) if isinstance(par.get(axis), int) else 1)
        d.setdefault("world_size", world_size(d))
        return d

    @property
    def world(self) -> int:
        return int(self.dims["world_size"] or 1)

    @property
    def degrees(self) -> str:
        return degrees(self.dims)

    @property
    def series(self) -> str:
        """The scaling series the study put this run in ("" = none named: report/scaling.py groups it)."""
        return str(self.r.get("config", {}).get("series") or "")

    @property
    def measured(self) -> dict:
        return self.r.get("measured") or {}

    @property
    def predicted(self) -> dict:
        return self.r.get("predicted") or {}

    @property
    def repeats(self) -> int:
        """How many times the study ran this config (repeats=N; 1 for a record before repeats)."""
        return int(self.r.get("repeats") or 1)

    def ci(self, key: str) -> tuple[float, float] | None:
        """The measured 95 % interval of a figure (`<key>_ci95`), None where the record has none."""
        v = self.measured.get(f"{key}_ci95")
        return (v[0], v[1]) if isinstance(v, list) and len(v) == 2 and all(_number(x) is not None for x in v) else None

    def m(self, key):
        return _number(self.measured.get(key))

    def p(self, key):
        return _number(self.predicted.get(key))

    @property
    def dtype_bytes(self) -> int:
        return catalog.PRECISION_BYTES.get(self.cfg("workload", "precision", default="fp32"), 4)

    @property
    def num_microbatches(self) -> int | None:
        """Micro-batches per rank per step as recorded (what the ranks ran, else what validation derived
        for the prediction); None for a record that has neither."""
        n = self.measured.get("num_microbatches") or self.predicted.get("num_microbatches")
        return int(n) if n else None

    @property
    def run_dir(self) -> Path | None:
        d = self.r.get("run_dir")
        return Path(d) if d else None

    def uses(self, axis: str) -> bool:
        return (self.dims.get(axis) or 1) > 1

    # -- communication -------------------------------------------------------------------------
    def comm_share_by_axis(self) -> dict[str, float] | None:
        """Measured % of the step each axis spent in collectives (the profiled window's
        comm_share_by_axis_pct, else derived from comm_by_axis times), None if not measured."""
        m = self.measured
        share = _pct_dict(m.get("comm_share_by_axis_pct"))
        if share is None and isinstance(m.get("comm_by_axis"), dict) and _number(m.get("profiled_step_time_s")):
            step = m["profiled_step_time_s"]
            share = {a: 100 * sum(_number(c.get("time_s")) or 0.0 for c in colls.values() if isinstance(c, dict)) / step
                     for a, colls in m["comm_by_axis"].items() if isinstance(colls, dict)} or None
        return share

    def comm_exposed_by_axis(self) -> dict[str, float] | None:
        return _pct_dict(self.measured.get("comm_exposed_by_axis_pct"))

    def predicted_comm_share_by_axis(self) -> dict[str, float] | None:
        """The cost model's comm time per axis as % of its predicted step time."""
        step = self.p("step_time_s")
        if not step:
            return None
        out = {a: 100 * self.p(f"comm_{a}_time_s") / step for a in COMM_AXES if self.p(f"comm_{a}_time_s")}
        return out or None

    def comm_bytes(self, axis: str) -> tuple[float | None, float | None]:
        """(measured, predicted) bytes sent per rank per step along one axis."""
        meas = self.m(f"comm_{axis}_bytes")
        if meas is None and isinstance(self.measured.get("comm_bytes_by_axis"), dict):
            meas = _number(self.measured["comm_bytes_by_axis"].get(axis))
        return meas, self.p(f"comm_{axis}_bytes")

    def collectives_of(self, axis: str) -> dict[str, dict]:
        """Measured collectives on one axis: {name: {time_s, exposed_s, count, bytes, ...}} ({} if none)."""
        by_axis = self.measured.get("comm_by_axis")
        colls = by_axis.get(axis) if isinstance(by_axis, dict) else None
        return {k: v for k, v in colls.items() if isinstance(v, dict)} if isinstance(colls, dict) else {}

    # -- pipeline timelines ------------------------------------------------------------------------
    def timelines(self) -> list[dict]:
        """The timeline_rank<r>.json files of a pipeline run, by rank ([] if none were written)."""
        d = self.run_dir
        if d is None or not d.is_dir():
            return []
        out = []
        for f in sorted(d.glob(rundir.TIMELINE_GLOB)):
            try:
                doc = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if isinstance(doc, dict) and isinstance(doc.get("events"), list):
                out.append(doc)
        return sorted(out, key=lambda t: t.get("rank", 0))


def _pct_dict(v) -> dict[str, float] | None:
    if not isinstance(v, dict):
        return None
    out = {a: float(x) for a, x in v.items() if _number(x) is not None}
    return out or None


@dataclass
class Study:
    name: str
    path: Path
    runs: list[Run]

    @property
    def ok_runs(self) -> list[Run]:
        return [r for r in self.runs if r.ok]

    @property
    def not_ok(self) -> list[Run]:
        return [r for r in self.runs if not r.ok]

    @property
    def strategies(self) -> list[str]:
        return sorted({r.strategy for r in self.runs})

    def example(self) -> Run | None:
        """A representative config (for commands that would run a missing mode)."""
        return (self.ok_runs or self.runs or [None])[0]

    def baseline(self, run: Run) -> Run | None:
        """The run that scaling is measured against for `run`: an ok one-device run of the same model
        and global batch (a strategy with no parallel axis first), else the smallest ok run of that model."""
        same = [r for r in self.ok_runs if r.cfg("model", "name") == run.cfg("model", "name")
                and r.cfg("workload", "global_batch_size") == run.cfg("workload", "global_batch_size")
                and r.m("tokens_per_s")]
        if not same:
            return None
        return min(same, key=lambda r: (r.world, bool(getattr(catalog.STRATEGIES.get(r.strategy), "axes", ())), r.run_id))


def load(path: str | Path, run_ids: set[str] | None = None, name: str | None = None) -> Study:
    """Read <results_dir>/<study>.jsonl; one record per config, in first-seen order: the latest one, or
    with repeats (repeats=N) their pooled statistics (harness/collect/aggregate.py).
    run_ids: only those configs (one invocation's ad-hoc runs), shown under `name`."""
    path = Path(path)
    records = [r for r in results_file.read(path) if run_ids is None or (isinstance(r, dict) and r.get("run_id") in run_ids)]
    configs = config_records(records)
    runs = [Run(r, lab) for r, lab in zip(configs, labels(configs))]
    name = name or next((r.r.get("study") for r in runs if r.r.get("study")), None) or path.stem
    return Study(name=name, path=path, runs=runs)


# -- which run each mode explains -------------------------------------------------------------------
def candidates(study: Study, mode: str) -> list[Run]:
    """Every run that uses the mode's axis (the page's picker offers them all), best first: ok before
    not ok, the purest use of the axis (fewest other axes), then the largest degree."""
    runs = study.runs
    if mode == "dp":
        use = [r for r in runs if r.uses("dp")]
        key = lambda r: (not r.ok, r.uses("tp") + r.uses("pp"), -r.dims["dp"], r.run_id)  # noqa: E731
    elif mode == "tp":
        use = [r for r in runs if r.uses("tp")]
        key = lambda r: (not r.ok, r.uses("dp") + r.uses("pp"), -r.dims["tp"], r.run_id)  # noqa: E731
    elif mode == "pp":
        use = [r for r in runs if r.uses("pp")]
        key = lambda r: (not r.ok, not r.timelines(), r.uses("dp") + r.uses("tp"), -r.dims["pp"], r.run_id)  # noqa: E731
    elif mode == "mesh":
        use = [r for r in runs if sum(r.uses(a) for a in MESH_AXES) >= 2]
        key = lambda r: (not r.ok, -sum(r.uses(a) for a in MESH_AXES), -r.world, r.run_id)  # noqa: E731
    else:
        raise ValueError(mode)
    # an invalid record has not run, so it explains nothing beyond its error: ok and failed runs only
    use = [r for r in use if r.status != Status.INVALID and r.r.get("dims")]
    return sorted(use, key=key)


def command_for(study: Study, mode: str) -> str:
    """The brigade command that would run a config of this mode with the study's model and hardware."""
    ex = study.example()
    model = ex.cfg("model", "name", default="tiny") if ex else "tiny"
    hw = ex.cfg("hardware", "name", default="cpu") if ex else "cpu"
    base = f"brigade study={study.name} model={model} hardware={hw}"
    return {
        "dp": f"{base} strategy=ddp parallel.dp=2",
        "tp": f"{base} strategy=tp parallel.tp=2",
        "pp": f"{base} strategy=pp parallel.pp=2 strategy.schedule=1f1b",
        "mesh": f"{base} strategy=3d parallel.dp=2 parallel.tp=2 parallel.pp=2",
    }[mode]
