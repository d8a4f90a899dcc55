"""The real scheduler's own decisions, logged step by step while the replay engine runs.

Shared by the replay tests that check the engine's figures against what the scheduler
decided (tests/test_replay_accounting.py, tests/test_replay_properties.py).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest


@dataclass
class Step:
    """One ``schedule()`` call and the ``update_from_output()`` that followed it."""

    start: float  # the scheduler's clock in schedule()
    preempted: frozenset[str]
    scheduled: dict[str, tuple[int, int]]  # id -> (tokens, num_computed_tokens after)
    total: int  # total_num_scheduled_tokens
    end: float = math.nan  # the scheduler's clock in update_from_output()
    emitted: Counter[str] = field(default_factory=Counter)  # new output tokens per id
    finished: list[str] = field(default_factory=list)


@contextmanager
def logged_steps(log: list[Step]) -> Iterator[None]:
    """Log every step of the schedulers the engine builds while the context is open."""
    from vllm.v1.core.sched import scheduler as sched_module

    from bidkv_ext.hosts.vllm import offline

    build = offline.build_scheduler

    def logging_build(*args: Any, **kwargs: Any) -> Any:
        scheduler = build(*args, **kwargs)
        schedule, update = scheduler.schedule, scheduler.update_from_output

        def logged_schedule() -> Any:
            out = schedule()
            log.append(Step(
                start=sched_module.time.monotonic(),
                preempted=frozenset(out.preempted_req_ids),
                scheduled={rid: (k, scheduler.requests[rid].num_computed_tokens)
                           for rid, k in out.num_scheduled_tokens.items()},
                total=out.total_num_scheduled_tokens,
            ))
            return out

        def logged_update(out: Any, runner_output: Any) -> Any:
            result = update(out, runner_output)
            step = log[-1]
            step.end = sched_module.time.monotonic()
            for engine_outputs in result.values():
                for output in engine_outputs.outputs:
                    step.emitted[output.request_id] += len(output.new_token_ids)
                    if output.finish_reason is not None:
                        step.finished.append(output.request_id)
            return result

        scheduler.schedule = logged_schedule  # instance attributes: the class is intact
        scheduler.update_from_output = logged_update
        return scheduler

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(offline, "build_scheduler", logging_build)
        yield
