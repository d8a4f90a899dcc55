"""The built-in strategies and their names (aliases keep the reference BidKV's names)."""

from __future__ import annotations

from bidkv_ext.strategies.base import StrategyRegistry, VictimStrategy
from bidkv_ext.strategies.simple import (
    Abstain,
    CostAware,
    LargestFirst,
    LeastComputedFirst,
    Lifo,
    PriorityRule,
    SeededRandom,
    SglangRetract,
    ShortestRemaining,
)
from bidkv_ext.strategies.utility import UtilityParams, UtilityStrategy

__all__ = ["ALIASES", "STRATEGY_NAMES", "builtin_strategies", "default_registry"]

# Reference BidKV names -> ours. "preempt-evict" is vLLM's LIFO victim.
ALIASES = {
    "preempt-evict": "lifo",
    "static-random": "random",
    "lcf": "least-computed-first",
}

_PRIMARY = (
    "builtin",
    "lifo",
    "priority",
    "largest-first",
    "least-computed-first",
    "random",
    "shortest-remaining",
    "cost-aware",
    "sglang",
    "bidkv",
)
STRATEGY_NAMES = frozenset(_PRIMARY) | frozenset(ALIASES)


def builtin_strategies(config: object | None = None) -> list[VictimStrategy]:
    """One fresh instance of every built-in strategy (and alias), configured from ``config``."""
    seed = int(getattr(config, "seed", 0))
    default_max = int(getattr(config, "default_max_tokens", 1024))
    primary: list[VictimStrategy] = [
        Abstain(),
        Lifo(),
        PriorityRule(),
        LargestFirst(),
        LeastComputedFirst(),
        SeededRandom(seed=seed),
        ShortestRemaining(default_max_tokens=default_max),
        CostAware(block_size=int(getattr(config, "block_size", 16))),
        SglangRetract(),
        UtilityStrategy(UtilityParams.from_config(config)),
    ]
    by_name = {s.name: s for s in primary}
    aliases: list[VictimStrategy] = [
        Lifo(name="preempt-evict"),
        SeededRandom(seed=seed, name="static-random"),
        LeastComputedFirst(name="lcf"),
    ]
    assert all(ALIASES[a.name] in by_name for a in aliases)
    return primary + aliases


def default_registry(config: object | None = None) -> StrategyRegistry:
    """A new registry holding every built-in strategy."""
    registry = StrategyRegistry()
    registry.create_default_registry(config)
    return registry
