"""The parent side of a run (no torch): the Hydra job, the sweep, records, the results table, W&B."""
