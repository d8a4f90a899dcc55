"""Guards: the liveness bound holds per epoch, state is bounded, the cascade guard and
priority classes behave as documented; ties go to the built-in victim. A negative liveness
threshold is refused, and after the guard has set the favourite aside the selector's
position hint never names another request than the victim. An abstention that leaves the
decision to a host victim which has spent its budget is the epoch's barrier, so the bound
holds for strategies that abstain too."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from bidkv_ext.config import BidKVConfig
from bidkv_ext.contract import CandidateFacts, PreemptionContextFacts
from bidkv_ext.controller import PolicyController
from bidkv_ext.selector import BidkvPreemptionPolicy
from tests.policy_helpers import cand, ctx


def replay_decisions(threshold: int, rounds: int) -> list[tuple[int, str]]:
    """Drive the controller like a host: each victim's num_preemptions grows by one (its
    computed tokens stay, so bidkv's favourite stays the least computed, "D")."""
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, liveness_preemptions=threshold))
    controller = PolicyController(policy)
    cands = {rid: cand(rid, computed=size) for rid, size in
             [("A", 5000), ("B", 3000), ("C", 1000), ("D", 500)]}
    history: list[tuple[int, str]] = []
    for _ in range(rounds):
        epoch = policy.liveness.epochs
        victim = controller.select_victim(ctx(list(cands.values()), requester="D"))
        history.append((epoch, victim))
        c = cands[victim]
        cands[victim] = dataclasses.replace(c, num_preemptions=c.num_preemptions + 1)
    assert controller.export_stats()["failures"] == 0
    return history


@pytest.mark.parametrize("threshold", [1, 2, 3])
def test_no_request_exceeds_threshold_plus_one_per_epoch(threshold: int) -> None:
    history = replay_decisions(threshold, 60)
    per_epoch = Counter(history)
    assert max(per_epoch.values()) <= threshold + 1
    # The favourite is taken `threshold` times, then the others get their turn before any
    # new epoch starts: nobody is untouched while one request absorbs every preemption.
    first_epoch = [v for e, v in history if e == 0]
    assert first_epoch[:threshold] == ["D"] * threshold
    assert set(first_epoch) == {"A", "B", "C", "D"}
    assert len({e for e, _ in history}) > 3


def test_threshold_zero_disables_the_guard() -> None:
    history = replay_decisions(0, 12)
    assert [v for _, v in history] == ["D"] * 12


def test_state_does_not_grow_with_departed_requests() -> None:
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, liveness_preemptions=1))
    for step in range(400):
        # Four fresh requests each time (the old ones left), all already preempted once.
        cands = [cand(f"r{step}-{i}", computed=100 * (i + 1), preemptions=1) for i in range(4)]
        policy.select_victim(ctx(cands))
        assert policy.liveness.tracked <= len(cands) + 1
    assert policy.liveness.epochs > 0


def test_ties_go_to_the_builtin_victim() -> None:
    same = [cand(x, computed=320, output=5, max_tokens=1024) for x in "abc"]
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, cascade_gain_ratio=1.0))
    assert policy.select_victim(ctx(same, requester="a", builtin="b")) == "b"
    assert policy.select_victim(ctx(same, requester="a")) == "c"


def test_priority_policy_only_considers_the_least_urgent_class() -> None:
    """Under ``priority`` scheduling the cheapest victim overall (a more urgent request)
    is not eligible: the choice stays in the least urgent class. The same candidates
    under FCFS pick that urgent one, so the data tells the two apart."""
    cands = [cand("urgent", computed=160, priority=0), cand("lazy1", computed=4000, priority=3),
             cand("lazy2", computed=2000, priority=3), cand("req", computed=3000, priority=3)]
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, cascade_gain_ratio=1.0))
    assert policy.select_victim(ctx(cands, requester="req")) == "urgent"
    chosen = policy.select_victim(ctx(cands, policy="priority", requester="req"))
    assert chosen in {"lazy1", "lazy2", "req"}


def test_liveness_never_makes_the_victim_more_urgent() -> None:
    """Under priority scheduling, when the least urgent class has spent its budget, the
    guard takes a barrier decision (the host's least urgent victim) instead of moving on
    to a more urgent class."""
    cands = [cand("u0", computed=110, priority=0, arrival=1.0),
             cand("u1", computed=110, priority=0, arrival=2.0),
             cand("lazy", computed=110, priority=5, arrival=3.0, preemptions=1)]
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, liveness_preemptions=1))
    controller = PolicyController(policy)
    context = ctx(cands, policy="priority", requester="u0", builtin="lazy")
    assert controller.select_victim(context) == "lazy"
    assert policy.barrier_decisions == 1
    # Under FCFS the same state moves on to an eligible request: no barrier.
    fcfs = BidkvPreemptionPolicy(BidKVConfig(enabled=True, liveness_preemptions=1))
    assert fcfs.select_victim(ctx(cands, requester="u0", builtin="lazy")) in {"u0", "u1"}
    assert fcfs.barrier_decisions == 0


def test_cascade_guard_takes_the_requester_only_when_a_cascade_would_follow() -> None:
    # Prefilling requester: 4,500 tokens still to place, one 2,048-token chunk -> it needs
    # 128 blocks. Nobody frees that many alone, so the host would preempt again after the
    # best victim ("mid", 113 blocks): when the requester's U is within the ratio, the
    # guard takes the requester, which ends the loop.
    cands = [cand("mid", computed=1800, output=5, prompt=1795),
             cand("req", computed=1500, output=0, prompt=6000)]

    def pick(ratio: float) -> str | None:
        config = BidKVConfig(enabled=True, prefix_caching=False, cascade_gain_ratio=ratio)
        return BidkvPreemptionPolicy(config).select_victim(ctx(cands, requester="req"))

    assert pick(1.0) == "mid"
    assert pick(1.25) == "req"


def test_cascade_guard_never_takes_a_requester_that_may_not_be_the_victim() -> None:
    """The cascade guard weighs the requester only when it is itself eligible. A prefilling
    requester of a more urgent priority class, or one that has spent its liveness budget,
    would otherwise win through the guard (nobody left frees its 128-block shortfall
    alone, and its own U is within the ratio): the victim would leave the least urgent
    class, and one request could be preempted again and again with no barrier."""
    # Priority: "req" is class 0; the least urgent class (5) holds only small victims.
    cands = [cand("req", computed=1600, prompt=5000, priority=0, arrival=0.0),
             cand("x", computed=100, prompt=100, output=10, priority=5, arrival=1.0),
             cand("y", computed=40, prompt=40, output=10, priority=5, arrival=2.0)]
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True))
    assert policy.select_victim(ctx(cands, requester="req", policy="priority",
                                    builtin="y")) in {"x", "y"}
    # Liveness: "req" (FCFS) has spent its budget of 2; never chosen again this epoch.
    guarded = BidkvPreemptionPolicy(BidKVConfig(enabled=True, liveness_preemptions=2))
    for _ in range(3):
        cands = [cand("req", computed=1600, prompt=5000, preemptions=2),
                 cand("x", computed=100, prompt=100, output=10),
                 cand("y", computed=40, prompt=40, output=10)]
        assert guarded.select_victim(ctx(cands, requester="req", builtin="y")) in {"x", "y"}


def test_a_victim_that_frees_the_shortfall_alone_is_preferred() -> None:
    # Same requester (needs 128 blocks); "big" frees 150 blocks alone, "mid" only 113.
    cands = [cand("mid", computed=1800, output=5, prompt=1795),
             cand("big", computed=2400, output=5, prompt=2395),
             cand("req", computed=1500, output=0, prompt=6000)]
    config = BidKVConfig(enabled=True, prefix_caching=False, cascade_gain_ratio=1.0)
    assert BidkvPreemptionPolicy(config).select_victim(ctx(cands, requester="req")) == "big"


def test_cascade_guard_stays_out_when_one_victim_suffices() -> None:
    # Decoding requester needs one block: any victim with a block ends the loop.
    cands = [cand("small", computed=100, output=50, prompt=51),
             cand("req", computed=110, output=50, prompt=61),
             cand("huge", computed=9000, output=50, prompt=8951)]
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, cascade_gain_ratio=4.0))
    assert policy.select_victim(ctx(cands, requester="req")) == "small"


def test_host_facts_change_the_estimate_of_freed_blocks() -> None:
    from bidkv_ext.contract import CandidateFacts, PreemptionContextFacts

    cands = [cand("shared", computed=1600, output=10), cand("private", computed=1700, output=10)]
    context = ctx(cands, requester="private")
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, cascade_gain_ratio=1.0))
    facts = PreemptionContextFacts(
        block_size=16, needed_blocks=50,
        facts={"shared": CandidateFacts(exclusive_blocks=0, cached_blocks=0, total_blocks=100),
               "private": CandidateFacts(exclusive_blocks=107, cached_blocks=0,
                                         total_blocks=107)},
    )
    assert policy.select_victim_with_facts(context, facts) == "private"
    assert policy.wants_host_facts



@pytest.mark.parametrize("threshold", [1, 2, 3])
def test_second_epoch_gives_every_request_its_full_budget(threshold: int) -> None:
    """Liveness over two epochs: the barrier victim's preemption is booked to the epoch it
    ends, so the next epoch starts every request with a full budget. In epoch 1 exactly as
    in epoch 0, D, C, B and A are each taken `threshold` times in score order, then the
    barrier takes the host's victim D once more: threshold + 1 for D, the per-epoch bound,
    reached and not exceeded."""
    history = replay_decisions(threshold, 3 * (4 * threshold + 1))
    expected = ["D"] * threshold + ["C"] * threshold + ["B"] * threshold + (
        ["A"] * threshold) + ["D"]
    for epoch in (0, 1, 2):
        assert [v for e, v in history if e == epoch] == expected
    assert Counter(v for e, v in history if e == 1) == {
        "A": threshold, "B": threshold, "C": threshold, "D": threshold + 1}


def test_barrier_victim_starts_the_new_epoch_with_a_full_budget() -> None:
    """LivenessGuard.start_epoch books the barrier victim's coming preemption (its
    num_preemptions + 1) to the old epoch: after that preemption it may still be preempted
    `threshold` times in the new epoch; other requests' offsets are their counts at the
    epoch start, and a request first seen later counts all its preemptions."""
    from bidkv_ext.guards import LivenessGuard

    guard = LivenessGuard(2)
    start = (cand("x", preemptions=2), cand("y", preemptions=2), cand("z", preemptions=0))
    guard.start_epoch(start, "y")
    assert guard.epochs == 1
    # y was preempted by the barrier (3): two more in this epoch, not a third.
    assert guard.allows(cand("y", preemptions=3))
    assert guard.allows(cand("y", preemptions=4))
    assert not guard.allows(cand("y", preemptions=5))
    # x was not preempted by the barrier: its offset is 2, so 3 and 4 allowed, 4 spent.
    assert guard.allows(cand("x", preemptions=3))
    assert not guard.allows(cand("x", preemptions=4))
    assert guard.allows(cand("z", preemptions=1))
    assert not guard.allows(cand("z", preemptions=2))
    assert [c.request_id for c in guard.filter(
        (cand("x", preemptions=4), cand("y", preemptions=4), cand("new", preemptions=2))
    ).eligible] == ["y"]


@pytest.mark.parametrize("threshold", [1, 2, 3])
def test_a_barrier_preemption_the_host_skips_does_not_widen_the_bound(threshold: int) -> None:
    """vLLM may leave the barrier victim running (its blocks cannot be freed yet, e.g. a
    KV connector with asynchronous scheduling defers the free): the guard booked its
    preemption in advance, so without a correction it would be taken threshold + 1 times
    by the policy in the new epoch, plus the next barrier. With it, no request exceeds
    threshold + 1 preemptions in any epoch, the skipped barrier included."""
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, liveness_preemptions=threshold))
    controller = PolicyController(policy)
    preemptions = {"a": threshold, "b": threshold}
    computed = {"a": 500, "b": 100}  # "b", the host's victim, is bidkv's favourite
    taken: Counter[tuple[int, str]] = Counter()
    for step in range(6 * (threshold + 1)):
        candidates = [cand(r, computed=computed[r], preemptions=preemptions[r])
                      for r in ("a", "b")]
        epoch = policy.liveness.epochs
        victim = controller.select_victim(ctx(candidates, requester="a", builtin="b"))
        if step == 0:
            assert victim == "b" and policy.liveness.epochs == 1  # the barrier
            continue  # the host does not carry it out
        preemptions[victim] += 1
        taken[(epoch, victim)] += 1
    assert taken[(1, "b")] == threshold + 1  # threshold picks, then the next barrier
    assert max(taken.values()) <= threshold + 1, taken


def test_a_negative_threshold_is_refused() -> None:
    from bidkv_ext.guards import LivenessGuard

    with pytest.raises(ValueError, match="non-negative"):
        LivenessGuard(-1)
    assert LivenessGuard(0).allows(cand("x", preemptions=99))


def test_position_hint_names_the_victim_after_the_guard_filtered() -> None:
    """``victim_index_hint`` is a position in ``context.candidates`` (or -1): when the guard
    sets the spent favourite aside, the strategy's index into the eligible subset is no such
    position, and the previous decision's hint is stale."""
    policy = BidkvPreemptionPolicy(
        BidKVConfig(enabled=True, cascade_gain_ratio=1.0, liveness_preemptions=1)
    )
    cands = [cand("r", computed=50), cand("a", computed=100), cand("b", computed=200),
             cand("c", computed=300)]
    victims: list[str] = []
    for _ in range(2):
        context = ctx(cands, requester="r")
        victim = policy.select_victim(context)
        assert victim is not None
        hint = policy.victim_index_hint
        assert hint == -1 or context.candidates[hint].request_id == victim
        victims.append(victim)
        cands = [dataclasses.replace(c, num_preemptions=c.num_preemptions + 1)
                 if c.request_id == victim else c for c in cands]
    # The utility's favourite is the requester at position 0 (fewest tokens to recompute);
    # in the second decision it has spent its budget, so the victim comes from the filter.
    assert victims[0] == "r" and victims[1] != "r"
    assert policy.barrier_decisions == 0


@pytest.mark.parametrize("crowd", [0, 60])
def test_priority_scheduling_never_takes_a_more_urgent_victim(crowd: int) -> None:
    """docs/policy.md: under ``priority`` scheduling only the least urgent priority class is
    eligible, in the Python path and in the array path (48+ candidates in that class)
    alike. Here the more urgent requests lose far less on recompute (50-100 tokens against
    1,000-3,000), so under FCFS the utility takes one of them; under priority it takes the
    best of the least urgent class (priority 3): "lazy_small", the one with the least to
    recompute, not the host's own victim "lazy_big"."""
    cands = [cand("urgent", computed=100, output=5, priority=0),
             *(cand(f"u{i}", computed=50, output=5, priority=1) for i in range(crowd)),
             cand("lazy_big", computed=3000, output=5, priority=3),
             *(cand(f"l{i}", computed=2000, output=5, priority=3) for i in range(crowd)),
             cand("lazy_small", computed=1000, output=5, priority=3),
             cand("req", computed=200, output=5, prompt=195, priority=0)]
    config = BidKVConfig(enabled=True, cascade_gain_ratio=1.0)
    fcfs = BidkvPreemptionPolicy(config).select_victim(ctx(cands, requester="req"))
    assert fcfs == ("urgent" if crowd == 0 else "u59")
    chosen = BidkvPreemptionPolicy(config).select_victim(
        ctx(cands, requester="req", policy="priority", builtin="lazy_big"))
    assert chosen == "lazy_small"


def test_cascade_guard_compares_utilities_not_computed_tokens() -> None:
    """docs/policy.md, cascade guard: the requester is taken when its own U, times the
    ratio, reaches the best U (the reference compared computed tokens). The requester is
    prefilling (5,000 tokens to place, one 2,048-token chunk: 128 blocks); nobody frees
    that alone, so a cascade would follow the best victim "mid" (113 blocks).
    U_mid = 113 / (1864 * (1 + 32/1051)) = 0.0589. With 1,000 computed tokens the
    requester's U = 63 / (1064 * (1 + 32/1056)) = 0.0575: within 1.25 of mid's, so the
    guard takes it, though 1,000 * 1.25 < 1,800 computed tokens. With 1,700 computed and
    the first-token term on (the requester has no output yet: delta doubles) its U is
    107 / (1764 * (1 + 32/1056) * 2) = 0.0294, beyond the ratio, so "mid" stays, though
    1,700 * 1.25 >= 1,800."""

    def pick(requester_computed: int, **settings: float) -> str | None:
        cands = [cand("mid", computed=1800, output=5, prompt=1795),
                 cand("req", computed=requester_computed, output=0, prompt=6000)]
        config = BidKVConfig(enabled=True, prefix_caching=False, cascade_gain_ratio=1.25,
                             **settings)  # type: ignore[arg-type]
        return BidkvPreemptionPolicy(config).select_victim(ctx(cands, requester="req"))

    assert pick(1000) == "req"
    assert pick(1700, first_token_weight=1.0) == "mid"


def test_an_abstention_on_a_spent_host_victim_is_the_epochs_barrier() -> None:
    """The bound holds when the strategy abstains: here only ``x`` frees blocks (the others
    hold only blocks shared with each other), so once ``x`` has spent its budget every
    eligible candidate frees nothing and bidkv abstains. The host then preempts its own
    victim, ``x`` again; that decision must be the epoch's barrier (a new epoch), or ``x``
    is preempted past threshold + 1 in one epoch (6 times at threshold 1 before the fix)."""
    policy = BidkvPreemptionPolicy(
        BidKVConfig(enabled=True, liveness_preemptions=1, cascade_gain_ratio=1.0)
    )
    controller = PolicyController(policy)
    cands = {"s1": cand("s1", computed=320, output=5), "s2": cand("s2", computed=320, output=5),
             "req": cand("req", computed=200, output=5, prompt=195),
             "x": cand("x", computed=320, output=5)}
    facts = PreemptionContextFacts(16, 1, {
        "s1": CandidateFacts(0, 0, 20), "s2": CandidateFacts(0, 0, 20),
        "req": CandidateFacts(0, 0, 13), "x": CandidateFacts(20, 0, 20)})
    history: list[tuple[int, str]] = []
    for _ in range(6):
        order = [cands[k] for k in ("s1", "s2", "req", "x")]
        epoch = policy.liveness.epochs
        victim = controller.select_victim(ctx(order, requester="req", builtin="x"), facts)
        history.append((epoch, victim))
        cands[victim] = dataclasses.replace(
            cands[victim], num_preemptions=cands[victim].num_preemptions + 1)
    assert {victim for _, victim in history} == {"x"}  # nothing else frees a block
    assert max(Counter(history).values()) <= 2  # threshold + 1
    assert policy.barrier_decisions >= 2


@pytest.mark.parametrize("settings", [{}, {"liveness_preemptions": 8},
                                      {"liveness_preemptions": 1}])
@pytest.mark.parametrize(("strategy", "favourite"), [
    ("preempt-evict", "d"), ("lifo", "d"), ("largest-first", "a"),
    ("least-computed-first", "d"),
])
def test_the_liveness_guard_is_bidkvs_alone(
    strategy: str, favourite: str, settings: dict[str, int]
) -> None:
    """The reference applied its liveness guard on the utility path only, and the brief
    names ``preempt-evict`` vLLM's LIFO victim: a peer strategy is its plain rule however
    often its favourite was preempted and whatever the threshold (the bundle's manifest
    sets 8 under ``vllm-hust-ext run``). The guard used to move ``preempt-evict`` off the
    tail after 8 preemptions of it in an epoch."""
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, strategy=strategy, **settings))
    controller = PolicyController(policy)
    sizes = {"a": 900, "b": 300, "c": 600, "d": 100}
    preemptions = dict.fromkeys(sizes, 0)
    for _ in range(20):
        cands = [cand(r, computed=sizes[r], preemptions=preemptions[r]) for r in sizes]
        victim = controller.select_victim(ctx(cands, requester="b"))
        assert victim == favourite
        preemptions[victim] += 1
    stats = policy.decision_stats()
    assert (stats.selections, stats.liveness_reselections, stats.barrier_decisions) == (20, 0, 0)
