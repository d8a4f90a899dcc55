"""Property tests: over random contexts the controller+policy never raise, always return a
candidate id, and are deterministic for equal input and seed (every strategy)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bidkv_ext.config import BidKVConfig
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


@settings(max_examples=150, deadline=None)
@given(
    st.lists(candidate, min_size=1, max_size=300),
    st.booleans(),
    st.floats(0.0, 1.0),
    st.floats(0.0, 3.0),
)
def test_pruned_argmax_equals_scoring_everyone(
    cands: list[PreemptionCandidate], prefix: bool, survival: float, weight: float
) -> None:
    """The C-level fast path (sufficiency filter, anchors, bound-and-prune) picks a
    candidate with the same, maximal U as scoring every candidate in Python."""
    strategy = UtilityStrategy(UtilityParams(
        prefix_caching=prefix, cache_survival=survival, preempt_weight=weight,
        cascade_gain_ratio=1.0,
    ))
    # Unique ids so that "which candidate" is well defined.
    cands = [PreemptionCandidate(str(i), *(getattr(c, f) for f in c.__slots__[1:]))
             for i, c in enumerate(cands)]
    context = PreemptionContext(tuple(cands), "fcfs", cands[0].request_id, 0.9, 1.0, None)
    need = strategy._needed_blocks(cands[0], None)
    chosen = strategy.choose(context.candidates, context, None)
    # The documented rule: the highest U among the candidates that free the shortfall on
    # their own, or among all when none does.
    sufficient = [c for c in cands if -(-c.num_computed_tokens // 16) >= need]
    scores = [strategy.utility(c, need) for c in (sufficient or cands)]
    best = max(scores)
    if best <= 0.0:
        assert chosen is None
    else:
        assert chosen is not None
        assert strategy.utility(chosen, need) == best


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
