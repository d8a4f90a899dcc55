"""kvcached's own Python code against the tests' fake pool, without a GPU (skipped unless
kvcached's source is given).

kvcached's page logic is split: its Python ``KVCacheManager`` decides which page a block
goes to, when an emptied page is retired or released and when a shrink ends; its compiled
``PageAllocator`` keeps the page lists. tests/kvcached_cpp_emulation.py emulates the
compiled part, so kvcached's real Python runs here. Set ``BIDKV_KVCACHED_SRC`` to an
unpacked kvcached 0.1.6 sdist (``scripts/kvcached-python-check.sh`` does) to run:

- kvcached's Python over the emulation answers the scripted pool life of
  tests/kvcached_fidelity.py exactly as a real pool did on a GPU (the recording in
  tests/kvcached_real_fidelity.json, prealloc thread off): the emulation is faithful where
  it can be checked;
- under vLLM's async scheduling (``defer_physical_release``: pages retired until the
  engine releases their batch), which no GPU run has recorded yet, the fake pool of
  tests/fake_kvcached.py answers as kvcached's Python does, at every step, and
  tests/kvcached_python_fidelity.json (which CI holds the fake to) is kvcached's answer.

Each side runs in a child process: the emulation replaces modules in ``sys.modules``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.kvcached_fidelity import assert_same_steps, digest, fidelity_steps, random_program
from tests.test_kvcached_fidelity import fake_pool, fake_provider_steps, random_fake

SOURCE = os.environ.get("BIDKV_KVCACHED_SRC", "")
if not SOURCE:
    pytest.skip("needs kvcached's source: BIDKV_KVCACHED_SRC (scripts/kvcached-python-check.sh)",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
RECORD: dict[str, Any] = json.loads(
    (Path(__file__).with_name("kvcached_real_fidelity.json")).read_text(encoding="utf-8"))
CELL = 8 * 64 * 2  # bytes per token per layer for K (or V): the GPU run's geometry
BLOCK = 16

_SCRIPT = """
import json, sys
sys.path[:0] = [{root!r}, {src!r}]
from tests import kvcached_cpp_emulation
kvcached_cpp_emulation.install({source!r})
from kvcached.kv_cache_manager import KVCacheManager
from tests.kvcached_fidelity import fidelity_steps
async_sched = {async_sched!r}
pool = KVCacheManager({blocks}, {block}, {cell}, 4, reserve_null_block=True,
                      async_sched=async_sched, defer_physical_release=async_sched)
pool._wait_post_init()
seen = fidelity_steps(pool, pool.page_allocator.get_num_inuse_pages, retiring=async_sched)
print(json.dumps(seen))
"""


_PROVIDER_SCRIPT = """
import json, sys
sys.path[:0] = [{root!r}, {src!r}]
from tests import kvcached_cpp_emulation
kvcached_cpp_emulation.install({source!r})
from kvcached.kv_cache_manager import KVCacheManager
from kvcached.pool_registry import register_kv_cache_pool
from tests.kvcached_fidelity import provider_steps
async_sched = {async_sched!r}
pools = []
for group in (0, 1):
    pool = KVCacheManager({blocks}, {block}, {cell}, 4, reserve_null_block=True,
                          async_sched=async_sched, defer_physical_release=async_sched,
                          group_id=group, pool_name="block_pool")
    pool._wait_post_init()
    register_kv_cache_pool(pool, integration="vllm")
    pools.append(pool)
seen = provider_steps(pools, lambda pool: pool.page_allocator.get_num_inuse_pages(),
                      retiring=async_sched)
print(json.dumps(seen))
"""


def _child(script: str, *, timeout: float = 120, **values: object) -> Any:
    """Run ``script`` (formatted with ``values``) in a child on kvcached's Python; the JSON
    line it prints (kvcached prints too)."""
    code = script.format(root=str(ROOT), src=str(ROOT / "src"), source=SOURCE, block=BLOCK,
                         cell=CELL, **values)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    env.update(KVCACHED_PAGE_PREALLOC_ENABLED="false", KVCACHED_IPC_NAME=f"bidkv_py_{os.getpid()}")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [text for text in done.stdout.splitlines() if text.startswith(("[", "{"))]
    return json.loads(line)


def _run(script: str, *, async_sched: bool) -> list[Any]:
    g = RECORD["geometry"]
    seen: list[Any] = _child(script, async_sched=async_sched,
                             blocks=g["mem_size"] // g["block_mem_size"])
    return seen


def kvcached_python(*, async_sched: bool) -> list[dict[str, Any]]:
    return _run(_SCRIPT, async_sched=async_sched)


def fake(*, async_sched: bool) -> list[dict[str, Any]]:
    pool = fake_pool(defer_physical_release=async_sched)
    return fidelity_steps(pool, pool.inuse_pages, retiring=async_sched)


def test_the_geometry_is_the_recorded_one() -> None:
    g = RECORD["geometry"]
    assert g["block_mem_size"] == BLOCK * CELL
    assert (g["num_layers"], g["num_kv_buffers"], g["page_size"]) == (4, 2, 2 << 20)


def test_kvcached_python_over_the_emulation_answers_as_the_real_pool_did() -> None:
    real = RECORD["seen"]
    emulated = kvcached_python(async_sched=False)
    assert_same_steps(emulated, real)


def answers() -> dict[str, list[Any]]:
    """What tests/kvcached_python_fidelity.json records, as kvcached's Python answers now."""
    return {"async": kvcached_python(async_sched=True),
            "provider": _run(_PROVIDER_SCRIPT, async_sched=False),
            "provider_async": _run(_PROVIDER_SCRIPT, async_sched=True)}


def test_the_recording_is_kvcached_pythons_answer() -> None:
    """tests/kvcached_python_fidelity.json, which CI holds the fake to
    (tests/test_kvcached_fidelity.py), is what kvcached's Python answers now: refresh it
    from the line printed here (``-rA``) after a kvcached upgrade or a change to a script."""
    now = answers()
    print(json.dumps(now))
    recorded = json.loads((Path(__file__).with_name("kvcached_python_fidelity.json"))
                          .read_text(encoding="utf-8"))
    for key, value in now.items():
        assert recorded[key] == value, key


def test_the_provider_reads_the_fake_as_kvcached_python(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """Two pools through the provider's own readings, synchronous and async: the fake's
    answers are kvcached's."""
    for retiring in (False, True):
        reference = _run(_PROVIDER_SCRIPT, async_sched=retiring)
        faked = fake_provider_steps(monkeypatch, retiring=retiring)
        assert_same_steps(faked, reference, f" (async {retiring})")


def test_the_fake_retires_pages_as_kvcached_python_does() -> None:
    """Under async scheduling a free only retires the pages it empties: they stay mapped and
    in use (their blocks allocatable) until the batch completes, no shrink ends before, and
    a retired page allocated again is not released. A shrink within reach once one batch
    completes still waits for a later batch's retired page."""
    reference = kvcached_python(async_sched=True)
    faked = fake(async_sched=True)
    assert_same_steps(faked, reference)
    # The script does reach the retirement: a reading before a batch completes differs
    # from the one after.
    by_step = {s["step"]: s for s in reference}
    before, after = by_step["free them, before the batch completes"], by_step["free them"]
    assert before["inuse_pages"] > after["inuse_pages"]
    # The shrink the second batch holds up: within the limit, still pending, until it ends.
    held, ended = by_step["the first batch completes"], by_step["the second batch completes"]
    assert held["in_shrink"] and held["inuse_pages"] == 2 and not ended["in_shrink"]


_RANDOM_SCRIPT = """
import json, sys
sys.path[:0] = [{root!r}, {src!r}]
from tests import kvcached_cpp_emulation
kvcached_cpp_emulation.install({source!r})
from kvcached.kv_cache_manager import KVCacheManager
from tests.kvcached_fidelity import random_program
runs = {{}}
for retiring in (False, True):
    for seed in range({programs}):
        pool = KVCacheManager({blocks}, {block}, {cell}, 4, reserve_null_block=True,
                              async_sched=retiring, defer_physical_release=retiring)
        pool._wait_post_init()
        runs[f"{{'async' if retiring else 'sync'}}/{{seed}}"] = random_program(
            pool, pool.page_allocator.get_num_inuse_pages, seed, retiring)
print(json.dumps(runs))
"""
RANDOM_PROGRAMS = 150
RANDOM_BLOCKS = 2048  # 16 pages: limits and shrinks bite often


def kvcached_random_programs() -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = _child(
        _RANDOM_SCRIPT, timeout=600, blocks=RANDOM_BLOCKS, programs=RANDOM_PROGRAMS)
    return runs


def test_the_fake_follows_kvcached_python_through_random_programs() -> None:
    """Beyond the scripted lives: 150 seeded random programs of 60 operations each,
    synchronous and async (``random_program`` in tests/kvcached_fidelity.py), on a 16-page
    pool; every reading after every operation must agree, and the recording's digests (which
    CI holds the fake to) must be kvcached's. This found the fake breaking ties between
    equally free pages by page id, where kvcached takes the first in its avail-page order."""
    runs = kvcached_random_programs()
    recorded = json.loads((Path(__file__).with_name("kvcached_python_fidelity.json"))
                          .read_text(encoding="utf-8"))["random"]
    for key, reference in runs.items():
        retiring, seed = key.startswith("async"), int(key.split("/")[1])
        pool = random_fake(retiring)
        faked = random_program(pool, pool.inuse_pages, seed, retiring)
        for step, (got, want) in enumerate(zip(faked, reference, strict=True)):
            assert got == want, f"program {key}, operation {step} ({want['op']})"
        assert recorded[key] == digest(reference), key
