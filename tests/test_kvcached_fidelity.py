"""The tests' fake kvcached pool answers as a real one did, step by step.

``tests/kvcached_real_fidelity.json`` holds what a real kvcached 0.1.6 pool answered to the
script of ``tests/kvcached_fidelity.py`` (recorded by tests/test_kvcached_real.py on an
H200; the file says how). Every CI test of the kvcached provider stands on the fake of
``tests/fake_kvcached.py``; this guards that the fake keeps answering as that pool did:
free blocks, pages in use, the shrink flag, each limit answer and the limit state. The
comparison found one difference, now modelled: kvcached keeps an emptied page mapped in
its reserve (up to 10 pages), so ``mapped_bytes`` falls only when a shrink unmaps it; the
fake had unmapped every emptied page at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.fake_kvcached import FakeKVCacheManager
from tests.kvcached_fidelity import fidelity_steps

RECORD: dict[str, Any] = json.loads(
    (Path(__file__).with_name("kvcached_real_fidelity.json")).read_text(encoding="utf-8"))


def test_the_fake_pool_answers_as_the_recorded_real_one() -> None:
    g = RECORD["geometry"]
    fake = FakeKVCacheManager(
        num_blocks=g["mem_size"] // g["block_mem_size"], block_mem_size=g["block_mem_size"],
        page_size=g["page_size"], num_layers=g["num_layers"],
        num_kv_buffers=g["num_kv_buffers"], physical_free_pages=1 << 20,
        reserve_null_block=g["reserve_null_block"])
    faked = fidelity_steps(fake, fake.inuse_pages)
    real = RECORD["seen"]
    assert [s["step"] for s in faked] == [s["step"] for s in real]
    for got, want in zip(faked, real, strict=True):
        assert got == want, f"at {want['step']!r}"


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
