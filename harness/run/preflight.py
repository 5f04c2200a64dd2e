"""What the CLI checks before Hydra starts, so that a bad name or a bad directory is one line, not a
traceback, and a config that does not compose is an `invalid` record, with or without -m.

Hydra creates <results_dir>/hydra/<study>/... before brigade's task function runs, so the study
name and results_dir are checked first, on the config composed with the command line's non-sweep
overrides (a sweep's own overrides are composed per job by the sweeper, harness/run/sweep.py).
"""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

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
        from harness.run.job import console

        console.print(f"[yellow]invalid[/] {problem}", markup=True, highlight=False)
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
