"""A policy that is also a ``ReplayObserver`` follows the real replay it decides in.

Guards the hook the lookahead oracle (``benchmarks/replay/headroom.py``) stands on, through
the real vLLM 0.33.0 scheduler: the observer sees the loop's state before the first step,
the clock after every model step (in order, ending at the last finish), and the end of the
replay exactly once; a length it rewrites ends that request there; an error raised inside
the replay reaches ``replay_ended`` and then the caller. Policies without these methods are
not observers (every other replay test runs them). The state's ``position`` drops to 0 at a
preemption while ``mark`` keeps the high-water mark, and a step that only preempted (no
model step) is not reported.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.conftest import HAVE_VLLM

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (real-scheduler tier)")

from bidkv_ext.contract import PreemptionContext  # noqa: E402
from bidkv_ext.replay.engine import ReplayObserver, ReplayState  # noqa: E402

COUNT, BLOCKS, SHORTENED = 40, 300, 3


class _LcfObserver:
    """Least computed first, recording what the replay tells it."""

    def __init__(self, fail_at_step: int = 0) -> None:
        self.fail_at_step = fail_at_step
        self.state: ReplayState | None = None
        self.lengths_at_start: list[int] = []
        self.steps: list[float] = []
        self.ended: list[BaseException | None] = []

    def select_victim(self, context: PreemptionContext) -> str | None:
        return min(context.candidates, key=lambda c: c.num_computed_tokens).request_id

    def replay_started(self, state: ReplayState) -> None:
        self.state = state
        self.lengths_at_start = list(state.lengths)
        state.lengths[0] = SHORTENED  # the first request must now end after 3 tokens

    def replay_stepped(self, now: float) -> None:
        self.steps.append(now)
        if len(self.steps) == self.fail_at_step:
            raise ValueError("observer failed on purpose")

    def replay_ended(self, error: BaseException | None) -> None:
        self.ended.append(error)


def _run(policy: object) -> Any:
    from bidkv_ext.replay.arms import Arm
    from bidkv_ext.replay.cli import SAMPLE_TRACE
    from bidkv_ext.replay.engine import ReplaySettings, run_arm
    from bidkv_ext.replay.steptime import load_step_model
    from bidkv_ext.replay.trace import load_trace

    requests = tuple(load_trace(SAMPLE_TRACE)[:COUNT])
    arm = Arm("observer", "class", lambda _lengths: policy)
    settings = ReplaySettings(num_gpu_blocks=BLOCKS, enable_prefix_caching=False)
    return requests, run_arm(requests, arm, settings, load_step_model("llama-3.1-8b-h100"))


def test_observer_sees_state_every_step_and_the_end() -> None:
    observer = _LcfObserver()
    assert isinstance(observer, ReplayObserver)
    requests, run = _run(observer)
    assert observer.lengths_at_start == [r.output_length for r in requests]
    assert observer.state is not None and observer.state.recomputed == run.recomputed_tokens
    assert run.preemption_events > 0  # the window is under real KV pressure
    assert observer.steps == sorted(observer.steps) and len(observer.steps) <= run.steps
    assert observer.steps[-1] == max(o.finish for o in run.outcomes)
    assert observer.ended == [None]
    outputs = [o.output_tokens for o in run.outcomes]
    assert outputs[0] == SHORTENED != requests[0].output_length
    assert outputs[1:] == [r.output_length for r in requests[1:]]
    assert not any(math.isnan(o.finish) for o in run.outcomes)


def test_an_error_inside_the_replay_reaches_the_observer_then_the_caller() -> None:
    observer = _LcfObserver(fail_at_step=5)
    with pytest.raises(ValueError, match="on purpose"):
        _run(observer)
    assert len(observer.steps) == 5
    assert len(observer.ended) == 1 and isinstance(observer.ended[0], ValueError)


class _SelfVictimObserver:
    """Preempts the request that asked for blocks; snapshots the state after every step."""

    def __init__(self) -> None:
        self.state: ReplayState | None = None
        self.seen: list[tuple[float, list[int], list[int]]] = []

    def select_victim(self, context: PreemptionContext) -> str | None:
        return context.requesting_request_id

    def replay_started(self, state: ReplayState) -> None:
        self.state = state

    def replay_stepped(self, now: float) -> None:
        assert self.state is not None
        state = self.state
        self.seen.append((now, list(state.position), list(state.mark)))

    def replay_ended(self, error: BaseException | None) -> None:
        pass


def test_observer_state_follows_a_preemption() -> None:
    """``ReplayState``'s documented fields through a preemption: ``position`` drops to 0
    when a request is preempted and stays there while it waits, while ``mark`` keeps its
    high-water mark; the step that only preempted ran no model, so the observer is not
    called for it."""
    from bidkv_ext.replay.arms import Arm
    from bidkv_ext.replay.engine import ReplaySettings, run_arm
    from bidkv_ext.replay.steptime import StepTimeModel
    from bidkv_ext.replay.trace import TraceRequest

    # 3 usable blocks: request 0 (16-token prompt) needs a second block in step 2 and
    # preempts itself; 1 and 2 decode alone until they finish (t=8), then 0 returns.
    requests = (TraceRequest(0, 0.0, 16, 3), TraceRequest(1, 0.0, 4, 8),
                TraceRequest(2, 0.0, 4, 8))
    observer = _SelfVictimObserver()
    arm = Arm("self-victim", "class", lambda _lengths: observer)
    run = run_arm(requests, arm, ReplaySettings(num_gpu_blocks=4, enable_prefix_caching=False),
                  StepTimeModel("unit", a=1.0, b=0.0, c=0.0, d=0.0))
    assert run.steps == 11 and run.preemption_events == 1
    assert [now for now, *_ in observer.seen] == [float(t) for t in range(1, 11)]
    assert observer.seen[0][1:] == ([16, 4, 4], [16, 4, 4])
    assert observer.seen[1][1:] == ([0, 5, 5], [16, 5, 5])
    assert observer.seen[7][1:] == ([0, 11, 11], [16, 11, 11])
    assert observer.seen[8][1:] == ([17, 11, 11], [17, 11, 11])
