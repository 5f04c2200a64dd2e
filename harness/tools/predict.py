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


def predict_overrides(overrides: list[str]) -> dict:
    from harness.config import as_dict, compose_run
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
