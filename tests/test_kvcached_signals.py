"""``kvcached_provider.signals``: capacity signals present with kvcached pools, empty without.

kvcached cannot be installed here, so these tests fake it at the module boundary: fake
``kvcached``, ``kvcached.control``, ``kvcached.pool_registry`` and ``kvcached._C`` modules
(``tests/fake_kvcached.py``, behaviour from the kvcached spec) are put into ``sys.modules``.
Guarded: ``None`` when kvcached is absent or has no pools (and kvcached is never imported);
the aggregated limit / shrink / available-block / physical-page figures (each pool's own
requested limit and capacity, sums over pools, shrinking when any pool shrinks, pools in
kvcached's ``(pool_name, group_id)`` order); ``pages_released`` counting only pages that a
set of freed blocks empties (never a page with no live block, each block once); failures
reading a pool never raise; one registered signals source at a time, withdrawn only by
itself, and a failing source's page model reads as ``None``; the CPU host passes the
shrink state on even when a pool cannot report page occupancy.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvcached_provider import signals
from tests.fake_kvcached import FakeKvcached, FakeKVCacheManager, install


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    signals.reset_cache()
    yield
    signals.reset_cache()


@pytest.fixture
def kv(monkeypatch: pytest.MonkeyPatch) -> FakeKvcached:
    return install(monkeypatch)


def test_absent_kvcached_gives_none_and_imports_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "kvcached" or m.startswith("kvcached.")]:
        monkeypatch.delitem(sys.modules, name)
    assert signals.current_signals() is None
    assert signals.pages_released([1, 2, 3]) is None
    assert "kvcached" not in sys.modules


def test_no_registered_pool_gives_none(kv: FakeKvcached) -> None:
    assert signals.current_signals() is None
    assert signals.pages_released([0]) is None


def test_signals_report_limit_shrink_and_capacity(kv: FakeKvcached) -> None:
    # 64 blocks, 16 per page -> 4 pages; 4 layers x 2 buffers x 1 MiB = 8 MiB per page bundle.
    pool = kv.register(FakeKVCacheManager(num_blocks=64, physical_free_pages=3))
    got = signals.current_signals()
    assert got is not None
    assert got.in_shrink is False
    assert got.available_blocks == 3 * 16  # capped by 3 free physical pages
    assert got.physical_free_pages == 3
    assert got.memory_limit_bytes is None  # no revisioned limit yet

    assert pool.alloc(40) is not None  # 3 pages in use
    pool.set_memory_limit(2 * (8 << 20), revision=1)  # 2 pages: must shrink
    got = signals.current_signals()
    assert got is not None
    assert got.in_shrink is True
    assert got.memory_limit_bytes == 16 << 20
    assert got.effective_limit_bytes == 16 << 20
    assert got.available_blocks == 3 * 16 - 40  # only holes in mapped pages
    assert got.pools[0].target_num_blocks == 32
    assert got.mapped_bytes == 3 * (8 << 20)


def test_signals_over_pools(kv: FakeKvcached) -> None:
    """Blocks add up over pools; free physical pages do not: each pool measures the whole
    device, so the aggregate is what every pool can still map, not the sum."""
    kv.register(FakeKVCacheManager(group_id=1, physical_free_pages=5))
    kv.register(FakeKVCacheManager(group_id=0, physical_free_pages=2))
    got = signals.current_signals()
    assert got is not None
    assert [p.group_id for p in got.pools] == [0, 1]  # sorted as kvcached sorts them
    assert got.physical_free_pages == 2
    assert got.available_blocks == (2 + 4) * 16


def test_pages_released_counts_only_emptied_pages(kv: FakeKvcached) -> None:
    pool = kv.register(FakeKVCacheManager(num_blocks=64))
    blocks = pool.alloc(40)  # pages 0, 1 full; page 2 holds blocks 32..39
    assert blocks == list(range(40))
    assert signals.pages_released(range(16)) == 1  # page 0 empties
    assert signals.pages_released(range(8, 24)) == 0  # half of two pages: nothing returns
    assert signals.pages_released(range(32, 40)) == 1  # all live blocks of page 2
    assert signals.pages_released(range(40)) == 3
    assert signals.pages_released([]) == 0
    assert signals.pages_released(range(16), group_id=1) is None  # no such group


def test_broken_pool_never_raises(kv: FakeKvcached, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = kv.register(FakeKVCacheManager())

    def boom(*_: object) -> int:
        raise RuntimeError("driver error")

    monkeypatch.setattr(pool, "available_size", boom)
    monkeypatch.setattr(pool, "get_page_occupancy", boom)
    assert signals.current_signals() is None
    assert signals.pages_released([1]) is None


def test_registry_lookup_follows_module_removal(
    kv: FakeKvcached, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv.register(FakeKVCacheManager())
    assert signals.current_signals() is not None
    monkeypatch.delitem(sys.modules, "kvcached.pool_registry")
    assert signals.current_signals() is None


def test_pool_figures_are_each_pools_own_and_add_up(kv: FakeKvcached) -> None:
    """A limit that is not a whole number of page bundles: the pool reports the requested
    limit and the rounded-down effective one apart; limits, effective limits and mapped
    bytes add up over pools, and the instance is shrinking while any one pool is."""
    bundle = 8 << 20  # 1 MiB page x 4 layers x 2 buffers
    shrinking = kv.register(FakeKVCacheManager(group_id=0, num_blocks=64))
    steady = kv.register(FakeKVCacheManager(group_id=1, num_blocks=64))
    assert shrinking.alloc(40) is not None  # 3 pages in use
    assert steady.alloc(8) is not None  # 1 page in use
    shrinking.set_memory_limit(2 * bundle + 5, revision=1)  # below its 3 pages: deferred
    steady.set_memory_limit(3 * bundle + 7, revision=1)  # above its 1 page: applied
    got = signals.current_signals()
    assert got is not None
    first, second = got.pools
    assert (first.limit_bytes, first.effective_limit_bytes) == (2 * bundle + 5, 2 * bundle)
    assert (second.limit_bytes, second.effective_limit_bytes) == (3 * bundle + 7, 3 * bundle)
    assert first.current_capacity_bytes == 4 * bundle  # unchanged until the shrink completes
    assert second.current_capacity_bytes == 3 * bundle
    assert (first.in_shrink, second.in_shrink) == (True, False)
    assert got.in_shrink is True
    assert got.memory_limit_bytes == 5 * bundle + 12
    assert got.effective_limit_bytes == 5 * bundle
    assert got.mapped_bytes == (3 + 1) * bundle


def test_pages_released_counts_neither_empty_pages_nor_repeated_blocks(kv: FakeKvcached) -> None:
    pool = kv.register(FakeKVCacheManager(num_blocks=64))
    assert pool.alloc(40) is not None  # pages 0 and 1 full, page 2 holds 32..39, page 3 none
    assert signals.pages_released(range(48, 64)) == 0  # page 3 holds no live block
    assert signals.pages_released([*range(32, 36)] * 2) == 0  # 4 of page 2's 8, each once
    assert signals.pages_released([*range(32, 40), 32]) == 1


class _Source:
    def __init__(self, model: signals.PageModel | None = None, fail: bool = False) -> None:
        self.model, self.fail = model, fail

    def capacity_signals(self) -> signals.CapacitySignals | None:
        return None

    def page_model(self) -> signals.PageModel | None:
        if self.fail:
            raise KeyError("host bookkeeping is gone")
        return self.model


def test_one_signals_source_at_a_time() -> None:
    first, second = _Source(signals.PageModel(4, 64)), _Source(signals.PageModel(8, 64))
    with signals.signals_source(first):
        with pytest.raises(RuntimeError, match="already registered"):
            signals.register_source(second)
        signals.register_source(first)  # the same source again: fine
        signals.unregister_source(second)  # not the registered one: a no-op
        assert signals.current_page_model() == signals.PageModel(4, 64)
    assert signals.current_page_model() is None
    with signals.signals_source(_Source(fail=True)):
        assert signals.current_page_model() is None  # a failing source never raises


# A KV-cache coordinator that counts no block to allocate (these tests read pages, not the
# requester's shortfall, which tests/test_host_facts_layouts.py checks on the real one).
_NO_SHORTFALL: dict[str, Any] = {
    "coordinator": SimpleNamespace(get_num_blocks_to_allocate=lambda **_: 0),
    "empty_kv_cache_blocks": SimpleNamespace(blocks=((),)),
}
_REQUEST = {"num_computed_tokens": 0, "num_prompt_tokens": 0, "num_tokens": 0}


def _stub_host(held: dict[str, list[int]], pinned: set[int], hashed: set[int],
               prefix_caching: bool) -> Any:
    """What ``PolicySchedulerMixin._host_facts`` reads of a vLLM scheduler: the running
    requests' blocks (one KV group; block 0 is vLLM's null block), and a coordinator that
    counts no shortfall."""
    refs: Counter[int] = Counter(b for blocks in held.values() for b in blocks)
    blocks = {b: SimpleNamespace(block_id=b, is_null=b == 0,
                                 ref_cnt=refs[b] + (1 if b in pinned else 0),
                                 block_hash=f"h{b}" if b in hashed else None)
              for b in range(64)}
    lists = {rid: SimpleNamespace(blocks=([blocks[b] for b in ids],))
             for rid, ids in held.items()}
    manager = SimpleNamespace(get_blocks=lists.__getitem__,
                              block_pool=SimpleNamespace(get_num_free_blocks=lambda: 0),
                              **_NO_SHORTFALL)
    return SimpleNamespace(
        kv_cache_manager=manager, block_size=16, num_lookahead_tokens=0, max_model_len=1 << 20,
        running=[SimpleNamespace(request_id=rid, num_computed_tokens=0) for rid in held],
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching))


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_the_host_reads_pages_released_from_real_kvcached_while_it_shrinks(
    kv: FakeKvcached, prefix_caching: bool
) -> None:
    """Without a registered page model (real kvcached, no replay), the CPU host fills each
    candidate's ``pages_released`` from kvcached's own page occupancy, while kvcached
    shrinks (the only time the policy weighs pages): the pages that the candidate's
    exclusive blocks of KV group 0 empty. With prefix caching its cached blocks do not
    count: they go to the evictable set and return memory only when evicted. Not
    shrinking, or without kvcached pools, it stays unknown (``None``)."""
    from bidkv_ext.hosts.vllm.scheduler import PolicySchedulerMixin

    pool = kv.register(FakeKVCacheManager(num_blocks=64))  # 16 blocks per page
    held = {"a": list(range(16, 32)),  # all of page 1
            "b": [*range(32, 40), 40],  # half of page 2; block 40 is shared with c
            "c": [40, 48, 49]}  # page 3's only live blocks, and the shared 40
    pool.allocated.update(b for blocks in held.values() for b in blocks)
    host = _stub_host(held, pinned=set(), hashed={16}, prefix_caching=prefix_caching)
    request = SimpleNamespace(request_id="a", **_REQUEST)

    def pages() -> dict[str, int | None]:
        facts = PolicySchedulerMixin._host_facts(host, request, 0)  # type: ignore[arg-type]
        return {rid: f.pages_released for rid, f in facts.facts.items()}

    assert pages() == {"a": None, "b": None, "c": None}  # not shrinking
    pool.in_shrink = True
    # a empties page 1, unless its cached block 16 stays (prefix caching); b leaves its
    # shared block 40 on page 2; c's blocks 48, 49 are page 3's only live ones.
    assert pages() == {"a": 0 if prefix_caching else 1, "b": 0, "c": 1}
    kv.registry.pools.clear()
    assert pages() == {"a": None, "b": None, "c": None}  # no kvcached pool


def test_one_decision_queries_kvcached_once(kv: FakeKvcached) -> None:
    """Under real kvcached the host reads the capacity signals for ``pages_released`` and
    passes their shrink state on (``facts.in_shrink``), so the policy does not query the
    driver a second time in the same decision: one physical-page query per pool, shrinking
    or not."""
    from bidkv_ext.config import BidKVConfig
    from bidkv_ext.hosts.vllm.scheduler import PolicySchedulerMixin
    from bidkv_ext.selector import BidkvPreemptionPolicy
    from tests.policy_helpers import cand, ctx

    pool = kv.register(FakeKVCacheManager(num_blocks=64))
    held = {"a": list(range(16, 32)), "b": [*range(32, 40)]}
    pool.allocated.update(b for blocks in held.values() for b in blocks)
    host = _stub_host(held, pinned=set(), hashed=set(), prefix_caching=False)
    request = SimpleNamespace(request_id="b", **_REQUEST)
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, prefix_caching=False))
    cands = [cand("a", computed=256, output=10), cand("b", computed=128, output=10)]
    for shrinking in (False, True):
        pool.in_shrink = shrinking
        before = pool.page_allocator.physical_queries
        facts = PolicySchedulerMixin._host_facts(host, request, 0)  # type: ignore[arg-type]
        assert facts.in_shrink is shrinking
        assert policy.select_victim_with_facts(ctx(cands, requester="b"), facts) in ("a", "b")
        assert pool.page_allocator.physical_queries - before == 1
    kv.registry.pools.clear()
    assert PolicySchedulerMixin._host_facts(
        host, request, 0).in_shrink is False  # type: ignore[arg-type]


def test_pages_released_reads_odd_ids_and_occupancy_as_no_facts(
    kv: FakeKvcached, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The observer never breaks victim selection: a block id that is not an integer, or an
    occupancy kvcached reports as something other than a count, gives ``None`` (no facts),
    not an exception out of the policy's scoring."""
    pool = kv.register(FakeKVCacheManager(num_blocks=64))
    assert pool.alloc(16) is not None
    assert signals.pages_released(range(16)) == 1
    assert signals.pages_released(["block-3"]) is None  # type: ignore[list-item]
    monkeypatch.setattr(pool, "get_page_occupancy", lambda pages: {p: "full" for p in pages})
    assert signals.pages_released(range(16)) is None


@pytest.mark.parametrize("shrinking", [True, False])
def test_shrink_state_survives_a_pool_without_page_occupancy(
    monkeypatch: pytest.MonkeyPatch, shrinking: bool
) -> None:
    """The host hands kvcached's shrink state to the policy (``facts.in_shrink``), so the
    policy does not query the driver again. A pool that shrinks but cannot report page
    occupancy (no ``get_page_occupancy``) leaves every ``pages_released`` unknown; the
    shrink state must still say ``True``, or the policy, which trusts a host-supplied
    value, would score the decision as if memory were not being reclaimed."""
    from bidkv_ext.hosts.vllm.scheduler import PolicySchedulerMixin

    kv = install(monkeypatch)
    pool = kv.register(FakeKVCacheManager(num_blocks=64))
    held = {"a": list(range(16, 32)), "b": list(range(32, 40))}
    pool.allocated.update(b for ids in held.values() for b in ids)
    pool.in_shrink = shrinking
    # A kvcached that cannot report page occupancy.
    monkeypatch.setattr(pool, "get_page_occupancy", None)
    request = SimpleNamespace(request_id="b", **_REQUEST)
    host = _stub_host(held, pinned=set(), hashed=set(), prefix_caching=False)

    facts = PolicySchedulerMixin._host_facts(host, request, 0)  # type: ignore[arg-type]

    assert {rid: f.pages_released for rid, f in facts.facts.items()} == {"a": None, "b": None}
    assert facts.in_shrink is shrinking
