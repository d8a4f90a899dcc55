"""``bidkv-replay`` through the real vLLM 0.33.0 scheduler (skips only without vLLM).

Guards: conservation (every request completes exactly once with exactly its trace output
length, no KV block leaks, every victim back once per preemption) under real preemption
for several arms; byte-identical ``report.json`` for the same seed; metrics taken from the
scheduler's real events equal hand-computed values on a 5-request trace (idle KV
included); with prefix caching off every position is executed once plus exactly the
recomputed ones; the headline ratios (recompute tax, preemptions per 1k, victims per
pressure step) follow from those counts; the clairvoyant arm is marked a reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import HAVE_VLLM

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (real-scheduler tier)")

from bidkv_ext.replay.cli import main  # noqa: E402
from bidkv_ext.replay.trace import load_trace  # noqa: E402

PRESSURE = ["--max-requests", "60", "--num-gpu-blocks", "300", "--no-plots", "--no-progress"]


def _replay(tmp_path: Path, name: str, *args: str) -> dict[str, Any]:
    out = tmp_path / name
    assert main([*args, "--output-dir", str(out)]) == 0
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report


@pytest.fixture(scope="module")
def pressured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("pressure")
    return _replay(tmp, "a", *PRESSURE, "--no-prefix-caching",
                   "--policies", "builtin,least-computed-first,bidkv,clairvoyant")


def test_conservation_under_preemption(pressured: dict[str, Any]) -> None:
    assert pressured["trace"]["requests"] == 60
    for arm in pressured["arms"]:
        c = arm["conservation"]
        assert arm["completed"] == 60
        assert c["all_completed_once"] and c["exact_output_lengths"], arm["label"]
        assert c["free_blocks_end"] == c["usable_blocks"] == 299
        assert arm["preemptions"] > 0
        assert arm["controller"]["calls"] == arm["preemptions"]
        # Each preemption is answered by exactly one return, at least one step later.
        assert arm["victim_returns"] == arm["preemptions"], arm["label"]
        assert arm["steps_to_return_mean"] >= 1.0


def test_every_position_executed_once_plus_recompute(pressured: dict[str, Any]) -> None:
    from bidkv_ext.replay.cli import SAMPLE_TRACE

    rows = load_trace(SAMPLE_TRACE)[:60]
    positions = sum(r.input_length + r.output_length - 1 for r in rows)
    for arm in pressured["arms"]:
        # Without prefix caching nothing is skipped: computed = each position once + redo,
        # and the upper bound (computed tokens at preemption) is exact.
        assert arm["computed_tokens"] == positions + arm["recomputed_tokens"], arm["label"]
        assert arm["recompute_upper_bound_tokens"] == arm["recomputed_tokens"]
        assert arm["output_tokens"] == sum(r.output_length for r in rows)


def test_headline_ratios_follow_the_counts(pressured: dict[str, Any]) -> None:
    """evaluation.md section 1 on every pressured arm: recompute tax = recomputed / computed
    tokens (both pinned by the test above), preemptions per 1k = 1000 x preemptions /
    completed requests, recomputed tokens per preemption, and at least one victim per
    pressure step (no more victims than preemptions)."""
    for arm in pressured["arms"]:
        assert arm["recomputed_tokens"] > 0, arm["label"]
        assert arm["recompute_tax"] == pytest.approx(
            arm["recomputed_tokens"] / arm["computed_tokens"]), arm["label"]
        assert arm["preemptions_per_1k"] == pytest.approx(1000 * arm["preemptions"] / 60)
        assert arm["recomputed_tokens_per_preemption"] == pytest.approx(
            arm["recomputed_tokens"] / arm["preemptions"])
        assert 1.0 <= arm["victims_per_pressure_step"] <= arm["preemptions"]
        assert 1 <= arm["max_preemptions_one_request"] <= arm["preemptions"]


def test_arms_are_labelled_and_counted(pressured: dict[str, Any]) -> None:
    arms = {a["label"]: a for a in pressured["arms"]}
    assert arms["builtin"]["controller"]["abstentions"] == arms["builtin"]["controller"]["calls"]
    assert arms["least-computed-first"]["controller"]["selections"] > 0
    assert arms["bidkv"]["controller"]["policy_name"] == "bidkv_ext.selector.BidkvPreemptionPolicy"
    reference = arms["clairvoyant (reference)"]
    assert reference["reference"] is True and reference["kind"] == "reference"
    assert not arms["bidkv"]["reference"]


def test_report_states_the_policy_versions(pressured: dict[str, Any]) -> None:
    """evaluation.md §5.6: every claim states policy versions. The report carries this
    package's version and, per selector arm, the BidKV settings it ran with (so a report
    made under another default cannot pass for a current one); other policies have none."""
    from bidkv_ext import __version__

    assert pressured["host"]["bidkv_ext_version"] == __version__
    arms = {a["label"]: a for a in pressured["arms"]}
    bidkv = arms["bidkv"]["policy_config"]
    assert bidkv["strategy"] == "bidkv" and bidkv["enabled"] is True
    assert bidkv["liveness_preemptions"] == 8 and bidkv["prefix_caching"] is False
    assert arms["least-computed-first"]["policy_config"]["strategy"] == "least-computed-first"
    assert arms["clairvoyant (reference)"]["policy_config"] is None


def test_same_seed_gives_byte_identical_json(tmp_path: Path) -> None:
    args = [*PRESSURE, "--policies", "random,bidkv", "--seed", "7"]
    for name in ("one", "two"):
        _replay(tmp_path, name, *args)
    first = (tmp_path / "one" / "report.json").read_bytes()
    assert first == (tmp_path / "two" / "report.json").read_bytes()
    assert json.loads(first)["arms"][0]["preemptions"] > 0


FIVE = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2023-11-16 18:00:00.0000000,10,1\n"
    "2023-11-16 18:00:00.0000000,10,2\n"
    "2023-11-16 18:00:00.0000000,10,3\n"
    "2023-11-16 18:00:00.0000000,10,4\n"
    "2023-11-16 18:00:02.5000000,10,2\n"
)


def test_five_requests_match_hand_computed_metrics(tmp_path: Path) -> None:
    trace = tmp_path / "five.csv"
    trace.write_text(FIVE)
    model = tmp_path / "unit.json"
    model.write_text(json.dumps({"name": "unit", "a": 1.0, "b": 0, "c": 0, "d": 0}))
    report = _replay(tmp_path, "out", "--trace", str(trace), "--step-model", str(model),
                     "--num-gpu-blocks", "64", "--policies", "builtin", "--no-progress")
    (arm,) = report["arms"]
    # One simulated second per step. Step 1 prefills requests 0-3 (first tokens at t=1;
    # request 0 done). Steps 2-3 decode; request 4 arrives at 2.5 and is prefilled in step 4
    # (t=3->4) beside request 3's last decode; step 5 decodes request 4 (done at t=5).
    assert arm["steps"] == 5
    assert arm["completed"] == 5 and arm["output_tokens"] == 12
    assert arm["makespan_s"] == 5.0
    assert arm["throughput_output_tok_s"] == pytest.approx(12 / 5)
    assert arm["throughput_req_s"] == pytest.approx(1.0)
    assert arm["computed_tokens"] == 50 + 7 and arm["recomputed_tokens"] == 0
    assert arm["preemptions"] == 0 and arm["preemptions_per_1k"] == 0
    assert arm["victim_returns"] == 0 and arm["steps_to_return_mean"] == 0
    # Idle KV after each step's scheduling: 63 usable blocks, one per running request
    # (<= 14 tokens each); steps hold 4, 3, 2, 2 (requests 3 and 4) and 1 block.
    assert arm["kv_free_blocks_mean"] == pytest.approx((59 + 60 + 61 + 61 + 62) / 5)
    ttft, tpot, e2e = arm["ttft_s"], arm["tpot_s"], arm["e2e_s"]
    # TTFT = [1, 1, 1, 1, 1.5]; E2E = [1, 2, 3, 4, 2.5]; every TPOT is 1 s.
    assert ttft == pytest.approx({"p50": 1.0, "p95": 1.4, "p99": 1.48, "mean": 1.1})
    assert e2e == pytest.approx({"p50": 2.5, "p95": 3.8, "p99": 3.96, "mean": 2.5})
    assert tpot == pytest.approx({"p50": 1.0, "p95": 1.0, "p99": 1.0, "mean": 1.0})
    # SLO TTFT <= 2 s holds for all, TPOT <= 100 ms only for the one-token request.
    assert arm["slo_attainment"] == pytest.approx(0.2)
    # Goodput: that one request over the 5 s makespan; nothing preempted or recomputed.
    assert arm["goodput_req_s"] == pytest.approx(1 / 5)
    assert arm["recompute_tax"] == 0 and arm["max_preemptions_one_request"] == 0
    assert arm["victims_per_pressure_step"] == 0
    assert (tmp_path / "out" / "ttft_cdf.png").stat().st_size > 0
    assert (tmp_path / "out" / "bars.png").stat().st_size > 0
    assert "| builtin |" in (tmp_path / "out" / "report.md").read_text()
