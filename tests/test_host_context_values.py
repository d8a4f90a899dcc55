"""The context's step-level values on the real scheduler: ``now``, ``kv_cache_usage``, policy.

preemption-contract.md sections 2 and 8, against the real vLLM 0.33.0 scheduler driven
through the adapter (synchronous ``PolicyScheduler`` and ``PolicyAsyncScheduler``, FCFS and
priority scheduling), over a pressured seeded workload and in a constructed four-victim
cascade (the pool's free blocks are taken, so a chunked prefill cannot continue):

* ``now`` is the step timestamp (``scheduled_timestamp``, vLLM's ``time.monotonic()``): every
  decision of one ``schedule()`` call carries the same value, taken inside that call on the
  monotonic clock, later steps carry later values, and it is the timestamp vLLM records on
  the victim's PREEMPTED event. A policy's cooldowns compare ``now`` with ``now`` only, so a
  wall-clock or per-decision value would break them;
* a repeated decision in the same step (a cascade) keeps the requester and lists ``running``
  without the victims already taken, and ``kv_cache_usage`` is the KV manager's usage at
  that decision (after the earlier victims' blocks were freed), not a step-start snapshot;
* ``scheduling_policy`` is the lowercase ``str`` (``"fcfs"`` / ``"priority"``), never vLLM's
  ``SchedulingPolicy`` enum, which compares unequal to those strings;
* the adapter logs nothing above DEBUG per decision (only the controller's construction
  line at INFO, before the first step).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from itertools import pairwise
from types import ModuleType
from typing import Any

import pytest

from bidkv_ext.contract import PreemptionContext
from tests.conftest import seeded_workload


@dataclass
class Decision:
    step: int
    context: PreemptionContext
    usage: float
    running: list[str]


def _decision(scheduler: Any, context: PreemptionContext) -> Decision:
    """The context with the scheduler's live step, KV usage and running ids."""
    return Decision(
        scheduler.current_step,
        context,
        scheduler.kv_cache_manager.usage,
        [r.request_id for r in scheduler.running],
    )


@dataclass
class StepRecorder:
    """Records each context with the live step number, KV usage and running ids.

    ``choose_head`` picks the head of ``running`` (often already scheduled this step);
    otherwise the policy abstains and the host's own victim is taken.
    """

    choose_head: bool
    scheduler: Any = None
    decisions: list[Decision] = field(default_factory=list)

    def select_victim(self, context: PreemptionContext) -> str | None:
        self.decisions.append(_decision(self.scheduler, context))
        return context.candidates[0].request_id if self.choose_head else None


def _preempted_timestamps(scheduler: Any, request_id: str) -> list[float]:
    from vllm.v1.engine import EngineCoreEventType

    request = scheduler.requests[request_id]
    return [e.timestamp for e in request.events if e.type == EngineCoreEventType.PREEMPTED]


@pytest.mark.parametrize("choose_head", [False, True], ids=["abstain", "head"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("policy_name", ["fcfs", "priority"])
def test_step_values_of_every_context(
    vllm_offline: ModuleType,
    make_scheduler: Any,
    caplog: pytest.LogCaptureFixture,
    policy_name: str,
    async_scheduling: bool,
    choose_head: bool,
) -> None:
    from bidkv_ext.hosts.vllm import PolicyAsyncScheduler, PolicyScheduler

    policy = StepRecorder(choose_head)
    scheduler = make_scheduler(
        num_gpu_blocks=48,
        preemption_policy=policy,
        policy=policy_name,
        max_num_seqs=16,
        async_scheduling=async_scheduling,
    )
    assert type(scheduler) is (PolicyAsyncScheduler if async_scheduling else PolicyScheduler)
    policy.scheduler = scheduler
    pending = list(seeded_workload(7, 60))
    step_nows: list[float] = []
    caplog.set_level(logging.DEBUG)
    caplog.clear()  # the controller's INFO construction line is not per decision
    while pending or scheduler.has_unfinished_requests():
        for _ in range(min(2, len(pending))):
            rid, prompt, max_tokens, arrival, priority = pending.pop(0)
            scheduler.add_request(
                vllm_offline.make_request(rid, prompt, max_tokens, arrival, priority)
            )
        seen = len(policy.decisions)
        before = time.monotonic()
        out = scheduler.schedule()
        after = time.monotonic()
        decisions = policy.decisions[seen:]
        assert all(d.step == scheduler.current_step for d in decisions)
        if decisions:
            now = decisions[0].context.now
            assert before <= now <= after, "now must be this step's monotonic timestamp"
            assert all(d.context.now == now for d in decisions), "one timestamp per step"
            if step_nows:
                assert now > step_nows[-1]
            step_nows.append(now)
            # vLLM stamps each victim's PREEMPTED event with the same step timestamp.
            for victim in out.preempted_req_ids or ():
                assert _preempted_timestamps(scheduler, victim)[-1] == now
        for d in decisions:
            ctx = d.context
            assert type(ctx.scheduling_policy) is str and ctx.scheduling_policy == policy_name
            assert ctx.kv_cache_usage == d.usage
            assert [c.request_id for c in ctx.candidates] == d.running
        for first, later in pairwise(decisions):
            # Between two decisions of one step, running only loses the earlier victim.
            ctx = first.context
            victim = ctx.candidates[0].request_id if choose_head else ctx.builtin_victim_id
            assert later.running == [rid for rid in first.running if rid != victim]
        scheduler.update_from_output(out, vllm_offline.runner_output_for(out, scheduler))

    assert len(step_nows) > 5, "the workload must preempt in several steps"
    stats = scheduler.controller.export_stats()
    assert stats["failures"] == 0 and stats["calls"] == len(policy.decisions)
    loud = [
        r for r in caplog.records
        if r.name.startswith("bidkv_ext") and r.levelno > logging.DEBUG
    ]
    assert loud == [], f"per-decision log records above DEBUG: {loud}"


@dataclass
class SpareRequester:
    """Picks the newest running request other than the requester; the requester last."""

    scheduler: Any = None
    decisions: list[Decision] = field(default_factory=list)

    def select_victim(self, context: PreemptionContext) -> str | None:
        self.decisions.append(_decision(self.scheduler, context))
        others = [
            c.request_id
            for c in context.candidates
            if c.request_id != context.requesting_request_id
        ]
        return others[-1] if others else context.requesting_request_id


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("policy_name", ["fcfs", "priority"])
def test_a_cascade_in_one_step_reads_fresh_values(
    vllm_offline: ModuleType, make_scheduler: Any, policy_name: str, async_scheduling: bool
) -> None:
    """Three one-block requests run beside a long prompt in chunked prefill, whose next
    chunk needs five more blocks; the pool's free blocks are then taken. Sparing the
    requester, the policy is asked four times in that one step: each small request frees
    one block, then the requester goes. Every decision has the step's ``now``, the same
    requester, ``running`` without the earlier victims and the usage after their blocks
    were freed."""
    policy = SpareRequester()
    scheduler = make_scheduler(
        num_gpu_blocks=16,
        preemption_policy=policy,
        policy=policy_name,
        max_num_batched_tokens=96,
        max_num_seqs=8,
        async_scheduling=async_scheduling,
    )
    policy.scheduler = scheduler
    for i in range(3):
        prompt = [1000 * (i + 1) + t for t in range(10)]
        scheduler.add_request(vllm_offline.make_request(f"s{i}", prompt, 20, float(i)))
    big = [5000 + t for t in range(192)]
    scheduler.add_request(vllm_offline.make_request("big", big, 4, 3.0))
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"s0": 10, "s1": 10, "s2": 10, "big": 66}
    scheduler.update_from_output(first, vllm_offline.runner_output_for(first, scheduler))
    # Take every free block, so the long prompt's next chunk (five blocks) cannot fit.
    pool = scheduler.kv_cache_manager.block_pool
    pool.get_new_blocks(pool.get_num_free_blocks())
    assert policy.decisions == []

    before = time.monotonic()
    out = scheduler.schedule()
    after = time.monotonic()

    decisions = policy.decisions
    assert [d.context.requesting_request_id for d in decisions] == ["big"] * 4
    assert [d.running for d in decisions] == [
        ["s0", "s1", "s2", "big"], ["s0", "s1", "big"], ["s0", "big"], ["big"]
    ]
    assert [[c.request_id for c in d.context.candidates] for d in decisions] == [
        d.running for d in decisions
    ]
    now = decisions[0].context.now
    assert before <= now <= after
    assert [d.context.now for d in decisions] == [now] * 4
    usage = [d.context.kv_cache_usage for d in decisions]
    assert usage == [d.usage for d in decisions]
    assert usage[0] == 1.0 and usage == sorted(usage, reverse=True) and len(set(usage)) == 4
    assert [type(d.context.scheduling_policy) for d in decisions] == [str] * 4
    assert out.preempted_req_ids == {"s0", "s1", "s2", "big"}
    assert out.num_scheduled_tokens == {}  # every scheduled small was rolled back
    for victim in ("s0", "s1", "s2", "big"):
        assert _preempted_timestamps(scheduler, victim) == [now]
    stats = scheduler.controller.export_stats()
    assert (stats["calls"], stats["selections"], stats["failures"]) == (4, 4, 0)
