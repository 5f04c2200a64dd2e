"""`python -m harness.calibrate`: the command line of harness/tools/calibrate.py (see there); with
--fabric, inside a SLURM allocation of several nodes, of harness/tools/calibrate_fabric.py."""
import sys

from harness.tools.calibrate import main

if __name__ == "__main__":
    if "--fabric" in sys.argv[1:]:
        from harness.tools.calibrate_fabric import main as fabric

        sys.exit(fabric([a for a in sys.argv[1:] if a != "--fabric"]))
    sys.exit(main())
