"""`python -m harness.predict <hydra overrides>`: the cost model's prediction for one config, as one
JSON object on stdout (every predicted key at the top level, plus `config`). No torch is imported and
nothing is launched, so it answers for any degrees (parallel.dp=1024, hardware=h100_sxm) on any machine.

    python -m harness.predict model=gpt_7b hardware=h100_sxm strategy=ddp parallel.dp=64 \\
        workload.global_batch_size=128 workload.micro_batch_size=1 workload.precision=bf16-mixed

A config that cannot run prints {"status": "invalid", "error": ...} (the arithmetic) and exits 2.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def compose_run(overrides: list[str]):
    """Hydra's compose API over conf/ -> RunConfig (the same composition `brigade` does)."""
    from hydra import compose, initialize_config_dir

    from harness.config import register_configs, to_run_config

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    return to_run_config(cfg)


def predict_overrides(overrides: list[str]) -> dict:
    from harness.config import as_dict
    from harness.costmodel import predict
    from harness.dims import ConfigError
    from harness.validate import validate

    run = compose_run(overrides)
    config = as_dict(run)
    try:
        dims = validate(run)
        out = predict(run, dims)
    except ConfigError as e:
        return {"status": "invalid", "error": str(e), "config": config}
    return {"status": "ok", **out, "dims": dims.as_dict(), "config": config}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    out = predict_overrides(argv)
    print(json.dumps(out, default=str))
    return 0 if out["status"] == "ok" else 2


if __name__ == "__main__":
    sys.exit(main())
