"""Equivalence: the rewritten scheduler with an abstaining policy is stock vLLM, step by step.

Conformance item 12 (preemption-contract.md section 13). On a seeded workload of a few
hundred requests under KV pressure, ``PolicyScheduler`` with no policy, with an
always-abstaining policy and with ``BidkvPreemptionPolicy`` on its ``builtin`` strategy
produces exactly the ``SchedulerOutput`` sequence of unmodified ``Scheduler`` (scheduled ids
and token counts, block ids, preempted and finished ids) and the same free-block count
after every step, for FCFS and priority scheduling, prefix caching on and off.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from bidkv_ext.contract import PreemptionContext
from tests.conftest import drive_workload, seeded_workload

NUM_REQUESTS = 240
NUM_GPU_BLOCKS = 72  # 71 usable blocks of 16 tokens: heavy pressure for this workload
ARRIVALS_PER_STEP = 2
CONFIG = {"max_num_seqs": 24, "max_num_batched_tokens": 256, "max_model_len": 1024}


class AlwaysAbstain:
    """The smallest conforming policy: it never chooses."""

    def __init__(self) -> None:
        self.contexts = 0

    def select_victim(self, context: PreemptionContext) -> str | None:
        self.contexts += 1
        return None


def trace_run(offline: ModuleType, scheduler: Any) -> tuple[list[object], int]:
    return drive_workload(
        offline,
        scheduler,
        seeded_workload(1234, NUM_REQUESTS),
        arrivals_per_step=ARRIVALS_PER_STEP,
    )


@pytest.fixture(scope="module")
def stock_runs(vllm_offline: ModuleType) -> dict[tuple[str, bool], tuple[list[object], int]]:
    return {}


def _bidkv_builtin() -> object:
    """BidKV's ``builtin`` strategy, loaded as a server loads it (the class; its settings
    from the engine's additional_config)."""
    return pytest.importorskip("bidkv_ext.selector").BidkvPreemptionPolicy


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["apc", "no-apc"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("variant", ["no-policy", "abstain", "bidkv-builtin"])
def test_policy_scheduler_matches_stock(
    vllm_offline: ModuleType,
    make_scheduler: Any,
    stock_runs: dict[tuple[str, bool], tuple[list[object], int]],
    policy: str,
    prefix_caching: bool,
    variant: str,
) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    key = (policy, prefix_caching)
    if key not in stock_runs:
        stock = make_scheduler(
            num_gpu_blocks=NUM_GPU_BLOCKS,
            scheduler_cls=Scheduler,
            policy=policy,
            enable_prefix_caching=prefix_caching,
            **CONFIG,
        )
        stock_runs[key] = trace_run(vllm_offline, stock)
    expected, stock_preemptions = stock_runs[key]
    assert stock_preemptions > 50, "workload must put the KV cache under pressure"

    chosen: object = {
        "no-policy": lambda: None,
        "abstain": AlwaysAbstain,
        "bidkv-builtin": _bidkv_builtin,
    }[variant]()
    settings = {"bidkv": {"enabled": True, "strategy": "builtin"}}
    ours = make_scheduler(
        num_gpu_blocks=NUM_GPU_BLOCKS,
        preemption_policy=chosen,
        policy=policy,
        enable_prefix_caching=prefix_caching,
        additional_config=settings if variant == "bidkv-builtin" else None,
        **CONFIG,
    )
    actual, preemptions = trace_run(vllm_offline, ours)

    assert preemptions == stock_preemptions
    assert len(actual) == len(expected)
    for step, (got, want) in enumerate(zip(actual, expected, strict=True)):
        assert got == want, f"step {step} differs from stock vLLM"
    stats = ours.controller.export_stats()
    if variant == "no-policy":
        assert stats["calls"] == 0 and stats["policy_name"] == "builtin"
    else:
        # The policy was asked at every decision and abstained each time.
        assert stats["calls"] > 0 and stats["enabled"] is True
        assert stats["abstentions"] == stats["calls"] and stats["selections"] == 0
    if variant == "bidkv-builtin":
        assert ours.controller.policy.config.strategy == "builtin"


def test_async_variant_matches_stock_async_scheduler(
    vllm_offline: ModuleType, make_scheduler: Any
) -> None:
    """``PolicyAsyncScheduler`` (what ``policy_scheduler`` builds under vLLM 0.33.0's default
    async scheduling) with an abstaining policy is stock ``AsyncScheduler`` step by step;
    with BidKV choosing it runs the same workload to completion and returns every block."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from bidkv_ext.hosts.vllm import PolicyAsyncScheduler
    from bidkv_ext.selector import BidkvPreemptionPolicy

    def run(cls: type | None, policy: object, **extra: Any) -> tuple[Any, list[object], int]:
        scheduler = make_scheduler(
            num_gpu_blocks=NUM_GPU_BLOCKS, scheduler_cls=cls, preemption_policy=policy,
            async_scheduling=True, **CONFIG, **extra,
        )
        return (scheduler, *trace_run(vllm_offline, scheduler))

    _, expected, stock_preemptions = run(AsyncScheduler, None)
    assert stock_preemptions > 50, "workload must put the KV cache under pressure"
    ours, actual, preemptions = run(PolicyAsyncScheduler, AlwaysAbstain())
    assert type(ours) is PolicyAsyncScheduler
    assert preemptions == stock_preemptions and actual == expected
    # Configured as on a server: the class, with the engine's additional_config.
    chosen, _, bidkv_preemptions = run(
        PolicyAsyncScheduler, BidkvPreemptionPolicy,
        additional_config={"bidkv": {"enabled": True}},
    )
    stats = chosen.controller.export_stats()
    assert stats["selections"] == stats["calls"] == bidkv_preemptions > 0
    assert stats["failures"] == 0
    assert vllm_offline.free_blocks(chosen) == NUM_GPU_BLOCKS - 1  # all returned
