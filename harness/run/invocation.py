"""The CLI's invocation: checks before Hydra, then Hydra's own entry point (@hydra.main).

Hydra creates <results_dir>/hydra/<study>/... before brigade's task function runs, so the study name
and results_dir are checked first, on the config composed (hydra.compose) with the command line's
non-sweep overrides: a bad one is one line and exit 2, not a traceback, and a config that does not
compose is an `invalid` record, with or without -m (a sweep's own overrides are composed per job by
the sweeper, harness/run/sweep.py). The run or sweep then goes through @hydra.main with a task
function bound to this invocation's Ending (harness/run/job.py: Task), whose exit status is returned.
Composing once more here costs about 0.25 s per invocation (`make bench` reports the fixed cost).
"""
from __future__ import annotations

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from rich.markup import escape

from harness.config import ADHOC_STUDY, CONF_DIR, register_configs
from harness.run.job import Task
from harness.run.results_file import results_problem
from harness.run.terminal import console

# Imports inside functions: harness.run.sweep, which only a sweep needs.


def run_invocation(argv: list[str], task=None) -> int:
    """The whole invocation (argv as in sys.argv[1:], which Hydra's entry point parses): its exit
    status (harness/run/ending.py). `task`: the task function, a harness.run.job.Task."""
    register_configs()
    task = task or Task()
    refused = _before_hydra(argv, task.run_ends)
    if refused is not None:
        return refused
    hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(task)()
    return task.run_ends.exit_status()


def _before_hydra(argv: list[str], run_ends) -> int | None:
    """An exit status to stop with (after one line, or an `invalid` record where one can go), or
    None to let Hydra's entry point run the invocation."""
    flags = [a for a in argv if a.startswith("-")]
    if any(f not in ("-m", "--multirun") for f in flags):
        return None  # Hydra's own options (--help, --cfg, --config-dir, ...): Hydra handles them
    overrides = [a for a in argv if not a.startswith("-")]
    given = {}
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        given = {o.key_or_group: o.value() for o in parsed if not o.is_sweep_override()}
        fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="__main__"):
            cfg = compose("config", overrides=fixed)
        results_dir, study, error = str(cfg.results_dir), str(cfg.study), None
    except Exception as e:  # noqa: BLE001 - composing only: a config that does not compose is invalid
        results_dir, study, error = str(given.get("results_dir", "results")), str(given.get("study", ADHOC_STUDY)), e
    problem = results_problem(results_dir, study)
    if problem:
        console.print(f"[yellow]invalid[/] {escape(problem)}", highlight=False, soft_wrap=True)  # one line
        return 2
    if error is not None:
        from harness.run.sweep import composition_failure

        composition_failure(run_ends, OmegaConf.create({"results_dir": results_dir, "study": study}), overrides, error)
        return run_ends.exit_status()
    return None
