import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session")
def reference_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("reference")


_REFERENCES: dict = {}


@pytest.fixture(scope="session")
def single_reference(reference_dir):
    """The `single` record for a set of overrides (after helpers.FAST), run once per session and shared."""
    from tests.helpers import run

    def get(*overrides: str) -> dict:
        key = tuple(sorted(overrides))
        if key not in _REFERENCES:
            rec = run(["strategy=single", *overrides], reference_dir)
            assert rec["status"] == "ok", rec["error"]
            _REFERENCES[key] = rec
        return _REFERENCES[key]

    return get


@pytest.fixture(autouse=True)
def _environment_restored():
    """A test that runs brigade's parent code in-process (W&B logging, the invocation id) sets variables in
    os.environ for the processes it would start; the next test must not inherit them (two CLI invocations
    would share one W&B group)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
