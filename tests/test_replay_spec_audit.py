"""``bidkv-replay`` against evaluation.md sections 1-5, where an audit found the code apart.

Guarded behaviours (through the real vLLM 0.33.0 scheduler):

* the KV-capacity filter keeps every request that can run alone in the pool: a request
  holds KV for its prompt and every output token but the last (that token is sampled and
  never fed back), so prompt + output - 1 positions decide, not prompt + output. A request
  whose prompt + output - 1 fills the usable blocks exactly is replayed to its full output
  and not counted in ``trace.filtered_kv_capacity``; one position more is removed;
* ``benchmarks/replay/run.py comparison``'s no-pressure run (the floor of the recovered
  fraction) is what section 2 defines: the cell's own requests with no preemption. A floor
  that replayed other requests (the cell's smaller pool removed one too big for it) or that
  still preempted stops the suite naming the cell, instead of feeding a recovered fraction
  measured on another workload; a floor that is both is used.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import HAVE_VLLM

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (real-scheduler tier)")

from bidkv_ext.replay.cli import main  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "replay"))
import run  # noqa: E402

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def test_a_request_that_fills_the_pool_exactly_is_replayed_not_filtered(tmp_path: Path) -> None:
    """3 blocks incl. the null block = 2 usable 16-token blocks = 32 positions. 17 + 16
    tokens execute 32 positions (fits exactly); 17 + 17 execute 33 (does not fit); 10 + 2
    fit either way. The exact fit completes with its trace length and conserves blocks."""
    trace = tmp_path / "t.csv"
    trace.write_text(
        AZURE_HEADER
        + "2023-11-16 18:00:00.0000000,10,2\n"
        + "2023-11-16 18:00:01.0000000,17,16\n"
        + "2023-11-16 18:00:02.0000000,17,17\n"
    )
    out = tmp_path / "out"
    assert main(["--trace", str(trace), "--num-gpu-blocks", "3", "--policies", "builtin",
                 "--no-plots", "--no-progress", "--output-dir", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["trace"]["filtered_kv_capacity"] == 1
    assert report["trace"]["requests"] == 2
    (arm,) = report["arms"]
    assert arm["completed"] == 2 and arm["output_tokens"] == 2 + 16
    assert arm["conservation"] == {"all_completed_once": True, "exact_output_lengths": True,
                                   "free_blocks_end": 2, "usable_blocks": 2}


def _comparison(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: str, blocks: str) -> str:
    """``run_suite("comparison", ...)`` on one hand-made cell, with the three arms its goals
    read (the full peer list would only make it slower)."""
    (tmp_path / "t.csv").write_text(AZURE_HEADER + rows)
    monkeypatch.setitem(run.SUITES, "comparison", "builtin,least-computed-first,bidkv")
    cell = run.Cell("tiny", "t.csv", ("--num-gpu-blocks", blocks))
    return run.run_suite("comparison", tmp_path, [cell], tmp_path / "out")


FITS = "2023-11-16 18:00:00.0000000,10,2\n2023-11-16 18:00:01.0000000,17,16\n"


def test_no_pressure_floor_replaying_other_requests_stops_the_suite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 usable blocks remove the 40 + 8 request from the cell; 16,384 blocks keep it."""
    big = "2023-11-16 18:00:02.0000000,40,8\n"
    with pytest.raises(SystemExit) as stopped:
        _comparison(tmp_path, monkeypatch, FITS + big, "3")
    assert str(stopped.value) == (
        "run.py: the no-pressure run of tiny (16384 blocks) replayed 3 requests with 0 "
        "preemptions; expected the cell's 2 requests and no preemption")


def test_no_pressure_floor_that_preempts_stops_the_suite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two simultaneous 8 + 17 requests start in one block each and grow into a second; a
    'no-pressure' pool of 2 usable blocks preempts one of them."""
    monkeypatch.setattr(run, "NO_PRESSURE_BLOCKS", 3)
    two = "2023-11-16 18:00:00.0000000,8,17\n2023-11-16 18:00:00.0000000,8,17\n"
    with pytest.raises(SystemExit, match=r"replayed 2 requests with [1-9]\d* preemptions; "
                                          r"expected the cell's 2 requests and no preemption"):
        _comparison(tmp_path, monkeypatch, two, "3")


def test_a_true_no_pressure_floor_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = _comparison(tmp_path, monkeypatch, FITS, "3")
    assert "| tiny | no-pressure run (builtin, 16384 blocks) | 0.00% |" in text
