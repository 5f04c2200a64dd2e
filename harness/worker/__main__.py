"""`python -m harness.worker <run_dir>`: what torchrun starts on every rank (see harness/worker/main.py)."""
import sys

from harness.worker.main import leave, main

main(sys.argv[1])
leave()  # measurement.json is written and the process group destroyed (leave's docstring)
