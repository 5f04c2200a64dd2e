"""`python -m harness.calibrate`: the command line of harness/tools/calibrate.py (see there)."""
import sys

from harness.tools.calibrate import main

if __name__ == "__main__":
    sys.exit(main())
