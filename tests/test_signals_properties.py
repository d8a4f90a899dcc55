"""Property tests: kvcached capacity signals, page models, and BidKV's use of them.

Guarded behaviour, each checked against an independent model written here:

- ``kvcached_provider.signals.pages_released`` over fake kvcached pools (drawn blocks per
  page, live-block maps, freed sets with repeats, blocks on pages holding no live block and
  blocks beyond the pool, in any order): the number of pages that had a live block and whose
  live blocks are all freed; repeats and order change nothing; a superset never releases
  fewer pages; bounded by the distinct freed live blocks and by the pages in use; freeing
  the blocks in kvcached empties exactly that many pages. The right KV group is asked;
  an unknown group, a pool that cannot report pages, or a failing read gives ``None``,
  never an exception.
- ``current_signals`` over several pools: pools in kvcached's ``(pool_name or "",
  group_id)`` order, shrinking when any pool shrinks, blocks and byte figures summed over
  the pools that report them (``None`` when none does), free physical pages the minimum
  (each pool measures the whole device), one physical-page query per pool per call and none
  from ``pages_released``; a failing read of any pool gives ``None``, never an exception.
- ``PageModel``: block ``b`` on page ``b // blocks_per_page``, the last page partial.
- the replay's ``ElasticPool`` (same page model, on vLLM's real ``BlockPool``): a page is
  physically free when all its blocks are free or reserved, so reserving free blocks never
  changes the count; the published signals agree.
- the vLLM host's ``pages_released`` fact (``PolicySchedulerMixin._host_facts``) from a
  page model: pages whose every block held by a running request (or the null block) is the
  candidate's alone; those page sets are disjoint between candidates.
- the ``bidkv`` strategy (strategies/utility.py module doc, "Elastic KV"): without a
  shrink, without signals, with a failing source, without page counts or with host facts
  off, page counts change no decision; during a shrink U is multiplied by
  ``1 + shrink_page_weight * pages_released``, so of two candidates equal in all else the
  one emptying more pages is preferred, and giving the chosen victim more pages keeps it.

Every test counts the situations its examples hit and asserts the interesting ones occur.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bidkv_ext.config import BidKVConfig
from bidkv_ext.contract import (
    CandidateFacts,
    PreemptionCandidate,
    PreemptionContext,
    PreemptionContextFacts,
)
from bidkv_ext.strategies.utility import UtilityParams, UtilityStrategy
from kvcached_provider import signals
from tests.conftest import HAVE_VLLM
from tests.fake_kvcached import FakeKVCacheManager, install
from tests.policy_helpers import PageModelSource
from tests.property_settings import REAL_SCHEDULER

BLOCK_BYTES = 1 << 16
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")


def _missing(tally: Counter[str], required: set[str]) -> list[str]:
    return sorted(required - {k for k, v in tally.items() if v > 0})


@contextmanager
def _fake_kvcached() -> Iterator[Any]:
    """Fake kvcached modules for one Hypothesis example (a fixture would span them all)."""
    with pytest.MonkeyPatch.context() as mp:
        signals.reset_cache()
        handle = install(mp)
        try:
            yield handle
        finally:
            handle.registry.pools.clear()
            signals.reset_cache()


def _raise(*_: object, **__: object) -> Any:
    raise RuntimeError("driver error")


# -- the independent page model -----------------------------------------------------------


def model_pages_released(live: set[int], freed: list[int], per_page: int) -> int:
    """Pages with at least one live block, all of whose live blocks are in ``freed``."""
    on_page: dict[int, set[int]] = {}
    for block in live:
        on_page.setdefault(block // per_page, set()).add(block)
    gone = set(freed)
    return sum(1 for blocks in on_page.values() if blocks <= gone)


@dataclass
class Layout:
    """One pool's geometry, its live blocks and a freed list (the call's argument)."""

    per_page: int
    pages: int
    live: set[int]
    freed: list[int]
    more: list[int]  # live blocks added to ``freed`` for the superset check
    kinds: set[str]

    @property
    def num_blocks(self) -> int:
        return self.per_page * self.pages


@st.composite
def layouts(draw: st.DrawFn, max_pages: int = 8) -> Layout:
    per_page = draw(st.integers(1, 8))
    pages = draw(st.integers(1, max_pages))
    live: set[int] = set()
    freed: list[int] = []
    kinds: set[str] = set()
    for page in range(pages):
        blocks = range(page * per_page, (page + 1) * per_page)
        mine = {b for b in blocks if draw(st.booleans())}
        live |= mine
        if not mine:
            # A page with no live block: freeing "its" blocks must not count it.
            strays = draw(st.lists(st.sampled_from(blocks), max_size=2))
            if strays:
                kinds.add("stray-on-empty-page")
            freed += strays
            continue
        how = draw(st.sampled_from(["none", "some", "all"]))
        chosen: list[int]
        if how == "all":
            chosen = sorted(mine)
        elif how == "some":
            chosen = draw(st.lists(st.sampled_from(sorted(mine)), unique=True))
        else:
            chosen = []
        if chosen and len(set(chosen)) < len(mine):
            kinds.add("partial-page")
        freed += chosen
    repeat = draw(st.booleans())
    if freed and repeat:
        repeats = draw(st.lists(st.sampled_from(freed), min_size=1, max_size=4))
        freed += repeats
        kinds.add("repeats")
    outside = draw(st.lists(st.integers(pages * per_page, (pages + 2) * per_page), max_size=2))
    if outside:
        kinds.add("beyond-pool")
    freed += outside
    freed = draw(st.permutations(freed))
    more = draw(st.lists(st.sampled_from(sorted(live)), max_size=6)) if live else []
    return Layout(per_page, pages, live, list(freed), more, kinds)


def _pool_for(layout: Layout, *, group_id: int = 0, pool_name: str | None = "block_pool"
              ) -> FakeKVCacheManager:
    """A fake pool whose live blocks are exactly ``layout.live`` (through alloc and free)."""
    pool = FakeKVCacheManager(num_blocks=layout.num_blocks, block_mem_size=BLOCK_BYTES,
                              page_size=layout.per_page * BLOCK_BYTES, group_id=group_id,
                              pool_name=pool_name)
    assert pool.alloc(layout.num_blocks) == list(range(layout.num_blocks))
    pool.free([b for b in range(layout.num_blocks) if b not in layout.live])
    return pool


# -- pages_released over one pool ---------------------------------------------------------

PAGES_TALLY: Counter[str] = Counter()


@settings(REAL_SCHEDULER, max_examples=250)
@given(layouts())
def _check_pages_released(layout: Layout) -> None:
    per = layout.per_page
    with _fake_kvcached() as kv:
        pool = kv.register(_pool_for(layout))
        got = signals.pages_released(layout.freed)
        expected = model_pages_released(layout.live, layout.freed, per)
        assert got == expected, (layout, got, expected)
        # Repeats and order change nothing.
        assert signals.pages_released(sorted(set(layout.freed), reverse=True)) == got
        assert signals.pages_released(iter(layout.freed + layout.freed)) == got
        # Bounds: each page needs a distinct freed live block, and must be in use.
        in_use = {b // per for b in layout.live}
        assert got <= len(set(layout.freed) & layout.live)
        assert got <= len(in_use) == pool.inuse_pages()
        # Monotone: freeing more never empties fewer pages.
        bigger = signals.pages_released(layout.freed + layout.more)
        assert bigger is not None and bigger >= got
        assert signals.pages_released(sorted(layout.live)) == len(in_use)
        assert signals.pages_released([]) == 0
        # The prediction is what kvcached then does: exactly that many pages empty.
        before = pool.inuse_pages()
        pool.free(layout.freed)
        assert pool.inuse_pages() == before - got
    PAGES_TALLY.update(layout.kinds)
    PAGES_TALLY["released-some" if got else "released-none"] += 1
    if layout.freed and not got and set(layout.freed) & layout.live:
        PAGES_TALLY["live-freed-but-no-page"] += 1
    if bigger > got:
        PAGES_TALLY["superset-releases-more"] += 1
    if per == 1:
        PAGES_TALLY["one-block-pages"] += 1
    if got >= 2:
        PAGES_TALLY["several-pages"] += 1


def test_pages_released_matches_the_page_model() -> None:
    """Over drawn page sizes, live maps and freed lists, ``pages_released`` counts exactly the
    pages whose live blocks are all freed (never an empty page, each block once), is
    insensitive to repeats and order, monotone, bounded, and agrees with what freeing does."""
    PAGES_TALLY.clear()
    _check_pages_released()
    required = {"stray-on-empty-page", "partial-page", "repeats", "beyond-pool",
                "released-some", "released-none", "live-freed-but-no-page",
                "superset-releases-more", "one-block-pages", "several-pages"}
    missing = _missing(PAGES_TALLY, required)
    assert not missing, f"never drawn: {missing}; tally={dict(PAGES_TALLY)}"


# -- pages_released over several pools: the group, and failures --------------------------

GROUP_TALLY: Counter[str] = Counter()
PAGE_FAILURES = ("none", "grouping", "occupancy", "unsupported", "registry")


@settings(REAL_SCHEDULER, max_examples=150)
@given(
    st.lists(layouts(max_pages=4), min_size=1, max_size=3),
    st.permutations(range(4)),
    st.integers(0, 3),
    st.sampled_from(PAGE_FAILURES),
)
def _check_pages_released_by_group(layouts_: list[Layout], groups: list[int], asked: int,
                                   failure: str) -> None:
    by_group = dict(zip(groups, layouts_, strict=False))
    with _fake_kvcached() as kv:
        pools: dict[int, FakeKVCacheManager] = {}
        for group, each in by_group.items():
            pools[group] = kv.register(_pool_for(each, group_id=group,
                                                 pool_name=f"pool{len(pools) % 2}"))
        layout = by_group.get(asked)
        freed = layout.freed if layout is not None else [0, 1, 2]
        target = pools.get(asked)
        if failure == "registry":
            registry = sys.modules["kvcached.pool_registry"]
            registry.get_registered_kv_cache_pools = _raise  # type: ignore[attr-defined]
        elif target is not None and failure == "grouping":
            target.page_allocator.group_indices_by_page = _raise  # type: ignore[method-assign]
        elif target is not None and failure == "occupancy":
            target.get_page_occupancy = _raise  # type: ignore[method-assign]
        elif target is not None and failure == "unsupported":
            target.page_allocator.group_indices_by_page = None  # type: ignore[assignment,method-assign]
        got = signals.pages_released(freed, group_id=asked)  # never raises
        # A failing grouping or occupancy read matters only when there is a block to group.
        broken = failure in ("registry", "unsupported") or (failure != "none" and bool(freed))
        if broken or layout is None:
            assert got is None
        else:
            assert layout is not None
            assert got == model_pages_released(layout.live, freed, layout.per_page)
            assert signals.pages_released([], group_id=asked) == 0
    GROUP_TALLY["unknown-group" if layout is None else f"failure-{failure}"] += 1
    if layout is not None and failure == "none" and len(by_group) > 1:
        GROUP_TALLY["right-group-among-several"] += 1
        others = [g for g in by_group if g != asked]
        if any(by_group[g].per_page != layout.per_page for g in others):
            GROUP_TALLY["groups-differ-in-page-size"] += 1


def test_pages_released_asks_the_right_group_and_never_raises() -> None:
    """With pools of several KV groups, each of its own page size, ``pages_released`` reads
    the asked group's pool; an unknown group, a pool without page bookkeeping or any failing
    read yields ``None`` (signals.py: "never raise"; ``None`` when "the pool cannot report
    page occupancy")."""
    GROUP_TALLY.clear()
    _check_pages_released_by_group()
    required = {"unknown-group", "right-group-among-several", "groups-differ-in-page-size",
                *(f"failure-{f}" for f in PAGE_FAILURES)}
    missing = _missing(GROUP_TALLY, required)
    assert not missing, f"never drawn: {missing}; tally={dict(GROUP_TALLY)}"


# -- current_signals over several pools ---------------------------------------------------


@dataclass
class PoolSpec:
    name: str | None
    group: int
    per_page: int
    pages: int
    used: int
    physical: int
    limit_pages: int | None  # None: no revisioned limit
    limit_extra: int  # bytes beyond whole page bundles
    reserved_pages: int
    probe: bool  # page allocator reports free physical pages
    state: bool  # manager reports its limit state
    failure: str  # "none", "available", "state", "physical"


@st.composite
def pool_specs(draw: st.DrawFn) -> PoolSpec:
    per_page = draw(st.integers(1, 4))
    pages = draw(st.integers(1, 6))
    limited = draw(st.booleans())
    return PoolSpec(
        name=draw(st.sampled_from([None, "", "block_pool", "a", "z"])),
        group=draw(st.integers(0, 2)),
        per_page=per_page,
        pages=pages,
        used=draw(st.integers(0, per_page * pages)),
        physical=draw(st.integers(0, 8)),
        limit_pages=draw(st.integers(0, pages + 1)) if limited else None,
        limit_extra=draw(st.integers(0, 999)),
        reserved_pages=draw(st.integers(0, 2)),
        probe=draw(st.booleans()),
        state=draw(st.booleans()),
        failure=draw(st.sampled_from(["none"] * 6 + ["available", "state", "physical"])),
    )


def _build_pool(spec: PoolSpec) -> FakeKVCacheManager:
    pool = FakeKVCacheManager(num_blocks=spec.per_page * spec.pages, block_mem_size=BLOCK_BYTES,
                              page_size=spec.per_page * BLOCK_BYTES, group_id=spec.group,
                              pool_name=spec.name)
    assert pool.alloc(spec.used) is not None
    if spec.limit_pages is not None:
        bundle = pool.page_size * pool.num_layers * pool.num_kv_buffers
        pool.set_memory_limit(spec.limit_pages * bundle + spec.limit_extra, revision=1)
    pool.reserved_pages = spec.reserved_pages
    pool.page_allocator.physical_free_pages = spec.physical
    if not spec.probe:
        pool.page_allocator.get_avail_physical_pages = None  # type: ignore[assignment]
    if not spec.state:
        pool.memory_limit_state = None  # type: ignore[assignment]
    return pool


def _inject(pool: FakeKVCacheManager, failure: str) -> None:
    if failure == "available":
        pool.available_size = _raise  # type: ignore[method-assign]
    elif failure == "state":
        pool.memory_limit_state = _raise  # type: ignore[method-assign]
    elif failure == "physical":
        pool.page_allocator.get_avail_physical_pages = _raise  # type: ignore[method-assign]


def _expected_pool(pool: FakeKVCacheManager, spec: PoolSpec) -> signals.PoolSignals:
    """What the spec says one pool reports, read through kvcached's own API."""
    state = pool.memory_limit_state() if spec.state else {}
    return signals.PoolSignals(
        pool_name=spec.name or "",
        group_id=spec.group,
        in_shrink=pool.in_shrink,
        available_blocks=pool.available_size(),
        target_num_blocks=pool.target_num_blocks,
        limit_bytes=state.get("limit_bytes"),
        effective_limit_bytes=state.get("effective_limit_bytes"),
        current_capacity_bytes=state.get("current_capacity_bytes"),
        mapped_bytes=state.get("mapped_bytes"),
        physical_free_pages=spec.physical if spec.probe else None,
    )


def _total(values: list[int | None]) -> int | None:
    total: int | None = None
    for value in values:
        if value is not None:
            total = value if total is None else total + value
    return total


AGGREGATE_TALLY: Counter[str] = Counter()


@settings(REAL_SCHEDULER, max_examples=250)
@given(st.lists(pool_specs(), min_size=1, max_size=4), st.booleans())
def _check_aggregation(specs: list[PoolSpec], fail_some: bool) -> None:
    with _fake_kvcached() as kv:
        pools = [kv.register(_build_pool(spec)) for spec in specs]
        expected = [_expected_pool(pool, spec) for pool, spec in zip(pools, specs, strict=True)]
        failing = fail_some and any(spec.failure != "none" for spec in specs)
        if failing:
            for pool, spec in zip(pools, specs, strict=True):
                _inject(pool, spec.failure)
        queries = [p.page_allocator.physical_queries for p in pools]
        got = signals.current_signals()  # never raises
        if failing:
            assert got is None
        else:
            assert got is not None
            # kvcached's order: (pool_name or "", group_id), stable for equal keys.
            order = sorted(range(len(specs)), key=lambda i: (specs[i].name or "", specs[i].group))
            assert got.pools == tuple(expected[i] for i in order)
            assert got.in_shrink == any(p.in_shrink for p in pools)
            assert got.available_blocks == sum(e.available_blocks for e in expected)
            assert got.memory_limit_bytes == _total([e.limit_bytes for e in expected])
            assert got.effective_limit_bytes == _total(
                [e.effective_limit_bytes for e in expected])
            assert got.mapped_bytes == _total([e.mapped_bytes for e in expected])
            present = [s.physical for s in specs if s.probe]
            assert got.physical_free_pages == (min(present) if present else None)
            # One driver query per pool per call, and none from pages_released.
            after = [p.page_allocator.physical_queries for p in pools]
            assert after == [q + (1 if s.probe else 0)
                             for q, s in zip(queries, specs, strict=True)]
            signals.pages_released(range(4), group_id=specs[0].group)
            assert [p.page_allocator.physical_queries for p in pools] == after
    if failing:
        AGGREGATE_TALLY["failing-pool"] += 1
        return
    assert got is not None
    shrinking = [p.in_shrink for p in pools]
    if any(shrinking) and not all(shrinking):
        AGGREGATE_TALLY["some-pools-shrinking"] += 1
    if all(shrinking):
        AGGREGATE_TALLY["all-shrinking"] += 1
    if not any(shrinking):
        AGGREGATE_TALLY["none-shrinking"] += 1
    limits = [e.limit_bytes for e in expected]
    if any(v is None for v in limits) and any(v is not None for v in limits):
        AGGREGATE_TALLY["limits-partly-reported"] += 1
    if all(v is None for v in limits):
        AGGREGATE_TALLY["no-limit-reported"] += 1
    probes = [s.probe for s in specs]
    if any(probes) and not all(probes):
        AGGREGATE_TALLY["physical-partly-reported"] += 1
    if not any(probes):
        AGGREGATE_TALLY["physical-never-reported"] += 1
    present = [s.physical for s in specs if s.probe]
    if len(set(present)) > 1:
        AGGREGATE_TALLY["physical-differs"] += 1
    if len(specs) > 1 and [p.pool_name for p in got.pools] != [s.name or "" for s in specs]:
        AGGREGATE_TALLY["reordered"] += 1
    if len(specs) >= 3:
        AGGREGATE_TALLY["three-or-more-pools"] += 1


def test_current_signals_aggregate_pools_as_documented() -> None:
    """Over drawn sets of pools (names, groups, geometry, usage, limits that shrink or not,
    missing limit state or physical probe), ``current_signals`` reports every pool in
    kvcached's order, sums blocks and bytes, shrinks when any pool does, takes the minimum
    of free physical pages, queries each pool's driver once; a failing pool gives ``None``."""
    AGGREGATE_TALLY.clear()
    _check_aggregation()
    required = {"failing-pool", "some-pools-shrinking", "all-shrinking", "none-shrinking",
                "limits-partly-reported", "no-limit-reported", "physical-partly-reported",
                "physical-never-reported", "physical-differs", "reordered",
                "three-or-more-pools"}
    missing = _missing(AGGREGATE_TALLY, required)
    assert not missing, f"never drawn: {missing}; tally={dict(AGGREGATE_TALLY)}"


# -- PageModel geometry -------------------------------------------------------------------


@settings(REAL_SCHEDULER, max_examples=100)
@given(st.integers(1, 40), st.integers(1, 200))
def test_page_model_geometry(per_page: int, num_blocks: int) -> None:
    """``PageModel``: block ``b`` on page ``b // blocks_per_page``; ``page_size`` counts the
    blocks of each page (the last one partial), zero beyond the last page."""
    model = signals.PageModel(per_page, num_blocks)
    pages = Counter(b // per_page for b in range(num_blocks))
    assert all(model.page_of(b) == b // per_page for b in range(num_blocks))
    assert {p: model.page_size(p) for p in pages} == dict(pages)
    assert model.page_size(len(pages)) == 0
    assert sum(model.page_size(p) for p in range(len(pages) + 2)) == num_blocks


# -- the replay's elastic pool ------------------------------------------------------------

ELASTIC_TALLY: Counter[str] = Counter()


@settings(REAL_SCHEDULER, max_examples=120)
@given(st.integers(2, 40), st.integers(1, 8), st.data())
def _check_elastic(num_blocks: int, per_page: int, data: st.DataObject) -> None:
    from vllm.v1.core.block_pool import BlockPool

    from bidkv_ext.replay.capacity import PAGE_BYTES, ElasticPool, parse_capacity_schedule

    usable = num_blocks - 1
    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=16)
    held = pool.get_new_blocks(usable)
    free_ids = data.draw(st.sets(st.integers(1, usable)), label="free")
    if data.draw(st.booleans(), label="free the last page"):
        last = (num_blocks - 1) // per_page * per_page
        free_ids |= set(range(max(last, 1), num_blocks))
    pool.free_blocks([b for b in held if b.block_id in free_ids])
    target = data.draw(st.integers(1, usable), label="target")
    schedule = parse_capacity_schedule([{"t": 0, "blocks": target}], "drawn", usable)
    elastic = ElasticPool(pool, schedule, blocks_per_page=per_page)
    # Independent model: a page is free when all its blocks are free (block 0 never is).
    pages = -(-num_blocks // per_page)
    expected = sum(
        1 for p in range(pages)
        if all(b in free_ids for b in range(p * per_page, min((p + 1) * per_page, num_blocks)))
    )
    assert elastic.physical_free_pages() == expected
    elastic.before_step(0.0)  # the reserve takes free blocks; pages stay free-or-reserved
    wanted = usable - target
    assert elastic.reserved == min(wanted, len(free_ids))
    assert elastic.physical_free_pages() == expected
    got = elastic.capacity_signals()
    assert got.physical_free_pages == expected
    assert got.mapped_bytes == (pages - expected) * PAGE_BYTES
    assert got.in_shrink == (len(free_ids) < wanted)
    assert got.available_blocks == len(free_ids) - elastic.reserved
    assert elastic.page_model() == signals.PageModel(per_page, num_blocks)
    elastic.finish()
    assert pool.get_num_free_blocks() == len(free_ids)
    assert elastic.physical_free_pages() == expected
    ELASTIC_TALLY["free-pages" if expected else "no-free-page"] += 1
    if elastic.reserved == 0 and min(wanted, len(free_ids)) > 0:
        ELASTIC_TALLY["reserve-taken-and-released"] += 1
    if got.in_shrink:
        ELASTIC_TALLY["shrink-pending"] += 1
    if num_blocks % per_page and all(
            b in free_ids for b in range((pages - 1) * per_page, num_blocks)) and pages > 1:
        ELASTIC_TALLY["free-partial-last-page"] += 1


@needs_vllm
def test_elastic_pool_free_pages_match_the_page_model() -> None:
    """On vLLM's real block pool with drawn free blocks and shrink targets, the elastic pool's
    physically free pages are the pages whose blocks are all free or reserved (the partial
    last page included), reserving changes nothing, and the signals agree (capacity.py)."""
    ELASTIC_TALLY.clear()
    _check_elastic()
    required = {"free-pages", "no-free-page", "reserve-taken-and-released", "shrink-pending",
                "free-partial-last-page"}
    missing = _missing(ELASTIC_TALLY, required)
    assert not missing, f"never drawn: {missing}; tally={dict(ELASTIC_TALLY)}"


# -- the vLLM host's pages_released fact --------------------------------------------------


@dataclass
class Holding:
    num_blocks: int
    per_page: int
    held: dict[str, list[list[int]]]  # request -> block ids per KV group (0 = null block)
    pinned: set[int]  # blocks with one more holder outside the running list
    hashed: set[int]


@st.composite
def holdings(draw: st.DrawFn) -> Holding:
    num_blocks = draw(st.integers(2, 48))
    per_page = draw(st.integers(1, 8))
    ids = st.integers(1, num_blocks - 1)
    count = draw(st.integers(1, 5))
    held: dict[str, list[list[int]]] = {}
    for i in range(count):
        blocks = draw(st.lists(ids, unique=True, max_size=12))
        if draw(st.booleans()):
            blocks = [0, *blocks]  # a sliding-window null block in the list
        cut = draw(st.integers(0, len(blocks)))
        groups = [blocks[:cut], blocks[cut:]] if draw(st.booleans()) else [blocks]
        held[f"r{i}"] = groups
    pinned = draw(st.sets(ids, max_size=3))
    hashed = draw(st.sets(ids, max_size=10))
    return Holding(num_blocks, per_page, held, pinned, hashed)


def _model_host_facts(h: Holding) -> dict[str, tuple[int, int, int, int]]:
    """(exclusive, cached, total, pages released) per request, from the holdings."""
    holders: Counter[int] = Counter()
    for groups in h.held.values():
        for group in groups:
            holders.update(b for b in group if b != 0)
    refs = {b: n + (1 if b in h.pinned else 0) for b, n in holders.items()}
    per = h.per_page
    out = {}
    for rid, groups in h.held.items():
        mine = [b for group in groups for b in group if b != 0]
        exclusive = {b for b in mine if refs[b] == 1}
        cached = len(exclusive & h.hashed)
        released = 0
        for page in {b // per for b in exclusive}:
            on_page = {b for b in holders if b // per == page}
            if page != 0 and on_page <= exclusive:  # page 0 holds the null block
                released += 1
        out[rid] = (len(exclusive), cached, len(mine), released)
    return out


def _stub_scheduler(h: Holding) -> Any:
    refs: Counter[int] = Counter()
    for groups in h.held.values():
        for group in groups:
            refs.update(group)
    blocks = {b: SimpleNamespace(block_id=b, is_null=b == 0,
                                 ref_cnt=refs[b] + (1 if b in h.pinned else 0),
                                 block_hash=f"h{b}" if b in h.hashed else None)
              for b in range(h.num_blocks)}
    lists = {rid: SimpleNamespace(blocks=tuple([blocks[b] for b in g] for g in groups))
             for rid, groups in h.held.items()}
    # The coordinator counts no shortfall: this property is about pages (the requester's
    # shortfall is checked on the real coordinator in tests/test_host_facts_layouts.py).
    manager = SimpleNamespace(get_blocks=lists.__getitem__,
                              block_pool=SimpleNamespace(get_num_free_blocks=lambda: 0),
                              coordinator=SimpleNamespace(get_num_blocks_to_allocate=lambda **_: 0),
                              empty_kv_cache_blocks=SimpleNamespace(blocks=((),)))
    return SimpleNamespace(kv_cache_manager=manager, block_size=16, num_lookahead_tokens=0,
                           max_model_len=1 << 20,
                           running=[SimpleNamespace(request_id=rid) for rid in h.held])


HOST_TALLY: Counter[str] = Counter()


@settings(REAL_SCHEDULER, max_examples=200)
@given(holdings())
def _check_host_facts(h: Holding) -> None:
    from bidkv_ext.hosts.vllm.scheduler import PolicySchedulerMixin

    stub = _stub_scheduler(h)
    request = SimpleNamespace(request_id="r0", num_computed_tokens=0, num_prompt_tokens=0,
                              num_tokens=0)

    def facts_of() -> PreemptionContextFacts:
        return PolicySchedulerMixin._host_facts(stub, request, 1)  # type: ignore[arg-type]

    plain = facts_of()
    assert all(f.pages_released is None for f in plain.facts.values())
    with signals.signals_source(PageModelSource(signals.PageModel(h.per_page, h.num_blocks))):
        facts = facts_of()
    expected = _model_host_facts(h)
    got = {rid: (f.exclusive_blocks, f.cached_blocks, f.total_blocks, f.pages_released)
           for rid, f in facts.facts.items()}
    assert got == expected, (h, got, expected)
    # A released page holds only the candidate's blocks: no page is released by two.
    used_pages = {b // h.per_page for groups in h.held.values() for g in groups for b in g
                  if b != 0}
    assert sum(r for *_, r in expected.values()) <= len(used_pages - {0})
    released = [r for *_, r in expected.values()]
    HOST_TALLY["some-released" if any(released) else "none-released"] += 1
    holders = Counter(b for groups in h.held.values() for g in groups for b in set(g) if b)
    if any(n > 1 for n in holders.values()):
        HOST_TALLY["shared-blocks"] += 1
    if h.pinned & set(holders):
        HOST_TALLY["pinned-held-block"] += 1
    if any(b // h.per_page == 0 for b in holders) and h.per_page > 1:
        HOST_TALLY["blocks-on-null-page"] += 1
    if any(0 in g for groups in h.held.values() for g in groups):
        HOST_TALLY["null-in-list"] += 1
    if sum(released) >= 2:
        HOST_TALLY["several-pages"] += 1
    if any(exc and not r for exc, _, _, r in expected.values()):
        HOST_TALLY["exclusive-but-no-page"] += 1


@needs_vllm
def test_host_pages_released_matches_the_model() -> None:
    """The host's per-candidate facts under a page model: exclusive, cached and total blocks
    as contract.py defines them, and ``pages_released`` = pages whose every block held by a
    running request is the candidate's alone, never the null block's page
    (hosts/vllm/scheduler.py ``_host_facts``); ``None`` without a page model."""
    HOST_TALLY.clear()
    _check_host_facts()
    required = {"some-released", "none-released", "shared-blocks", "pinned-held-block",
                "blocks-on-null-page", "null-in-list", "several-pages", "exclusive-but-no-page"}
    missing = _missing(HOST_TALLY, required)
    assert not missing, f"never drawn: {missing}; tally={dict(HOST_TALLY)}"


# -- the bidkv strategy under capacity signals --------------------------------------------


class _Signals:
    """A stand-in signals source (the replay's elastic pool plays this role for real)."""

    def __init__(self, in_shrink: bool, fail: bool = False) -> None:
        self.in_shrink, self.fail = in_shrink, fail

    def capacity_signals(self) -> signals.CapacitySignals | None:
        if self.fail:
            raise RuntimeError("host bookkeeping is gone")
        return signals.CapacitySignals(
            in_shrink=self.in_shrink, available_blocks=0, memory_limit_bytes=None,
            effective_limit_bytes=None, mapped_bytes=None, physical_free_pages=0, pools=())

    def page_model(self) -> signals.PageModel | None:
        return signals.PageModel(blocks_per_page=8, num_blocks=4096)


@dataclass
class Decision:
    candidates: tuple[PreemptionCandidate, ...]
    context: PreemptionContext
    facts: PreemptionContextFacts
    config: BidKVConfig


def _candidate(draw: st.DrawFn, rid: str) -> PreemptionCandidate:
    prompt = draw(st.integers(1, 4000))
    output = draw(st.integers(0, 300))
    computed = draw(st.integers(0, prompt + output))
    return PreemptionCandidate(rid, 0, 0.0, prompt, output, computed,
                               draw(st.integers(0, 3)), draw(st.integers(0, 2048)))


def _fact(draw: st.DrawFn, c: PreemptionCandidate) -> CandidateFacts:
    blocks = -(-c.num_computed_tokens // 16)
    total = draw(st.integers(0, blocks + 2))
    exclusive = draw(st.integers(0, total))
    cached = draw(st.integers(0, exclusive))
    pages = draw(st.one_of(st.none(), st.integers(0, 4)))
    return CandidateFacts(exclusive, cached, total, pages)


def _config(draw: st.DrawFn, *, min_weight: float = 0.0) -> BidKVConfig:
    return BidKVConfig(
        enabled=True,
        prefix_caching=draw(st.booleans()),
        shrink_page_weight=draw(st.sampled_from([min_weight, 0.05, 0.5, 1.0, 4.0, 10.0])),
        cascade_gain_ratio=draw(st.sampled_from([1.0, 1.25, 3.0])),
        cache_survival=draw(st.sampled_from([0.0, 0.5])),
        preempt_weight=draw(st.sampled_from([0.0, 0.5])),
        base_cost=draw(st.sampled_from([0.0, 64.0])),
    )


@st.composite
def decisions(draw: st.DrawFn, *, twins: bool = False) -> Decision:
    count = draw(st.integers(1, 6))
    cands = [_candidate(draw, f"c{i}") for i in range(count)]
    facts = {c.request_id: _fact(draw, c) for c in cands}
    requester = draw(st.sampled_from([c.request_id for c in cands]))
    if twins:
        model = _candidate(draw, "twin")
        fact = _fact(draw, model)
        few = draw(st.integers(0, 3))
        many = draw(st.integers(few + 1, 6))
        lesser, greater = replace(model, request_id="lesser"), replace(model, request_id="more")
        facts["lesser"] = replace(fact, pages_released=few or draw(st.sampled_from([0, None])))
        facts["more"] = replace(fact, pages_released=many)
        for twin in draw(st.permutations([lesser, greater])):
            cands.insert(draw(st.integers(0, len(cands))), twin)
    ids = [c.request_id for c in cands]
    builtin = draw(st.one_of(st.none(), st.sampled_from(ids)))
    context = PreemptionContext(tuple(cands), "fcfs", requester, 0.9, 1.0, builtin)
    needed = draw(st.integers(0, 40))
    return Decision(tuple(cands), context,
                    PreemptionContextFacts(16, needed, facts),
                    _config(draw, min_weight=0.05 if twins else 0.0))


def _choose(d: Decision, facts: PreemptionContextFacts | None = None,
            source: object | None = None, config: BidKVConfig | None = None
            ) -> tuple[str | None, int]:
    strategy = UtilityStrategy(UtilityParams.from_config(config or d.config))
    if source is None:
        best = strategy.choose(d.candidates, d.context, facts or d.facts)
    else:
        with signals.signals_source(source):  # type: ignore[arg-type]
            best = strategy.choose(d.candidates, d.context, facts or d.facts)
    return (best.request_id if best is not None else None), strategy.last_index


def _with_pages(facts: PreemptionContextFacts, pages: Callable[[str, CandidateFacts], int | None]
                ) -> PreemptionContextFacts:
    return replace(facts, facts={rid: replace(f, pages_released=pages(rid, f))
                                 for rid, f in facts.facts.items()})


NEUTRAL_TALLY: Counter[str] = Counter()


@settings(REAL_SCHEDULER, max_examples=250)
@given(decisions())
def _check_neutral(d: Decision) -> None:
    base = _choose(d)
    stripped = _with_pages(d.facts, lambda rid, f: None)
    zeros = _with_pages(d.facts, lambda rid, f: 0)
    assert _choose(d, stripped) == base  # no signals: page counts are ignored
    assert _choose(d, source=_Signals(in_shrink=False)) == base
    assert _choose(d, source=_Signals(in_shrink=True, fail=True)) == base
    assert _choose(d, stripped, source=_Signals(in_shrink=True)) == base
    assert _choose(d, zeros, source=_Signals(in_shrink=True)) == base
    off = d.config.model_copy(update={"use_host_facts": False})
    assert (_choose(d, source=_Signals(in_shrink=True), config=off)
            == _choose(d, stripped, config=off))
    shrinking = _choose(d, source=_Signals(in_shrink=True))
    if shrinking != base:
        NEUTRAL_TALLY["shrink-changes-decision"] += 1
    if any(f.pages_released for f in d.facts.facts.values()):
        NEUTRAL_TALLY["pages-present"] += 1
    NEUTRAL_TALLY["abstain" if base[0] is None else "victim"] += 1


def test_page_counts_matter_only_during_a_shrink() -> None:
    """utility.py's "Elastic KV" paragraph: with no signals, signals without a shrink, a
    failing source, no (or zero) page counts, or host facts off, the decision (victim and
    its index) is the one made without page counts; during a shrink they can change it."""
    NEUTRAL_TALLY.clear()
    _check_neutral()
    required = {"shrink-changes-decision", "pages-present", "abstain", "victim"}
    missing = _missing(NEUTRAL_TALLY, required)
    assert not missing, f"never drawn: {missing}; tally={dict(NEUTRAL_TALLY)}"


TWIN_TALLY: Counter[str] = Counter()


@settings(REAL_SCHEDULER, max_examples=250)
@given(decisions(twins=True))
def _check_twins(d: Decision) -> None:
    shrinking = _choose(d, source=_Signals(in_shrink=True))[0]
    assert shrinking != "lesser", d
    plain = _choose(d)[0]
    TWIN_TALLY[f"shrink-{shrinking if shrinking in ('more', None) else 'other'}"] += 1
    if plain == "lesser":
        TWIN_TALLY["lesser-wins-without-shrink"] += 1
        if shrinking == "more":
            TWIN_TALLY["shrink-flips-the-tie"] += 1
    if d.context.builtin_victim_id == "lesser":
        TWIN_TALLY["lesser-is-builtin"] += 1


def test_more_whole_pages_preferred_when_all_else_is_equal() -> None:
    """Of two candidates equal in every field and fact but ``pages_released``, during a
    shrink (shrink_page_weight > 0) the one emptying fewer pages is never the victim: U is
    multiplied by ``1 + shrink_page_weight * pages_released`` (utility.py), strictly more for
    the other twin; the built-in victim's tie privilege does not save it."""
    TWIN_TALLY.clear()
    _check_twins()
    required = {"shrink-more", "shrink-other", "lesser-wins-without-shrink",
                "shrink-flips-the-tie", "lesser-is-builtin"}
    missing = _missing(TWIN_TALLY, required)
    assert not missing, f"never drawn: {missing}; tally={dict(TWIN_TALLY)}"


MONOTONE_TALLY: Counter[str] = Counter()


@settings(REAL_SCHEDULER, max_examples=250)
@given(decisions(), st.integers(1, 5))
def _check_monotone(d: Decision, extra: int) -> None:
    shrink = _Signals(in_shrink=True)
    victim, index = _choose(d, source=shrink)
    if victim is None:
        MONOTONE_TALLY["abstain"] += 1
        return
    more = _with_pages(d.facts, lambda rid, f: (f.pages_released or 0) + extra
                       if rid == victim else f.pages_released)
    assert _choose(d, more, source=shrink) == (victim, index)
    MONOTONE_TALLY["checked"] += 1
    if victim == d.context.requesting_request_id:
        MONOTONE_TALLY["victim-is-requester"] += 1
    if not d.facts.facts[victim].pages_released:
        MONOTONE_TALLY["victim-had-no-pages"] += 1


def test_more_pages_for_the_victim_keep_it_chosen() -> None:
    """During a shrink, giving the chosen victim more released pages (all else equal) raises
    only its U (utility.py), so the decision stays the same, also when the cascade guard
    chose the requester."""
    MONOTONE_TALLY.clear()
    _check_monotone()
    required = {"abstain", "checked", "victim-is-requester", "victim-had-no-pages"}
    missing = _missing(MONOTONE_TALLY, required)
    assert not missing, f"never drawn: {missing}; tally={dict(MONOTONE_TALLY)}"
