"""`python -m harness.predict`: the command line of harness/tools/predict.py (see there)."""
import sys

from harness.tools.predict import main

if __name__ == "__main__":
    sys.exit(main())
