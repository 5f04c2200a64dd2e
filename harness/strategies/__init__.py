"""Strategies: one module each, found by name, so adding one touches no central if-chain.

A strategy module defines `STRATEGY`, a subclass of `harness.strategies.base.Strategy`. The module is
`harness.strategies.<impl>` where impl is `strategy.impl` (default: `strategy.name`); every strategy
run on the DeepSpeed engine is executed by `harness.strategies.deepspeed`.
"""
from __future__ import annotations

import importlib


def module_name(strategy_cfg) -> str:
    if strategy_cfg.engine == "deepspeed":
        return "deepspeed_engine"
    return strategy_cfg.impl or strategy_cfg.name


def load(strategy_cfg):
    return importlib.import_module(f"harness.strategies.{module_name(strategy_cfg)}").STRATEGY
