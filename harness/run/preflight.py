"""Where records go, checked before anything is written there: a study name that stays one plain
entry inside results_dir, and a results_dir that exists (or can be made) and takes a file. Each
problem is one line. The CLI checks both before Hydra starts (harness/run/invocation.py), the
job again for callers that bypass the CLI."""
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
