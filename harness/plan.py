"""`python -m harness.plan`: the command line of harness/tools/plan.py (see there)."""
import sys

from harness.tools.plan import main

if __name__ == "__main__":
    sys.exit(main())
