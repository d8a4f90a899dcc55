"""One scripted life of a kvcached pool, for comparing the tests' fake with a real pool.

``fidelity_steps`` drives a pool through allocations, a deferred shrink and its end, the
revision rules (apply, idempotent, conflict, stale, beyond the virtual size), the
reserve of mapped free pages (filled past its size, then cut by a shrink), when
kvcached's prealloc thread is on what wakes it, and under vLLM's async scheduling the pages
a free retires until the worker batch completes; after each step it records what the
provider reads of the pool. tests/test_kvcached_real.py runs it on a real kvcached pool
(on a CUDA machine, with the thread off and on) and on the fake, and compares them;
tests/test_kvcached_fidelity.py compares the fake with recordings of the real runs
(``kvcached_real_fidelity.json``). ``provider_steps`` reads two pools through the provider
itself; tests/test_kvcached_python.py runs it on kvcached's own Python (over an emulation of
its compiled allocator) and records the answers (``kvcached_python_fidelity.json``).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

_STATE_KEYS = ("status", "reason", "limit_bytes", "effective_limit_bytes",
               "current_capacity_bytes", "revision", "mapped_bytes", "remaining_bytes",
               "overage_bytes")


def reading(pool: Any, inuse_pages: Callable[[], int], answer: Any = None) -> dict[str, Any]:
    """What the provider reads of ``pool`` now: free blocks, pages in use, the shrink flag
    and the limit state, with the step's ``answer``."""
    state = pool.memory_limit_state()
    return {"available": int(pool.available_size()), "inuse_pages": int(inuse_pages()),
            "in_shrink": bool(pool.in_shrink),
            "state": {k: state.get(k) for k in _STATE_KEYS}, "answer": answer}


def release(pool: Any, marker: int | None = None) -> None:
    """What kvcached's vLLM integration does once a worker batch is done: release the pages
    retired up to the marker that batch was tagged with (the latest by default)."""
    done = pool.capture_physical_release_marker() if marker is None else marker
    pool.release_retired_pages_through(done)


def assert_same_steps(got: list[dict[str, Any]], want: list[dict[str, Any]],
                      context: str = "") -> None:
    """The same steps, in order, with the same readings; a mismatch names its step."""
    assert [s["step"] for s in got] == [s["step"] for s in want], context
    for mine, theirs in zip(got, want, strict=True):
        assert mine == theirs, f"at {theirs['step']!r}{context}"


def fidelity_steps(pool: Any, inuse_pages: Callable[[], int],
                   settle: Callable[[], None] = lambda: None,
                   retiring: bool = False) -> list[dict[str, Any]]:
    """Drive ``pool`` (real or fake) through the script; after each step, what the
    provider reads of it: free blocks, pages in use, the shrink flag, the limit state and
    the step's answer (a state for a limit; for an allocation, how many blocks went to each
    page, an empty list when it failed). ``settle`` runs before each reading: a real pool
    with kvcached's prealloc thread on must be given time to refill its reserve.

    ``retiring`` is for a pool under vLLM's async scheduling, where ``free`` only retires
    emptied pages until the engine reports the worker batch done
    (``release_retired_pages_through`` the marker it captured): each free is then read
    twice, before and after its batch completes, and the script ends with an allocation
    before a batch completes and a shrink that two batches hold up."""
    per_page = pool.page_size // pool.block_mem_size
    one_page = pool.page_size * pool.num_layers * pool.num_kv_buffers
    seen: list[dict[str, Any]] = []

    def look(step: str, answer: Any = None) -> None:
        settle()
        if isinstance(answer, dict):
            answer = {k: answer.get(k) for k in _STATE_KEYS}
        seen.append({"step": step, **reading(pool, inuse_pages, answer)})

    def alloc(n: int) -> list[int]:
        ids = pool.alloc(n)
        return list(ids) if ids is not None else []

    def freed(step: str, ids: list[int]) -> None:
        pool.free(ids)
        if retiring:
            look(f"{step}, before the batch completes")
            release(pool)
        look(step)

    def spread(ids: list[int]) -> list[int]:
        # How many of the blocks landed on each page, smallest first: which pages were
        # partly used, and how full each new one is (page ids themselves may differ).
        return sorted(Counter(i // per_page for i in ids).values())

    look("start")
    first = alloc(3 * per_page + 5)
    look("allocate 3 pages and 5 blocks", spread(first))
    second = alloc(per_page // 2)
    look("allocate half a page", spread(second))
    freed("free 2 pages' worth of the first", first[: 2 * per_page])
    look("limit 1 page, below the pages in use", pool.set_memory_limit(one_page, revision=1))
    third = alloc(1)
    look("allocate 1 block while shrinking", spread(third))
    fourth = alloc(per_page)
    look("allocate a page while shrinking", spread(fourth))
    freed("free the rest of the first", first[2 * per_page:])
    freed("free everything", second + third + fourth)
    look("raise to 10 pages", pool.set_memory_limit(10 * one_page, revision=2))
    look("the same again", pool.set_memory_limit(10 * one_page, revision=2))
    look("another limit, same revision", pool.set_memory_limit(12 * one_page, revision=2))
    look("an older revision", pool.set_memory_limit(5 * one_page, revision=1))
    # The reserve is empty here (the shrink unmapped it): a block that fits a page in use
    # maps no page, so kvcached's prealloc thread is not woken.
    beside = alloc(1)
    look("allocate 1 block beside the null block", spread(beside))
    freed("free it", beside)
    look("allocate 10 pages", spread(alloc(10 * per_page)))
    most = alloc(10 * per_page - 1)
    look("allocate all but one block of 10 pages", spread(most))
    freed("free them", most)
    look("above the virtual size", pool.set_memory_limit(1 << 50, revision=3))
    many = alloc(13 * per_page)
    look("allocate 13 pages", spread(many))
    freed("free them, past the reserve's size", many)
    look("limit 4 pages, fewer than in use and reserved",
         pool.set_memory_limit(4 * one_page, revision=4))
    last = alloc(2 * per_page)
    look("allocate 2 pages", spread(last))
    if retiring:
        # Two pages retired, then a page's worth allocated before their batch completes:
        # it takes one of them back (best fit), and only the other is released.
        pool.free(last)
        look("free the 2 pages, before the batch completes")
        again = alloc(per_page)
        look("allocate a page before the batch completes", spread(again))
        release(pool)
        look("the batch completes")
        # Two more pages (the null block's page filled, one page, one block on another):
        # four in use, then a limit of two, deferred. Two pages emptied in one batch and
        # the last in the next: once the first batch completes two pages are in use,
        # within the limit, but the shrink waits for the second batch too.
        more = alloc(2 * per_page)
        look("allocate 2 pages' worth", spread(more))
        look("limit 2 pages, below the pages in use",
             pool.set_memory_limit(2 * one_page, revision=5))
        pool.free(again + more[:-1])
        first_batch = pool.capture_physical_release_marker()
        pool.free(more[-1:])
        look("empty 3 pages over two batches")
        release(pool, first_batch)
        look("the first batch completes")
        release(pool)
        look("the second batch completes")
    return seen


def provider_steps(pools: Sequence[Any], inuse_pages: Callable[[Any], int],
                   retiring: bool = False) -> list[dict[str, Any]]:
    """Two registered pools (KV groups 0 and 1, one geometry) through the provider's own
    readings: ``current_signals`` after each step, ``apply_here``'s answers to instance
    limits (kvcached splits one limit over the pools: a deferred share beside an applied
    one, an uneven split, conflict, stale, beyond the virtual size) and ``pages_released``
    against the pages a free takes out of use. ``retiring`` as in :func:`fidelity_steps`:
    each free is read before and after its batch completes."""
    from kvcached_provider.limit import apply_here
    from kvcached_provider.signals import current_signals, pages_released

    first, second = pools
    per_page = first.page_size // first.block_mem_size
    one_page = first.page_size * first.num_layers * first.num_kv_buffers
    seen: list[dict[str, Any]] = []

    def look(step: str, answer: Any = None) -> None:
        signals = current_signals()
        seen.append({"step": step, "signals": None if signals is None else asdict(signals),
                     "inuse_pages": [int(inuse_pages(p)) for p in pools], "answer": answer})

    def limit(nbytes: int, revision: int) -> dict[str, Any]:
        answer = apply_here("fidelity", nbytes, revision, check_startup=False).to_dict()
        answer.pop("ipc_name")
        return answer

    def freed(step: str, pool: Any, ids: list[int], group_id: int) -> None:
        predicted, before = pages_released(ids, group_id), int(inuse_pages(pool))
        pool.free(ids)
        if retiring:
            look(f"{step}, before the batch completes")
            release(pool)
        look(step, {"predicted": predicted, "released": before - int(inuse_pages(pool))})

    look("start")
    a = list(first.alloc(5 * per_page + 3))
    b = list(second.alloc(2 * per_page))
    look("5 pages and 3 blocks in group 0, 2 pages in group 1", [len(a), len(b)])
    look("instance limit of 6 pages: group 0 deferred, group 1 applied", limit(6 * one_page, 1))
    a += list(first.alloc(1))
    b += list(second.alloc(1))
    look("a block in each while group 0 shrinks")
    look("an unknown group releases nothing known", pages_released(a[:1], group_id=5))
    freed("free 3 pages' worth in group 0", first, a[: 3 * per_page], 0)
    freed("free the rest of group 0", first, a[3 * per_page:], 0)
    look("7 pages and a byte, split unevenly", limit(7 * one_page + 1, 2))
    look("another limit, same revision", limit(8 * one_page, 2))
    look("an older revision", limit(5 * one_page, 1))
    look("above the virtual size", limit(1 << 50, 3))
    freed("free group 1", second, b, 1)
    return seen


def random_program(pool: Any, inuse_pages: Callable[[], int], seed: int,
                   retiring: bool = False, steps: int = 60) -> list[dict[str, Any]]:
    """A seeded random life of ``pool`` (real or fake), read after every operation as in
    :func:`fidelity_steps`: allocations of up to three pages, frees of all, half or one
    block of a held allocation, limits with new, repeated and older revisions and, with
    ``retiring``, releases up to the latest or an older batch marker. The operations depend
    only on ``seed`` and on which allocations succeeded, so two pools that answer alike
    get the same program."""
    rng = random.Random(seed)
    per_page = pool.page_size // pool.block_mem_size
    bundle = pool.page_size * pool.num_layers * pool.num_kv_buffers
    most = int(pool.mem_size) // pool.page_size
    held: list[list[int]] = []
    markers: list[int] = []
    revision = 0
    seen: list[dict[str, Any]] = []
    for _ in range(steps):
        kind = rng.choice(["alloc", "alloc", "free", "free", "limit", "release"])
        answer: Any = None
        if kind == "alloc":
            ids = pool.alloc(rng.randint(1, 3 * per_page))
            if ids:
                held.append(list(ids))
            answer = sorted(Counter(i // per_page for i in ids or []).values())
        elif kind == "free":
            pick, part = rng.random(), rng.choice(["all", "half", "one"])
            if held:
                index = int(pick * len(held))
                ids = held[index]
                cut = {"all": len(ids), "half": len(ids) // 2 or 1, "one": 1}[part]
                pool.free(ids[:cut])
                if ids[cut:]:
                    held[index] = ids[cut:]
                else:
                    held.pop(index)
                if retiring:
                    markers.append(pool.capture_physical_release_marker())
        elif kind == "limit":
            if rng.random() < 0.7:
                revision += 1
                used = revision
            else:
                used = max(0, revision - rng.randint(0, 1))
            nbytes = rng.randint(0, most + 2) * bundle + rng.choice([0, 0, 1, bundle // 2])
            state = pool.set_memory_limit(nbytes, revision=used)
            answer = {k: state.get(k) for k in _STATE_KEYS}
        else:
            older = rng.random() < 0.4
            if retiring:
                release(pool, markers[len(markers) // 2] if older and markers else None)
        seen.append({"op": kind, **reading(pool, inuse_pages, answer)})
    return seen


def digest(readings: list[dict[str, Any]]) -> str:
    """A short fingerprint of a program's readings, for recordings kept small."""
    text = json.dumps(readings, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
