"""A policy's victim leaves the scheduler exactly as stock vLLM leaves it for that victim.

Conformance items 10 and 11 (preemption-contract.md section 13), checked against stock
vLLM 0.33.0 itself rather than against invariants. Under PRIORITY scheduling stock
``Scheduler.schedule`` picks its victim with ``max(self.running, key=...)`` and then runs
the removal the adapter makes unconditional (removal by index, loop-index correction, full
rollback of a victim already scheduled in the step). So a stock scheduler whose module-level
``max`` is made to return a scripted victim is an oracle: stock code preempts exactly the
request the script names. ``PolicyScheduler`` driven by a policy answering from the same
script must produce the same ``SchedulerOutput`` (scheduled ids, token counts, block ids,
preempted and finished ids) and the same free-block count at every step, with the same
number of preemptions. The script abstains, names the requester, or names any running
request (often one scheduled earlier in the same step), with and without prefix caching,
for the synchronous and the async scheduler.
"""

from __future__ import annotations

import builtins
import random
import sys
from types import ModuleType
from typing import Any

import pytest

from bidkv_ext.contract import PreemptionContext
from tests.conftest import drive_workload, seeded_workload

NUM_REQUESTS = 120
NUM_GPU_BLOCKS = 72
CONFIG = {"max_num_seqs": 24, "max_num_batched_tokens": 256, "max_model_len": 1024}
SEED = 7


def scripted_pick(call: int, ids: list[str], requester: str) -> str | None:
    """The ``call``-th answer (1-based): abstain, the requester, or any running request."""
    rng = random.Random(SEED * 100_003 + call)
    draw = rng.random()
    if draw < 0.25:
        return None
    if draw < 0.4:
        return requester
    return ids[rng.randrange(len(ids))]


class ScriptedPolicy:
    """Answers each decision from :func:`scripted_pick`."""

    def __init__(self) -> None:
        self.calls = 0
        self.visited = 0  # picks of a request before the requester: visited in the step

    def select_victim(self, context: PreemptionContext) -> str | None:
        self.calls += 1
        ids = [c.request_id for c in context.candidates]
        requester = context.requesting_request_id
        choice = scripted_pick(self.calls, ids, requester)
        if choice is not None and ids.index(choice) < ids.index(requester):
            self.visited += 1
        return choice


def _forced_max(stock: Any, counter: list[int]) -> Any:
    """A ``max`` for the scheduler module: stock's victim choice follows the script,
    every other call is the builtin's."""

    def forced(*args: Any, **kwargs: Any) -> Any:
        if args and args[0] is stock.running and "key" in kwargs:
            counter[0] += 1
            requester = sys._getframe(1).f_locals["request"]
            ids = [r.request_id for r in stock.running]
            choice = scripted_pick(counter[0], ids, requester.request_id)
            if choice is not None:
                return stock.running[ids.index(choice)]
        return builtins.max(*args, **kwargs)

    return forced


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["apc", "no-apc"])
def test_policy_victim_matches_stock_preempting_it(
    vllm_offline: ModuleType,
    make_scheduler: Any,
    monkeypatch: pytest.MonkeyPatch,
    prefix_caching: bool,
    async_scheduling: bool,
) -> None:
    from vllm.v1.core.sched import scheduler as stock_module
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    settings: dict[str, Any] = dict(
        num_gpu_blocks=NUM_GPU_BLOCKS, policy="priority", enable_prefix_caching=prefix_caching,
        async_scheduling=async_scheduling, **CONFIG,
    )
    stock = make_scheduler(
        scheduler_cls=AsyncScheduler if async_scheduling else Scheduler, **settings
    )
    stock_calls = [0]
    with monkeypatch.context() as patch:
        patch.setattr(stock_module, "max", _forced_max(stock, stock_calls), raising=False)
        expected, stock_preemptions = drive_workload(
            vllm_offline, stock, seeded_workload(SEED, NUM_REQUESTS)
        )
    assert "max" not in vars(stock_module)

    policy = ScriptedPolicy()
    ours = make_scheduler(preemption_policy=policy, **settings)
    actual, preemptions = drive_workload(vllm_offline, ours, seeded_workload(SEED, NUM_REQUESTS))

    stats = ours.controller.export_stats()
    # Not vacuous: many decisions, most of them picks, some of a request already visited.
    assert stats["calls"] == stock_calls[0] > 20
    assert stats["selections"] > stats["abstentions"] > 0 and policy.visited > 0
    assert stats["failures"] == 0
    assert preemptions == stock_preemptions
    assert len(actual) == len(expected)
    for step, (got, want) in enumerate(zip(actual, expected, strict=True)):
        assert got == want, f"step {step} differs from stock vLLM preempting the same victim"
