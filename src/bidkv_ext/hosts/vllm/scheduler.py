"""Stock vLLM ``Scheduler`` subclasses whose victim choice goes through a policy controller.

Use with ``scheduler_cls`` / ``--scheduler-cls bidkv_ext.hosts.vllm.PolicyScheduler`` (or
``PolicyAsyncScheduler`` with async scheduling; ``bidkv_ext.hosts.vllm.policy_scheduler``
picks the one matching ``scheduler_config.async_scheduling``). The policy comes from the
constructor argument ``preemption_policy=`` or, when that is ``None``, from
``vllm_config.additional_config["preemption_policy"]`` (a dotted path, loaded by the
contract's rules). The adapter emulates the vLLM-HUST call site (preemption-contract.md
section 8); ``schedule`` itself is the installed method rewritten by
:mod:`bidkv_ext.hosts.vllm.rewrite` when this module is imported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import vllm
from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched import scheduler as _sched_module
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from bidkv_ext.contract import (
    CandidateFacts,
    PreemptionCandidate,
    PreemptionContext,
    PreemptionContextFacts,
)
from bidkv_ext.controller import PolicyController
from bidkv_ext.evidence import evidence_sink_from_env
from bidkv_ext.hosts.vllm.rewrite import build_schedule, check_host

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "PolicyAsyncScheduler",
    "PolicyScheduler",
    "PolicySchedulerMixin",
    "policy_scheduler",
    "select_scheduler_cls",
]

logger = logging.getLogger("bidkv_ext.hosts.vllm")

ADDITIONAL_CONFIG_KEY = "preemption_policy"
"""Key of ``--additional-config`` holding the policy's dotted path (stock vLLM has no flag)."""

# Fail at import (class creation) on an unknown vLLM or a changed file, before any engine
# starts; the rewrite below fails the same way on an unknown shape.
_HOST = check_host(vllm.__version__)
_REWRITTEN_SCHEDULE = build_schedule(
    Scheduler.schedule, _sched_module.__dict__, version=_HOST.version
)

_PRIORITY = SchedulingPolicy.PRIORITY


def _priority_key(request: Request) -> tuple[int, float]:
    return (request.priority, request.arrival_time)


def _policy_spec(vllm_config: VllmConfig, explicit: object) -> object:
    if explicit is not None:
        return explicit
    additional = getattr(vllm_config, "additional_config", None)
    if isinstance(additional, dict):
        return additional.get(ADDITIONAL_CONFIG_KEY)
    return None


def _block_counts(groups: Sequence[Sequence[KVCacheBlock]]) -> tuple[int, int, int]:
    """(exclusive, exclusive and cached, total) blocks of one request, null block skipped."""
    exclusive = cached = total = 0
    for group in groups:
        for block in group:
            if block.is_null:
                continue
            total += 1
            if block.ref_cnt == 1:
                exclusive += 1
                if block.block_hash is not None:
                    cached += 1
    return exclusive, cached, total


def _page_counts(
    groups: Sequence[Sequence[KVCacheBlock]], per_page: int, held_on_page: dict[int, int],
) -> dict[int, int]:
    """One request's exclusive blocks per page; adds each of its blocks to ``held_on_page``."""
    mine: dict[int, int] = {}
    for group in groups:
        for block in group:
            if block.is_null:
                continue
            page = block.block_id // per_page
            held_on_page[page] = held_on_page.get(page, 0) + 1
            if block.ref_cnt == 1:
                mine[page] = mine.get(page, 0) + 1
    return mine


# Each running request's blocks, per KV-cache group, read once per decision.
_Held = dict[str, Sequence[Sequence[KVCacheBlock]]]


def _candidate_facts(held: _Held, per_page: int) -> dict[str, CandidateFacts]:
    """Block counts of every running request, and with ``per_page`` its released pages."""
    counts = {rid: _block_counts(groups) for rid, groups in held.items()}
    if not per_page:
        return {rid: CandidateFacts(*c) for rid, c in counts.items()}
    # The second pass: per page, how many times running requests hold a block on it, and
    # per candidate its exclusive blocks on it. A page is released when the two counts are
    # equal: a block held twice (shared) is nobody's exclusive block, so it keeps its page.
    held_on_page: dict[int, int] = {0: 1}  # block 0, vLLM's null block, is always held
    exclusive_on_page = {
        rid: _page_counts(groups, per_page, held_on_page) for rid, groups in held.items()
    }
    return {
        rid: CandidateFacts(*c, sum(1 for page, n in exclusive_on_page[rid].items()
                                    if held_on_page[page] == n))
        for rid, c in counts.items()
    }


def _blocks_to_allocate(
    manager: Any, request: Request, num_new_tokens: int, lookahead: int, max_model_len: int,
) -> int:
    """The blocks the running-queue ``allocate_slots(request, num_new_tokens,
    num_lookahead_tokens=lookahead)`` asks the pool for, counted by vLLM's own coordinator
    with the arguments that call derives (vLLM 0.33.0; the adapter refuses other versions).

    Counting it by hand (``ceil(tokens / block_size)`` minus the blocks held) is right only
    for one full-attention group: a sliding-window group holds null blocks the allocator
    counts as held, and a hybrid model needs blocks in every group, each of its own size.
    """
    computed = min(request.num_computed_tokens, max_model_len)
    main_model = computed + num_new_tokens
    # allocate_slots never reserves slots past max_model_len (the drafter's lookahead near
    # the end of a request would otherwise count a block it will not get).
    return int(manager.coordinator.get_num_blocks_to_allocate(
        request_id=request.request_id,
        num_tokens=min(main_model + lookahead, max_model_len),
        new_computed_blocks=manager.empty_kv_cache_blocks.blocks,
        num_encoder_tokens=0,
        total_computed_tokens=computed,
        num_local_computed_tokens=request.num_computed_tokens,
        num_tokens_main_model=main_model,
        prefill_end=max(request.num_prompt_tokens, request.num_tokens - 1),
    ))


def _kvcached_pages(
    held: _Held, facts: dict[str, CandidateFacts], prefix_caching: bool,
) -> tuple[dict[str, CandidateFacts], bool]:
    """``facts`` with real kvcached's ``pages_released`` while it shrinks (the only time
    the policy weighs pages; one page-occupancy query per candidate), else as they are;
    and whether it shrinks, which the policy then need not query again.

    A preemption returns to kvcached at once the candidate's exclusive blocks of KV group 0
    that are not cached: with prefix caching, cached ones go to the evictable set first and
    return memory only when evicted (kvcached-notes.md §3, §9).
    """
    from kvcached_provider.signals import current_signals, pages_released

    signals = current_signals()
    if signals is None or not signals.in_shrink:
        return facts, False
    out: dict[str, CandidateFacts] = {}
    for rid, groups in held.items():
        ids = [b.block_id for b in (groups[0] if groups else ())
               if not b.is_null and b.ref_cnt == 1
               and not (prefix_caching and b.block_hash is not None)]
        pages = pages_released(ids)
        if pages is None:  # no kvcached pool that reports page occupancy
            return facts, True
        fact = facts[rid]
        out[rid] = CandidateFacts(
            fact.exclusive_blocks, fact.cached_blocks, fact.total_blocks, pages)
    return out, True


class PolicySchedulerMixin:
    """The adapter half: owns the controller and answers the rewritten ``schedule``.

    Mixed in before a vLLM scheduler class; relies on its ``running``, ``policy``,
    ``requests``, ``kv_cache_manager``, ``num_lookahead_tokens``, ``max_model_len`` and
    ``block_size`` attributes.
    """

    controller: PolicyController
    schedule = _REWRITTEN_SCHEDULE

    # Attributes provided by the vLLM scheduler this is mixed into.
    running: list[Request]
    policy: SchedulingPolicy
    requests: dict[str, Request]
    kv_cache_manager: Any
    num_lookahead_tokens: int
    max_model_len: int
    block_size: int

    def __init__(self, *args: Any, preemption_policy: object = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        vllm_config: VllmConfig = self.vllm_config  # type: ignore[attr-defined]
        self.controller = PolicyController.from_spec(
            _policy_spec(vllm_config, preemption_policy),
            vllm_config,
            evidence=evidence_sink_from_env(),
        )

    def _bidkv_select_victim(self, request: Request, now: float, num_new_tokens: int) -> Request:
        """Choose the request to preempt so that ``request`` can get KV blocks.

        Called by the rewritten ``schedule`` each time allocation fails. The stock choice
        is computed first; with no live policy it is returned without building a context.
        """
        running = self.running
        builtin = max(running, key=_priority_key) if self.policy is _PRIORITY else running[-1]
        controller = self.controller
        if not controller.enabled:
            # The contract's thread guard holds even with no policy (section 5, step 0).
            controller.check_thread()
            return builtin
        context = PreemptionContext(
            tuple(
                [
                    PreemptionCandidate(
                        r.request_id,
                        r.priority,
                        r.arrival_time,
                        r.num_prompt_tokens,
                        r.num_output_tokens,
                        r.num_computed_tokens,
                        r.num_preemptions,
                        r.max_tokens,
                    )
                    for r in running
                ]
            ),
            self.policy.value,  # "fcfs" or "priority"
            request.request_id,
            self.kv_cache_manager.usage,
            now,
            builtin.request_id,
        )
        facts = self._host_facts(request, num_new_tokens) if controller.wants_facts else None
        victim_id = controller.select_victim(context, facts)
        if victim_id == builtin.request_id:
            return builtin
        # The controller only returns candidate ids, and every candidate is running.
        return self.requests[victim_id]

    def _host_facts(self, request: Request, num_new_tokens: int) -> PreemptionContextFacts:
        """Optional block facts, computed only for policies that ask for them.

        ``needed_blocks`` is the shortfall ``allocate_slots`` just met: the blocks vLLM's
        own KV-cache coordinator counts for ``request``'s step (every KV-cache group, each
        with its own block size; sliding-window groups count their null blocks as held, as
        the allocator does) minus the pool's free blocks (cached free blocks count as free,
        as the allocator evicts them). The running-queue call passes no prefix-cache hits,
        encoder tokens, reserve or watermark, so none is counted here.

        ``pages_released`` is filled when a capacity-signals source with a page model
        is registered (the replay's elastic pool): the pages on which every block held by a
        running request (or the null block) is exclusive to the candidate, i.e. pages
        whose blocks would all be free or reserved after preempting it. Cost: one more
        pass over the same blocks, O(blocks of running requests). Without one, under real
        kvcached, it is filled while kvcached shrinks, from kvcached's own page occupancy
        (:func:`_kvcached_pages`).
        """
        from kvcached_provider.signals import current_page_model

        model = current_page_model()
        manager = self.kv_cache_manager
        blocks: _Held = {r.request_id: manager.get_blocks(r.request_id).blocks
                         for r in self.running}
        facts = _candidate_facts(blocks, model.blocks_per_page if model is not None else 0)
        in_shrink: bool | None = None  # with a page model the policy reads the signals
        if model is None:
            prefix_caching = bool(getattr(getattr(self, "cache_config", None),
                                          "enable_prefix_caching", False))
            facts, in_shrink = _kvcached_pages(blocks, facts, prefix_caching)
        required = _blocks_to_allocate(manager, request, num_new_tokens,
                                       self.num_lookahead_tokens, self.max_model_len)
        free = manager.block_pool.get_num_free_blocks()
        return PreemptionContextFacts(
            self.block_size, max(0, required - free), facts, in_shrink)

    def shutdown(self) -> None:
        self.controller.emit_effective()
        super().shutdown()  # type: ignore[misc]


class PolicyScheduler(PolicySchedulerMixin, Scheduler):
    """vLLM's synchronous ``Scheduler`` with policy-routed victim choice."""


class PolicyAsyncScheduler(PolicySchedulerMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with policy-routed victim choice."""


def select_scheduler_cls(vllm_config: VllmConfig) -> type[Scheduler]:
    """``PolicyAsyncScheduler`` when async scheduling is on, else ``PolicyScheduler``.

    Refuses a diffusion language model: vLLM gives those its DiffusionScheduler only when
    no ``scheduler_cls`` is named, so ours would replace it and silently drop its
    block-wise draft handling (the adapter rewrites only the autoregressive Scheduler).
    """
    if getattr(vllm_config, "diffusion_config", None) is not None:
        raise ValueError(
            "the stock-vLLM policy adapter does not support diffusion language models "
            "(diffusion_config is set): vLLM runs them with its DiffusionScheduler, which "
            "--scheduler-cls would replace; serve this model without the adapter"
        )
    if vllm_config.scheduler_config.async_scheduling:
        return PolicyAsyncScheduler
    return PolicyScheduler


def policy_scheduler(*args: Any, **kwargs: Any) -> Scheduler:
    """A ``scheduler_cls`` factory: builds the variant matching ``async_scheduling``."""
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    if not isinstance(vllm_config, VllmConfig):
        raise TypeError("policy_scheduler needs vllm_config (a VllmConfig)")
    cls: Callable[..., Scheduler] = select_scheduler_cls(vllm_config)
    return cls(*args, **kwargs)
