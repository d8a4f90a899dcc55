"""The stock-vLLM adapter honours the policy's victim with the host's semantics.

Conformance items 9-13 of preemption-contract.md section 13, against the real vLLM 0.33.0
scheduler and KV-cache manager: the context is ``running`` in order (requester and
already-scheduled requests included) with the stock choice as ``builtin_victim_id``; a
victim already scheduled this step is removed with its token budget, scheduled entry and
new blocks rolled back and the loop index corrected; exactly its exclusively owned blocks
return to the pool (prefix-shared blocks stay); choosing the requester stops the retry
loop; a step with a preemption admits nothing from WAITING; faulty policies are disabled
after one ERROR and the run continues exactly as stock vLLM; optional host facts reach
policies that ask for them.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import pytest

from bidkv_ext.contract import PreemptionContext, PreemptionContextFacts
from tests.conftest import drive_workload, seeded_workload
from tests.policy_helpers import raised_in_another_thread

BLOCK = 16
SHARED = list(range(100, 132))  # two full blocks shared by requests "0" and "1"


class Recorder:
    """Abstains or chooses a fixed id; records each context and the pool as the policy saw it."""

    def __init__(self, choose: str | None = None) -> None:
        self.choose = choose
        self.scheduler: Any = None
        self.contexts: list[PreemptionContext] = []
        self.running_ids: list[list[str]] = []
        self.exclusive: list[dict[str, int]] = []

    def select_victim(self, context: PreemptionContext) -> str | None:
        self.contexts.append(context)
        s = self.scheduler
        self.running_ids.append([r.request_id for r in s.running])
        manager = s.kv_cache_manager
        self.exclusive.append(
            {
                r.request_id: sum(
                    1
                    for b in manager.get_blocks(r.request_id).blocks[0]
                    if not b.is_null and b.ref_cnt == 1
                )
                for r in s.running
            }
        )
        return self.choose


def _three_requests(offline: ModuleType, scheduler: Any) -> None:
    # "0" and "1" share SHARED (2 blocks); each has one own prompt block; "2" is unshared.
    prompts = [SHARED + [1000 + i for i in range(16)], SHARED + [2000 + i for i in range(16)]]
    prompts.append([3000 + i for i in range(48)])
    for i, prompt in enumerate(prompts):
        scheduler.add_request(offline.make_request(str(i), prompt, 40, 10.0 + i))


def _step(offline: ModuleType, scheduler: Any) -> Any:
    out = scheduler.schedule()
    scheduler.update_from_output(out, offline.runner_output_for(out, scheduler))
    return out


def _pressured(offline: ModuleType, make_scheduler: Any, policy: Recorder) -> Any:
    """Step 1 prefills all three into 7 of 8 usable blocks; step 2's decodes need 3 more."""
    scheduler = make_scheduler(num_gpu_blocks=9, preemption_policy=policy)
    policy.scheduler = scheduler
    _three_requests(offline, scheduler)
    first = _step(offline, scheduler)
    assert [r.req_id for r in first.scheduled_new_reqs] == ["0", "1", "2"]
    assert first.scheduled_new_reqs[1].num_computed_tokens == 32  # prefix hit on "0"
    assert offline.free_blocks(scheduler) == 1
    return scheduler


def test_context_is_running_in_order_with_stock_builtin(
    vllm_offline: ModuleType, make_scheduler: Any
) -> None:
    policy = Recorder(choose=None)
    scheduler = _pressured(vllm_offline, make_scheduler, policy)
    _step(vllm_offline, scheduler)
    ctx = policy.contexts[0]
    assert [c.request_id for c in ctx.candidates] == ["0", "1", "2"] == policy.running_ids[0]
    assert ctx.requesting_request_id == "1"
    assert ctx.builtin_victim_id == "2"  # FCFS: the tail
    assert ctx.scheduling_policy == "fcfs"
    assert ctx.kv_cache_usage == pytest.approx(1.0)  # "0" took the last free block
    first = ctx.candidates[0]
    assert (first.num_prompt_tokens, first.num_output_tokens, first.max_tokens) == (48, 1, 40)
    assert (first.num_computed_tokens, first.num_preemptions) == (48, 0)
    assert first.arrival_time == 10.0


@pytest.mark.parametrize("policy_name", ["fcfs", "priority"])
def test_every_context_matches_running_and_stock_rule(
    vllm_offline: ModuleType, make_scheduler: Any, policy_name: str
) -> None:
    """Over a pressured workload, each context mirrors ``running`` at the call."""
    policy = Recorder(choose=None)
    scheduler = make_scheduler(
        num_gpu_blocks=48, preemption_policy=policy, policy=policy_name, max_num_seqs=16
    )
    policy.scheduler = scheduler
    drive_workload(vllm_offline, scheduler, seeded_workload(7, 60))
    assert len(policy.contexts) > 10
    for ctx, running in zip(policy.contexts, policy.running_ids, strict=True):
        ids = [c.request_id for c in ctx.candidates]
        assert ids == running and ctx.requesting_request_id in ids
        if policy_name == "priority":
            stock = max(ctx.candidates, key=lambda c: (c.priority, c.arrival_time)).request_id
        else:
            stock = ids[-1]
        assert ctx.builtin_victim_id == stock


def test_scheduled_victim_is_rolled_back_and_frees_exclusive_blocks(
    vllm_offline: ModuleType, make_scheduler: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A victim already scheduled this step gives back its token *and* input budget, its
    scheduled entry and new blocks; the loop index is corrected (contract section 13)."""
    policy = Recorder(choose="0")  # "0" is already scheduled when "1" fails to allocate
    scheduler = _pressured(vllm_offline, make_scheduler, policy)
    victim = scheduler.requests["0"]
    shared_blocks = vllm_offline_blocks(scheduler, "0")[:2]

    freed: list[int] = []
    preempt = scheduler._preempt_request

    def measured(request: Any, *args: Any, **kwargs: Any) -> Any:
        before = vllm_offline.free_blocks(scheduler)
        result = preempt(request, *args, **kwargs)
        freed.append(vllm_offline.free_blocks(scheduler) - before)
        return result

    monkeypatch.setattr(scheduler, "_preempt_request", measured)
    # Two tokens of budget, token and input budget alike: "2" is scheduled only if the
    # victim's token is given back to both and the loop index is corrected after removing
    # an entry before the requester.
    scheduler.max_num_scheduled_tokens = 2
    batched = scheduler.scheduler_config.max_num_batched_tokens
    scheduler.scheduler_config.max_num_batched_tokens = 2
    out = scheduler.schedule()
    scheduler.scheduler_config.max_num_batched_tokens = batched

    assert len(policy.contexts) == 1
    assert out.preempted_req_ids == {"0"}
    assert out.num_scheduled_tokens == {"1": 1, "2": 1}
    assert out.total_num_scheduled_tokens == 2
    assert "0" not in out.scheduled_cached_reqs.req_ids  # its new block entry is gone
    # Exactly its exclusive blocks (own prompt block + this step's new block) came back.
    assert policy.exclusive[0]["0"] == 2
    assert freed == [2]
    assert all(b.ref_cnt == 1 for b in shared_blocks)  # still held by "1"
    assert vllm_offline_blocks(scheduler, "1")[:2] == shared_blocks
    # Host-side preemption effects (item 11).
    assert victim.status.name == "PREEMPTED" and victim.num_computed_tokens == 0
    assert victim.num_preemptions == 1
    assert scheduler.waiting.peek_request() is victim
    assert [r.request_id for r in scheduler.running] == ["1", "2"]
    scheduler.update_from_output(out, vllm_offline.runner_output_for(out, scheduler))
    scheduler.max_num_scheduled_tokens = 8192
    vllm_offline.run_to_completion(scheduler)
    assert vllm_offline.free_blocks(scheduler) == 8
    assert scheduler.controller.export_stats()["selections"] >= 1


def vllm_offline_blocks(scheduler: Any, request_id: str) -> list[Any]:
    return list(scheduler.kv_cache_manager.get_blocks(request_id).blocks[0])


def test_choosing_requester_stops_loop_and_skips_admission(
    vllm_offline: ModuleType, make_scheduler: Any
) -> None:
    policy = Recorder(choose="1")  # the requester itself
    scheduler = _pressured(vllm_offline, make_scheduler, policy)
    late = vllm_offline.make_request("late", [5, 6, 7], 4, 99.0)
    scheduler.add_request(late)
    out = scheduler.schedule()

    assert len(policy.contexts) == 1  # the retry loop ended after the requester
    assert out.preempted_req_ids == {"1"}
    assert out.num_scheduled_tokens == {"0": 1}  # FCFS: the running loop stops too
    assert out.scheduled_new_reqs == []  # no admission from WAITING in this step
    requester = scheduler.requests["1"]
    assert requester.num_computed_tokens == 0 and requester.num_preemptions == 1
    assert scheduler.waiting.peek_request() is requester
    assert late.status.name == "WAITING"


class Unknown:
    def select_victim(self, context: PreemptionContext) -> object:
        return "no-such-request"


class NotAString:
    def select_victim(self, context: PreemptionContext) -> object:
        return 42


class Unhashable:
    def select_victim(self, context: PreemptionContext) -> object:
        return [context.candidates[0].request_id]


class Raises:
    def select_victim(self, context: PreemptionContext) -> object:
        raise RuntimeError("policy bug")


@pytest.fixture(scope="module")
def stock_digests(vllm_offline: ModuleType) -> list[object]:
    from vllm.v1.core.sched.scheduler import Scheduler

    vllm_config, kv = vllm_offline.build_vllm_config(num_gpu_blocks=48, max_num_seqs=16)
    stock = vllm_offline.build_scheduler(vllm_config, kv, scheduler_cls=Scheduler)
    digests, preemptions = drive_workload(vllm_offline, stock, seeded_workload(11, 80))
    assert preemptions > 10
    return digests


@pytest.mark.parametrize(
    ("policy_cls", "invalid"),
    [(Unknown, 1), (NotAString, 1), (Unhashable, 1), (Raises, 0)],
)
def test_faulty_policy_is_disabled_once_and_run_is_stock(
    vllm_offline: ModuleType,
    make_scheduler: Any,
    stock_digests: list[object],
    caplog: pytest.LogCaptureFixture,
    policy_cls: type,
    invalid: int,
) -> None:
    scheduler = make_scheduler(num_gpu_blocks=48, preemption_policy=policy_cls(), max_num_seqs=16)
    with caplog.at_level(logging.ERROR, logger="bidkv_ext.controller"):
        digests, _ = drive_workload(vllm_offline, scheduler, seeded_workload(11, 80))
    assert digests == stock_digests  # the faulty call fell back to the stock victim
    stats = scheduler.controller.export_stats()
    assert stats["enabled"] is False
    assert (stats["calls"], stats["failures"], stats["invalid_selections"]) == (1, 1, invalid)
    assert stats["selections"] == 0
    disabled = [r for r in caplog.records if "disabling it" in r.getMessage()]
    assert len(disabled) == 1 and disabled[0].levelno == logging.ERROR


class FactsPolicy:
    """Asks for host facts; abstains, so the run stays stock."""

    wants_host_facts = True

    def __init__(self) -> None:
        self.seen: list[tuple[PreemptionContext, PreemptionContextFacts | None]] = []

    def select_victim(self, context: PreemptionContext) -> str | None:
        raise AssertionError("the host must call select_victim_with_facts")

    def select_victim_with_facts(
        self, context: PreemptionContext, facts: PreemptionContextFacts | None
    ) -> str | None:
        self.seen.append((context, facts))
        return None


def test_host_facts_reach_policies_that_want_them(
    vllm_offline: ModuleType, make_scheduler: Any
) -> None:
    policy = FactsPolicy()
    scheduler = _pressured(vllm_offline, make_scheduler, policy)  # type: ignore[arg-type]
    _step(vllm_offline, scheduler)
    context, facts = policy.seen[0]
    assert facts is not None and facts.block_size == BLOCK
    assert set(facts.facts) == {c.request_id for c in context.candidates}
    # "0" holds 2 shared + 1 own prompt block + 1 new decode block; "1" 2 shared + 1 own.
    assert facts.facts["0"].total_blocks == 4 and facts.facts["0"].exclusive_blocks == 2
    assert facts.facts["1"].total_blocks == 3 and facts.facts["1"].exclusive_blocks == 1
    assert facts.facts["2"].exclusive_blocks == 3 and facts.facts["2"].cached_blocks == 3
    assert facts.needed_blocks == 1  # "1" needs a 4th block and none is free


def test_facts_not_computed_for_plain_policies(
    vllm_offline: ModuleType, make_scheduler: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = Recorder(choose=None)
    scheduler = _pressured(vllm_offline, make_scheduler, policy)

    def boom(*args: Any) -> Any:
        raise AssertionError("facts computed for a policy that did not ask")

    monkeypatch.setattr(scheduler, "_host_facts", boom)
    _step(vllm_offline, scheduler)
    assert len(policy.contexts) == 1


def test_no_policy_path_still_guards_the_thread(
    vllm_offline: ModuleType, make_scheduler: Any
) -> None:
    """With no policy in charge the adapter skips the context but keeps the contract's
    single-thread guard (section 5): a victim asked for from another thread raises."""
    scheduler = make_scheduler(num_gpu_blocks=48)
    assert not scheduler.controller.enabled
    _three_requests(vllm_offline, scheduler)
    _step(vllm_offline, scheduler)
    requester = scheduler.running[0]
    error = raised_in_another_thread(
        lambda: scheduler._bidkv_select_victim(requester, 0.0, 1))
    assert isinstance(error, RuntimeError) and "scheduler thread" in str(error)
    assert scheduler._bidkv_select_victim(requester, 0.0, 1) is scheduler.running[-1]
