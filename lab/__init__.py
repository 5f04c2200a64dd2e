"""The lab beside the product: the cost model checked against published, measured GPU runs
(`python -m lab.published`). Nothing in harness/ imports it."""
