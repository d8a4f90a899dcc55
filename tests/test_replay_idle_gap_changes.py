"""Capacity changes timed while the engine is empty apply at their own times.

Guarded behaviour (engine.py ``_Loop.run``, capacity.py ``ElasticPool.idle``): no step runs
in an idle gap, so the elastic pool walks the schedule's changes inside the gap itself.
Every block is free then, so a shrink there completes at once. A shrink and the growth
that undoes it inside one gap used to vanish: the next step saw only the capacity in force
at its arrival, so the report counted neither, and its lowest capacity stayed the full
pool. A change timed during the last step (before the replay's end) now applies at the
end; one after the end still never does (tests/test_replay_shrink_at_end.py).
Real vLLM 0.33.0 scheduler; a unit step model (1 s per step) keeps the times exact.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import HAVE_VLLM

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (real-scheduler tier)")

USABLE = 15
# 8 one-block requests (4 prompt + 5 output tokens) arrive at t=10, the schedule's origin:
# prefill 10-11, four decodes 11-15, all finish at 15. One more arrives at t=40 and
# finishes at 45. The engine is empty from 15 to 40 (schedule time 5 to 30).
FIRST, SECOND = 10.0, 40.0


def _run(points: list[dict[str, float]]) -> Any:
    from bidkv_ext.replay.arms import named_arm
    from bidkv_ext.replay.capacity import parse_capacity_schedule
    from bidkv_ext.replay.engine import ReplaySettings, run_arm
    from bidkv_ext.replay.steptime import StepTimeModel
    from bidkv_ext.replay.trace import TraceRequest

    requests = (*(TraceRequest(i, FIRST, 4, 5) for i in range(8)),
                TraceRequest(8, SECOND, 4, 5))
    settings = ReplaySettings(
        num_gpu_blocks=USABLE + 1, enable_prefix_caching=False, blocks_per_page=1,
        capacity_schedule=parse_capacity_schedule(points, "schedule", USABLE))
    unit = StepTimeModel("unit", a=1.0, b=0.0, c=0.0, d=0.0)
    return run_arm(requests, named_arm("builtin", 0), settings, unit)


def test_a_shrink_and_its_growth_inside_one_gap_are_both_applied() -> None:
    """Shrink to 4 at schedule time 10 and back to 15 at 20, both inside the gap: one
    shrink, completed at once (0 s, none of it spent in shrink), one growth, two capacity
    changes, lowest capacity 4. It used to report 0 shrinks, 0 growths, 0 changes and a
    lowest capacity of 15."""
    run = _run([{"t": 10, "blocks": 4}, {"t": 20, "blocks": USABLE}])
    assert [o.finish for o in run.outcomes] == [FIRST + 5.0] * 8 + [SECOND + 5.0]
    cap = run.capacity
    assert cap is not None
    assert (cap["shrinks"], cap["grows"], cap["shrinks_completed"]) == (1, 1, 1)
    assert cap["capacity_changes"] == 2
    assert cap["shrink_completion_s"] == {"max": 0.0, "mean": 0.0}
    assert cap["time_in_shrink_s"] == 0.0 and cap["steps_in_shrink"] == 0
    assert cap["min_effective_blocks"] == 4
    # Every block was free or reserved when the shrink completed.
    assert cap["free_pages_at_shrink_end"] == {"min": USABLE, "reserve_pages_max": 11}
    assert cap["reserved_blocks_end"] == 0 and cap["free_blocks_end"] == USABLE
    assert run.free_blocks_end == USABLE


def test_a_shrink_inside_a_gap_holds_for_the_next_arrival() -> None:
    """A shrink to 4 inside the gap with no growth: the last request runs under capacity 4
    (reserve of 11 at the end), one shrink completed at once."""
    run = _run([{"t": 10, "blocks": 4}])
    cap = run.capacity
    assert cap is not None
    assert (cap["shrinks"], cap["grows"], cap["shrinks_completed"]) == (1, 0, 1)
    assert cap["shrink_completion_s"]["max"] == 0.0
    assert cap["reserved_blocks_end"] == 11 and cap["free_blocks_end"] == 4


def test_a_change_timed_during_the_last_step_applies_at_the_end() -> None:
    """The last step runs 44-45 (schedule time 34-35); a shrink at 34.5 is inside the
    replay and applies at its end, 45: counted and completed at once. It used to be
    dropped (0 shrinks, lowest capacity 15)."""
    run = _run([{"t": 34.5, "blocks": 4}])
    cap = run.capacity
    assert cap is not None
    assert (cap["shrinks"], cap["shrinks_completed"]) == (1, 1)
    assert cap["min_effective_blocks"] == 4
    assert cap["reserved_blocks_end"] == 11
