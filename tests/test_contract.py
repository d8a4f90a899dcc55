"""The local contract types match the vLLM-HUST host: field order, frozen, slotted, defaults."""

from __future__ import annotations

import dataclasses

import pytest

from bidkv_ext import contract
from bidkv_ext.contract import (
    PREEMPTION_POLICY_API_VERSION,
    PreemptionCandidate,
    PreemptionContext,
    PreemptionPolicy,
    PreemptionPolicyStats,
    candidate_index,
)
from bidkv_ext.selector import BidkvPreemptionPolicy


def test_candidate_field_order_is_the_hosts() -> None:
    names = [f.name for f in dataclasses.fields(PreemptionCandidate)]
    assert names == [
        "request_id",
        "priority",
        "arrival_time",
        "num_prompt_tokens",
        "num_output_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "max_tokens",
    ]


def test_context_field_order_and_optional_builtin() -> None:
    names = [f.name for f in dataclasses.fields(PreemptionContext)]
    assert names == [
        "candidates",
        "scheduling_policy",
        "requesting_request_id",
        "kv_cache_usage",
        "now",
        "builtin_victim_id",
    ]
    c = PreemptionCandidate("a", 0, 1.0, 10, 0, 10, 0, 16)
    assert PreemptionContext((c,), "fcfs", "a", 0.5, 2.0).builtin_victim_id is None


def test_types_are_frozen_and_slotted() -> None:
    c = PreemptionCandidate("a", 0, 1.0, 10, 0, 10, 0, 16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_computed_tokens = 3  # type: ignore[misc]
    ctx = PreemptionContext((c,), "fcfs", "a", 0.5, 2.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.now = 3.0  # type: ignore[misc]
    assert not hasattr(c, "__dict__") and not hasattr(ctx, "__dict__")


def test_stats_defaults_and_version_markers() -> None:
    assert dataclasses.asdict(PreemptionPolicyStats()) == {
        "policy_name": "builtin",
        "enabled": False,
        "calls": 0,
        "selections": 0,
        "abstentions": 0,
        "failures": 0,
        "invalid_selections": 0,
    }
    assert PREEMPTION_POLICY_API_VERSION == "1.0"
    assert BidkvPreemptionPolicy.vllm_preemption_policy_api_version == 1
    assert isinstance(BidkvPreemptionPolicy(), PreemptionPolicy)
    assert set(contract.__all__) >= {
        "PREEMPTION_POLICY_API_VERSION",
        "PreemptionCandidate",
        "PreemptionContext",
        "PreemptionPolicy",
        "PreemptionPolicyController",
        "PreemptionPolicyStats",
    }


def test_host_controller_name_loads_from_the_engine_config() -> None:
    """``PreemptionPolicyController(vllm_config)``, as the host module exports it, loads
    ``scheduler_config.preemption_policy``; without that field there is no policy."""
    from types import SimpleNamespace

    controller = contract.PreemptionPolicyController(
        SimpleNamespace(
            scheduler_config=SimpleNamespace(
                preemption_policy="bidkv_ext.selector.BidkvPreemptionPolicy"
            ),
            additional_config={"bidkv": {"enabled": True}},
        )
    )
    stats = controller.export_stats()
    assert stats["policy_name"] == "bidkv_ext.selector.BidkvPreemptionPolicy"
    assert stats["enabled"] is True
    stock = contract.PreemptionPolicyController(SimpleNamespace(scheduler_config=object()))
    assert stock.export_stats()["enabled"] is False and stock.policy is None


def test_policy_accepts_foreign_objects_by_attribute() -> None:
    """A host's own (non-ours) candidate/context classes work: attribute access only."""

    @dataclasses.dataclass(frozen=True)
    class HostCandidate:
        request_id: str
        priority: int
        arrival_time: float
        num_prompt_tokens: int
        num_output_tokens: int
        num_computed_tokens: int
        num_preemptions: int
        max_tokens: int

    @dataclasses.dataclass(frozen=True)
    class HostContext:
        candidates: tuple[HostCandidate, ...]
        scheduling_policy: str
        requesting_request_id: str
        kv_cache_usage: float
        now: float
        builtin_victim_id: str | None = None

    from bidkv_ext.config import BidKVConfig

    cands = tuple(HostCandidate(str(i), 0, float(i), 500, 5, 505, 0, 64) for i in range(3))
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True))
    chosen = policy.select_victim(HostContext(cands, "fcfs", "2", 0.9, 1.0, "2"))  # type: ignore[arg-type]
    assert chosen in {"0", "1", "2"}


def test_candidate_index_finds_every_position_and_reports_absence() -> None:
    """candidate_index (used by the controller's validation and the built-in victim) must
    return the true position for the head, middle and tail (the tail has its own fast
    path) and -1 for an unknown id or no candidates."""
    cands = [PreemptionCandidate(f"r{i}", 0, float(i), 10, 1, 11, 0, 100) for i in range(7)]
    for i in range(7):
        assert candidate_index(cands, f"r{i}") == i
    assert candidate_index(cands, "r7") == -1
    assert candidate_index(cands, 3) == -1  # not a str: never equal to an id
    assert candidate_index([], "r0") == -1
