"""The brigade CLI: `brigade <hydra overrides>` (or `python -m harness`).

    brigade strategy=ddp parallel.dp=2          one run
    brigade -m strategy=single,ddp ...          a sweep (jobs one after another)
    brigade experiment=demo                     a named study (multirun set by the overlay)
"""
from __future__ import annotations

import hydra
from omegaconf import DictConfig

from harness.config import CONF_DIR, register_configs

register_configs()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> dict:
    from harness.run.job import run_job

    return run_job(cfg)


if __name__ == "__main__":
    main()
