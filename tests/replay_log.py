"""The real scheduler's own decisions, logged step by step while the replay engine runs.

Shared by the replay tests that check the engine's figures against what the scheduler
decided (tests/test_replay_accounting.py, tests/test_replay_properties.py). With a capacity
schedule, each step also records the elastic pool's state right after ``schedule()``, and
after ``ElasticPool.idle`` (and the times the engine passed it) when the engine emptied
after it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest


@dataclass(frozen=True)
class Capacity:
    """The elastic pool right after ``schedule()`` (``ElasticPool.after_schedule``)."""

    target: int  # capacity the schedule asks for now
    effective: int  # usable blocks minus the reserve
    used: int  # blocks requests hold
    in_shrink: bool  # the reserve still lacks blocks to reach the target


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
    capacity: Capacity | None = None  # None without a capacity schedule
    # The pool after ElasticPool.idle, when the engine emptied after this step before a gap
    # to the next arrival (a pending shrink reserves the freed blocks then; the changes
    # timed inside the gap apply), or for good (the replay's end).
    idle_capacity: Capacity | None = None
    # The engine's arguments to that call: empty from `now` until the next arrival
    # (None: the replay ended).
    idle_window: tuple[float, float | None] | None = None


@contextmanager
def logged_steps(log: list[Step], max_steps: int | None = None) -> Iterator[None]:
    """Log every step of the schedulers the engine builds while the context is open.

    With ``max_steps``, a replay that would log more steps fails (AssertionError) instead
    of looping: the engine has no step limit of its own.
    """
    from vllm.v1.core.sched import scheduler as sched_module

    from bidkv_ext.hosts.vllm import offline
    from bidkv_ext.replay.capacity import ElasticPool

    build = offline.build_scheduler

    def logging_build(*args: Any, **kwargs: Any) -> Any:
        scheduler = build(*args, **kwargs)
        schedule, update = scheduler.schedule, scheduler.update_from_output

        def logged_schedule() -> Any:
            assert max_steps is None or len(log) < max_steps, (
                f"more than {max_steps} scheduler steps: the replay does not end "
                f"(the last at t={log[-1].start}, preempting {sorted(log[-1].preempted)})")
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

    after_schedule = ElasticPool.after_schedule

    def logged_after_schedule(pool: ElasticPool) -> None:
        # The engine calls it right after schedule(), so the step is the last one logged.
        log[-1].capacity = Capacity(pool.target, pool.effective, pool.used(), pool.in_shrink)
        after_schedule(pool)

    idle = ElasticPool.idle

    def logged_idle(pool: ElasticPool, now: float, until: float | None) -> None:
        idle(pool, now, until)
        if log:  # the engine empties only after a step
            log[-1].idle_capacity = Capacity(pool.target, pool.effective, pool.used(),
                                             pool.in_shrink)
            log[-1].idle_window = (now, until)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(offline, "build_scheduler", logging_build)
        patch.setattr(ElasticPool, "after_schedule", logged_after_schedule)
        patch.setattr(ElasticPool, "idle", logged_idle)
        yield
