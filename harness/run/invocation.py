"""What the CLI checks before Hydra starts, so that a bad study name or results_dir is one line, not a
traceback, and a config that does not compose is an `invalid` record, with or without -m.

Hydra creates <results_dir>/hydra/<study>/... before brigade's task function runs, so the study
name and results_dir are checked first, on the config composed with the command line's non-sweep
overrides (a sweep's own overrides are composed per job by the sweeper, harness/run/sweep.py).
"""
from __future__ import annotations

from harness.run.preflight import results_problem


def check_invocation(argv: list[str]) -> int | None:
    """Before Hydra: an exit status to stop with (after one line, and a record where one can go),
    or None to let Hydra run the invocation."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit:
        return None  # Hydra reports its own usage errors
    if any(getattr(args, flag, None) for flag in ("help", "hydra_help", "cfg", "info", "shell_completion",
                                                  "config_path", "config_dir", "config_name")):
        return None  # Hydra's own commands: nothing runs
    overrides = list(args.overrides)
    given = {}
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        given = {o.key_or_group: o.value() for o in parsed if not o.is_sweep_override()}
        cfg = _compose([o.input_line for o in parsed if not o.is_sweep_override()])
        results_dir, study, error = str(cfg.results_dir), str(cfg.study), None
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
    return None


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from harness.config import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)
