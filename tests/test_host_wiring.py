"""How vLLM finds the adapter and how the adapter finds the policy.

``--scheduler-cls bidkv_ext.hosts.vllm.PolicyScheduler`` resolves through vLLM's own
``SchedulerConfig.get_scheduler_cls``; the selector picks the async variant when async
scheduling is on; the policy comes from the constructor or from
``additional_config["preemption_policy"]`` (dotted path, contract loading rules, errors
propagate); the controller writes manager evidence (initialized, effective) when
``VLLM_HUST_EXT_EVIDENCE_PATH`` is set, and ``shutdown`` records a final ``effective``.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from bidkv_ext.contract import PreemptionContext


class ChooseHead:
    """Always picks the first running request (a valid, non-stock choice)."""

    def select_victim(self, context: PreemptionContext) -> str | None:
        return context.candidates[0].request_id


class BrokenFactory:
    @classmethod
    def from_vllm_config(cls, vllm_config: object) -> ChooseHead:
        raise ValueError("utility_completion_weight must be >= 0")


def _pressure(offline: ModuleType, scheduler: Any) -> None:
    for i in range(6):
        prompt = [500 * i + t for t in range(40)]
        scheduler.add_request(offline.make_request(f"q{i}", prompt, 30, float(i)))


def test_scheduler_cls_dotted_path_resolves(vllm_offline: ModuleType) -> None:
    from bidkv_ext.hosts.vllm import PolicyScheduler

    vllm_config, _ = vllm_offline.build_vllm_config(num_gpu_blocks=16)
    vllm_config.scheduler_config.scheduler_cls = "bidkv_ext.hosts.vllm.PolicyScheduler"
    assert vllm_config.scheduler_config.get_scheduler_cls() is PolicyScheduler


def test_the_factory_resolves_and_follows_async_scheduling(vllm_offline: ModuleType) -> None:
    """``--scheduler-cls bidkv_ext.hosts.vllm.policy_scheduler`` (the README's command):
    vLLM resolves it and, async scheduling on, gets the async variant."""
    from vllm.v1.structured_output import StructuredOutputManager

    from bidkv_ext.hosts.vllm import PolicyAsyncScheduler, PolicyScheduler, policy_scheduler

    for async_on, expected in ((True, PolicyAsyncScheduler), (False, PolicyScheduler)):
        vllm_config, kv = vllm_offline.build_vllm_config(num_gpu_blocks=16)
        vllm_config.scheduler_config.async_scheduling = async_on
        vllm_config.scheduler_config.scheduler_cls = "bidkv_ext.hosts.vllm.policy_scheduler"
        factory = vllm_config.scheduler_config.get_scheduler_cls()
        assert factory is policy_scheduler
        made = factory(  # the keywords vLLM's EngineCore passes
            vllm_config=vllm_config,
            kv_cache_config=kv,
            structured_output_manager=StructuredOutputManager(vllm_config),
            include_finished_set=False,
            log_stats=False,
            block_size=16,
        )
        assert type(made) is expected


def test_selector_follows_async_scheduling(vllm_offline: ModuleType) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from bidkv_ext.hosts.vllm import (
        PolicyAsyncScheduler,
        PolicyScheduler,
        policy_scheduler,
        select_scheduler_cls,
    )

    vllm_config, kv = vllm_offline.build_vllm_config(num_gpu_blocks=16)
    assert select_scheduler_cls(vllm_config) is PolicyScheduler
    vllm_config.scheduler_config.async_scheduling = True
    assert select_scheduler_cls(vllm_config) is PolicyAsyncScheduler
    scheduler = vllm_offline.build_scheduler(vllm_config, kv, preemption_policy=ChooseHead)
    assert isinstance(scheduler, PolicyAsyncScheduler) and isinstance(scheduler, AsyncScheduler)
    assert scheduler.controller.enabled
    from vllm.v1.structured_output import StructuredOutputManager

    made = policy_scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=16,
    )
    assert type(made) is PolicyAsyncScheduler


def test_policy_from_additional_config(vllm_offline: ModuleType) -> None:
    vllm_config, kv = vllm_offline.build_vllm_config(
        num_gpu_blocks=12,
        additional_config={"preemption_policy": f"{__name__}.ChooseHead"},
    )
    scheduler = vllm_offline.build_scheduler(vllm_config, kv)
    assert scheduler.controller.export_stats()["policy_name"] == f"{__name__}.ChooseHead"
    _pressure(vllm_offline, scheduler)
    vllm_offline.run_to_completion(scheduler)
    stats = scheduler.controller.export_stats()
    assert stats["selections"] == stats["calls"] > 0 and stats["failures"] == 0
    assert vllm_offline.free_blocks(scheduler) == 11


def test_constructor_policy_wins_over_additional_config(vllm_offline: ModuleType) -> None:
    vllm_config, kv = vllm_offline.build_vllm_config(
        num_gpu_blocks=12, additional_config={"preemption_policy": "no.such.Policy"}
    )
    scheduler = vllm_offline.build_scheduler(vllm_config, kv, preemption_policy=ChooseHead())
    assert scheduler.controller.export_stats()["policy_name"].endswith("ChooseHead")


def test_policy_load_errors_fail_construction(vllm_offline: ModuleType) -> None:
    vllm_config, kv = vllm_offline.build_vllm_config(num_gpu_blocks=12)
    with pytest.raises(ValueError, match="utility_completion_weight"):
        vllm_offline.build_scheduler(vllm_config, kv, preemption_policy=BrokenFactory)
    with pytest.raises(TypeError, match="implementing PreemptionPolicy"):
        vllm_offline.build_scheduler(vllm_config, kv, preemption_policy=object())


def test_stock_scheduler_refuses_a_policy(vllm_offline: ModuleType) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    vllm_config, kv = vllm_offline.build_vllm_config(num_gpu_blocks=12)
    with pytest.raises(TypeError, match="takes no preemption_policy"):
        vllm_offline.build_scheduler(vllm_config, kv, scheduler_cls=Scheduler, preemption_policy=1)


def test_evidence_written_and_shutdown_reports_effective(
    vllm_offline: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    evidence = tmp_path / "evidence.jsonl"
    monkeypatch.setenv("VLLM_HUST_EXT_EVIDENCE_PATH", str(evidence))
    vllm_config, kv = vllm_offline.build_vllm_config(num_gpu_blocks=12)
    scheduler = vllm_offline.build_scheduler(vllm_config, kv, preemption_policy=ChooseHead())
    _pressure(vllm_offline, scheduler)
    vllm_offline.run_to_completion(scheduler)
    scheduler.shutdown()
    lines = [json.loads(line) for line in evidence.read_text().splitlines()]
    assert [line["event"] for line in lines] == ["initialized", "effective", "effective"]
    assert lines[-1]["stats"]["calls"] == scheduler.controller.export_stats()["calls"] > 0


def test_a_diffusion_model_is_refused_not_given_the_autoregressive_scheduler(
    vllm_offline: ModuleType,
) -> None:
    """vLLM picks its DiffusionScheduler only when no scheduler_cls is named; the adapter
    would silently replace it, so a diffusion config is refused in one line naming why."""
    from vllm.config.diffusion import DiffusionConfig

    from bidkv_ext.hosts.vllm import select_scheduler_cls

    vllm_config, _ = vllm_offline.build_vllm_config(num_gpu_blocks=16)
    object.__setattr__(vllm_config, "diffusion_config", DiffusionConfig(canvas_length=8))
    with pytest.raises(ValueError) as refused:
        select_scheduler_cls(vllm_config)
    assert "\n" not in str(refused.value)
    assert str(refused.value).startswith(
        "the stock-vLLM policy adapter does not support diffusion language models"
    )
