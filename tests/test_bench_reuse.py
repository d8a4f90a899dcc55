"""``run.py``/``headroom.py --reuse`` reads a saved report only when it stands for the
replay asked for now: the same arms, and every BidKV arm recorded with exactly the settings
this code resolves for it. A report made under an earlier default (the liveness threshold
was 4) or without recorded settings is replayed, never mixed into the medians."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "replay"))

import run  # noqa: E402

from bidkv_ext.config import BidKVConfig  # noqa: E402

ARGV = ["--trace", "t.csv", "--duration", "300", "--num-gpu-blocks", "600", "--start", "0",
        "--policies", "builtin,bidkv,bidkv{liveness_preemptions=4}"]


def _config(**overrides: object) -> dict[str, object]:
    return BidKVConfig.from_sources({"bidkv": {"seed": 0, **overrides}}, {},
                                    block_size=16, prefix_caching=True).model_dump()


def _arms(bidkv_liveness: int | None) -> list[dict[str, object]]:
    bidkv = None if bidkv_liveness is None else _config(
        enabled=True, strategy="bidkv", liveness_preemptions=bidkv_liveness)
    return [
        {"label": "builtin", "policy_config": _config(enabled=True, strategy="builtin",
                                                      liveness_preemptions=0)},
        {"label": "bidkv", "policy_config": bidkv},
        {"label": "bidkv{liveness_preemptions=4}",
         "policy_config": _config(enabled=True, strategy="bidkv", liveness_preemptions=4)},
    ]


@pytest.fixture(autouse=True)
def _no_bidkv_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The expected settings are resolved over the environment, as the replay does.
    for name in [n for n in os.environ if n.startswith("BIDKV_UTILITY_")]:
        monkeypatch.delenv(name)


def _saved(tmp_path: Path, arms: list[dict[str, object]]) -> Path:
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"arms": arms}))
    return path


def test_a_current_report_is_reused(tmp_path: Path) -> None:
    assert run.stale_reason(_saved(tmp_path, _arms(8)), ARGV) is None


@pytest.mark.parametrize(
    ("arms", "why"),
    [
        (_arms(4), "bidkv was made with other (or unrecorded) settings"),  # the old default
        (_arms(None), "bidkv was made with other (or unrecorded) settings"),  # not recorded
        (_arms(8)[:2], "arms"),  # an arm missing
    ],
    ids=["old-default", "unrecorded", "missing-arm"],
)
def test_a_stale_report_is_replayed(tmp_path: Path, arms: list[dict[str, object]],
                                    why: str) -> None:
    reason = run.stale_reason(_saved(tmp_path, arms), ARGV)
    assert reason is not None and why in reason
