"""Each named strategy picks by its rule; the registry keeps the reference BidKV's API.

Also guarded: the registry's ``count`` and ``in``; a name registered before
``create_default_registry`` keeps its strategy, and the selector uses the registry it is
given; the catalog configures the peers from the policy's settings (``seed`` for
``random`` and its alias ``static-random``, ``default_max_tokens`` for
``shortest-remaining``, ``block_size`` for ``cost-aware``); ``random`` reaches every
candidate; ``shortest-remaining`` counts the output already produced and substitutes the
default for a missing ``max_tokens``; ``cost-aware`` rounds blocks up, counts output in the
current tokens and damps by generation progress, without clamping the damping past a
request's cap; ties of the max-score peers go to the newest; ``priority`` is vLLM's PRIORITY
victim, max ``(priority, arrival_time)``, the first in running order on an exact tie.
"""

from __future__ import annotations

import pytest

from bidkv_ext import BaselineRegistry, BidKVConfig, BidkvPreemptionPolicy
from bidkv_ext.contract import PreemptionCandidate, PreemptionContext, PreemptionContextFacts
from bidkv_ext.strategies import STRATEGY_NAMES, default_registry
from bidkv_ext.strategies.base import Candidates
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
    # sglang: fewest output tokens, ties to the longest prompt, wherever it sits in the
    # batch (a full tie would go to the last one: y is first here, x last).
    sglang = BidkvPreemptionPolicy(BidKVConfig(enabled=True, strategy="sglang"))
    tied = [cand("y", output=3, prompt=900), cand("z", output=9), cand("x", output=3, prompt=100)]
    assert sglang.select_victim(ctx(tied)) == "y"
    assert sglang.select_victim(ctx(tied[::-1])) == "y"


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


def select(strategy: str, cands: list[PreemptionCandidate], **settings: object) -> str | None:
    config = BidKVConfig(enabled=True, strategy=strategy, **settings)  # type: ignore[arg-type]
    return BidkvPreemptionPolicy(config).select_victim(ctx(cands))


class _Head:
    """A user's rule registered under a built-in name: the head of the running list."""

    name = "lifo"

    def choose(
        self, candidates: Candidates, context: PreemptionContext,
        facts: PreemptionContextFacts | None,
    ) -> PreemptionCandidate | None:
        return candidates[0] if candidates else None


def test_registry_count_membership_and_a_name_registered_first() -> None:
    """``count`` and ``in`` report what is registered; ``create_default_registry`` adds only
    the names not taken, so a strategy registered first under a built-in name stays, and a
    policy built with that registry decides by it."""
    registry = BaselineRegistry()
    assert registry.count == 0 and "lifo" not in registry
    mine = _Head()
    registry.register(mine)
    assert registry.count == 1 and "lifo" in registry
    registry.create_default_registry()
    assert registry.get("lifo") is mine
    assert registry.count == len(registry.names()) == len(STRATEGY_NAMES)
    assert "largest-first" in registry and "static-random" in registry
    assert "nope" not in registry and 3 not in registry
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, strategy="lifo"), registry=registry)
    assert policy.strategy is mine
    assert policy.select_victim(ctx(CANDS)) == CANDS[0].request_id  # the head, not the tail
    assert default_registry().get("lifo") is not mine


def test_static_random_is_random_seeded_from_the_settings() -> None:
    """The reference name ``static-random`` is ``random`` under the policy's ``seed``: the
    same victims for the same seed, other victims for another seed."""

    def run(strategy: str, seed: int) -> list[str | None]:
        policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, strategy=strategy, seed=seed))
        return [policy.select_victim(ctx(CANDS)) for _ in range(20)]

    for seed in (1, 2, 7):
        assert run("static-random", seed) == run("random", seed)
    assert run("static-random", 1) != run("static-random", 2)
    assert len(set(run("static-random", 1))) > 1


def test_random_reaches_every_candidate() -> None:
    """A uniform choice: over many decisions each position is taken, the last one included
    (and a lone candidate is always the victim)."""
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, strategy="random", seed=0))
    seen = {policy.select_victim(ctx(CANDS)) for _ in range(200)}
    assert seen == {c.request_id for c in CANDS}
    assert policy.select_victim(ctx(CANDS[:1])) == CANDS[0].request_id


def test_shortest_remaining_counts_output_and_the_default_max_tokens() -> None:
    """Remaining work is max_tokens - output tokens; max_tokens <= 0 means
    ``default_max_tokens`` (from the settings); ties go to the newest."""
    # 100 left against 500 left: the output produced counts, not max_tokens alone.
    assert select("shortest-remaining", [cand("near", output=900, max_tokens=1000),
                                         cand("far", output=0, max_tokens=500)]) == "far"
    unknown = [cand("unknown", output=100, max_tokens=0), cand("known", output=0, max_tokens=500)]
    assert select("shortest-remaining", unknown) == "unknown"  # 1024 - 100 = 924 left
    assert select("shortest-remaining", unknown, default_max_tokens=200) == "known"  # 100 left
    tied = [cand("x", max_tokens=300), cand("y", max_tokens=300), cand("z", max_tokens=300)]
    assert select("shortest-remaining", tied) == "z"


def test_cost_aware_blocks_current_tokens_and_progress() -> None:
    """``B / max(1, T) * (1 - O / M)``: B = ceil(computed / block_size) with the configured
    block size, T = prompt + output, the output's share of max_tokens damps; ties go to
    the newest."""
    # Block size 16: "odd" spans 2 blocks for 24 tokens (1/12 per token), "even" 1 for 16.
    # Block size 32: one block each, so the smaller request gives more per token.
    sizes = [cand("even", computed=16, prompt=16), cand("odd", computed=24, prompt=24)]
    assert select("cost-aware", sizes) == "odd"
    assert select("cost-aware", sizes, block_size=32) == "even"
    # Output tokens are current tokens: "chatty" holds 100 blocks over 1600 tokens, not 100.
    chatty = [cand("chatty", computed=1600, prompt=100, output=1500, max_tokens=100_000),
              cand("prompt", computed=1600, prompt=1600, output=0, max_tokens=100_000)]
    assert select("cost-aware", chatty) == "prompt"
    # Nearly done (16 of 17 tokens): damped to 1/17 of its 2 blocks per 17 tokens.
    done = [cand("done", computed=17, prompt=1, output=16, max_tokens=17),
            cand("fresh", computed=16, prompt=16, output=0, max_tokens=17)]
    assert select("cost-aware", done) == "fresh"
    tied = [cand("x", computed=160, prompt=160), cand("y", computed=160, prompt=160)]
    assert select("cost-aware", tied) == "y"


def test_shortest_remaining_still_chooses_when_every_candidate_is_past_its_cap() -> None:
    """A request past its cap (output > max_tokens) has a negative estimate; the rule still
    takes the one with the most left instead of abstaining to the host's victim."""
    past = [cand("a", output=1500, max_tokens=0), cand("b", output=1100, max_tokens=0)]
    assert select("shortest-remaining", past) == "b"  # 1024 - 1100 > 1024 - 1500


def test_sglang_full_ties_go_to_the_last_in_batch_order() -> None:
    """SGLang's retract_decode sorts with reverse=True (stable) and pops the last element,
    so among equal (output, prompt) keys it retracts the last request of the batch."""
    tied = [cand("x", output=3, prompt=100), cand("y", output=3, prompt=100),
            cand("z", output=4, prompt=100)]
    assert select("sglang", tied) == "y"


def test_cost_aware_damping_is_not_clamped_past_the_cap() -> None:
    """evaluation.md's ``B / max(1, T) * (1 - O / max(1, M))`` has no clamp: a request past
    its cap (O > M) scores below zero, and the rule takes the highest score (the least
    negative one), not the newest of a tie at zero."""
    # Both 10 blocks over 160 current tokens (1/16 per token). "a": 1 - 60/30 = -1, so
    # S = -1/16; "b": 1 - 40/10 = -3, so S = -3/16. The highest is "a".
    past = [cand("a", computed=160, prompt=100, output=60, max_tokens=30),
            cand("b", computed=160, prompt=120, output=40, max_tokens=10)]
    assert select("cost-aware", past) == "a"
    # A missing max_tokens (0) counts as M = max(1, 0) = 1: "c" 10/160 * (1 - 3) = -1/8,
    # "d" 20/320 * (1 - 2) = -1/16, so "d", though it is not the newest.
    unknown = [cand("d", computed=320, prompt=318, output=2, max_tokens=0),
               cand("c", computed=160, prompt=157, output=3, max_tokens=0)]
    assert select("cost-aware", unknown) == "d"


def test_priority_is_vllms_priority_victim() -> None:
    """``priority`` is vLLM's PRIORITY victim (evaluation.md section 2, preemption-contract.md
    section 6): max ``(priority, arrival_time)``. With equal priorities that is the latest
    arrival wherever it sits in the running list (not the tail), and on an exact tie Python's
    ``max`` keeps the first in running order."""
    from bidkv_ext.controller import builtin_victim_id

    equal = [cand("x", priority=1, arrival=5.0), cand("y", priority=1, arrival=9.0),
             cand("z", priority=1, arrival=2.0)]
    tied = [cand("p", priority=1, arrival=3.0), cand("q", priority=1, arrival=3.0),
            cand("r", priority=0, arrival=9.0)]
    for cands, expected in ((equal, "y"), (tied, "p")):
        assert select("priority", cands) == expected
        # The host's own built-in victim under priority scheduling is the same request.
        assert builtin_victim_id(ctx(cands, policy="priority")) == expected
