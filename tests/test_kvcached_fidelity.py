"""The tests' fake kvcached pool answers as a real one did, step by step.

``tests/kvcached_real_fidelity.json`` holds what a real kvcached 0.1.6 pool answered to the
script of ``tests/kvcached_fidelity.py``, with its prealloc thread off and on (kvcached's
default), recorded by tests/test_kvcached_real.py on an H200 (the file says how). Every CI
test of the kvcached provider stands on the fake of ``tests/fake_kvcached.py``; this guards
that the fake keeps answering as that pool did: free blocks, pages in use, the shrink flag,
each limit answer and the limit state. The comparisons found two differences, now
modelled: kvcached keeps an emptied page mapped in its reserve (up to 10 pages), so
``mapped_bytes`` falls only when a shrink unmaps it (the fake had unmapped every emptied
page at once); and with prealloc on, a thread keeps at least 5 spare pages mapped (the fake
had no such thread). Under vLLM's async scheduling, not yet recorded on a GPU, the fake is
held to kvcached's own Python instead (``tests/kvcached_python_fidelity.json``, made by
tests/test_kvcached_python.py over an emulation of kvcached's compiled allocator that
answers as the GPU pool did).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.fake_kvcached import FakeKVCacheManager, install
from tests.kvcached_fidelity import (
    assert_same_steps,
    digest,
    fidelity_steps,
    provider_steps,
    random_program,
)

RECORD: dict[str, Any] = json.loads(
    (Path(__file__).with_name("kvcached_real_fidelity.json")).read_text(encoding="utf-8"))
PYTHON_RECORD: dict[str, Any] = json.loads(
    (Path(__file__).with_name("kvcached_python_fidelity.json")).read_text(encoding="utf-8"))


def fake_pool(min_reserved_pages: int = 0, *, defer_physical_release: bool = False,
              group_id: int = 0, physical_free_pages: int = 1 << 20,
              num_blocks: int | None = None) -> FakeKVCacheManager:
    """A fake pool of the recorded geometry (``num_blocks``: of another size)."""
    g = RECORD["geometry"]
    if num_blocks is None:
        num_blocks = g["mem_size"] // g["block_mem_size"]
    return FakeKVCacheManager(
        num_blocks=num_blocks, block_mem_size=g["block_mem_size"],
        page_size=g["page_size"], num_layers=g["num_layers"],
        num_kv_buffers=g["num_kv_buffers"], group_id=group_id,
        physical_free_pages=physical_free_pages, reserve_null_block=g["reserve_null_block"],
        min_reserved_pages=min_reserved_pages, defer_physical_release=defer_physical_release)


@pytest.mark.parametrize(("recording", "min_reserved_pages"),
                         [("seen", 0), ("seen_prealloc", 5)],
                         ids=["prealloc-off", "prealloc-on"])
def test_the_fake_pool_answers_as_the_recorded_real_one(recording: str,
                                                        min_reserved_pages: int) -> None:
    fake = fake_pool(min_reserved_pages)
    faked = fidelity_steps(fake, fake.inuse_pages)
    real = RECORD[recording]
    assert_same_steps(faked, real)


def test_the_recording_shows_the_reserve_of_mapped_pages() -> None:
    """The recording itself (not the fake): after ten pages' worth of blocks are freed with
    no shrink under way, one page is in use and all ten stay mapped; the shrink that ends
    when everything is freed leaves only the page in use mapped."""
    by_step = {s["step"]: s for s in RECORD["seen"]}
    g = RECORD["geometry"]
    one_page = g["page_size"] * g["num_layers"] * g["num_kv_buffers"]
    freed = by_step["free them"]
    assert freed["inuse_pages"] == 1 and freed["state"]["mapped_bytes"] == 10 * one_page
    ended = by_step["free everything"]
    assert not ended["in_shrink"] and ended["state"]["mapped_bytes"] == one_page


def test_the_prealloc_recording_shows_the_thread_refilling_the_reserve() -> None:
    """The prealloc recording itself: at start-up five spare pages are mapped beside the
    null block's page; an allocation that empties the reserve leaves five mapped spares
    again once the thread has run; frees grow the reserve past five (to its maximum of ten)
    without the thread taking any back; a block that fits a page in use does not wake the
    thread (the reserve a shrink emptied stays empty); and after a shrink the refill stops at
    the pages the limit leaves unmapped."""
    off = {s["step"]: s for s in RECORD["seen"]}
    on = {s["step"]: s for s in RECORD["seen_prealloc"]}
    g = RECORD["geometry"]
    one_page = g["page_size"] * g["num_layers"] * g["num_kv_buffers"]

    def spare(step: str) -> int:
        seen = on[step]
        return int(seen["state"]["mapped_bytes"]) // one_page - int(seen["inuse_pages"])

    assert on["start"]["inuse_pages"] == 1 and spare("start") == 5
    assert spare("free everything") == 0 and spare("allocate 1 block beside the null block") == 0
    assert spare("allocate 13 pages") == 5
    assert spare("free them, past the reserve's size") == 10
    # Limit 4 pages, 3 in use after the last allocation: the one page left is the reserve.
    assert on["allocate 2 pages"]["inuse_pages"] == 3 and spare("allocate 2 pages") == 1
    # What the thread does not change: free blocks, pages in use, the shrink flag.
    for step, seen in on.items():
        assert (seen["available"], seen["inuse_pages"], seen["in_shrink"]) == (
            off[step]["available"], off[step]["inuse_pages"], off[step]["in_shrink"]), step


def test_the_fake_retires_pages_as_kvcached_python_did() -> None:
    """vLLM's async scheduling, which no GPU run has recorded yet: the fake answers as
    kvcached 0.1.6's own Python did over an emulation of its compiled allocator
    (tests/kvcached_python_fidelity.json, made by tests/test_kvcached_python.py, whose
    emulation answers as the real pool above did): an emptied page stays mapped and in use
    until its batch completes, a page taken back before then is not released, and a
    shrink waits for every batch holding a retired page."""
    recorded = PYTHON_RECORD["async"]
    pool = fake_pool(defer_physical_release=True)
    faked = fidelity_steps(pool, pool.inuse_pages, retiring=True)
    assert_same_steps(faked, recorded)


def fake_provider_steps(monkeypatch: pytest.MonkeyPatch, *, retiring: bool) -> list[Any]:
    """``provider_steps`` on two fake pools of the recorded geometry, registered in the fake
    kvcached modules; the answers as JSON has them (tuples as lists)."""
    from kvcached_provider import signals

    kv = install(monkeypatch)
    signals.reset_cache()
    try:
        # The emulation under kvcached's Python reports unlimited device memory (1 << 40).
        pools = [kv.register(fake_pool(defer_physical_release=retiring, group_id=group,
                                   physical_free_pages=1 << 40)) for group in (0, 1)]
        seen = provider_steps(pools, lambda pool: pool.inuse_pages(), retiring=retiring)
    finally:
        signals.reset_cache()
    answers: list[Any] = json.loads(json.dumps(seen))
    return answers


@pytest.mark.parametrize("recording", ["provider", "provider_async"])
def test_the_provider_reads_two_fake_pools_as_kvcached_python(
    monkeypatch: pytest.MonkeyPatch, recording: str
) -> None:
    """Two pools read through the provider itself (capacity signals summed over the pools,
    instance limits split over them, ``pages_released``), synchronous and under async
    scheduling: the fake answers as kvcached's own Python did (its pool registry, its
    control module's split, its manager), recorded in tests/kvcached_python_fidelity.json."""
    recorded = PYTHON_RECORD[recording]
    faked = fake_provider_steps(monkeypatch, retiring=recording == "provider_async")
    assert_same_steps(faked, recorded)


def random_fake(retiring: bool) -> FakeKVCacheManager:
    """A fake pool of 16 pages, of the recorded block and page sizes, for random programs."""
    return fake_pool(defer_physical_release=retiring, physical_free_pages=1 << 40,
                     num_blocks=2048)


def test_the_fake_follows_kvcached_python_through_random_programs() -> None:
    """150 seeded random programs of 60 operations, synchronous and async, on a 16-page pool:
    the fake's readings after every operation fingerprint as kvcached's own Python's did
    (tests/kvcached_python_fidelity.json, ``random``; tests/test_kvcached_python.py compares
    them reading by reading where kvcached's source is at hand). Among equally free pages
    the fake takes the first in kvcached's avail-page order, not the lowest page id."""
    recorded: dict[str, str] = PYTHON_RECORD["random"]
    assert len(recorded) == 300
    for key, want in recorded.items():
        retiring, seed = key.startswith("async"), int(key.split("/")[1])
        pool = random_fake(retiring)
        assert digest(random_program(pool, pool.inuse_pages, seed, retiring)) == want, key
