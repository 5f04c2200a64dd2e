"""Strategies: one module each, found through harness/catalog.py, so adding one touches no if-chain.

A strategy module defines `STRATEGY`, a subclass of `harness.strategies.base.Strategy`. The module
is the catalog row's `module` (e.g. zero2 and zero3 run harness.strategies.fsdp); every strategy
run on the DeepSpeed engine is executed by harness/strategies/deepspeed/.
"""
from __future__ import annotations

import importlib

from harness import catalog


def load(run, dims):
    """The Strategy class that runs this config."""
    module = catalog.module_of(run.strategy.name, run.strategy.engine, dims.pp, run.model.n_experts)
    return importlib.import_module(module).STRATEGY
