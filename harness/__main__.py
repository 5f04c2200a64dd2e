"""The brigade CLI: `brigade <hydra overrides>` (or `python -m harness`).

    brigade strategy=ddp parallel.dp=2          one run
    brigade -m strategy=single,ddp ...          a sweep (jobs one after another)
    brigade experiment=demo                     a named study (multirun set by the overlay)
"""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from harness.config import CONF_DIR, register_configs

register_configs()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def run(cfg: DictConfig) -> dict:
    from harness.run.job import run_job

    return run_job(cfg)


def main() -> None:
    """Exit status: 0 every run ok, 2 some run invalid, 1 some run failed (harness/run/outcome.py)."""
    from harness.run import invocation, outcome, signals

    signals.install()  # SIGTERM/SIGINT/SIGHUP end the run in flight, record it, stop the sweep
    status = invocation.run_invocation(sys.argv[1:], run.__wrapped__)  # a plain run: composed once, run here
    if status is None:  # a sweep, a study or a Hydra command: Hydra's entry point
        run()
        status = outcome.exit_status()
    sys.exit(status)


if __name__ == "__main__":
    main()
