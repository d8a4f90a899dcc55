"""Edges of the replay loop (engine.py ``_Loop.run``) through the real vLLM 0.33.0 scheduler.

Guards: two steps in a row that only preempt (each schedules nothing because the first
running request preempted itself) are progress, not "nothing can be scheduled": the clock
neither jumps to the next arrival nor reports that the replay is stuck. The clock jumps
only after two steps in a row that neither schedule nor preempt (the reported step count).
With a capacity schedule, a shrink pending when the engine empties completes when the last
requests free their blocks, not at the next arrival: the idle gap is no time in shrink.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import HAVE_VLLM

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (real-scheduler tier)")


class _SelfVictim:
    """Preempts the request that asked for blocks, whatever else is running."""

    def select_victim(self, context: Any) -> str | None:
        return str(context.requesting_request_id)


def test_two_preempt_only_steps_in_a_row_keep_the_clock() -> None:
    """Only steps that neither schedule nor preempt count toward the clock jump.

    4 usable blocks, prefix caching on. Requests 0 and 1 share their prompt's first 32
    tokens (the same Mooncake hash block): request 0 holds 2 blocks, both shared with
    request 1, which holds 1 more; request 2 holds the fourth. At t=1 request 0 needs a
    block and preempts itself, freeing nothing (its blocks are shared), so the step
    schedules nothing; the next step request 1 needs a block and preempts itself, again
    scheduling nothing. Request 2 still runs at t=1: it decodes 7 steps (done at 8), then
    request 1 (9) and request 0 (10) resume from their cached prefixes. Counting the two
    preempt-only steps as idle would jump the clock to request 3's arrival at t=30 (or,
    without it, end the replay with "cannot make progress").
    """
    from bidkv_ext.replay.arms import Arm
    from bidkv_ext.replay.engine import ReplaySettings, run_arm
    from bidkv_ext.replay.steptime import StepTimeModel
    from bidkv_ext.replay.trace import TraceRequest

    requests = (TraceRequest(0, 0.0, 32, 2, (0,)), TraceRequest(1, 0.0, 48, 2, (0,)),
                TraceRequest(2, 0.0, 4, 8), TraceRequest(3, 30.0, 4, 1))
    arm = Arm("self-victim", "class", lambda _lengths: _SelfVictim())
    run = run_arm(requests, arm, ReplaySettings(num_gpu_blocks=5),
                  StepTimeModel("unit", a=1.0, b=0.0, c=0.0, d=0.0))
    assert run.preemption_events == 2 and run.pressure_steps == 2
    # 13 steps: 1 prefill, 2 preempt-only, 7 decodes, 2 resumes, request 3; none idle.
    assert run.steps == 13
    assert [(o.first_token, o.finish, o.preemptions) for o in run.outcomes] == [
        (1.0, 10.0, 1), (1.0, 9.0, 1), (1.0, 8.0, 0), (31.0, 31.0, 0)]
    # Resumes hit their cached prefixes: 32 + 16 + 4 prompt positions, 7 decodes, one
    # position per resume, request 3's 4; the upper bound counts 32 + 48 anyway.
    assert run.computed_tokens == 52 + 7 + 2 + 4 and run.recomputed_tokens == 0
    assert run.recompute_upper_bound == 80


def _unit_model() -> Any:
    from bidkv_ext.replay.steptime import StepTimeModel

    return StepTimeModel("unit", a=1.0, b=0.0, c=0.0, d=0.0)


def _capacity(points: list[dict[str, float]], usable: int) -> Any:
    from bidkv_ext.replay.capacity import parse_capacity_schedule

    return parse_capacity_schedule(points, "schedule", usable)


def test_a_stuck_scheduler_is_asked_twice_before_the_clock_jumps() -> None:
    """The engine doc's rule: the clock jumps only after two steps in a row that neither
    schedule nor preempt. Request 0 needs 2 blocks, 1 is usable until t=105: steps 1-2 at
    t=100 are idle, the clock jumps to the growth, steps 3-4 prefill and decode it (done at
    107), and step 5 runs request 1 after the gap (jumping over an empty engine is no
    step). The reported step count moves if the rule asks once or three times."""
    from bidkv_ext.replay.arms import named_arm
    from bidkv_ext.replay.engine import ReplaySettings, run_arm
    from bidkv_ext.replay.trace import TraceRequest

    requests = (TraceRequest(0, 100.0, 20, 2), TraceRequest(1, 110.0, 4, 1))
    settings = ReplaySettings(
        num_gpu_blocks=4, enable_prefix_caching=False, blocks_per_page=1,
        capacity_schedule=_capacity([{"t": 0, "blocks": 1}, {"t": 5, "blocks": 3}], 3))
    run = run_arm(requests, named_arm("builtin", 0), settings, _unit_model())
    assert [(o.first_token, o.finish) for o in run.outcomes] == [(106.0, 107.0),
                                                                 (111.0, 111.0)]
    assert run.steps == 5
    assert run.capacity is not None and run.capacity["steps_in_shrink"] == 0


def test_a_shrink_completes_when_the_last_request_frees_its_blocks() -> None:
    """An idle gap is no time in shrink. 15 usable blocks, 8 one-block requests from t=0 to
    t=5; at t=1 capacity shrinks to 4, so the reserve takes the 7 free blocks and waits
    for 4 more, which the requests free at t=5, when the engine empties until the next
    arrival at t=100. The shrink completes at t=5: 4 s in shrink, completion time 4 s.
    The pool used to see the freed blocks only at the next step, at t=100 (99 s both)."""
    from bidkv_ext.replay.arms import named_arm
    from bidkv_ext.replay.engine import ReplaySettings, run_arm
    from bidkv_ext.replay.trace import TraceRequest

    requests = (*(TraceRequest(i, 0.0, 4, 5) for i in range(8)), TraceRequest(8, 100.0, 4, 2))
    settings = ReplaySettings(num_gpu_blocks=16, enable_prefix_caching=False,
                              blocks_per_page=1,
                              capacity_schedule=_capacity([{"t": 1, "blocks": 4}], 15))
    run = run_arm(requests, named_arm("builtin", 0), settings, _unit_model())
    assert [o.finish for o in run.outcomes] == [5.0] * 8 + [102.0]
    cap = run.capacity
    assert cap is not None
    assert (cap["shrinks"], cap["shrinks_completed"]) == (1, 1)
    assert cap["shrink_completion_s"] == {"max": 4.0, "mean": 4.0}
    assert cap["time_in_shrink_s"] == 4.0
    # Steps at t=1..4 ran with the shrink pending; the engine's idle gap is no step.
    assert cap["steps_in_shrink"] == 4
    assert cap["reserved_blocks_end"] == 11 and cap["free_blocks_end"] == 4
    assert cap["min_effective_blocks"] == 4



def test_a_shrink_completed_in_an_idle_gap_counts_before_a_growth_in_it() -> None:
    """The same shrink with a growth back to 15 blocks at t=50, inside the idle gap: the
    capacity was 4 blocks from t=5 to t=50 (min capacity 4, a reserve of 11 one-block
    pages when the shrink completed, after 4 s). It used to be reported as 8 blocks at
    least, a shrink of 99 s "completed" by the growth at t=100 with a reserve of 0 pages."""
    from bidkv_ext.replay.arms import named_arm
    from bidkv_ext.replay.engine import ReplaySettings, run_arm
    from bidkv_ext.replay.trace import TraceRequest

    requests = (*(TraceRequest(i, 0.0, 4, 5) for i in range(8)), TraceRequest(8, 100.0, 4, 2))
    settings = ReplaySettings(
        num_gpu_blocks=16, enable_prefix_caching=False, blocks_per_page=1,
        capacity_schedule=_capacity([{"t": 1, "blocks": 4}, {"t": 50, "blocks": 15}], 15))
    run = run_arm(requests, named_arm("builtin", 0), settings, _unit_model())
    cap = run.capacity
    assert cap is not None
    assert (cap["shrinks"], cap["grows"], cap["shrinks_completed"]) == (1, 1, 1)
    assert cap["shrink_completion_s"] == {"max": 4.0, "mean": 4.0}
    assert cap["free_pages_at_shrink_end"] == {"min": 15, "reserve_pages_max": 11}
    assert cap["min_effective_blocks"] == 4 and cap["time_in_shrink_s"] == 4.0
    assert cap["reserved_blocks_end"] == 0 and cap["free_blocks_end"] == 15
