"""Behaviours of the ``bidkv`` strategy (strategies/utility.py) that a mutation audit of
that module found unguarded by any other test (docs/policy.md sections named per line).

- "The decision", sufficiency: a candidate one token short of the shortfall's last block
  (need - 1 blocks) does not free the shortfall, one with a single token in the last block
  does; the same on the Python path and the array path (48+ candidates).
- "The decision", ties: a host victim with one token in its last block frees that block
  (ceil), so it is ranked and keeps its tie (Python and array path).
- "The decision", blocks needed: one chunk of all pending tokens (prompt + output -
  computed, so a resumed request's output counts), rounded up to whole blocks; one block
  when the requester is unknown.
- "The decision", ties: when no candidate frees the shortfall alone, every candidate is
  ranked and the host's built-in victim keeps its tie (Python and array path).
- "Guards" / reference lessons: when every candidate frees nothing the strategy abstains
  even though the host names its victim, so the controller books an abstention.
- "Elastic KV": during a shrink U is multiplied by ``1 + shrink_page_weight * pages``: the
  weight scales the page bonus (the choice flips where 1 + 2w crosses the U ratio), and 0
  turns it off.
- "The decision", priority: an empty candidate tuple under ``priority`` is no choice
  (``None``), not an error.
- "Decision cost" (``victim_index_hint``): after the priority filter the strategy reports
  a position in the tuple it was given, or -1, never an index into the filtered subset.
"""

from __future__ import annotations

import pytest

from bidkv_ext.config import BidKVConfig
from bidkv_ext.contract import CandidateFacts, PreemptionCandidate, PreemptionContextFacts
from bidkv_ext.controller import PolicyController
from bidkv_ext.selector import BidkvPreemptionPolicy
from bidkv_ext.strategies.utility import UtilityParams, UtilityStrategy
from tests.policy_helpers import cand, ctx

# A prefilling requester with 64 prompt tokens still to place: 4 blocks of 16 tokens.
SMALL_NEED = 4


def strategy(**settings: object) -> UtilityStrategy:
    return UtilityStrategy(UtilityParams.from_config(BidKVConfig(**settings)))  # type: ignore[arg-type]


def fillers(count: int, computed: int) -> list[PreemptionCandidate]:
    """``count`` older candidates that free ``computed`` tokens' worth of blocks."""
    return [cand(f"f{i}", computed=computed, output=5) for i in range(count)]


@pytest.mark.parametrize("crowd", [0, 60], ids=["python", "array"])
def test_a_candidate_one_block_short_is_not_sufficient(crowd: int) -> None:
    """Sufficiency first: the requester needs 4 blocks; "short" holds 48 tokens (3 blocks)
    and has the higher U, "enough" holds 49 (4 blocks, the last with one token) but is at
    its cap. Only "enough" frees the shortfall alone, so only it is ranked."""
    requester = cand("req", computed=0, prompt=64, output=0)
    short = cand("short", computed=16 * (SMALL_NEED - 1), output=5)
    enough = cand("enough", computed=16 * (SMALL_NEED - 1) + 1, output=10, max_tokens=10)
    scorer = strategy()
    assert scorer._needed_blocks(requester, None) == SMALL_NEED
    # The precondition: ranked together, "short" would win.
    assert scorer.utility(short, SMALL_NEED) > scorer.utility(enough, SMALL_NEED)
    cands = [*fillers(crowd, 16), short, enough, requester]
    context = ctx(cands, requester="req")
    chosen = scorer.choose(context.candidates, context, None)
    assert chosen is enough
    assert context.candidates[scorer.last_index] is enough


@pytest.mark.parametrize("crowd", [0, 60], ids=["python", "array"])
def test_a_builtin_victim_with_one_token_in_its_last_block_keeps_its_tie(crowd: int) -> None:
    """Blocks freed are ceil(computed / block_size): the host's victim "a", 49 tokens, frees
    the 4 blocks needed alone, so it is ranked and keeps its tie with the identical, newer
    "b"."""
    requester = cand("req", computed=0, prompt=64, output=0)
    tied = 16 * (SMALL_NEED - 1) + 1
    cands = [
        *fillers(crowd, 16),
        cand("a", computed=tied, output=5),
        cand("b", computed=tied, output=5),
        requester,
    ]
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True))
    assert policy.select_victim(ctx(cands, requester="req", builtin="a")) == "a"


@pytest.mark.parametrize(
    ("requester", "need"),
    [
        # Resumed after a preemption: prompt and output are re-prefilled, 80 tokens.
        (cand("req", computed=0, prompt=64, output=16), 5),
        # 65 tokens: the last of the 5 blocks holds one token.
        (cand("req", computed=0, prompt=65, output=0), 5),
    ],
    ids=["resumed", "partial-last-block"],
)
def test_the_shortfall_counts_every_pending_token_in_whole_blocks(
    requester: PreemptionCandidate,
    need: int,
) -> None:
    """Blocks needed without host facts: one chunk of the requester's pending tokens
    (prompt + output - computed), in blocks rounded up. "four" (4 blocks) has the higher U
    but only "five" frees the 5 blocks alone, so only it is ranked."""
    scorer = strategy()
    assert scorer._needed_blocks(requester, None) == need
    four = cand("four", computed=64, output=5)
    five = cand("five", computed=65, output=10, max_tokens=10)
    assert scorer.utility(four, need) > scorer.utility(five, need)  # the precondition
    context = ctx([four, five, requester], requester="req")
    assert scorer.choose(context.candidates, context, None) is five


def test_an_unknown_requester_needs_one_block() -> None:
    """Without host facts and without the requester among the candidates (nor in the
    context) the shortfall is one block, so every candidate holding a block is ranked and
    the one-block "tiny" (highest U) wins over "two" (2 blocks, at its cap)."""
    tiny = cand("tiny", computed=16, output=5)
    two = cand("two", computed=32, output=10, max_tokens=10)
    context = ctx([tiny, two], requester="gone")
    assert strategy().choose(context.candidates, context, None) is tiny


@pytest.mark.parametrize("crowd", [0, 60], ids=["python", "array"])
def test_ties_go_to_the_builtin_victim_when_nobody_frees_the_shortfall(crowd: int) -> None:
    """When no candidate frees the shortfall alone (128 blocks here), every candidate is
    ranked, and the host's built-in victim "a" keeps its tie with the identical, newer
    "b"; without a host victim the tie goes to the newest, "b"."""
    requester = cand("req", computed=16, prompt=16 + 4500, output=0)  # one 2,048-token chunk
    cands = [
        *fillers(crowd, 16),
        cand("a", computed=320, output=5),
        cand("b", computed=320, output=5),
        requester,
    ]
    policy_config = BidKVConfig(enabled=True)
    assert strategy()._needed_blocks(requester, None) == 128
    named = ctx(cands, requester="req", builtin="a")
    assert BidkvPreemptionPolicy(policy_config).select_victim(named) == "a"
    unnamed = ctx(cands, requester="req")
    assert BidkvPreemptionPolicy(policy_config).select_victim(unnamed) == "b"


def test_nothing_to_free_is_an_abstention_even_with_a_named_host_victim() -> None:
    """Every candidate holds 0 computed tokens, so every U is 0: the strategy returns
    ``None`` (the host decides) instead of handing back the host's victim as its own
    choice, and the controller counts an abstention, not a selection."""
    zero = [cand(f"z{i}", computed=0) for i in range(3)]
    context = ctx(zero, requester="z2", builtin="z0")
    assert strategy().choose(context.candidates, context, None) is None
    controller = PolicyController(BidkvPreemptionPolicy(BidKVConfig(enabled=True)))
    assert controller.select_victim(context) == "z0"
    stats = controller.export_stats()
    assert (stats["selections"], stats["abstentions"], stats["failures"]) == (0, 1, 0)


# "spread" frees 60 blocks, "packed" 64 on two whole pages; needing one block, U_spread is
# (64 + 1,024) / (64 + 960) = 1.0625 x U_packed without the page bonus.
PAGE_CANDS = [
    cand("spread", computed=960, output=10),
    cand("packed", computed=1024, output=10),
    cand("req", computed=3000, output=10),
]
SHRINKING = PreemptionContextFacts(
    block_size=16,
    needed_blocks=1,
    in_shrink=True,
    facts={
        "spread": CandidateFacts(60, 0, 60, pages_released=0),
        "packed": CandidateFacts(64, 0, 64, pages_released=2),
        "req": CandidateFacts(188, 0, 188, pages_released=0),
    },
)


@pytest.mark.parametrize(
    ("weight", "expected"),
    [
        (0.0, "spread"),  # weight 0: no page bonus at all
        (0.03, "spread"),  # x 1.06 < 1.0625
        (0.035, "packed"),  # x 1.07 > 1.0625
        (1.0, "packed"),  # x 3
    ],
)
def test_the_page_bonus_scales_with_shrink_page_weight(weight: float, expected: str) -> None:
    """Elastic KV: during a shrink U is multiplied by 1 + shrink_page_weight x pages
    released, so the weight decides whether two whole pages outweigh 6 % more recompute."""
    config = BidKVConfig(enabled=True, prefix_caching=False, shrink_page_weight=weight)
    policy = BidkvPreemptionPolicy(config)
    assert policy.select_victim_with_facts(ctx(PAGE_CANDS, requester="req"), SHRINKING) == (
        expected
    )


def test_no_candidates_under_priority_is_no_choice() -> None:
    """An empty candidate tuple is no choice under ``priority`` as under FCFS: ``None``,
    not an error from looking for the least urgent class of nobody."""
    for policy in ("fcfs", "priority"):
        context = ctx((), requester="gone", policy=policy)
        assert strategy().choose((), context, None) is None


def test_the_reported_position_is_in_the_given_tuple_after_the_priority_filter() -> None:
    """``last_index`` is the victim's position in the tuple ``choose`` was given, or -1:
    under ``priority`` the strategy ranks the least urgent class only, and an index into
    that subset ("cheap" is its second member, the given tuple's third) names another
    candidate."""
    cands = (
        cand("urgent", computed=50, output=5, priority=0),
        cand("big", computed=3000, output=5, priority=1),
        cand("cheap", computed=100, output=5, priority=1),
        cand("req", computed=2000, output=5, prompt=1995, priority=1),
    )
    scorer = strategy(cascade_gain_ratio=1.0)
    chosen = scorer.choose(cands, ctx(cands, requester="req", policy="priority"), None)
    assert chosen is cands[2]
    assert scorer.last_index in (-1, 2)
