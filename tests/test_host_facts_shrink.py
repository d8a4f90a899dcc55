"""The CPU host passes kvcached's shrink state on even when pages cannot be counted.

``PolicySchedulerMixin._host_facts`` reads kvcached's capacity signals for
``pages_released`` and hands their shrink state to the policy (``facts.in_shrink``), so the
policy does not query the driver again. A kvcached pool that shrinks but cannot report
page occupancy (no ``get_page_occupancy``) leaves every ``pages_released`` unknown; the
shrink state must still say ``True``, or the policy, which trusts a host-supplied value,
would score the decision as if memory were not being reclaimed. kvcached is faked at the
module boundary (``tests/fake_kvcached.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvcached_provider import signals
from tests.fake_kvcached import FakeKVCacheManager, install


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    signals.reset_cache()
    yield
    signals.reset_cache()


def _host(held: dict[str, list[int]]) -> Any:
    """What ``_host_facts`` reads of a vLLM scheduler: running requests' blocks (one KV
    group, each block held once, none cached) and an empty free pool."""
    blocks = {b: SimpleNamespace(block_id=b, is_null=False, ref_cnt=1, block_hash=None)
              for ids in held.values() for b in ids}
    lists = {rid: SimpleNamespace(blocks=([blocks[b] for b in ids],))
             for rid, ids in held.items()}
    manager = SimpleNamespace(get_blocks=lists.__getitem__,
                              block_pool=SimpleNamespace(get_num_free_blocks=lambda: 0))
    return SimpleNamespace(
        kv_cache_manager=manager, block_size=16, num_lookahead_tokens=0, max_model_len=1 << 20,
        running=[SimpleNamespace(request_id=rid, num_computed_tokens=0) for rid in held],
        cache_config=SimpleNamespace(enable_prefix_caching=False))


@pytest.mark.parametrize("shrinking", [True, False])
def test_shrink_state_survives_a_pool_without_page_occupancy(
    monkeypatch: pytest.MonkeyPatch, shrinking: bool
) -> None:
    from bidkv_ext.hosts.vllm.scheduler import PolicySchedulerMixin

    kv = install(monkeypatch)
    pool = kv.register(FakeKVCacheManager(num_blocks=64))
    held = {"a": list(range(16, 32)), "b": list(range(32, 40))}
    pool.allocated.update(b for ids in held.values() for b in ids)
    pool.in_shrink = shrinking
    # A kvcached that cannot report page occupancy.
    monkeypatch.setattr(pool, "get_page_occupancy", None)
    request = SimpleNamespace(request_id="b", num_computed_tokens=0)

    facts = PolicySchedulerMixin._host_facts(_host(held), request, 0)  # type: ignore[arg-type]

    assert {rid: f.pages_released for rid, f in facts.facts.items()} == {"a": None, "b": None}
    assert facts.in_shrink is shrinking
