"""BidKV under elastic KV: during a capacity shrink it prefers victims whose preemption
returns whole pages; without signals (or without host page counts) it is unchanged.

The signals come from a stand-in ``SignalsSource`` registered through the real
``kvcached_provider.signals`` module (kvcached itself cannot be installed here; this fakes
only the source of the numbers, not the policy's code path).
"""

from __future__ import annotations

import dataclasses

from bidkv_ext.config import BidKVConfig
from bidkv_ext.contract import CandidateFacts, PreemptionContextFacts
from bidkv_ext.selector import BidkvPreemptionPolicy
from kvcached_provider.signals import CapacitySignals, PageModel, signals_source
from tests.policy_helpers import cand, ctx


class Source:
    def __init__(self, in_shrink: bool) -> None:
        self.in_shrink = in_shrink

    def capacity_signals(self) -> CapacitySignals:
        return CapacitySignals(in_shrink=self.in_shrink, available_blocks=0,
                               memory_limit_bytes=None, effective_limit_bytes=None,
                               mapped_bytes=None, physical_free_pages=0, pools=())

    def page_model(self) -> PageModel:
        return PageModel(blocks_per_page=32, num_blocks=1024)


# "spread" is slightly cheaper to preempt, but its blocks share pages with others;
# "packed" fills two pages alone.
CANDS = [cand("spread", computed=960, output=10), cand("packed", computed=1024, output=10),
         cand("req", computed=3000, output=10)]
FACTS = PreemptionContextFacts(block_size=16, needed_blocks=1, facts={
    "spread": CandidateFacts(60, 0, 60, pages_released=0),
    "packed": CandidateFacts(64, 0, 64, pages_released=2),
    "req": CandidateFacts(188, 0, 188, pages_released=0),
})


def choose(facts: PreemptionContextFacts | None) -> str | None:
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, prefix_caching=False))
    return policy.select_victim_with_facts(ctx(CANDS, requester="req"), facts)


def test_no_signals_no_change() -> None:
    assert choose(FACTS) == "spread"


def test_shrink_prefers_whole_pages() -> None:
    with signals_source(Source(in_shrink=True)):
        assert choose(FACTS) == "packed"
    assert choose(FACTS) == "spread"  # the source is gone again


def test_signals_without_shrink_or_without_page_counts_change_nothing() -> None:
    with signals_source(Source(in_shrink=False)):
        assert choose(FACTS) == "spread"
    with signals_source(Source(in_shrink=True)):
        assert choose(None) == "spread"


def test_the_hosts_shrink_state_stands_for_the_signals() -> None:
    """A host that already read the capacity signals for this decision passes their shrink
    state in ``facts.in_shrink``; the policy uses it instead of reading them again (and
    reads them itself only when it is ``None``)."""
    told_shrinking = dataclasses.replace(FACTS, in_shrink=True)
    told_steady = dataclasses.replace(FACTS, in_shrink=False)
    assert choose(told_shrinking) == "packed"  # no source registered: the host's word
    with signals_source(Source(in_shrink=True)):
        assert choose(told_steady) == "spread"
        assert choose(FACTS) == "packed"  # None: the policy reads the source
