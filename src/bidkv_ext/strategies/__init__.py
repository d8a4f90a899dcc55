"""Victim strategies and their registry."""

from bidkv_ext.strategies.base import (
    BaselineRegistry,
    Candidates,
    StrategyRegistry,
    VictimStrategy,
)
from bidkv_ext.strategies.catalog import (
    ALIASES,
    STRATEGY_NAMES,
    builtin_strategies,
    default_registry,
)
from bidkv_ext.strategies.utility import UtilityParams, UtilityStrategy

__all__ = [
    "ALIASES",
    "STRATEGY_NAMES",
    "BaselineRegistry",
    "Candidates",
    "StrategyRegistry",
    "UtilityParams",
    "UtilityStrategy",
    "VictimStrategy",
    "builtin_strategies",
    "create_default_registry",
    "default_registry",
]


def create_default_registry(config: object | None = None) -> StrategyRegistry:
    """Module-level spelling of :func:`default_registry`."""
    return default_registry(config)
