"""`python -m harness.fidelity <results/study.jsonl> ...`: the command line of harness/tools/fidelity.py."""
import sys

from harness.tools.fidelity import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
