"""The parts of the commands in harness/ (plan.py, calibrate.py): the planner's search space, reasons,
dry-run and run-top checks; calibrate's measurements by kind (compute, collectives, fabric, GPU); the
README's generated tables."""
