"""Each named strategy picks by its rule; the registry keeps the reference BidKV's API."""

from __future__ import annotations

import pytest

from bidkv_ext import BaselineRegistry, BidKVConfig, BidkvPreemptionPolicy
from bidkv_ext.strategies import STRATEGY_NAMES, default_registry
from tests.policy_helpers import cand, ctx

CANDS = [
    cand("old", computed=800, output=700, max_tokens=710, arrival=1.0, priority=0),
    cand("mid", computed=50, output=0, max_tokens=1000, arrival=2.0, priority=2),
    cand("big", computed=3000, output=10, max_tokens=2000, arrival=3.0, priority=2),
    cand("new", computed=400, output=5, max_tokens=100, arrival=4.0, priority=1),
]


def pick(strategy: str, **kw: object) -> str | None:
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, strategy=strategy))
    return policy.select_victim(ctx(CANDS, requester="mid", **kw))  # type: ignore[arg-type]


def test_rules() -> None:
    assert pick("builtin") is None
    assert pick("lifo") == pick("preempt-evict") == "new"
    assert pick("priority") == "big"
    assert pick("largest-first") == "big"
    assert pick("least-computed-first") == pick("lcf") == "mid"
    assert pick("shortest-remaining") == "big"  # 1990 tokens left
    assert pick("random") in {c.request_id for c in CANDS}


def test_random_is_seeded_and_reproducible() -> None:
    def run(seed: int) -> list[str | None]:
        policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, strategy="random", seed=seed))
        return [policy.select_victim(ctx(CANDS)) for _ in range(20)]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_ties_go_to_the_newest() -> None:
    tied = [cand("x", computed=100), cand("y", computed=100), cand("z", computed=100)]
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, strategy="largest-first"))
    assert policy.select_victim(ctx(tied)) == "z"


def test_registry_api_matches_the_reference_examples() -> None:
    registry = BaselineRegistry()
    registry.create_default_registry()
    names = registry.list_strategies()
    assert names == sorted(names) == sorted(STRATEGY_NAMES)
    for name in ("preempt-evict", "static-random", "largest-first", "bidkv"):
        assert registry.get(name).name == name
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.get("lifo"))
    with pytest.raises(KeyError, match="unknown strategy 'pe'; registered: bidkv"):
        registry.get("pe")
    before = registry.count
    registry.create_default_registry()  # idempotent: skips taken names
    assert registry.count == before
    assert default_registry().names() == names


def test_custom_strategy_registration() -> None:
    class Oldest:
        name = "oldest"

        def choose(self, candidates, context, facts):  # type: ignore[no-untyped-def]
            return min(candidates, key=lambda c: c.arrival_time)

    registry = default_registry()
    registry.register(Oldest())
    assert registry.get("oldest").choose(tuple(CANDS), ctx(CANDS), None).request_id == "old"


def test_cost_aware_and_sglang_peers() -> None:
    cands = [
        cand("a", computed=1600, prompt=1500, output=100, max_tokens=200),  # half done
        cand("b", computed=1600, prompt=1590, output=10, max_tokens=2000),  # barely started
        cand("c", computed=160, prompt=320, output=0, max_tokens=100),  # mid-prefill
    ]
    # cost-aware: blocks per current token x (1 - progress): b has the most to give.
    assert BidkvPreemptionPolicy(BidKVConfig(enabled=True, strategy="cost-aware")).select_victim(
        ctx(cands)) == "b"
    # sglang: fewest output tokens, ties to the longest prompt.
    tied = [cand("x", output=3, prompt=100), cand("y", output=3, prompt=900), cand("z", output=9)]
    assert BidkvPreemptionPolicy(BidKVConfig(enabled=True, strategy="sglang")).select_victim(
        ctx(tied)) == "y"


def test_least_computed_first_ties_go_to_the_first_in_running_order() -> None:
    """least-computed-first: among candidates with the fewest computed tokens the first in
    running order wins (vLLM RFC #54644's LCF), not the newest as in the other rules."""
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, strategy="least-computed-first"))
    tied = [cand("big", computed=900), cand("x", computed=100), cand("y", computed=100),
            cand("z", computed=100)]
    assert policy.select_victim(ctx(tied)) == "x"
    assert policy.select_victim(ctx(tied[::-1])) == "z"
    assert policy.select_victim(ctx([cand("p", computed=7), cand("q", computed=7)],
                                    builtin="q")) == "p"
