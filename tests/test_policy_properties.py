"""Property tests: over random contexts the controller+policy never raise, always return a
candidate id, and are deterministic for equal input and seed (every strategy)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bidkv_ext.config import MAX_WEIGHT, BidKVConfig
from bidkv_ext.contract import PreemptionCandidate, PreemptionContext
from bidkv_ext.controller import PolicyController
from bidkv_ext.selector import BidkvPreemptionPolicy
from bidkv_ext.strategies import STRATEGY_NAMES
from bidkv_ext.strategies.utility import UtilityParams, UtilityStrategy

HUGE = 2**40
ids = st.sampled_from(["a", "b", "c", "d", "e", "f", "g", "h"])
counts = st.one_of(st.just(0), st.integers(0, 5000), st.just(HUGE))
candidate = st.builds(
    PreemptionCandidate,
    request_id=ids,
    priority=st.integers(-3, 3),
    arrival_time=st.floats(0, 1e9, allow_nan=False),
    num_prompt_tokens=counts,
    num_output_tokens=counts,
    num_computed_tokens=counts,
    num_preemptions=st.integers(0, 50),
    max_tokens=st.one_of(st.just(0), st.just(-1), counts),
)


@st.composite
def contexts(draw: st.DrawFn) -> PreemptionContext:
    cands = tuple(draw(st.lists(candidate, min_size=1, max_size=12)))  # duplicates allowed
    ids_in = [c.request_id for c in cands]
    requester = draw(st.sampled_from(ids_in))
    builtin = draw(st.one_of(st.none(), st.sampled_from(ids_in), st.just("stale")))
    return PreemptionContext(
        cands,
        draw(st.sampled_from(["fcfs", "priority"])),
        requester,
        draw(st.floats(0, 1)),
        draw(st.floats(0, 1e6, allow_nan=False)),
        builtin,
    )


def make(strategy: str, seed: int) -> PolicyController:
    config = BidKVConfig(enabled=True, strategy=strategy, seed=seed)
    return PolicyController(BidkvPreemptionPolicy(config))


@settings(max_examples=120, deadline=None)
@given(contexts(), st.sampled_from(sorted(STRATEGY_NAMES)), st.integers(0, 3))
def test_never_raises_always_a_candidate_and_deterministic(
    context: PreemptionContext, strategy: str, seed: int
) -> None:
    first, second = make(strategy, seed), make(strategy, seed)
    ids_in = {c.request_id for c in context.candidates}
    for _ in range(3):
        a = first.select_victim(context)
        b = second.select_victim(context)
        assert a in ids_in
        assert a == b
    stats = first.export_stats()
    assert stats["failures"] == 0 and stats["invalid_selections"] == 0


extreme = st.sampled_from([0.0, 1e-3, 1.0, MAX_WEIGHT])


@settings(max_examples=120, deadline=None)
@given(
    st.one_of(st.lists(candidate, min_size=1, max_size=47),
              st.lists(candidate, min_size=48, max_size=120)),
    extreme, extreme, extreme, extreme, extreme,
    st.sampled_from([1e-3, 1.0, MAX_WEIGHT]),
)
def test_any_accepted_configuration_keeps_the_policy_in_charge(
    cands: list[PreemptionCandidate],
    base_cost: float,
    recompute: float,
    preempt: float,
    completion: float,
    first_token: float,
    epsilon: float,
) -> None:
    """Every value the config accepts (weights at their bounds included) scores without a
    fault: a setting that would break the policy must fail start-up instead."""
    config = BidKVConfig(
        enabled=True, base_cost=base_cost, recompute_weight=recompute, preempt_weight=preempt,
        completion_weight=completion, first_token_weight=first_token, epsilon=epsilon,
    )
    controller = PolicyController(BidkvPreemptionPolicy(config))
    context = PreemptionContext(tuple(cands), "fcfs", cands[0].request_id, 0.99, 1.0, None)
    assert controller.select_victim(context) in {c.request_id for c in cands}
    assert controller.export_stats()["failures"] == 0


@settings(max_examples=150, deadline=None)
@given(
    # Both paths: plain Python scoring below 48 candidates, array passes from 48.
    st.one_of(st.lists(candidate, min_size=1, max_size=47),
              st.lists(candidate, min_size=48, max_size=300)),
    st.booleans(),
    st.floats(0.0, 1.0),
    st.floats(0.0, 3.0),
    st.sampled_from([0.0, 1.0, 8.0]),
    st.sampled_from([0.0, 16.0, 64.0]),
    st.integers(0, 299),
    st.one_of(st.none(), st.integers(0, 299)),
    # A tiny slope puts the cut's limit beyond any token count (1e-18: past 2**62) and
    # magnifies its rounding; 1e-300 overflows it.
    st.sampled_from([1.0, 1e-3, 1e-18, 1e-300]),
)
def test_bounded_argmax_picks_what_scoring_everyone_picks(
    cands: list[PreemptionCandidate],
    prefix: bool,
    survival: float,
    weight: float,
    completion: float,
    base: float,
    requester: int,
    builtin: int | None,
    recompute: float,
) -> None:
    """The array fast path (sufficiency filter, anchors, bound-and-cut; from 48 candidates)
    picks exactly the candidate that scoring everyone in Python picks, ties included:
    the highest U among the candidates that free the shortfall alone (or among all when
    none does); ties to the built-in victim, then to the newest."""
    strategy = UtilityStrategy(UtilityParams.from_config(BidKVConfig(
        prefix_caching=prefix, cache_survival=survival, preempt_weight=weight,
        completion_weight=completion, base_cost=base, cascade_gain_ratio=1.0,
        recompute_weight=recompute,
    )))
    # Unique ids so that "which candidate" is well defined.
    cands = [PreemptionCandidate(str(i), *(getattr(c, f) for f in c.__slots__[1:]))
             for i, c in enumerate(cands)]
    asker = cands[requester % len(cands)]
    host = None if builtin is None else cands[builtin % len(cands)].request_id
    context = PreemptionContext(tuple(cands), "fcfs", asker.request_id, 0.9, 1.0, host)
    need = strategy._needed_blocks(asker, None)
    chosen = strategy.choose(context.candidates, context, None)

    sufficient = [c for c in cands if -(-c.num_computed_tokens // 16) >= need]
    ranked = sufficient or cands
    scores = {c.request_id: strategy.utility(c, need) for c in ranked}
    best = max(scores.values())
    if best <= 0.0:
        assert chosen is None
        return
    winners = [c.request_id for c in ranked if scores[c.request_id] == best]
    expected = host if host in winners else winners[-1]
    assert chosen is not None and chosen.request_id == expected
    assert context.candidates[strategy.last_index] is chosen


def test_a_tiny_recompute_slope_never_lets_an_insufficient_candidate_win() -> None:
    """With 48+ candidates, those that cannot free a prefilling requester's shortfall alone
    are marked out of the ranked set; a recompute weight the config accepts (1e-18) must not
    lift the cut's limit past that mark and let one of them in."""
    strategy = UtilityStrategy(UtilityParams.from_config(BidKVConfig(
        recompute_weight=1e-18, completion_weight=8.0, cascade_gain_ratio=1.0)))
    asker = PreemptionCandidate("asker", 0, 0.0, 64, 0, 0, 0, 100)  # needs 4 blocks
    big = [PreemptionCandidate(f"big{i}", 0, 1.0, 80, 10, 80, 0, 10) for i in range(3)]
    small = [PreemptionCandidate(f"small{i}", 0, 2.0, 16, 1, 16, 0, 10**6) for i in range(60)]
    cands = (asker, *big, *small)
    chosen = strategy.choose(cands, PreemptionContext(cands, "fcfs", "asker", 0.9, 1.0), None)
    assert chosen is not None and chosen.request_id.startswith("big")


def test_a_tiny_recompute_slope_keeps_ties_to_the_newest() -> None:
    """The cut's bound is a difference divided by the slope: at 1e-18 its rounding is
    worth ~1,600 tokens, which cut the anchor itself out and broke the tie toward the
    older of two equal candidates (found by the property test above)."""
    strategy = UtilityStrategy(UtilityParams.from_config(BidKVConfig(
        prefix_caching=False, completion_weight=0.0, base_cost=16.0, cascade_gain_ratio=1.0,
        recompute_weight=1e-18)))
    cands = tuple(PreemptionCandidate(str(i), 0, 0.0, 0, 0, int(i >= 67), 0, 0)
                  for i in range(69))
    chosen = strategy.choose(cands, PreemptionContext(cands, "fcfs", "0", 0.9, 1.0), None)
    assert chosen is not None and chosen.request_id == "68"


@settings(max_examples=80, deadline=None)
@given(st.lists(candidate, min_size=1, max_size=200), st.integers(0, 199))
def test_position_hint_always_names_the_victim(
    cands: list[PreemptionCandidate], requester: int
) -> None:
    """The hint lets the controller skip its scan, so it must never point elsewhere."""
    cands = [PreemptionCandidate(str(i), *(getattr(c, f) for f in c.__slots__[1:]))
             for i, c in enumerate(cands)]
    rid = cands[requester % len(cands)].request_id
    context = PreemptionContext(tuple(cands), "fcfs", rid, 0.9, 1.0, cands[-1].request_id)
    # Guards off: the liveness guard may rightly exclude the sufficient candidates.
    config = BidKVConfig(enabled=True, cascade_gain_ratio=1.0, liveness_preemptions=0)
    policy = BidkvPreemptionPolicy(config)
    chosen = policy.select_victim(context)
    hint = policy.victim_index_hint
    if chosen is not None and hint != -1:
        assert context.candidates[hint].request_id == chosen
    # With a built-in victim given, the ranked set is still the sufficient one.
    strategy = policy.strategy
    assert isinstance(strategy, UtilityStrategy)
    need = strategy._needed_blocks(context.candidates[requester % len(cands)], None)
    sufficient = [c for c in cands if -(-c.num_computed_tokens // 16) >= need]
    if chosen is not None and sufficient:
        assert any(c.request_id == chosen for c in sufficient)


def test_position_hint_after_the_sufficiency_filter() -> None:
    """Regression: an index found inside the filtered window is not a tuple position."""
    small = [PreemptionCandidate(f"s{i}", 0, float(i), 100, 5, 100, 0, 4096) for i in range(60)]
    large = [PreemptionCandidate(f"l{i}", 0, 100.0 + i, 3000, 5, 3000 + i, 0, 4096)
             for i in range(60)]
    requester = PreemptionCandidate("req", 0, 500.0, 6000, 0, 1000, 0, 4096)
    cands = (*small, *large, requester)
    context = PreemptionContext(cands, "fcfs", "req", 0.9, 1.0, "req")
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, cascade_gain_ratio=1.0))
    chosen = policy.select_victim(context)
    assert chosen == "l0"  # the least computed of those that free 128 blocks alone
    assert cands[policy.victim_index_hint].request_id == "l0"


def test_the_bound_keeps_a_winner_just_inside_it() -> None:
    """Regression guard for the array path's bound: the least computed request is nearly
    finished (its delta doubles), so a slightly larger one wins; it sits one token inside
    the computed-token limit and must not be cut."""
    fillers = [PreemptionCandidate(f"f{i}", 0, float(i), 2990, 10, 3000, 0, 100_000)
               for i in range(58)]
    finishing = PreemptionCandidate("finishing", 0, 100.0, 90, 10, 100, 0, 10)
    contender = PreemptionCandidate("contender", 0, 101.0, 253, 10, 263, 0, 1_000_000)
    cands = (*fillers[:30], finishing, contender, *fillers[30:])
    context = PreemptionContext(cands, "fcfs", "f3", 0.9, 1.0, cands[-1].request_id)
    strategy = UtilityStrategy()
    assert strategy.utility(contender, 1) > strategy.utility(finishing, 1)
    chosen = strategy.choose(cands, context, None)
    assert chosen is contender
    assert cands[strategy.last_index] is contender
