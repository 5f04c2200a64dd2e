"""brigade's Hydra sweeper: a study is an explicit list of runs, crossed with any command-line sweep.

A study is rarely a cartesian product (single at dp=1, ddp at dp=2 and 4, tp at tp=2 ...), so an
experiment overlay lists its runs, each a list of overrides:

    hydra:
      mode: MULTIRUN
      sweeper:
        runs:
          - [strategy=single]
          - [strategy=ddp, parallel.dp=2]

Command-line sweeps (`strategy=ddp,fsdp`) still expand as with Hydra's basic sweeper and are crossed
with the runs; on the same key the command line wins. `repeats=N` runs the whole list N times,
round-robin, each job with `repeat=i`. Before launching, every job is composed once:
a job that cannot be composed (an unknown config option) becomes an `invalid` record and the sweep
goes on. A job whose launcher reports a failure without a record (a SLURM job killed before it could
write one) gets a `failed` record here. At the end the study's table is printed (and its report
written). The launcher is whatever hydra/launcher says (basic: one by one; submitit: SLURM jobs).
"""


import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf

# Imports inside functions: Hydra imports every plugin at start-up, so what a sweep or a launch needs loads
# when it runs.

log = logging.getLogger(__name__)


@dataclass
class StudySweeperConf:
    _target_: str = "hydra_plugins.brigade_sweeper.study_sweeper.StudySweeper"
    max_batch_size: Optional[int] = None  # jobs handed to the launcher at once (None: all; basic launcher: 1)
    params: Optional[Dict[str, str]] = None  # cartesian sweep params, as Hydra's basic sweeper
    runs: List[Any] = field(default_factory=list)  # the study's runs: each a list of overrides


ConfigStore.instance().store(group="hydra/sweeper", name="brigade", node=StudySweeperConf, provider="brigade")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _as_overrides(run) -> list[str]:
    if isinstance(run, (list, tuple)) or OmegaConf.is_list(run):
        return [str(x) for x in run]
    if isinstance(run, str):
        return [run]
    return [f"{k}={v}" for k, v in dict(run).items()]


class StudySweeper(Sweeper):
    def __init__(self, max_batch_size: Optional[int] = None, params: Optional[Dict[str, str]] = None,
                 runs: Optional[List[Any]] = None):
        super().__init__()
        self.max_batch_size = max_batch_size
        self.params = params or {}
        self.runs = [_as_overrides(r) for r in (runs or [])]

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context,
                                                                task_function=task_function, config=config)

    def jobs(self, arguments: list[str]) -> list[list[str]]:
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        params = [f"{k}={v}" for k, v in self.params.items()] + list(arguments)
        product = BasicSweeper.split_arguments(parser.parse_overrides(params), None)[0]
        if not self.runs:
            return product
        out = []
        for run, base in itertools.product(self.runs, product):
            keys = {_key(o) for o in base}
            out.append([o for o in run if _key(o) not in keys] + list(base))
        return out

    def repeated(self, jobs: list[list[str]]) -> list[list[str]]:
        """repeats=N: every job N times, round-robin (A B C A B C ...), so that drift over the study
        (another job starting on the machine, a clock change) falls on every config alike."""
        n = self.config.get("repeats", 1)
        if not isinstance(n, int) or n <= 1:  # repeats < 1: each job's validation refuses it, with its record
            return jobs
        return [[*job, f"repeat={i}"] for i in range(n) for job in jobs]

    def sweep(self, arguments: list[str]) -> Any:
        from rich.markup import escape

        from harness.run.job import Task
        from harness.run.record import Status
        from harness.run.signals import received
        from harness.run.sweep import composition_failure, finish_study, launcher_failure, unlaunched
        from harness.run.terminal import console

        # The invocation's Ending comes with the task function (the CLI's); a sweep started some
        # other way gets the task function's own.
        task = self.launcher.task_function
        run_ends = task.run_ends if isinstance(task, Task) else Task().run_ends
        jobs = self.repeated(self.jobs(arguments))
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")

        records: list = [None] * len(jobs)
        composed: dict = {}
        for i, job in enumerate(jobs):
            try:
                composed[i] = self.hydra_context.config_loader.load_sweep_config(self.config, list(job))
            except Exception as e:  # noqa: BLE001 - e.g. strategy=nosuch: an invalid record, not a dead sweep
                records[i] = composition_failure(run_ends, self.config, job, e)
        runnable = sorted(composed)

        common = set.intersection(*(set(j) for j in jobs)) if len(jobs) > 1 else set()
        basic = "BasicLauncher" in str(self.config.hydra.launcher.get("_target_", ""))
        size = 1 if basic else (self.max_batch_size or len(runnable) or 1)
        run_ends.sweep_total = len(jobs)
        returns = []
        for start in range(0, len(runnable), size):
            idx = runnable[start:start + size]
            if received():  # between runs: the next run ends as interrupted unless one in flight did
                left = len(runnable) - start
                if not run_ends.interrupted():
                    records[idx[0]] = unlaunched(run_ends, composed[idx[0]], Status.INTERRUPTED,
                                                 f"brigade received {received()} before the run was launched; "
                                                 f"nothing was started")
                    left -= 1
                console.print(f"[red]{received()}[/]: the sweep stops; {left} run(s) not "
                              f"started (run the same command again to resume a named study)")
                break
            run_ends.sweep_done = sum(r is not None for r in records)
            for i in idx:  # what sets this job apart from the others
                own = [o for o in jobs[i] if o not in common] or jobs[i]
                console.print(f"[bold][{i + 1}/{len(jobs)}][/] {escape(' '.join(own))}")
            results = self.launcher.launch([jobs[i] for i in idx], initial_job_idx=idx[0])
            returns.append(results)
            for i, r in zip(idx, results):
                try:
                    records[i] = r.return_value
                    if records[i]:  # a SLURM job's record was ended in another process: it counts here too
                        run_ends.count(records[i])
                except Exception as e:  # noqa: BLE001 - the job died without writing its record
                    records[i] = launcher_failure(run_ends, composed[i], e)
        finish_study(self.config, [r for r in records if r is not None])
        return returns
