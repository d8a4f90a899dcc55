"""Well-formed input at the semantic edges of a replay through the real vLLM scheduler.

Guarded behaviours:

* ``run_arm`` refuses, before the first scheduler step and naming the request, a request it
  cannot replay as the trace says: prompt plus output above ``max_model_len`` (vLLM would
  end it early, so it "completed" with a shorter output; with ``max_tokens="model-len"`` a
  prompt of ``max_model_len`` or more made vLLM raise its own validation error mid-replay)
  or an output of 0 tokens;
* a replay that can never progress (a request larger than the KV pool, or than the capacity
  schedule's final capacity) ends with a :class:`ReplayError` naming the request, within a
  few steps, instead of spinning;
* one-token outputs, identical timestamps, a first arrival far from 0, ``max_num_seqs`` 1
  and identical prompts under prefix caching give a conserved run whose figures are all
  defined (no NaN, no division by zero; ``None`` where there is no sample).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.conftest import HAVE_VLLM
from tests.replay_log import Step, logged_steps

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (real-scheduler tier)")

from bidkv_ext.replay.arms import named_arm  # noqa: E402
from bidkv_ext.replay.capacity import parse_capacity_schedule  # noqa: E402
from bidkv_ext.replay.engine import ReplayError, ReplaySettings, run_arm  # noqa: E402
from bidkv_ext.replay.metrics import arm_metrics  # noqa: E402
from bidkv_ext.replay.steptime import StepTimeModel  # noqa: E402
from bidkv_ext.replay.trace import TraceRequest  # noqa: E402

UNIT = StepTimeModel("unit", a=1.0, b=0.0, c=0.0, d=0.0)
MAX_STEPS = 200  # far above what these replays need: a spinning replay fails, not hangs


@pytest.mark.parametrize(
    ("prompt", "output", "max_tokens", "message"),
    [
        (200, 3, "model-len", "request 1: 200 prompt + 3 output tokens exceed max_model_len 128"),
        (128, 1, "model-len", "request 1: 128 prompt + 1 output tokens exceed max_model_len 128"),
        (120, 30, "exact", "request 1: 120 prompt + 30 output tokens exceed max_model_len 128"),
        (120, 30, "model-len",
         "request 1: 120 prompt + 30 output tokens exceed max_model_len 128"),
        (10, 0, "exact", "request 1: 10 prompt and 0 output tokens; expected at least 1 of each"),
        (10, 0, "model-len",
         "request 1: 10 prompt and 0 output tokens; expected at least 1 of each"),
    ],
)
def test_a_request_the_scheduler_cannot_replay_is_refused_before_any_step(
    prompt: int, output: int, max_tokens: str, message: str
) -> None:
    requests = (TraceRequest(0, 0.0, 10, 2), TraceRequest(1, 1.0, prompt, output))
    settings = ReplaySettings(num_gpu_blocks=64, max_model_len=128, max_num_batched_tokens=256,
                              max_tokens=max_tokens)
    log: list[Step] = []
    with logged_steps(log, MAX_STEPS), pytest.raises(ReplayError) as refused:
        run_arm(requests, named_arm("builtin", 0), settings, UNIT)
    assert str(refused.value) == message
    assert log == []


def test_the_longest_request_max_model_len_allows_is_replayed_exactly() -> None:
    """The bound is inclusive: prompt + output == max_model_len runs to its full output."""
    requests = (TraceRequest(0, 0.0, 120, 8),)
    for max_tokens in ("model-len", "exact"):
        settings = ReplaySettings(num_gpu_blocks=64, max_model_len=128,
                                  max_num_batched_tokens=256, max_tokens=max_tokens)
        (outcome,) = run_arm(requests, named_arm("builtin", 0), settings, UNIT).outcomes
        assert (outcome.output_tokens, outcome.completions) == (8, 1), max_tokens


@pytest.mark.parametrize(
    ("capacity", "message"),
    [
        # 7 usable blocks of 16 tokens; request 1 needs 13.
        (None, r"request 1 \(200 prompt \+ 3 output tokens\) needs more KV blocks than "
               r"--num-gpu-blocks provides"),
        # 63 usable blocks, but only 2 from t=0.5 on; request 1 (t=5) needs 3.
        ([{"t": 0.5, "blocks": 2}], r"request 1 \(40 prompt \+ 3 output tokens\) needs more KV "
                                    r"blocks than the capacity schedule's final 2 blocks"),
    ],
)
def test_a_replay_that_cannot_progress_stops_naming_the_request(
    capacity: list[dict[str, float]] | None, message: str
) -> None:
    """The engine's liveness rule: with nothing schedulable and no arrival or capacity change
    left, the replay stops at once (after the request before it finished), not spinning."""
    schedule = None if capacity is None else parse_capacity_schedule(capacity, "edge", 63)
    blocks = 8 if capacity is None else 64
    prompt = 200 if capacity is None else 40
    requests = (TraceRequest(0, 0.0, 10, 2), TraceRequest(1, 5.0, prompt, 3))
    settings = ReplaySettings(num_gpu_blocks=blocks, max_num_batched_tokens=256,
                              blocks_per_page=1, capacity_schedule=schedule)
    log: list[Step] = []
    with logged_steps(log, MAX_STEPS), pytest.raises(ReplayError, match=message):
        run_arm(requests, named_arm("builtin", 0), settings, UNIT)
    assert [step.finished for step in log if step.finished] == [["0"]]
    assert len(log) <= 6


def _finite(value: Any, where: str = "metrics") -> None:
    """Every number in the figures is finite; ``None`` marks a figure without samples."""
    if isinstance(value, dict):
        for key, item in value.items():
            _finite(item, f"{where}.{key}")
    elif isinstance(value, float):
        assert math.isfinite(value), where


def test_edge_traces_give_defined_figures() -> None:
    """One-token outputs arriving together far from t=0, one running request at a time,
    identical prompts under prefix caching: conserved, and every figure defined (TPOT has
    no sample, so it is None; no preemption, so the per-preemption figures are 0)."""
    origin = 1e9
    requests = tuple(TraceRequest(i, origin, 40, 1, (7,)) for i in range(4))
    settings = ReplaySettings(num_gpu_blocks=8, max_num_seqs=1, max_num_batched_tokens=64,
                              enable_prefix_caching=True)
    log: list[Step] = []
    with logged_steps(log, MAX_STEPS):
        run = run_arm(requests, named_arm("least-computed-first", 0), settings, UNIT)
    metrics = arm_metrics(run)
    _finite(metrics)
    assert metrics["conservation"] == {"all_completed_once": True, "exact_output_lengths": True,
                                       "free_blocks_end": 7, "usable_blocks": 7}
    # One request per step; the three later ones hit the first one's two full blocks and
    # compute only their last 8 positions.
    assert run.steps == 4 and run.computed_tokens == 40 + 3 * 8
    assert metrics["tpot_s"] == {"p50": None, "p95": None, "p99": None, "mean": None}
    assert metrics["ttft_s"] == pytest.approx({"p50": 2.5, "p95": 3.85, "p99": 3.97,
                                               "mean": 2.5})
    assert metrics["makespan_s"] == 4.0 and metrics["throughput_output_tok_s"] == 1.0
    assert metrics["preemptions"] == metrics["recompute_tax"] == 0
    assert metrics["recomputed_tokens_per_preemption"] == metrics["steps_to_return_mean"] == 0
