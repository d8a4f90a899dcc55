"""The terms of BidKV's disruption estimate, scored exactly (docs/policy.md, "delta").

U = r / (delta + epsilon), delta = (base_cost + recompute_weight * lost) * (1 + preempt_weight
* P) * (1 + completion_weight * H / (H + remaining)) * (1 + first_token_weight * [no output]).
Each test pins one term to the value the table in docs/policy.md gives it. r is capped at
the requester's shortfall even when the requester is not eligible, and ties go to the host's
PRIORITY victim when the host names none.
"""

from __future__ import annotations

import pytest

from bidkv_ext.config import BidKVConfig
from bidkv_ext.contract import CandidateFacts, PreemptionContextFacts
from bidkv_ext.selector import BidkvPreemptionPolicy
from bidkv_ext.strategies.utility import UtilityParams, UtilityStrategy
from tests.policy_helpers import cand, ctx

EPS = BidKVConfig().epsilon
BASE = BidKVConfig().base_cost


def strategy(**settings: object) -> UtilityStrategy:
    return UtilityStrategy(UtilityParams.from_config(BidKVConfig(**settings)))  # type: ignore[arg-type]


def completion(output: int, max_tokens: int = 1024, horizon: float = 32.0) -> float:
    """The default completion factor, 1 + H / (H + remaining)."""
    return 1.0 + horizon / (horizon + (max_tokens - output))


def facts_for(rid: str, *, exclusive: int, cached: int, total: int) -> PreemptionContextFacts:
    return PreemptionContextFacts(
        block_size=16, needed_blocks=1,
        facts={rid: CandidateFacts(exclusive_blocks=exclusive, cached_blocks=cached,
                                   total_blocks=total)},
    )


def test_first_token_weight_multiplies_delta_only_before_the_first_token() -> None:
    """first_token_weight: delta carries (1 + first_token_weight) for a candidate with no
    output token yet (num_output_tokens == 0) and nothing for one that has output; the
    default weight 0 treats both alike."""
    weighted = strategy(first_token_weight=3.0, completion_weight=0.0)
    no_output = cand("v", computed=320, output=0)
    has_output = cand("v", computed=320, output=1)
    delta = BASE + 320.0
    assert weighted.utility(no_output, 1) == pytest.approx(1 / (delta * 4.0 + EPS), rel=1e-12)
    assert weighted.utility(has_output, 1) == pytest.approx(1 / (delta + EPS), rel=1e-12)
    # With the default completion term on, the factor still multiplies the whole delta.
    default_terms = strategy(first_token_weight=0.5)
    assert default_terms.utility(no_output, 1) == pytest.approx(
        1 / (delta * completion(0) * 1.5 + EPS), rel=1e-12)
    assert default_terms.utility(cand("v", computed=320, output=7), 1) == pytest.approx(
        1 / (delta * completion(7) + EPS), rel=1e-12)
    # Default weight 0: no output and some output score alike (up to the completion term).
    plain = strategy(completion_weight=0.0)
    assert plain.utility(no_output, 1) == plain.utility(has_output, 1)


def test_cache_survival_without_host_facts_discounts_full_blocks_only() -> None:
    """Without host facts, with prefix caching, lost = computed - cache_survival * (tokens
    in full blocks): the partial last block is always redone. Default cache_survival 0:
    lost = all computed tokens. Without prefix caching cache_survival is ignored."""
    victim = cand("v", computed=330, output=10)  # 20 full blocks (320 tokens) + 10 tokens
    comp = completion(10)
    half = strategy(cache_survival=0.5)
    assert half.utility(victim, 1) == pytest.approx(
        1 / ((BASE + (330 - 0.5 * 320)) * comp + EPS), rel=1e-12)
    assert strategy(cache_survival=1.0).utility(victim, 1) == pytest.approx(
        1 / ((BASE + 10) * comp + EPS), rel=1e-12)
    assert strategy().utility(victim, 1) == pytest.approx(
        1 / ((BASE + 330) * comp + EPS), rel=1e-12)
    assert strategy(cache_survival=1.0, prefix_caching=False).utility(victim, 1) == (
        pytest.approx(1 / ((BASE + 330) * comp + EPS), rel=1e-12))
    # Blocks freed stay ceil(330 / 16) = 21 whatever survives: r = min(21, need).
    assert half.utility(victim, 30) == pytest.approx(
        21 / ((BASE + 170) * comp + EPS), rel=1e-12)


def test_shared_blocks_are_certain_hits_under_default_settings() -> None:
    """With host facts and prefix caching (the defaults), blocks the candidate shares with
    other running requests (total - exclusive) stay held and come back as certain hits:
    lost = computed - block_size * shared (cache_survival 0, so its own hashed blocks count
    for nothing), never below the partial last block; blocks freed = exclusive blocks."""
    victim = cand("v", computed=330, output=10)
    comp = completion(10)
    default = strategy()
    # 21 blocks, 6 shared: lost 330 - 96 = 234; frees its 15 exclusive blocks.
    shared6 = facts_for("v", exclusive=15, cached=15, total=21)
    assert default.utility(victim, 1, shared6) == pytest.approx(
        1 / ((BASE + 234) * comp + EPS), rel=1e-12)
    assert default.utility(victim, 40, shared6) == pytest.approx(
        15 / ((BASE + 234) * comp + EPS), rel=1e-12)
    # Nothing shared: all 330 tokens lost, hashed or not.
    private = facts_for("v", exclusive=21, cached=21, total=21)
    assert default.utility(victim, 1, private) == pytest.approx(
        1 / ((BASE + 330) * comp + EPS), rel=1e-12)
    # 20 of 21 shared: only the 10 tokens of the partial last block are lost.
    mostly = facts_for("v", exclusive=1, cached=0, total=21)
    assert default.utility(victim, 1, mostly) == pytest.approx(
        1 / ((BASE + 10) * comp + EPS), rel=1e-12)
    # Survival of its own hashed blocks adds to the shared ones: 6 + 0.5 * 8 = 10 blocks.
    half = strategy(cache_survival=0.5)
    assert half.utility(victim, 1, facts_for("v", exclusive=15, cached=8, total=21)) == (
        pytest.approx(1 / ((BASE + 330 - 160) * comp + EPS), rel=1e-12))
    # Kept blocks beyond the computed tokens: the partial last block (10 tokens) still lost.
    everything = strategy(cache_survival=1.0)
    assert everything.utility(victim, 1, facts_for("v", exclusive=1, cached=1, total=21)) == (
        pytest.approx(1 / ((BASE + 10) * comp + EPS), rel=1e-12))
    # Without prefix caching nothing comes back: lost = computed, freed still exclusive.
    nopc = strategy(prefix_caching=False)
    assert nopc.utility(victim, 40, shared6) == pytest.approx(
        15 / ((BASE + 330) * comp + EPS), rel=1e-12)


def test_shared_blocks_steer_the_choice_between_equal_candidates() -> None:
    """Two candidates alike but for sharing: the one whose blocks are mostly shared loses
    less on return, so under the default settings BidKV preempts it."""
    cands = [cand("shared", computed=330, output=10), cand("private", computed=330, output=10),
             cand("req", computed=200, output=5, prompt=196)]
    facts = PreemptionContextFacts(
        block_size=16, needed_blocks=1,
        facts={"shared": CandidateFacts(exclusive_blocks=5, cached_blocks=5, total_blocks=21),
               "private": CandidateFacts(exclusive_blocks=21, cached_blocks=21,
                                         total_blocks=21),
               "req": CandidateFacts(exclusive_blocks=13, cached_blocks=12, total_blocks=13)},
    )
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, cascade_gain_ratio=1.0))
    # "shared": lost 330 - 16 * 16 = 74 tokens; "req": 200; "private": 330.
    assert policy.select_victim_with_facts(ctx(cands, requester="req"), facts) == "shared"


def test_the_shortfall_is_the_requesters_when_it_may_not_be_the_victim() -> None:
    """r is capped at the requester's need also when the requester is not eligible: under
    ``priority`` an urgent prefilling requester (4,500 tokens to go: one 2,048-token chunk,
    128 blocks) is outside the least urgent class, and ``big`` (150 blocks) is the only
    victim that frees that alone. Before, the need fell back to one block there, and the
    small victim won (a cascade of preemptions for one chunk)."""
    config = BidKVConfig(enabled=True, prefix_caching=False, cascade_gain_ratio=1.0)
    urgent = cand("req", computed=1500, output=0, prompt=6000, priority=0)
    small = cand("small", computed=320, output=5, prompt=315, priority=3)
    big = cand("big", computed=2400, output=5, prompt=2395, priority=3)
    context = ctx([urgent, small, big], requester="req", policy="priority", builtin="big")
    assert BidkvPreemptionPolicy(config).select_victim(context) == "big"
    # The same shortfall when the liveness guard sets the requester aside (FCFS): the
    # favourite ``big1`` and the requester have both spent their budget of 8.
    spent_requester = cand("req", computed=1500, output=0, prompt=6000, preemptions=8)
    fcfs = [cand("big1", computed=2400, output=5, prompt=2395, preemptions=8),
            cand("small", computed=320, output=5, prompt=315),
            cand("big2", computed=3000, output=5, prompt=2995), spent_requester]
    assert BidkvPreemptionPolicy(config).select_victim(ctx(fcfs, requester="req")) == "big2"


@pytest.mark.parametrize("named", [None, "gone"], ids=["unnamed", "stale"])
def test_priority_ties_go_to_the_hosts_victim_when_the_host_names_none(
    named: str | None,
) -> None:
    """Ties go to the host's built-in victim also when the host names none or a stale one
    (an API 1.0 host): under ``priority`` that is the latest arrival of the least urgent
    class (preemption-contract.md section 6), here ``late`` at the head of the list, not
    the tail ``early``."""
    config = BidKVConfig(enabled=True, cascade_gain_ratio=1.0)
    tied = [cand("late", computed=320, output=5, arrival=9.0),
            cand("early", computed=320, output=5, arrival=1.0),
            cand("req", computed=640, output=5, prompt=635, arrival=5.0)]
    for builtin in ("late", named):
        context = ctx(tied, requester="req", policy="priority", builtin=builtin)
        assert BidkvPreemptionPolicy(config).select_victim(context) == "late"
