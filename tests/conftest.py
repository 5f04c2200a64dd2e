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
