"""The stock-vLLM adapter's ``needed_blocks`` fact is the allocator's shortfall on every
KV-cache layout, not only on one full-attention group.

A decoding request that crosses a block boundary needs exactly one new block in each
KV-cache group. With no free block left, its shortfall is therefore the number of groups:
1 for a sliding-window model, 2 for a hybrid full + sliding-window model. The adapter used
to count ``ceil(tokens / block_size)`` minus the non-null blocks held, summed over groups:
on a sliding-window group the null blocks that replace blocks outside the window made the
shortfall 6-10 instead of 1, and on a hybrid model the sum over both groups against one
group's need made it 0 (which the policy reads as "no fact"). Real vLLM 0.33.0 scheduler,
block pool and KV-cache coordinator, built with these layouts directly (no model runs).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bidkv_ext.contract import PreemptionContext, PreemptionContextFacts

BLOCK = 16
WINDOW = 32


class FactsRecorder:
    """Abstains, and records for every decision the requester's state, the pool's free
    blocks and the facts the adapter computed."""

    wants_host_facts = True

    def __init__(self) -> None:
        self.scheduler: Any = None
        self.seen: list[tuple[int, int, int, int]] = []  # computed, prompt, free, needed

    def select_victim(self, context: PreemptionContext) -> str | None:
        raise AssertionError("a policy that asks for facts is called with them")

    def select_victim_with_facts(
        self, context: PreemptionContext, facts: PreemptionContextFacts | None
    ) -> str | None:
        assert facts is not None
        requester = self.scheduler.requests[context.requesting_request_id]
        free = self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        self.seen.append((requester.num_computed_tokens, requester.num_prompt_tokens, free,
                          facts.needed_blocks))
        return None


def _spec(kind: str) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    common: dict[str, Any] = {
        "block_size": BLOCK, "num_kv_heads": 1, "head_size": 1, "dtype": torch.float32}
    if kind == "full":
        return FullAttentionSpec(**common)
    return SlidingWindowSpec(**common, sliding_window=WINDOW)


@pytest.mark.parametrize(("layout", "num_blocks"), [(("window",), 10),
                                                     (("full", "window"), 24)])
def test_a_decoding_requester_is_one_block_short_per_group(
    layout: tuple[str, ...], num_blocks: int
) -> None:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from bidkv_ext.hosts.vllm import offline

    vllm_config, _ = offline.build_vllm_config(num_gpu_blocks=num_blocks,
                                               enable_prefix_caching=False)
    groups = [KVCacheGroupSpec([f"layer{i}"], _spec(kind)) for i, kind in enumerate(layout)]
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=groups)
    policy = FactsRecorder()
    scheduler: Any = offline.build_scheduler(vllm_config, kv_cache_config,
                                             preemption_policy=policy)
    policy.scheduler = scheduler
    for i in range(6):
        scheduler.add_request(offline.make_request(str(i), [i + 3] * 100, max_tokens=80,
                                                   arrival_time=float(i)))
    for _ in range(400):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        scheduler.update_from_output(out, offline.runner_output_for(out, scheduler))
    at_boundary = [needed for computed, prompt, free, needed in policy.seen
                   if computed >= prompt and computed % BLOCK == 0 and free == 0]
    assert at_boundary, policy.seen  # the workload does make decoders one block short
    assert set(at_boundary) == {len(layout)}, policy.seen
