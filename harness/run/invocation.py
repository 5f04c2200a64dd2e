"""What the CLI does before Hydra's own entry point, so that a bad study name or results_dir is one
line, not a traceback, a config that does not compose is an `invalid` record, with or without -m,
and a plain run is composed once.

Hydra creates <results_dir>/hydra/<study>/... before brigade's task function runs, so the study
name and results_dir are checked first, on the config composed with the command line's non-sweep
overrides (a sweep's own overrides are composed per job by the sweeper, harness/run/sweep.py).

A plain run (no -m, no sweep override, no overlay that makes it a study) then runs on that same
composition: Hydra's entry point would compose it twice more (once to read hydra.mode, once to run),
about 0.25 s each on a 2-core CPU, a third of a run's fixed cost in the parent (`make bench`). The job
goes through Hydra's own run_job (output dir, .hydra/ files, HydraConfig, callbacks), as Hydra.run does.
"""
from __future__ import annotations

from typing import Callable

from harness.run.preflight import results_problem

_HYDRA_COMMANDS = ("help", "hydra_help", "cfg", "info", "shell_completion", "config_path", "config_dir", "config_name")


def run_invocation(argv: list[str], task_function: Callable) -> int | None:
    """Before Hydra: an exit status to stop with (after one line and a record where one can go, or
    after a plain run), or None to let Hydra's entry point run the invocation."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit:
        return None  # Hydra reports its own usage errors
    if any(getattr(args, flag, None) for flag in _HYDRA_COMMANDS):
        return None  # Hydra's own commands: nothing runs
    overrides = list(args.overrides)
    given, sweeping = {}, bool(args.multirun)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        sweeping = sweeping or any(o.is_sweep_override() for o in parsed)
        given = {o.key_or_group: o.value() for o in parsed if not o.is_sweep_override()}
        fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
        with _hydra() as hydra:
            cfg = _compose(hydra, fixed)
            results_dir, study, error = str(cfg.results_dir), str(cfg.study), None
            if not sweeping and cfg.hydra.mode is None and not results_problem(results_dir, study):
                _run_composed(hydra, cfg, task_function)
                from harness.run import outcome

                return outcome.exit_status()
    except Exception as e:  # noqa: BLE001 - a config that does not compose becomes an invalid record
        results_dir, study, error = str(given.get("results_dir", "results")), str(given.get("study", "adhoc")), e
    problem = results_problem(results_dir, study)
    if problem:
        from rich.markup import escape

        from harness.run.job import console

        console.print(f"[yellow]invalid[/] {escape(problem)}", highlight=False, soft_wrap=True)  # one line
        return 2
    if error is not None:
        from omegaconf import OmegaConf

        from harness.run.sweep import composition_failure

        composition_failure(OmegaConf.create({"results_dir": results_dir, "study": study}), overrides, error)
        return 2
    return None  # a sweep or a study: Hydra's multirun


class _hydra:
    """Hydra initialised on conf/ as its entry point does (job name `__main__`, as harness/__main__.py gets)."""
    def __enter__(self):
        from hydra import initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        from harness.config import CONF_DIR, register_configs

        register_configs()
        self._init = initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="__main__")
        self._init.__enter__()
        return GlobalHydra.instance().hydra

    def __exit__(self, *exc):
        return self._init.__exit__(*exc)


def _compose(hydra, overrides: list[str]):
    """The config with its hydra node, for a run (an overlay may still set hydra.mode=MULTIRUN)."""
    from hydra.types import RunMode

    return hydra.compose_config("config", overrides, run_mode=RunMode.RUN, with_log_configuration=False)


def _run_composed(hydra, cfg, task_function: Callable) -> None:
    """Hydra.run's job on a config already composed (hydra/_internal/hydra.py: Hydra.run)."""
    from hydra._internal.callbacks import Callbacks
    from hydra.core.utils import configure_log, run_job
    from hydra.types import HydraContext, RunMode
    from omegaconf import open_dict

    configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
    with open_dict(cfg):
        cfg.hydra.mode = RunMode.RUN
    callbacks = Callbacks(cfg)
    callbacks.on_run_start(config=cfg, config_name="config")
    ret = run_job(hydra_context=HydraContext(config_loader=hydra.config_loader, callbacks=callbacks),
                  task_function=task_function, config=cfg, job_dir_key="hydra.run.dir", job_subdir_key=None)
    callbacks.on_run_end(config=cfg, config_name="config", job_return=ret)
    _ = ret.return_value  # a task function that raised raises here, as under Hydra.run
