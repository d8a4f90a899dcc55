"""A fake of kvcached's Python API, at the module boundary, for ``kvcached_provider`` tests.

kvcached cannot be installed here (sdists only; the build needs a CUDA/ROCm torch and the
GPU toolkit), so tests insert these fakes into ``sys.modules`` as ``kvcached``,
``kvcached.control``, ``kvcached.pool_registry`` and ``kvcached._C``. Their behaviour
follows ``shared/specs/kvcached-notes.md`` (sections 2.1-2.3) and kvcached 0.1.6 as read
in its sdist: page/block bookkeeping, the shrink rules, the per-pool revision rules
(stale / idempotent / conflict / apply, with ``deferred`` when in-use pages exceed the
target), the reserve of mapped free pages (a page emptied by ``free`` stays mapped there,
up to ``min(total pages, KVCACHED_MAX_RESERVED_PAGES)``, 10 by default; a page mapped
afresh comes out of it; a shrink that cannot give up enough unmapped pages unmaps the
whole reserve, a deferred one only when it completes; with ``min_reserved_pages``, kvcached's
prealloc thread topping the reserve up to that minimum at start-up and whenever a page taken
for an allocation leaves it below, seen as settled), with ``defer_physical_release`` (vLLM's
async scheduling) an emptied page retired, still mapped and in use, until the engine releases
its batch's marker, a retired page reused when allocated again, and no shrink completing
while pages are retired, the allocation order (partly used
pages best-fit, equals taken in kvcached's avail-page order, the most recently touched
last, then fresh pages, bounded by the device's free pages plus the reserved ones, as
``available_size`` counts them), block 0 kept as the null block when asked,
quarantined pages making ``set_memory_limit`` raise ``QuarantinedResizeError`` (a
``ValueError``) without taking the revision (the notes name that outcome ``rejected``; the provider
takes either form, and a ``rejected`` answer is tested verbatim), ``mapped_bytes``
counting in-use plus reserved pages, the instance-level split, status precedence, result
keys, the pool's ``ipc_name`` and, as under vLLM's synchronous scheduling, a no-op
``_lock`` that every mutating method takes. Written from those facts; it shares no code
with kvcached. tests/test_kvcached_real.py compares it with a real pool, step by step, on
a CUDA machine, and tests/test_kvcached_fidelity.py with that comparison's recording
(kvcached 0.1.6 on an H200): the reserve was found there, where the fake had unmapped
every emptied page at once.

The control record helpers write real 24-byte records (three native int64) into a
directory standing in for ``/dev/shm``, like kvcached at start-up and ``kvctl limit``.
"""

from __future__ import annotations

import os
import struct
import sys
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

_STATUS_ORDER = ("conflict", "stale", "rejected", "deferred", "applied")
_REASONS = {
    "deferred": "inuse_capacity_above_limit",
    "conflict": "revision_reused_with_different_limit",
    "rejected": "quarantined_pages_prevent_resize",
}


class QuarantinedResizeError(ValueError):
    """kvcached.errors.QuarantinedResizeError: capacity cannot change while pages are
    quarantined."""


class NoOpLock:
    """kvcached.locks.NoOpLock: what a pool holds unless vLLM schedules asynchronously."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return True

    def release(self) -> None:
        pass

    def __enter__(self) -> bool:
        return True

    def __exit__(self, *exc: object) -> None:
        pass


def _synchronized(method: Any) -> Any:
    """kvcached's ``@synchronized``: the pool's lock, read at each call."""
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class FakePageAllocator:
    def __init__(self, manager: FakeKVCacheManager, physical_free_pages: int) -> None:
        self.manager = manager
        self.physical_free_pages = physical_free_pages
        self.physical_queries = 0

    def group_indices_by_page(self, indices: Iterable[int], block_mem_size: int
                              ) -> dict[int, list[int]]:
        per_page = self.manager.page_size // block_mem_size
        grouped: dict[int, list[int]] = {}
        for index in indices:
            grouped.setdefault(index // per_page, []).append(index)
        return grouped

    def get_avail_physical_pages(self) -> int:
        self.physical_queries += 1
        return self.physical_free_pages


class FakeKVCacheManager:
    """One pool: ``num_blocks`` blocks of ``block_mem_size`` bytes per layer and buffer."""

    def __init__(self, *, num_blocks: int = 64, block_mem_size: int = 1 << 16,
                 page_size: int = 1 << 20, num_layers: int = 4, num_kv_buffers: int = 2,
                 group_id: int = 0, pool_name: str | None = "block_pool",
                 physical_free_pages: int = 1000, reserve_null_block: bool = False,
                 max_reserved_pages: int = 10, min_reserved_pages: int = 0,
                 defer_physical_release: bool = False) -> None:
        self.block_mem_size = block_mem_size
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_buffers = num_kv_buffers
        self.group_id = group_id
        self.pool_name = pool_name
        self.mem_size = num_blocks * block_mem_size  # virtual bytes per layer and buffer
        self.blocks_per_page = page_size // block_mem_size
        self.capacity_pages = self.mem_size // page_size
        self.allocated: set[int] = set()
        self.in_shrink = False
        self.target_num_blocks: int | None = None
        self.quarantined = False
        self.reserved_pages = 0  # pre-mapped pages kvcached keeps beside the in-use ones
        # A freed page stays mapped in that reserve while it holds fewer than this many
        # (kvcached: min(total pages, KVCACHED_MAX_RESERVED_PAGES), default 10).
        self.max_reserved_pages = min(self.capacity_pages, max_reserved_pages)
        # kvcached's prealloc thread (KVCACHED_PAGE_PREALLOC_ENABLED, on by default) keeps at
        # least this many mapped (KVCACHED_MIN_RESERVED_PAGES, 5); 0 models it switched off.
        self.min_reserved_pages = min_reserved_pages
        # Under vLLM's async scheduling a page emptied by ``free`` is only retired: still
        # mapped and counted in use (its blocks allocatable again) until the engine reports
        # the worker batch that may read it done (``release_retired_pages_through``).
        self.defer_physical_release = defer_physical_release
        self.retired: list[tuple[int, list[int]]] = []  # (epoch, pages), oldest first
        self._epoch = 0
        # kvcached names the pool's segment after KVCACHED_IPC_NAME (read at its import).
        self.ipc_name = os.environ.get("KVCACHED_IPC_NAME") or "kvcached_fake"
        self._lock: Any = NoOpLock()
        self.page_allocator = FakePageAllocator(self, physical_free_pages)
        self._revision = -1
        self._limit: int | None = None
        self._effective: int | None = None
        # kvcached's avail_pages order: the pages with free blocks it may allocate from
        # (partly used, or retired), the most recently touched last. Its best fit takes the
        # first of equals in this order.
        self._recency: dict[int, None] = {}
        if reserve_null_block:  # vLLM asks for it: block 0 is never handed out
            self.allocated.add(0)
            self._recency[0] = None
        self._prealloc()  # the thread's first fill, at start-up

    # -- block bookkeeping
    def _page(self, block: int) -> int:
        return block // self.blocks_per_page

    def _holding_pages(self) -> set[int]:
        return {self._page(b) for b in self.allocated}

    def _retired_pages(self) -> set[int]:
        return {page for _, pages in self.retired for page in pages}

    def inuse_pages(self) -> int:
        """Pages the allocator counts in use: those holding blocks, and retired ones."""
        return len(self._holding_pages() | self._retired_pages())

    def _fresh_pages(self) -> int:
        """Pages a new allocation may map: virtual room, bounded by the device's free pages
        plus the pre-mapped (reserved) ones."""
        return max(0, min(self.capacity_pages - self.inuse_pages(),
                          self.page_allocator.physical_free_pages + self.reserved_pages))

    def available_size(self) -> int:
        holes = self.inuse_pages() * self.blocks_per_page - len(self.allocated)
        if self.in_shrink:
            return holes  # only holes in mapped pages while shrinking
        return holes + self._fresh_pages() * self.blocks_per_page

    def _free_on(self, page: int) -> list[int]:
        first = page * self.blocks_per_page
        return [b for b in range(first, first + self.blocks_per_page) if b not in self.allocated]

    @_synchronized
    def alloc(self, n: int) -> list[int] | None:
        """Partly used pages first, best fit (the smallest page holding the whole run, else
        the emptiest; among equals the first in kvcached's avail-page order, see
        ``_recency``), then fresh pages in page order, as kvcached's allocator does."""
        if self.available_size() < n:
            return None
        taken: list[int] = []
        in_use = self._holding_pages() | self._retired_pages()
        partly = {p: free for p in in_use if (free := self._free_on(p))}
        # Pages a test marked allocated directly (not through alloc) come after, by id.
        order = [p for p in self._recency if p in partly]
        order += sorted(p for p in partly if p not in self._recency)
        while len(taken) < n and order:
            need = n - len(taken)
            fits = [p for p in order if len(partly[p]) >= need]
            # min and max keep the first of equals: the order decides ties.
            page = (min(fits, key=lambda p: len(partly[p])) if fits
                    else max(order, key=lambda p: len(partly[p])))
            order.remove(page)
            taken += partly[page][:need]
            self._recency.pop(page, None)
            if len(partly[page]) > need:
                self._recency[page] = None  # still has free blocks: touched last
        fresh = 0  # pages mapped afresh: each one not in use gives blocks
        last_fresh: int | None = None
        for page in range(self.capacity_pages):
            if len(taken) == n:
                break
            if page not in in_use:
                got = self._free_on(page)[:n - len(taken)]
                taken += got
                fresh += 1
                if len(got) < self.blocks_per_page:
                    last_fresh = page
        self.allocated.update(taken)
        if last_fresh is not None and self._free_on(last_fresh):
            self._recency[last_fresh] = None  # the last fresh page, left partly used
        if self.retired:
            # A retired page given blocks again is in use again: its release is cancelled.
            reused = self._holding_pages()
            self.retired = [(epoch, kept) for epoch, pages in self.retired
                            if (kept := [page for page in pages if page not in reused])]
        # A page mapped afresh comes out of the reserve while it has one.
        self.reserved_pages -= min(self.reserved_pages, fresh)
        if fresh:
            # Taking a page that leaves the reserve below its minimum (or finding it empty)
            # wakes the prealloc thread; modelled as settled, as a test sees it after waiting.
            self._prealloc()
        return taken

    def _prealloc(self) -> None:
        """Top the reserve up to its minimum from the unmapped free pages the device can
        back (kvcached's prealloc worker; it never takes a reserve above the minimum)."""
        unmapped = self.capacity_pages - self.inuse_pages() - self.reserved_pages
        want = self.min_reserved_pages - self.reserved_pages
        self.reserved_pages += max(0, min(want, unmapped, self.page_allocator.physical_free_pages))

    @_synchronized
    def free(self, ids: Iterable[int]) -> None:
        blocks = list(ids)
        before = self._holding_pages()
        self.allocated.difference_update(blocks)
        holding = self._holding_pages()
        emptied = sorted(before - holding)  # a retired page holds no block
        if self.defer_physical_release and emptied:
            self._epoch += 1
            self.retired.append((self._epoch, emptied))
        else:
            self._unmap(len(emptied))
        # Each page touched moves to the end of the avail order (kvcached visits them in its
        # C++ grouping's order, which the C++ library decides; here, first seen); one
        # emptied leaves it unless it is retired.
        for page in dict.fromkeys(self._page(b) for b in blocks):
            self._recency.pop(page, None)
            if page in holding or (self.defer_physical_release and page in emptied):
                self._recency[page] = None
        self._maybe_finish_shrink()

    def _unmap(self, emptied: int) -> None:
        if self.reserved_pages < self.max_reserved_pages:
            # An emptied page stays mapped in the reserve until that is full.
            self.reserved_pages = min(self.max_reserved_pages, self.reserved_pages + emptied)

    def _maybe_finish_shrink(self) -> None:
        # Not while pages are retired: they stay mapped for a batch still in flight.
        if self.retired or not self.in_shrink or self.target_num_blocks is None:
            return
        target_pages = self.target_num_blocks // self.blocks_per_page
        if self.inuse_pages() <= target_pages:  # enough whole pages are empty
            self._shrink_to(target_pages)
            self.in_shrink = False
            self.target_num_blocks = None

    @_synchronized
    def capture_physical_release_marker(self) -> int:
        """The latest retirement epoch (what the engine tags a worker batch with)."""
        return self._epoch

    @_synchronized
    def release_retired_pages_through(self, marker: int) -> None:
        """The batch tagged ``marker`` is done: pages retired up to it are released."""
        due = [page for epoch, pages in self.retired if epoch <= marker for page in pages]
        self.retired = [(epoch, pages) for epoch, pages in self.retired if epoch > marker]
        for page in due:
            self._recency.pop(page, None)
        self._unmap(len(due))
        self._maybe_finish_shrink()

    def _shrink_to(self, target_pages: int) -> None:
        """Capacity becomes ``target_pages``. The pages given up come from the unmapped
        free ones; when those are too few, every reserved page is unmapped first."""
        if self.reserved_pages > target_pages - self.inuse_pages():
            self.reserved_pages = 0
        self.capacity_pages = target_pages

    def get_page_occupancy(self, page_ids: Iterable[int]) -> dict[int, int]:
        return {p: sum(1 for b in self.allocated if self._page(b) == p) for p in page_ids}

    # -- revisioned limits
    def _bundle(self) -> int:
        return self.page_size * self.num_layers * self.num_kv_buffers

    def memory_limit_state(self, status: str | None = None) -> dict[str, Any]:
        mapped = (self.inuse_pages() + self.reserved_pages) * self._bundle()
        status = status or ("deferred" if self.in_shrink else "applied")
        eff = self._effective
        return {
            "status": status, "reason": _REASONS.get(status, ""),
            "pool_name": str(self.pool_name or ""), "group_id": self.group_id,
            "limit_bytes": self._limit, "effective_limit_bytes": eff,
            "current_capacity_bytes": self.capacity_pages * self._bundle(),
            "revision": self._revision, "mapped_bytes": mapped,
            "remaining_bytes": None if eff is None else max(0, eff - mapped),
            "overage_bytes": 0 if eff is None else max(0, mapped - eff),
        }

    @_synchronized
    def set_memory_limit(self, limit_bytes: int, *, revision: int) -> dict[str, Any]:
        limit_bytes, revision = int(limit_bytes), int(revision)
        if limit_bytes < 0:
            raise ValueError("limit_bytes must be non-negative")
        if revision < 0:
            raise ValueError("revision must be non-negative")
        if revision < self._revision:
            return self.memory_limit_state("stale")
        if revision == self._revision:
            return self.memory_limit_state(None if limit_bytes == self._limit else "conflict")
        target_pages = min(limit_bytes // self._bundle(), self.mem_size // self.page_size)
        if self.quarantined:  # raised by resize(), before the revision is taken
            raise QuarantinedResizeError("capacity cannot change while pages are quarantined")
        self._revision, self._limit = revision, limit_bytes
        self._effective = target_pages * self._bundle()
        if self.inuse_pages() > target_pages:
            # Deferred: the reserve stays mapped until the shrink completes (in free()).
            self.in_shrink = True
            self.target_num_blocks = target_pages * self.blocks_per_page
        else:
            self._shrink_to(target_pages)
            self.in_shrink = False
            self.target_num_blocks = None
        return self.memory_limit_state()


def set_instance_memory_limit(limit_bytes: int, *, revision: int,
                              registry: FakeRegistry | None = None) -> dict[str, Any]:
    limit_bytes, revision = int(limit_bytes), int(revision)
    if limit_bytes < 0:
        raise ValueError("limit_bytes must be non-negative")
    if revision < 0:
        raise ValueError("revision must be non-negative")
    pools = sorted((m for m, _ in (registry or _REGISTRY).get()),
                   key=lambda m: (m.pool_name or "", m.group_id))
    if not pools:
        return {"status": "unavailable", "reason": "no_registered_kv_cache_pool",
                "limit_bytes": limit_bytes, "effective_limit_bytes": 0, "revision": revision,
                "mapped_bytes": 0, "remaining_bytes": 0, "overage_bytes": 0, "pools": []}
    sizes = [m.mem_size * m.num_layers * m.num_kv_buffers for m in pools]
    total = sum(sizes)
    if total <= 0:
        raise ValueError("registered KV pools have no virtual capacity")
    budget = min(limit_bytes, total)
    left = budget
    states = []
    for i, (manager, size) in enumerate(zip(pools, sizes, strict=True)):
        share = left if i == len(pools) - 1 else min(left, budget * size // total)
        states.append(manager.set_memory_limit(share, revision=revision))
        left -= share
    found = {s["status"] for s in states}
    status = next(s for s in _STATUS_ORDER if s in found or s == "applied")
    mapped = sum(int(s["mapped_bytes"]) for s in states)
    effective = sum(int(s["effective_limit_bytes"] or 0) for s in states)
    return {"status": status, "reason": _REASONS.get(status, ""), "limit_bytes": limit_bytes,
            "effective_limit_bytes": effective, "revision": revision, "mapped_bytes": mapped,
            "remaining_bytes": max(0, effective - mapped),
            "overage_bytes": max(0, mapped - effective), "pools": states}


class FakeRegistry:
    def __init__(self) -> None:
        self.pools: list[tuple[FakeKVCacheManager, str | None]] = []

    def get(self, *, integration: str | None = None) -> list[tuple[Any, str | None]]:
        return [p for p in self.pools if integration is None or p[1] == integration]


_REGISTRY = FakeRegistry()


class FakeKvcached:
    """Handle returned by :func:`install`: register pools, reach the fake modules."""

    def __init__(self) -> None:
        self.registry = _REGISTRY
        self.registry.pools.clear()

    def register(self, manager: FakeKVCacheManager) -> FakeKVCacheManager:
        self.registry.pools.append((manager, "vllm"))
        return manager


def install(monkeypatch: pytest.MonkeyPatch) -> FakeKvcached:
    """Put fake kvcached modules into ``sys.modules`` for one test (undone afterwards)."""
    handle = FakeKvcached()
    package = types.ModuleType("kvcached")
    package.__path__ = []
    package.__version__ = "0.1.6"  # type: ignore[attr-defined]
    control = types.ModuleType("kvcached.control")
    control.set_instance_memory_limit = (  # type: ignore[attr-defined]
        lambda limit_bytes, *, revision: set_instance_memory_limit(limit_bytes,
                                                                   revision=revision))
    registry = types.ModuleType("kvcached.pool_registry")
    registry.get_registered_kv_cache_pools = _REGISTRY.get  # type: ignore[attr-defined]
    registry.register_kv_cache_pool = (  # type: ignore[attr-defined]
        lambda manager, *, integration=None: _REGISTRY.pools.append((manager, integration)))
    registry.clear_registered_kv_cache_pools = (  # type: ignore[attr-defined]
        lambda *, integration=None: _REGISTRY.pools.clear())
    native = types.ModuleType("kvcached._C")
    for name, module in {"kvcached": package, "kvcached.control": control,
                         "kvcached.pool_registry": registry, "kvcached._C": native}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(package, "control", control, raising=False)
    monkeypatch.setattr(package, "pool_registry", registry, raising=False)
    return handle


_RECORD = struct.Struct("=qqq")


def write_record(shm: Path, name: str, total_size: int, used_size: int = 0,
                 *, replace: bool = False) -> Path:
    """Write a control record in place (``kvctl limit``) or as a new file (an engine start)."""
    path = shm / name
    data = _RECORD.pack(total_size, used_size, 0)
    if replace or not path.exists():
        # Created beside the old file and renamed over it, so the inode always differs.
        fresh = shm / f".{name}.new"
        fresh.write_bytes(data)
        fresh.replace(path)
    else:
        with path.open("r+b") as handle:
            handle.write(data)
    return path


def virtual_total(manager: FakeKVCacheManager) -> int:
    return manager.mem_size * manager.num_layers * manager.num_kv_buffers


def provider_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ipc: str) -> tuple[Path, Path]:
    """The provider's state directory and a private stand-in for /dev/shm under
    ``tmp_path``, with ``KVCACHED_IPC_NAME`` set to ``ipc``; returns (state, shm)."""
    state, shm = tmp_path / "state", tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("KVCACHED_PROVIDER_STATE_DIR", str(state))
    monkeypatch.setenv("KVCACHED_PROVIDER_SHM_DIR", str(shm))
    monkeypatch.setenv("KVCACHED_IPC_NAME", ipc)
    return state, shm
