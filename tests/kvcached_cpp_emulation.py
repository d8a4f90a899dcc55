"""kvcached's compiled layer (``kvcached.vmm_ops``), emulated in Python, so that kvcached's
own Python code can run without CUDA.

kvcached's ``KVCacheManager`` (Python) keeps the blocks of each page and decides when pages
are taken, retired, released and shrunk; its C++ ``PageAllocator`` and ``InternalPage``
keep the page lists (free, reserved up to ``KVCACHED_MAX_RESERVED_PAGES``, reclaimed by a
shrink) and a page's free blocks. This module stands in for the C++ part only, written from
kvcached 0.1.6's ``csrc/page_allocator.cpp`` as read: pages are mapped from the reserve
first, then from the free list; freed pages go to the reserve while it has room, the rest
are unmapped; a shrink needs enough unmapped free pages and unmaps the whole reserve when
they are too few; the in-use count is total minus free (reserved pages count as free).
There is no prealloc thread (run with ``KVCACHED_PAGE_PREALLOC_ENABLED=false``), no
device memory (the physical count is unlimited) and no worker IPC.

tests/test_kvcached_python.py uses it to run kvcached's Python manager through the scripted
pool life of tests/kvcached_fidelity.py: checked against the recording of a real pool on a
GPU where one exists, and then used to check tests/fake_kvcached.py where no GPU recording
exists yet (vLLM's async scheduling, whose page retirement is kvcached Python code).
"""

from __future__ import annotations

import collections
import sys
import types
from collections.abc import Iterable
from typing import Any

MAX_RESERVED_PAGES = 10  # KVCACHED_MAX_RESERVED_PAGES's default


class InternalPage:
    """A page's blocks: ids ``page_id * n`` to ``page_id * n + n - 1``, handed out in order."""

    def __init__(self, page_id: int, page_size: int) -> None:
        self.page_id, self.page_size = page_id, page_size
        self._free: collections.deque[int] = collections.deque()
        self._blocks = 0

    @staticmethod
    def get_num_blocks(page_size: int, block_mem_size: int) -> int:
        return page_size // block_mem_size

    @staticmethod
    def get_block_range(page_id: int, page_size: int, block_mem_size: int) -> tuple[int, int]:
        per_page = page_size // block_mem_size
        return page_id * per_page, (page_id + 1) * per_page

    def init(self, block_mem_size: int) -> None:
        start, end = self.get_block_range(self.page_id, self.page_size, block_mem_size)
        self._free = collections.deque(range(start, end))
        self._blocks = end - start

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError("Not enough free blocks in page")
        return [self._free.popleft() for _ in range(n)]

    def free(self, block: int) -> None:
        self._free.append(block)

    def free_batch(self, blocks: Iterable[int]) -> None:
        self._free.extend(blocks)

    def empty(self) -> bool:
        return len(self._free) == self._blocks

    def full(self) -> bool:
        return not self._free

    def num_free_blocks(self) -> int:
        return len(self._free)

    def get_free_blocks(self) -> list[int]:
        return list(self._free)


class PageAllocator:
    """Page lists of one pool (per layer and buffer; every layer maps alike)."""

    def __init__(self, num_layers: int, mem_size: int, page_size: int, world_size: int,
                 **_options: Any) -> None:
        self.page_size = page_size
        self.total = mem_size // page_size
        self.free_list: collections.deque[int] = collections.deque(range(self.total))
        self.reserved: collections.deque[int] = collections.deque()
        self.reclaimed: collections.deque[int] = collections.deque()
        self.num_free = self.total  # unmapped free pages plus reserved ones
        self.max_reserved = min(MAX_RESERVED_PAGES, self.total)

    # -- set-up and threads kvcached's manager calls; nothing to do without a device
    def set_use_worker_ipc(self, use: bool) -> None:
        pass

    def start_prealloc_thread(self) -> None:
        pass

    def stop_prealloc_thread(self) -> None:
        pass

    def release_shared_segment(self) -> bool:
        return True

    def get_resize_target(self) -> int:
        return -1  # no `kvctl limit` written to the control record

    # -- pages
    def alloc_page(self) -> InternalPage:
        if self.reserved:
            page_id = self.reserved.popleft()
        elif self.free_list:
            page_id = self.free_list.popleft()
        else:
            raise RuntimeError("No free pages left")
        self.num_free -= 1
        return InternalPage(page_id, self.page_size)

    def free_pages(self, page_ids: Iterable[int]) -> None:
        pages = list(page_ids)
        self.num_free += len(pages)
        kept = pages[: max(0, self.max_reserved - len(self.reserved))]
        self.reserved.extend(kept)
        self.free_list.extend(pages[len(kept):])

    def trim(self) -> None:
        self.free_list.extend(self.reserved)
        self.reserved.clear()

    def resize(self, new_mem_size: int) -> bool:
        new = new_mem_size // self.page_size
        if new < self.total - self.num_free:
            return False  # in-use pages above the target: the manager defers the shrink
        if new >= self.total:
            grow = new - self.total
            reused = [self.reclaimed.popleft() for _ in range(min(grow, len(self.reclaimed)))]
            self.free_list.extend(reused)
            self.free_list.extend(range(self.total, self.total + grow - len(reused)))
            self.num_free += grow
            self.total = new
            return True
        cut = self.total - new
        if len(self.free_list) < cut:
            if not self.reserved:
                return False
            self.trim()  # too few unmapped pages: the whole reserve is unmapped first
            if len(self.free_list) < cut:
                return False
        for _ in range(cut):
            self.reclaimed.append(self.free_list.pop())
        self.num_free -= cut
        self.total = new
        return True

    # -- counts
    def get_num_free_pages(self) -> int:
        return self.num_free

    def get_num_reserved_pages(self) -> int:
        return len(self.reserved)

    def get_num_inuse_pages(self) -> int:
        return self.total - self.num_free

    def get_num_total_pages(self) -> int:
        return self.total

    def get_page_state(self) -> dict[str, int]:
        return {"total_pages": self.total, "free_pages": self.num_free,
                "inuse_pages": self.total - self.num_free, "reserved_pages": len(self.reserved)}

    def get_avail_physical_pages(self) -> int:
        return 1 << 40

    def group_indices_by_page(self, indices: Iterable[int], block_mem_size: int
                              ) -> dict[int, list[int]]:
        per_page = self.page_size // block_mem_size
        grouped: dict[int, list[int]] = {}
        for index in indices:
            grouped.setdefault(index // per_page, []).append(index)
        return grouped


def install(source_dir: str) -> None:
    """Make ``import kvcached`` load the Python package in ``source_dir`` (an unpacked sdist)
    over this emulation. For a process of its own: it replaces modules in ``sys.modules``."""
    sys.path.insert(0, source_dir)
    native = types.ModuleType("kvcached._C")
    ops = types.ModuleType("kvcached.vmm_ops")
    ops.PageAllocator = PageAllocator  # type: ignore[attr-defined]
    ops.InternalPage = InternalPage  # type: ignore[attr-defined]
    ops.kv_tensors_created = lambda group_id=0: True  # type: ignore[attr-defined]
    ops.map_to_kv_tensors = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    ops.unmap_from_kv_tensors = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    sys.modules["kvcached._C"] = native
    sys.modules["kvcached.vmm_ops"] = ops
