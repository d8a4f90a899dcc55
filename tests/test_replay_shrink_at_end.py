"""A shrink still pending when the replay ends completes when the last requests finish.

Guarded behaviour (engine.py ``_Loop.run``, capacity.py ``ElasticPool.idle``): the end of
the replay is the engine emptying for good. The last requests' finishes free their blocks
at the last step's end, so a pending shrink takes them then, as it does before an idle gap
and as kvcached would: it counts as done ("shrinks done" in the capacity report), its
completion time and its time in shrink run to the last finish (not to the last step's
start), and the end state holds the reserve at the target. A schedule change after the end
is never applied. The replay used to end with the shrink pending: reported not done, its
time in shrink one step short, free blocks above the target at the end.
Real vLLM 0.33.0 scheduler; a unit step model (1 s per step) keeps the times exact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import HAVE_VLLM

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (real-scheduler tier)")

USABLE = 15
# 8 one-block requests (4 prompt + 5 output tokens) arrive together at t=10 (the schedule's
# origin): the prefill step runs 10-11, four decodes 11-15, all finish at 15. At t=1 after
# the origin capacity shrinks to 4: the reserve takes the 7 free blocks and waits for 4 more,
# which only the last finishes free.
ARRIVAL = 10.0
SHRINK = {"t": 1, "blocks": 4}


def _unit_model() -> Any:
    from bidkv_ext.replay.steptime import StepTimeModel

    return StepTimeModel("unit", a=1.0, b=0.0, c=0.0, d=0.0)


def _run(points: list[dict[str, float]]) -> Any:
    from bidkv_ext.replay.arms import named_arm
    from bidkv_ext.replay.capacity import parse_capacity_schedule
    from bidkv_ext.replay.engine import ReplaySettings, run_arm
    from bidkv_ext.replay.trace import TraceRequest

    requests = tuple(TraceRequest(i, ARRIVAL, 4, 5) for i in range(8))
    settings = ReplaySettings(
        num_gpu_blocks=USABLE + 1, enable_prefix_caching=False, blocks_per_page=1,
        capacity_schedule=parse_capacity_schedule(points, "schedule", USABLE))
    return run_arm(requests, named_arm("builtin", 0), settings, _unit_model())


@pytest.mark.parametrize(
    "points",
    [[SHRINK], [SHRINK, {"t": 50, "blocks": USABLE}]],
    ids=["last-change", "growth-after-the-end"],
)
def test_a_shrink_pending_at_the_end_completes_at_the_last_finish(
    points: list[dict[str, float]],
) -> None:
    """The shrink from t=11 completes at t=15, when the last requests free their blocks:
    done, 4 s to complete, 4 s in shrink (steps at 11..14), capacity 4 with a reserve of
    11 one-block pages, 4 blocks free at the end. A growth scheduled after the end (t=60)
    is not applied. It used to stay pending: 0 of 1 done, 3 s in shrink, capacity 8 at
    least, 8 blocks free and 7 reserved at the end."""
    run = _run(points)
    assert [o.finish for o in run.outcomes] == [ARRIVAL + 5.0] * 8
    cap = run.capacity
    assert cap is not None
    assert (cap["shrinks"], cap["grows"], cap["shrinks_completed"]) == (1, 0, 1)
    assert cap["shrink_completion_s"] == {"max": 4.0, "mean": 4.0}
    assert cap["time_in_shrink_s"] == 4.0
    assert cap["steps_in_shrink"] == 4
    assert cap["free_pages_at_shrink_end"] == {"min": USABLE, "reserve_pages_max": 11}
    assert cap["min_effective_blocks"] == 4
    assert cap["reserved_blocks_end"] == 11 and cap["free_blocks_end"] == 4
    assert cap["reserve_released"] is True
    assert run.free_blocks_end == USABLE


def test_the_report_counts_a_shrink_that_completed_at_the_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Through the CLI: report.json and the capacity table (terminal and report.md) show
    the shrink done (1/1) with 4 s to complete and 4 s in shrink; they used to show 0/1."""
    from bidkv_ext.replay.cli import main

    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     + "2023-11-16 18:00:00.0000000,4,5\n" * 8)
    schedule = tmp_path / "capacity.json"
    schedule.write_text(json.dumps([SHRINK]))
    model = tmp_path / "unit.json"
    model.write_text(json.dumps({"name": "unit", "a": 1.0, "b": 0.0, "c": 0.0, "d": 0.0}))
    out = tmp_path / "out"
    assert main(["--trace", str(trace), "--num-gpu-blocks", str(USABLE + 1),
                 "--no-prefix-caching", "--blocks-per-page", "1",
                 "--capacity-schedule", str(schedule), "--step-model", str(model),
                 "--policies", "builtin", "--no-plots", "--no-progress",
                 "--output-dir", str(out)]) == 0
    cap = json.loads((out / "report.json").read_text())["arms"][0]["capacity"]
    assert (cap["shrinks"], cap["shrinks_completed"]) == (1, 1)
    assert cap["shrink_completion_s"]["max"] == cap["time_in_shrink_s"] == 4.0
    terminal = [line.split() for line in capsys.readouterr().out.splitlines()
                if line.startswith("builtin ")]
    assert ["1/1", "4.00s", "4.00s"] in [row[1:4] for row in terminal]
    markdown = [line.split(" | ") for line in (out / "report.md").read_text().splitlines()
                if line.startswith("| builtin | 1/1 |")]
    assert [row[1:4] for row in markdown] == [["1/1", "4.00s", "4.00s"]]
