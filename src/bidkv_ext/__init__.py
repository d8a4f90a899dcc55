"""BidKV: a KV-cache victim-selection policy for vLLM (``vllm.preemption-policy.v1``).

The names a user of the original BidKV knows are here: :class:`BidKVConfig` (with
``enabled``, ``kill_switch`` and ``.is_active``), :class:`BaselineRegistry` (``register``,
``get``, ``list_strategies``, ``create_default_registry``) and the strategy names
``preempt-evict``, ``static-random``, ``largest-first`` beside ours.
"""

from bidkv_ext._version import __version__
from bidkv_ext.config import BidKVConfig, ConfigError
from bidkv_ext.controller import PolicyController
from bidkv_ext.selector import BidkvPreemptionPolicy
from bidkv_ext.strategies import BaselineRegistry, StrategyRegistry, create_default_registry

__all__ = [
    "BaselineRegistry",
    "BidKVConfig",
    "BidkvPreemptionPolicy",
    "ConfigError",
    "PolicyController",
    "StrategyRegistry",
    "__version__",
    "create_default_registry",
]
