"""The ``anatomy`` suite of ``benchmarks/replay/headroom.py``, on real replays.

Guards: the per-preemption figures the suite derives from a report. Without prefix caching
a victim re-executes everything it had computed, so the share lost is exactly 1 and the
tokens lost per preemption equal the victim's size; with prefix caching, under the same
pressure, part of each victim comes back as cache hits, so the share lost is below 1. The
idle-KV column reads ``kv_free_blocks_mean``, which lies between 0 and the usable blocks.
Runs ``bidkv-replay`` in-process through the real vLLM scheduler.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import HAVE_VLLM

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (real-scheduler tier)")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "replay"))

import headroom  # noqa: E402

from bidkv_ext.replay.cli import main  # noqa: E402

WINDOW = ["--max-requests", "60", "--num-gpu-blocks", "300", "--no-plots", "--no-progress",
          "--policies", "builtin,least-computed-first,bidkv"]


def _arms(tmp_path: Path, name: str, *extra: str) -> dict[str, dict[str, Any]]:
    out = tmp_path / name
    assert main([*WINDOW, *extra, "--output-dir", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    return {arm["label"]: arm for arm in report["arms"]}


def test_victims_lose_everything_without_prefix_caching_and_less_with_it(
    tmp_path: Path,
) -> None:
    nopc = _arms(tmp_path, "nopc", "--no-prefix-caching")
    pc = _arms(tmp_path, "pc")
    for label, arm in nopc.items():
        assert arm["preemptions"] > 0, label
        size, lost, share = headroom.anatomy_figures(arm)
        assert share == 1.0 and lost == size > 0, label
    shares = [headroom.anatomy_figures(arm)[2] for arm in pc.values() if arm["preemptions"]]
    assert shares and all(0.0 < share < 1.0 for share in shares)
    for arm in (*nopc.values(), *pc.values()):
        assert 0.0 <= arm["kv_free_blocks_mean"] <= arm["conservation"]["usable_blocks"]
    table = headroom._anatomy_table({"window": [pc, pc]})
    idler = pc["builtin"]["kv_free_blocks_mean"] > pc["least-computed-first"]["kv_free_blocks_mean"]
    assert "| window | builtin |" in table
    assert f"builtin left more KV idle than LCF in {2 if idler else 0} of 2 slices" in table


def test_no_preemption_gives_zero_figures() -> None:
    arm = {"preemptions": 0, "recompute_upper_bound_tokens": 0, "recomputed_tokens": 0,
           "recomputed_tokens_per_preemption": 0.0}
    assert headroom.anatomy_figures(arm) == (0.0, 0.0, 0.0)
