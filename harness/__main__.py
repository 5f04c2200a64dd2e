"""The brigade CLI: `brigade <hydra overrides>` (or `python -m harness`).

    brigade strategy=ddp parallel.dp=2          one run
    brigade -m strategy=single,ddp ...          a sweep (jobs one after another)
    brigade experiment=demo                     a named study (multirun set by the overlay)
"""
from __future__ import annotations

import sys

from harness.run.signals import install_signals


def main() -> None:
    """Exit status: 0 every run ok, 2 some run invalid, 1 some run failed (harness/run/ending.py)."""
    install_signals()  # first: SIGTERM/SIGINT/SIGHUP from here on end as `interrupted`, with a record
    from harness.run.invocation import run_invocation  # Hydra and the configs: after the handlers

    sys.exit(run_invocation(sys.argv[1:]))


if __name__ == "__main__":
    main()
