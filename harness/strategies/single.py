"""single: one process, no parallelism. The reference every strategy is compared against."""
from harness.strategies.base import Strategy

STRATEGY = Strategy
