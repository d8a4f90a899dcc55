"""The ``bidkv`` array fast path (from 48 candidates) chooses exactly what scoring every
candidate in Python chooses, on seeded random contexts built to reach the cases the
Hypothesis property test rarely draws: prefilling requesters whose shortfall only some
candidates cover (the requester and built-in anchors must then be filtered by
sufficiency), ``cache_survival`` strictly between 0 and 1 (the pruning slope must shrink
with it), completion factors that differ per candidate, weights at their extremes.

Also: token counts beyond what an int64 holds make the fast path fall back to Python
scoring instead of raising (which the controller would answer by dropping the policy for
good), and a negative prior-preemption count (outside the contract) cannot make the
disruption factor fall below 1, which the fast path's bound assumes.
"""

from __future__ import annotations

import random

import pytest

from bidkv_ext.config import BidKVConfig
from bidkv_ext.contract import PreemptionCandidate, PreemptionContext
from bidkv_ext.controller import PolicyController
from bidkv_ext.selector import BidkvPreemptionPolicy
from bidkv_ext.strategies import utility
from bidkv_ext.strategies.utility import UtilityParams, UtilityStrategy

CONTEXTS = 2500


def _config(rng: random.Random) -> BidKVConfig:
    return BidKVConfig(
        enabled=True,
        base_cost=rng.choice([0.0, 1.0, 64.0, 1e6]),
        recompute_weight=rng.choice([1e-12, 0.01, 1.0, 1e6]),
        completion_weight=rng.choice([0.0, 1.0, 1e3]),
        preempt_weight=rng.choice([0.0, 2.0]),
        first_token_weight=rng.choice([0.0, 5.0]),
        cache_survival=rng.choice([0.0, 0.5, 0.999999, 1.0]),
        prefix_caching=rng.random() < 0.5,
        block_size=rng.choice([1, 16]),
        cascade_gain_ratio=rng.choice([1.0, 1.25, 100.0]),
        prefill_chunk_tokens=rng.choice([1, 512, 2048]),
    )


def _context(rng: random.Random) -> PreemptionContext:
    n = rng.randint(48, 200)
    # A few shared computed counts make ties and equal anchors common.
    shared = [rng.choice([0, 1, 16, 17, 100, 2048]) for _ in range(5)]
    cands = tuple(
        PreemptionCandidate(
            f"r{i}", 0, float(i), rng.randint(0, 4000), rng.randint(0, 50),
            rng.choice([*shared, rng.randint(0, 5000)]), rng.choice([0, 0, 0, 1, 3]),
            rng.choice([0, 10, 4096]),
        )
        for i in range(n)
    )
    requester = rng.choice(cands).request_id
    builtin = rng.choice([None, cands[-1].request_id, rng.choice(cands).request_id, "gone"])
    return PreemptionContext(cands, "fcfs", requester, 0.5, 0.0, builtin)


def test_the_fast_path_chooses_what_scoring_everyone_chooses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seeded contexts of 48-200 candidates: the same victim (by identity, and at the
    position the strategy reports) with the fast path and with every candidate scored."""
    mismatches = []
    for seed in range(CONTEXTS):
        rng = random.Random(seed)
        strategy = UtilityStrategy(UtilityParams.from_config(_config(rng)))
        context = _context(rng)
        fast = strategy.choose(context.candidates, context, None)
        index = strategy.last_index
        with monkeypatch.context() as patch:
            patch.setattr(utility, "_PRUNE_FROM", 10**9)
            slow = strategy.choose(context.candidates, context, None)
        if fast is not slow or (fast is not None and context.candidates[index] is not fast):
            mismatches.append(seed)
    assert mismatches == []


@pytest.mark.parametrize("builtin", ["r1", None])
def test_token_counts_beyond_int64_fall_back_to_python_scoring(builtin: str | None) -> None:
    """With 48+ candidates the computed counts go into an int64 array; a count of 2**63
    raised OverflowError there (below 48 it worked), and the controller dropped the policy
    for the life of the process. Now the decision is made by scoring in Python: the best
    candidate, not merely the built-in victim (here a loser, or none)."""
    huge = 2**63
    for n in (47, 48, 200):
        large = [PreemptionCandidate(f"r{i}", 0, float(i), 10, 1, huge + i, 0, 4096)
                 for i in range(n - 1)]
        cands = (*large, PreemptionCandidate("small", 0, float(n), 10, 1, 32, 0, 4096))
        controller = PolicyController(BidkvPreemptionPolicy(BidKVConfig(enabled=True)))
        context = PreemptionContext(cands, "fcfs", "r0", 0.9, 1.0, builtin)
        assert controller.select_victim(context) == "small", n
        stats = controller.export_stats()
        assert stats["failures"] == 0 and stats["selections"] == 1 and stats["enabled"], n


@pytest.mark.parametrize("count", [2**61, 2**62, 2**63 - 1, 2**63])
def test_counts_near_the_fast_paths_markers_choose_as_below_48(count: int) -> None:
    """Counts that fit in int64 but reach the fast path's markers (2**62 marks a candidate
    outside the ranked set, 2**61 caps the cut's limit) made it abstain, or return the
    built-in victim although it frees too little, while 47 candidates chose the one that
    frees enough. From 48 candidates the decision is the same as with 47."""
    def victim(n: int) -> str | None:
        small = [PreemptionCandidate(f"s{i}", 0, float(i), 10, 1, 5, 0, 4096)
                 for i in range(n - 2)]
        cands = (*small, PreemptionCandidate("big", 0, 100.0, 10, 1, count, 0, 4096),
                 PreemptionCandidate("req", 0, 200.0, 5000, 0, 0, 0, 4096))
        controller = PolicyController(BidkvPreemptionPolicy(BidKVConfig(enabled=True)))
        return controller.select_victim(PreemptionContext(cands, "fcfs", "req", 0.9, 0.0, "s0"))

    assert victim(47) == "big"
    assert victim(48) == victim(200) == "big"


def test_a_negative_preemption_count_cannot_lower_the_disruption() -> None:
    """``num_preemptions`` below 0 is outside the contract; with a prior-preemption weight
    it made the factor (1 + w * P) negative, so a 9,000-token victim outranked a 10-token
    one, and the fast path (which bounds U assuming every factor >= 1) disagreed with
    scoring everyone. It counts as 0."""
    strategy = UtilityStrategy(UtilityParams.from_config(
        BidKVConfig(enabled=True, preempt_weight=2.0, cascade_gain_ratio=1.0)))
    tiny = PreemptionCandidate("tiny", 0, 1.0, 10, 5, 10, 0, 4096)
    huge = PreemptionCandidate("huge", 0, 0.0, 9000, 5, 9000, -1, 4096)
    assert strategy.utility(huge, 1) == strategy.utility(
        PreemptionCandidate("huge", 0, 0.0, 9000, 5, 9000, 0, 4096), 1)
    context = PreemptionContext((huge, tiny), "fcfs", "tiny", 0.9, 1.0, None)
    assert strategy.choose(context.candidates, context, None) is tiny
