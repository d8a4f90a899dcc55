"""In-process capacity signals from kvcached's KV pools, for the BidKV policy.

The scheduler (EngineCore) process holds kvcached's ``KVCacheManager`` objects; the vLLM
integration registers each in ``kvcached.pool_registry``. This module reads them:

- :func:`current_signals` -- memory limit, shrink state, available blocks and free physical
  pages, aggregated over the registered pools, or ``None`` when kvcached is not active here.
- :func:`pages_released` -- how many whole pages a set of block ids would empty if they
  were freed (a page leaves the pool only when all its blocks are free). That is what a
  shrink needs; it overstates memory handed straight back to the GPU, since kvcached keeps
  up to ``KVCACHED_MAX_RESERVED_PAGES`` emptied pages mapped for reuse and, under async
  scheduling, releases them a step later.
- :func:`register_source` / :func:`signals_source` -- a host without kvcached (the
  replay's simulated elastic pool) publishes its own :class:`CapacitySignals` and, through
  :func:`current_page_model`, how its block ids map to pages. A registered source takes
  precedence over kvcached pools: registering one is an explicit statement by the host.

Both are cheap and never raise. kvcached is **never imported** here: when kvcached is active
its autopatch has already imported it (that is how the pools got registered), and when it
has not, no pool can exist in this process. So the only per-call cost in the absent case is
one ``sys.modules`` lookup; once found, the registry module is cached.

Costs when present: ``available_size()`` is ~0.5 us; the free-physical-pages figure is one
driver memory query (~6 us) per pool, paid only by :func:`current_signals`. Call these per
preemption decision, not per scheduler step.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "CapacitySignals",
    "PageModel",
    "PoolSignals",
    "SignalsSource",
    "current_page_model",
    "current_signals",
    "pages_released",
    "register_source",
    "reset_cache",
    "signals_source",
    "unregister_source",
]

_REGISTRY_MODULE = "kvcached.pool_registry"
_registry: ModuleType | None = None


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """One registered pool (one KV cache group)."""

    pool_name: str
    group_id: int
    in_shrink: bool
    available_blocks: int
    target_num_blocks: int | None
    limit_bytes: int | None
    effective_limit_bytes: int | None
    current_capacity_bytes: int | None
    mapped_bytes: int | None
    physical_free_pages: int | None


@dataclass(frozen=True, slots=True)
class CapacitySignals:
    """kvcached's capacity state in this process, summed over its pools.

    ``in_shrink`` is true when any pool is shrinking towards a lower limit: only holes in
    mapped pages are allocatable then, and a preemption helps the shrink complete only if it
    empties whole pages. Byte and page figures are ``None`` when no pool reports them.
    """

    in_shrink: bool
    available_blocks: int
    memory_limit_bytes: int | None
    effective_limit_bytes: int | None
    mapped_bytes: int | None
    physical_free_pages: int | None
    pools: tuple[PoolSignals, ...]


@dataclass(frozen=True, slots=True)
class PageModel:
    """How a source's block ids map to physical pages: block ``b`` lies on page
    ``b // blocks_per_page``; ids run from 0 to ``num_blocks - 1`` (so the last page may
    be partial). Block 0 is the host's null block: always held, its page never frees."""

    blocks_per_page: int
    num_blocks: int

    def page_of(self, block_id: int) -> int:
        return block_id // self.blocks_per_page

    def page_size(self, page: int) -> int:
        """Blocks on ``page`` (the last page holds the remainder)."""
        start = page * self.blocks_per_page
        return max(0, min(self.blocks_per_page, self.num_blocks - start))


@runtime_checkable
class SignalsSource(Protocol):
    """A host-side publisher of capacity signals (e.g. the replay's elastic pool)."""

    def capacity_signals(self) -> CapacitySignals | None: ...

    def page_model(self) -> PageModel | None: ...


_source: SignalsSource | None = None


def register_source(source: SignalsSource) -> None:
    """Publish ``source``'s signals in this process. One source at a time."""
    global _source
    if _source is not None and _source is not source:
        raise RuntimeError("a capacity signals source is already registered in this process")
    _source = source


def unregister_source(source: SignalsSource) -> None:
    """Withdraw ``source`` (a no-op when another source, or none, is registered)."""
    global _source
    if _source is source:
        _source = None


@contextmanager
def signals_source(source: SignalsSource) -> Iterator[SignalsSource]:
    """Register ``source`` for the duration of the block, also on exceptions."""
    register_source(source)
    try:
        yield source
    finally:
        unregister_source(source)


def current_page_model() -> PageModel | None:
    """The registered source's page model; ``None`` without a source (one global read)."""
    source = _source
    if source is None:
        return None
    try:
        return source.page_model()
    except Exception:  # an observer must never break victim selection
        return None


def reset_cache() -> None:
    """Forget the cached registry module (tests swap fake kvcached modules in and out)."""
    global _registry
    _registry = None


def _registry_module() -> ModuleType | None:
    global _registry
    if _registry is None:
        _registry = sys.modules.get(_REGISTRY_MODULE)
    elif sys.modules.get(_REGISTRY_MODULE) is not _registry:
        # The module was removed or replaced (reload, tests): follow sys.modules.
        _registry = sys.modules.get(_REGISTRY_MODULE)
    return _registry


def _managers() -> list[Any]:
    registry = _registry_module()
    if registry is None:
        return []
    getter = getattr(registry, "get_registered_kv_cache_pools", None)
    if getter is None:
        return []
    pairs = getter()
    managers = [pair[0] for pair in pairs]
    managers.sort(key=lambda m: (str(getattr(m, "pool_name", "") or ""), _int(m, "group_id")))
    return managers


def _int(obj: Any, name: str, default: int = 0) -> int:
    value = getattr(obj, name, None)
    return default if value is None else int(value)


def _opt_int(mapping: Mapping[str, Any], key: str) -> int | None:
    value = mapping.get(key)
    return None if value is None else int(value)


def _physical_free_pages(manager: Any) -> int | None:
    allocator = getattr(manager, "page_allocator", None)
    probe = getattr(allocator, "get_avail_physical_pages", None)
    return None if probe is None else int(probe())


def _pool_signals(manager: Any) -> PoolSignals:
    state_fn = getattr(manager, "memory_limit_state", None)
    state: Mapping[str, Any] = state_fn() if state_fn is not None else {}
    target = getattr(manager, "target_num_blocks", None)
    return PoolSignals(
        pool_name=str(getattr(manager, "pool_name", "") or ""),
        group_id=_int(manager, "group_id"),
        in_shrink=bool(getattr(manager, "in_shrink", False)),
        available_blocks=int(manager.available_size()),
        target_num_blocks=None if target is None else int(target),
        limit_bytes=_opt_int(state, "limit_bytes"),
        effective_limit_bytes=_opt_int(state, "effective_limit_bytes"),
        current_capacity_bytes=_opt_int(state, "current_capacity_bytes"),
        mapped_bytes=_opt_int(state, "mapped_bytes"),
        physical_free_pages=_physical_free_pages(manager),
    )


def _sum(values: Iterable[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _min(values: Iterable[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def current_signals() -> CapacitySignals | None:
    """kvcached's capacity state, or ``None`` when no kvcached pool lives in this process.

    Never raises: a failure reading a live pool yields ``None`` so that the caller falls
    back to its behaviour without signals. A registered source (see
    :func:`register_source`) answers instead of kvcached.
    """
    source = _source
    if source is not None:
        try:
            return source.capacity_signals()
        except Exception:  # the scheduler must never fail because of an observer
            return None
    try:
        managers = _managers()
        if not managers:
            return None
        pools = tuple(_pool_signals(m) for m in managers)
    except Exception:  # the scheduler must never fail because of an observer
        return None
    return CapacitySignals(
        in_shrink=any(p.in_shrink for p in pools),
        available_blocks=sum(p.available_blocks for p in pools),
        memory_limit_bytes=_sum(p.limit_bytes for p in pools),
        effective_limit_bytes=_sum(p.effective_limit_bytes for p in pools),
        mapped_bytes=_sum(p.mapped_bytes for p in pools),
        # Each pool measures the whole device (in its own page bundles): summing would
        # count the same memory once per pool, so the aggregate is what every pool can map.
        physical_free_pages=_min(p.physical_free_pages for p in pools),
        pools=pools,
    )


def pages_released(block_ids: Iterable[int], group_id: int = 0) -> int | None:
    """Whole pages that freeing ``block_ids`` (of KV group ``group_id``) would empty.

    Pass the blocks a preemption would actually return to kvcached: the victim's blocks with
    no other holder. Every id must be live: kvcached reports only how many blocks of a page
    are in use, not which, so a page counts as emptied when the number of ids passed on it
    reaches its count, whoever holds them. (With prefix caching on, full cached blocks go to
    vLLM's evictable set first, so they return memory only when evicted.) Block ids are
    kvcached's, which the vLLM integration keeps equal to vLLM's ``KVCacheBlock.block_id``.
    ``None`` when kvcached is not active here or the pool cannot report page occupancy.
    """
    try:
        ids = [int(b) for b in block_ids]
        manager = next((m for m in _managers() if _int(m, "group_id") == group_id), None)
        if manager is None:
            return None
        allocator = getattr(manager, "page_allocator", None)
        group = getattr(allocator, "group_indices_by_page", None)
        occupancy_fn = getattr(manager, "get_page_occupancy", None)
        if group is None or occupancy_fn is None:
            return None
        if not ids:
            return 0
        by_page: Mapping[int, list[int]] = group(ids, int(manager.block_mem_size))
        occupancy: Mapping[int, int] = occupancy_fn(list(by_page))
        return _emptied(by_page, occupancy)
    except Exception:  # never let an observer break victim selection (kvcached's answers
        return None    # included: an odd page map or occupancy value reads as "no facts")


def _emptied(by_page: Mapping[int, list[int]], occupancy: Mapping[int, int]) -> int:
    released = 0
    for page_id, members in by_page.items():
        live = int(occupancy.get(page_id, 0))
        # A page empties when every live block on it is among the freed ones.
        if 0 < live <= len(set(members)):
            released += 1
    return released
