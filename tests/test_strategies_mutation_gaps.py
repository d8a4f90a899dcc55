"""Gaps the twenty-fourth mutation audit (``bidkv_ext.strategies``: the registry, the catalog
and the peer rules) found in the strategy tests; each test below failed under a mutant that
the policy, strategy, configuration and replay tests let pass.

Guarded: ``ALIASES`` (exported) says what each reference BidKV name runs, and the
catalog builds each alias as that rule; a registry built without settings configures the
peers as ``BidKVConfig``'s defaults do (``default_max_tokens`` 1024, ``seed`` 0);
``shortest-remaining`` ranks requests past their cap by how far past they are, not as
equals; and ``cost-aware`` reads a ``max_tokens`` of 0 or below as 1, the ``max(1, M)`` of
evaluation.md's formula.
"""

from __future__ import annotations

import pytest

from bidkv_ext import BidKVConfig
from bidkv_ext.strategies import ALIASES, default_registry
from tests.policy_helpers import cand, ctx
from tests.test_strategies import select


def test_aliases_name_the_rule_each_reference_name_runs() -> None:
    """Mutant: ``preempt-evict`` mapped to ``priority`` (the catalog's own check passes,
    since ``priority`` is built too)."""
    assert ALIASES == {"preempt-evict": "lifo", "static-random": "random",
                       "lcf": "least-computed-first"}
    registry = default_registry(BidKVConfig())
    for alias, target in ALIASES.items():
        assert type(registry.get(alias)) is type(registry.get(target)), alias


def test_a_registry_without_settings_uses_the_config_defaults() -> None:
    """Mutants: the catalog's fallbacks for a config without the setting (a registry built
    with none) drifting from ``BidKVConfig``'s, ``default_max_tokens`` to 2048 or ``seed``
    to 1."""
    bare, configured = default_registry(), default_registry(BidKVConfig())
    # 1024 - 1000 = 24 left against 1030: with a default of 2048 "unknown" would have 1048.
    cands = [cand("unknown", output=1000, max_tokens=0), cand("known", output=0, max_tokens=1030)]
    context = ctx(cands)
    for registry in (bare, configured):
        chosen = registry.get("shortest-remaining").choose(context.candidates, context, None)
        assert chosen is not None and chosen.request_id == "known"
    many = ctx([cand(f"r{i}") for i in range(16)])

    def draws(name: str, registry: object) -> list[str]:
        rule = registry.get(name)  # type: ignore[attr-defined]
        return [rule.choose(many.candidates, many, None).request_id for _ in range(32)]

    for name in ("random", "static-random"):
        assert draws(name, bare) == draws(name, configured), name


@pytest.mark.parametrize("order", [("b", "a"), ("a", "b")])
def test_shortest_remaining_ranks_requests_past_their_cap(order: tuple[str, str]) -> None:
    """Mutant: the estimate floored at 0, which makes every request past its cap a tie
    (won by the newest). "b" is 76 tokens past its cap, "a" 476: "b" has more left, first
    or last in the running list."""
    by_id = {"a": cand("a", output=1500, max_tokens=0), "b": cand("b", output=1100, max_tokens=0)}
    assert select("shortest-remaining", [by_id[rid] for rid in order]) == "b"


def test_cost_aware_reads_a_cap_of_zero_or_below_as_one() -> None:
    """Mutant: ``max(1, M)`` replaced by ``M or 1``, which divides by a negative cap and turns
    the damping positive. With M = -5 and 10 output tokens the damping is 1 - 10 / 1 = -9, so
    "negcap" scores below zero and "plain" (1 block per 16 tokens, undamped) wins."""
    cands = [cand("negcap", computed=160, prompt=160, output=10, max_tokens=-5),
             cand("plain", computed=16, prompt=16, output=0, max_tokens=100)]
    assert select("cost-aware", cands) == "plain"
