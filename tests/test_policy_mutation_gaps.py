"""Behaviours a mutation audit of the policy modules found unguarded by any other test.

- Controller (preemption-contract.md section 5): an answer that is not a ``str`` is an
  invalid selection even when it compares equal to a candidate id (a Request-like object).
- Controller construction: an object that is not a policy fails with the section 4 text.
- Liveness guard: threshold 0 disables it on every route, ``filter`` included, and an empty
  candidate tuple is no error.
- Configuration: a boolean setting given a number fails start-up, as a number given a
  boolean does (the bounds, zero ``epsilon`` and ``block_size`` among them, are
  tests/test_controller_mutation_gaps.py's).
- The ``bidkv`` decision (docs/policy.md "The decision", "Guards"): sufficiency with host
  facts counts exclusive blocks, and a candidate freeing exactly the shortfall is
  sufficient; a built-in victim that does not free the shortfall alone is outside the
  ranked set and cannot win; one freeing exactly the shortfall keeps its tie; the cascade
  guard stays out when the best victim frees exactly the shortfall, is off at ratio 1.0
  (ties still go to the host's victim), and takes the requester when its U times the
  ratio exactly reaches the best U.
"""

from __future__ import annotations

from typing import Any

import pytest

from bidkv_ext import BidKVConfig, BidkvPreemptionPolicy, ConfigError
from bidkv_ext.contract import CandidateFacts, PreemptionCandidate, PreemptionContextFacts
from bidkv_ext.controller import PolicyController
from bidkv_ext.guards import LivenessGuard
from bidkv_ext.strategies import UtilityStrategy
from tests.policy_helpers import Fixed, cand, ctx

# A prefilling requester: 4,500 tokens still to place, one 2,048-token chunk of 16-token
# blocks, so it needs 128 blocks (2,048 computed tokens free exactly that many).
SHORTFALL = 128


def prefilling_requester(computed: int = 1500) -> PreemptionCandidate:
    return cand("req", computed=computed, output=0, prompt=computed + 4500)


def decide(
    config: BidKVConfig,
    cands: list[PreemptionCandidate],
    facts: PreemptionContextFacts | None = None,
    **context: Any,
) -> str | None:
    policy = BidkvPreemptionPolicy(config)
    return policy.select_victim_with_facts(ctx(cands, requester="req", **context), facts)


def scorer(config: BidKVConfig) -> UtilityStrategy:
    strategy = BidkvPreemptionPolicy(config).strategy
    assert isinstance(strategy, UtilityStrategy)
    return strategy


class RequestLike:
    """A scheduler Request stand-in: it compares equal to its own request id."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id

    def __eq__(self, other: object) -> bool:
        return other == self.request_id

    __hash__ = None  # type: ignore[assignment]


def test_a_non_str_answer_equal_to_a_candidate_id_is_invalid() -> None:
    """Section 5: a Request object is a wrong type, an invalid selection, even when its
    ``__eq__`` says it equals a candidate id; the host's own victim is returned."""
    context = ctx([cand("a"), cand("b"), cand("c")], builtin="a")
    controller = PolicyController(Fixed(RequestLike("c")))
    assert controller.select_victim(context) == "a"
    stats = controller.export_stats()
    assert (stats["calls"], stats["selections"], stats["invalid_selections"],
            stats["failures"], stats["enabled"]) == (1, 0, 1, 1, False)


def test_a_controller_refuses_an_object_that_is_not_a_policy() -> None:
    """Section 4's TypeError also for an object handed to the controller directly, so a
    non-policy fails start-up instead of raising AttributeError at the first decision."""
    text = "preemption_policy must resolve to an object implementing PreemptionPolicy"
    with pytest.raises(TypeError, match=f"^{text}$"):
        PolicyController(object())  # type: ignore[arg-type]


def test_liveness_threshold_zero_disables_filter_and_empty_is_no_error() -> None:
    spent = (cand("a", preemptions=9), cand("b", preemptions=3))
    off = LivenessGuard(0)
    assert off.filter(spent).eligible == spent
    assert not off.filter(spent).barrier
    assert LivenessGuard(2).filter(()).eligible == ()


@pytest.mark.parametrize("key", ["enabled", "kill_switch", "use_host_facts", "prefix_caching"])
@pytest.mark.parametrize("number", [1, 0])
def test_a_number_given_for_a_boolean_setting_is_refused(key: str, number: int) -> None:
    """JSON 1/0 in a boolean key would be read as true/false by pydantic's lax mode; like a
    boolean in a numeric key it fails with one line naming the key."""
    with pytest.raises(ConfigError) as caught:
        BidKVConfig.from_sources({"bidkv": {key: number}}, {})
    message = str(caught.value)
    assert message.startswith(f"additional_config['bidkv'][{key!r}]={number!r} is invalid")
    assert "expected a boolean" in message
    assert "\n" not in message


def test_a_number_given_for_the_reference_enable_key_is_refused() -> None:
    """The reference's top-level key is read as ``enabled``, with the same strictness."""
    key = "enable_utility_victim_selection"
    with pytest.raises(ConfigError, match=rf"^additional_config\[{key!r}\]=1 is invalid"):
        BidKVConfig.from_sources({key: 1}, {})


def test_sufficiency_with_host_facts_counts_exclusive_blocks_inclusively() -> None:
    """docs/policy.md, r: blocks freed are the host's exclusive blocks, and the candidates
    that free the shortfall on their own are the only ones ranked. "exact" frees exactly
    the 50 blocks needed (near its cap, so its U is low); "shared" has higher U but frees
    only 20 exclusive blocks of its 100. Counting total blocks, or requiring more than the
    shortfall, would rank "shared" too and pick it."""
    cands = [cand("shared", computed=1600, output=10),
             cand("exact", computed=800, output=10, max_tokens=20),
             cand("req", computed=16, output=10)]
    facts = PreemptionContextFacts(16, 50, {
        "shared": CandidateFacts(exclusive_blocks=20, cached_blocks=0, total_blocks=100),
        "exact": CandidateFacts(exclusive_blocks=50, cached_blocks=0, total_blocks=50),
        "req": CandidateFacts(exclusive_blocks=1, cached_blocks=0, total_blocks=1)})
    strategy = scorer(BidKVConfig(enabled=True))
    u = {c.request_id: strategy.utility(c, 50, facts) for c in cands}
    assert u["shared"] > u["exact"]  # the precondition: only sufficiency keeps "shared" out
    assert decide(BidKVConfig(enabled=True), cands, facts) == "exact"


def test_an_insufficient_builtin_victim_cannot_win_over_the_ranked_set() -> None:
    """Sufficiency first (docs/policy.md): "host", the host's victim, has the higher U but
    frees 63 of the 128 blocks needed; "big" frees them alone, so only "big" is ranked."""
    cands = [cand("big", computed=2400, output=5), cand("host", computed=1000, output=5),
             prefilling_requester()]
    config = BidKVConfig(enabled=True, prefix_caching=False, cascade_gain_ratio=1.0)
    u_big, u_host = (scorer(config).utility(c, SHORTFALL) for c in cands[:2])
    assert u_host > u_big  # the precondition: unranked, the host's victim would win
    assert decide(config, cands, builtin="host") == "big"


def test_a_builtin_victim_freeing_exactly_the_shortfall_keeps_its_tie() -> None:
    """Ties go to the host's built-in victim, also inside the sufficient set: "a" (the
    host's victim) and the newer "b" are identical and each frees exactly the shortfall."""
    cands = [cand("a", computed=16 * SHORTFALL, output=5),
             cand("b", computed=16 * SHORTFALL, output=5), prefilling_requester()]
    config = BidKVConfig(enabled=True, prefix_caching=False)
    assert decide(config, cands, builtin="a") == "a"
    assert decide(config, cands) == "b"  # without a host victim: the newest of the tie


def test_cascade_guard_stays_out_when_the_best_frees_exactly_the_shortfall() -> None:
    """The guard acts only when the best victim frees *less* than the shortfall: "mid"
    frees exactly the 128 blocks needed, so no cascade follows, although the requester's
    U is within the ratio of mid's."""
    cands = [cand("mid", computed=16 * SHORTFALL, output=5), prefilling_requester()]
    config = BidKVConfig(enabled=True, prefix_caching=False, cascade_gain_ratio=1.25)
    u_mid, u_req = (scorer(config).utility(c, SHORTFALL) for c in cands)
    assert u_req * 1.25 >= u_mid  # the precondition: the guard would take the requester
    assert decide(config, cands) == "mid"


def equal_pair_facts(req_blocks: int, other_blocks: int) -> PreemptionContextFacts:
    """Host facts where nobody frees the 50-block shortfall alone (a cascade follows)."""
    return PreemptionContextFacts(16, 50, {
        "req": CandidateFacts(req_blocks, 0, req_blocks),
        "other": CandidateFacts(other_blocks, 0, other_blocks)})


def test_cascade_guard_is_off_at_ratio_one_even_on_a_tie() -> None:
    """docs/policy.md: ratio 1.0 is "cascade guard off"; the requester ties the best U here,
    and the tie goes to the newest request (the FCFS tail), not to the requester."""
    cands = [cand("req", computed=320, output=5), cand("other", computed=320, output=5)]
    facts = equal_pair_facts(10, 10)
    off = BidKVConfig(enabled=True, prefix_caching=False, cascade_gain_ratio=1.0)
    assert decide(off, cands, facts) == "other"
    on = BidKVConfig(enabled=True, prefix_caching=False, cascade_gain_ratio=1.25)
    assert decide(on, cands, facts) == "req"


def test_cascade_guard_takes_the_requester_when_its_scaled_u_exactly_reaches_the_best() -> None:
    """Module doc: the requester is chosen when its U times the ratio *reaches* the best U.
    Equal disruption and half the freed blocks make U_req x 2 equal U_other exactly."""
    cands = [cand("req", computed=320, output=5), cand("other", computed=320, output=5)]
    facts = equal_pair_facts(10, 20)
    config = BidKVConfig(enabled=True, prefix_caching=False, cascade_gain_ratio=2.0)
    u_req, u_other = (scorer(config).utility(c, 50, facts) for c in cands)
    assert u_req * 2.0 == u_other  # exact: a power-of-two ratio scales without rounding
    assert decide(config, cands, facts) == "req"
