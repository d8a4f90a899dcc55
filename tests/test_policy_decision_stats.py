"""The policy's decision counts and DEBUG tags (qualification.md section 4's "policy log-tag
counts; the sum of the r values the policy logged").

Guarded behaviour: every decision is counted once under exactly one kind (a named victim,
an abstention by the strategy, a barrier), so that with the controller's counters they add
up; a victim named by the cascade guard or after the liveness guard set the favourite
aside is counted as such; ``useful_blocks`` adds each named victim's r =
min(blocks freed, blocks needed), computed here independently of the strategy; a
strategy that scores no r reports None; each decision logs one tagged line at DEBUG and
nothing above it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bidkv_ext.config import BidKVConfig
from bidkv_ext.contract import PreemptionCandidate, PreemptionContext, candidate_index
from bidkv_ext.controller import PolicyController
from bidkv_ext.selector import BidkvPreemptionPolicy, DecisionStats
from tests.policy_helpers import cand, ctx

LOGGER = "bidkv_ext.selector"


def _policy(**settings: object) -> BidkvPreemptionPolicy:
    return BidkvPreemptionPolicy(BidKVConfig(enabled=True, **settings))  # type: ignore[arg-type]


def _tags(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage().split()[0] for r in records if r.name == LOGGER]


def test_a_fresh_policy_has_counted_nothing() -> None:
    assert _policy().decision_stats() == DecisionStats(
        selections=0, cascade_selections=0, liveness_reselections=0, strategy_abstentions=0,
        barrier_decisions=0, liveness_epochs=0, useful_blocks=0)
    assert _policy(strategy="least-computed-first").decision_stats().useful_blocks is None


def test_a_plain_selection_counts_its_r_and_logs_select(caplog: pytest.LogCaptureFixture) -> None:
    # A decoding requester needs one block: r = 1 whoever is chosen.
    policy = _policy()
    caplog.set_level(logging.DEBUG, LOGGER)
    cands = [cand("a", computed=320, output=5), cand("b", computed=64, output=5),
             cand("req", computed=101, prompt=100, output=2)]
    assert policy.select_victim(ctx(cands, requester="req")) == "b"
    stats = policy.decision_stats()
    assert (stats.selections, stats.useful_blocks, stats.cascade_selections) == (1, 1, 0)
    assert _tags(caplog.records) == ["BIDKV_SELECT"]
    assert caplog.records[-1].levelno == logging.DEBUG
    assert "victim=b requester=req r=1" in caplog.records[-1].getMessage()


def test_the_cascade_guard_choice_is_counted_with_the_requesters_r(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The prefilling requester needs 128 blocks (a 2,048-token chunk); "mid" frees 113, so
    # a cascade would follow and the guard names the requester, which frees 94 (1,500 / 16).
    cands = [cand("mid", computed=1800, output=5, prompt=1795),
             cand("req", computed=1500, output=0, prompt=6000)]
    caplog.set_level(logging.DEBUG, LOGGER)
    policy = _policy(prefix_caching=False, cascade_gain_ratio=1.25, prefill_chunk_tokens=2048)
    assert policy.select_victim(ctx(cands, requester="req")) == "req"
    stats = policy.decision_stats()
    assert (stats.selections, stats.cascade_selections, stats.useful_blocks) == (1, 1, 94)
    assert _tags(caplog.records) == ["BIDKV_CASCADE"]
    # Without the guard the best victim is named, with its own r (113 of the 128 needed).
    plain = _policy(prefix_caching=False, cascade_gain_ratio=1.0, prefill_chunk_tokens=2048)
    assert plain.select_victim(ctx(cands, requester="req")) == "mid"
    assert (plain.cascade_selections, plain.useful_blocks) == (0, 113)


def test_a_victim_named_after_the_liveness_guard_is_a_reselection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # "small" is the favourite but has spent its budget of 1: the next best is named.
    cands = [cand("small", computed=32, output=3, preemptions=1),
             cand("big", computed=640, output=3), cand("req", computed=101, output=3)]
    caplog.set_level(logging.DEBUG, LOGGER)
    policy = _policy(liveness_preemptions=1)
    victim = policy.select_victim(ctx(cands, requester="req"))
    assert victim in {"big", "req"}
    stats = policy.decision_stats()
    assert (stats.selections, stats.liveness_reselections, stats.barrier_decisions) == (1, 1, 0)
    assert _tags(caplog.records) == ["BIDKV_RESELECT"]


def test_a_barrier_is_not_an_abstention_of_the_strategy(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cands = [cand(x, computed=160, output=3, preemptions=1) for x in "abc"]
    policy = _policy(liveness_preemptions=1)
    controller = PolicyController(policy)
    caplog.set_level(logging.DEBUG, LOGGER)
    assert controller.select_victim(ctx(cands, requester="a")) == "c"  # the host's own
    stats = policy.decision_stats()
    assert (stats.barrier_decisions, stats.liveness_epochs, stats.strategy_abstentions,
            stats.selections) == (1, 1, 0, 0)
    assert _tags(caplog.records) == ["BIDKV_BARRIER"]
    assert controller.export_stats()["abstentions"] == 1


def test_a_strategy_with_nobody_to_name_abstains(caplog: pytest.LogCaptureFixture) -> None:
    cands = [cand(x, computed=0, output=0) for x in "ab"]  # nobody frees a block
    policy = _policy()
    caplog.set_level(logging.DEBUG, LOGGER)
    assert policy.select_victim(ctx(cands, requester="a")) is None
    stats = policy.decision_stats()
    assert (stats.strategy_abstentions, stats.barrier_decisions, stats.selections) == (1, 0, 0)
    assert _tags(caplog.records) == ["BIDKV_ABSTAIN"]


def test_an_abstention_onto_a_spent_host_victim_is_a_barrier_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Nobody frees a block, and the host's victim (the tail) has spent its budget: the
    # abstention is the epoch's barrier decision, counted once, as a barrier.
    cands = [cand("a", computed=0), cand("b", computed=0, preemptions=1)]
    policy = _policy(liveness_preemptions=1)
    caplog.set_level(logging.DEBUG, LOGGER)
    assert policy.select_victim(ctx(cands, requester="a")) is None
    stats = policy.decision_stats()
    assert (stats.barrier_decisions, stats.strategy_abstentions) == (1, 0)
    assert _tags(caplog.records) == ["BIDKV_BARRIER"]


def test_decisions_log_nothing_above_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    policy = _policy(liveness_preemptions=1)
    cands = [cand("a", computed=160, output=3, preemptions=1), cand("b", computed=32)]
    for _ in range(3):
        policy.select_victim(ctx(cands, requester="a"))
    policy.select_victim(ctx([cand("z", computed=0)], requester="z"))
    assert policy.selections + policy.strategy_abstentions + policy.barrier_decisions == 4
    assert [r for r in caplog.records if r.name == LOGGER] == []


def test_other_strategies_are_counted_without_r() -> None:
    policy = _policy(strategy="least-computed-first")
    policy.select_victim(ctx([cand("a", computed=320), cand("b", computed=64)], requester="a"))
    stats = policy.decision_stats()
    assert (stats.selections, stats.useful_blocks, stats.cascade_selections) == (1, None, 0)


def _expected_r(victim: PreemptionCandidate, context: PreemptionContext, chunk: int) -> int:
    """r of ``victim`` from the contract's fields alone (docs/policy.md): blocks it holds,
    capped at the requester's need (one block decoding, else one prefill chunk)."""
    requester = context.candidates[candidate_index(context.candidates,
                                                   context.requesting_request_id)]
    pending = requester.num_prompt_tokens + requester.num_output_tokens \
        - requester.num_computed_tokens
    need = 1 if pending <= 1 else max(1, math.ceil(min(pending, chunk) / 16))
    return min(math.ceil(victim.num_computed_tokens / 16), need)


_CANDIDATE = st.builds(
    lambda computed, prompt, output, preempted: cand(
        "", computed=computed, prompt=prompt, output=output, preemptions=preempted),
    st.one_of(st.just(0), st.integers(0, 5000)), st.integers(1, 5000), st.integers(0, 300),
    st.integers(0, 3))


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(st.lists(st.lists(_CANDIDATE, min_size=1, max_size=70), min_size=1, max_size=8),
       st.integers(0, 3), st.sampled_from([1.0, 1.25, 4.0]))
def test_counts_add_up_and_r_is_each_victims_own(
    rounds: list[list[PreemptionCandidate]], liveness: int, cascade: float
) -> None:
    """Over any sequence of decisions (through the controller, up to 70 candidates so both
    the Python and the array path run): named + abstained + barriers = the controller's
    calls; named = its selections; useful_blocks = the sum of the named victims' r; a
    cascade choice is always the requester."""
    policy = _policy(liveness_preemptions=liveness, cascade_gain_ratio=cascade,
                     prefill_chunk_tokens=2048)
    controller = PolicyController(policy)
    total_r = 0
    for n, raw in enumerate(rounds):
        cands = [replace(c, request_id=f"r{n}-{i}") for i, c in enumerate(raw)]
        context = ctx(cands, requester=cands[len(cands) // 2].request_id)
        named, cascades = policy.selections, policy.cascade_selections
        answer = controller.select_victim(context)
        if policy.selections > named:
            total_r += _expected_r(cands[candidate_index(cands, answer)], context, 2048)
            if policy.cascade_selections > cascades:
                assert answer == context.requesting_request_id
    stats, counted = policy.decision_stats(), controller.export_stats()
    assert stats.useful_blocks == total_r
    assert stats.selections == counted["selections"]
    assert stats.strategy_abstentions + stats.barrier_decisions == counted["abstentions"]
    assert counted["calls"] == len(rounds)
    assert stats.barrier_decisions == stats.liveness_epochs
