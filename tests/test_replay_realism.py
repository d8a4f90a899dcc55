"""The replay hides true output lengths from policies by default and runs every peer.

Guards: with ``--max-tokens model-len`` (the default) no candidate's ``max_tokens`` reveals
its trace output length (requests stop by EOS, still at exactly that length); ``exact`` is
the opt-in clairvoyant mode; peer arms run without our guards; the reference BidKV 0.2.1
rule abstains as documented.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest

from bidkv_ext.contract import PreemptionContext
from tests.conftest import HAVE_VLLM
from tests.policy_helpers import cand, ctx

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (real-scheduler tier)")

from bidkv_ext.replay.arms import ReferenceBidkv021, named_arm  # noqa: E402
from bidkv_ext.replay.cli import SAMPLE_TRACE, main  # noqa: E402
from bidkv_ext.replay.trace import load_trace  # noqa: E402

PRESSURE = ["--max-requests", "60", "--num-gpu-blocks", "300", "--no-prefix-caching", "--no-plots",
            "--no-progress"]


class Probe:
    """Records every candidate's max_tokens and abstains."""

    seen: ClassVar[dict[str, int]] = {}

    def select_victim(self, context: PreemptionContext) -> str | None:
        for c in context.candidates:
            Probe.seen[c.request_id] = c.max_tokens
        return None


def _run(tmp_path: Path, *extra: str) -> dict[str, Any]:
    Probe.seen = {}
    out = tmp_path / "out"
    assert main([*PRESSURE, "--policy-class", f"{__name__}:Probe", *extra,
                 "--output-dir", str(out)]) == 0
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report


def test_policies_cannot_read_true_output_lengths(tmp_path: Path) -> None:
    report = _run(tmp_path)
    rows = load_trace(SAMPLE_TRACE)[:60]
    (arm,) = report["arms"]
    assert arm["conservation"]["exact_output_lengths"]
    assert arm["completed"] == report["trace"]["requests"] > 50
    assert arm["preemptions"] > 0 and Probe.seen
    assert report["settings"]["max_tokens"] == "model-len"
    true_len = {str(r.index): r.output_length for r in rows}
    prompt = {str(r.index): r.input_length for r in rows}
    for rid, max_tokens in Probe.seen.items():
        assert max_tokens == report["settings"]["max_model_len"] - prompt[rid]
        assert max_tokens != true_len[rid]


def test_exact_mode_is_the_clairvoyant_opt_in(tmp_path: Path) -> None:
    report = _run(tmp_path, "--max-tokens", "exact")
    rows = {str(r.index): r.output_length for r in load_trace(SAMPLE_TRACE)[:60]}
    assert report["settings"]["max_tokens"] == "exact"
    assert all(rows[rid] == m for rid, m in Probe.seen.items())


def test_peers_run_without_our_guards() -> None:
    assert named_arm("least-computed-first", 0).bidkv_overrides["liveness_preemptions"] == 0  # type: ignore[index]
    assert "liveness_preemptions" not in (named_arm("bidkv", 0).bidkv_overrides or {})


def test_reference_rule_abstains_like_0_2_1() -> None:
    ref = ReferenceBidkv021()
    big = cand("big", computed=4000, output=10, max_tokens=1000)
    req = cand("req", computed=3500, output=10, max_tokens=1000)
    small = cand("small", computed=100)
    # Cascade guard: requester's r x 1.25 >= top's r -> abstain.
    assert ref.select_victim(ctx([small, big, req], requester="req")) is None
    # Otherwise the largest U (~ most computed) wins.
    assert ref.select_victim(ctx([small, big, cand("r2", computed=10)], requester="r2")) == "big"
    # Liveness: the top has been preempted twice -> abstain once, then pick it again.
    twice = cand("big", computed=4000, preemptions=2)
    assert ref.select_victim(ctx([small, twice, cand("r3", computed=1)], requester="r3")) is None
    assert ref.select_victim(ctx([small, twice, cand("r3", computed=1)], requester="r3")) == "big"


def test_arm_overrides_reach_the_policy_config() -> None:
    from bidkv_ext.replay.arms import parse_arms

    arms = parse_arms("builtin,bidkv{use_host_facts=false;preempt_weight=2},bidkv-0.2.1",
                      preemption_policy=None, policy_classes=[], seed=3)
    labels = [a.label for a in arms]
    assert labels == ["builtin", "bidkv{use_host_facts=false;preempt_weight=2}", "bidkv-0.2.1"]
    overrides = arms[1].bidkv_overrides
    assert overrides is not None
    assert overrides["use_host_facts"] is False and overrides["preempt_weight"] == 2
    assert overrides["seed"] == 3 and overrides["strategy"] == "bidkv"
    from bidkv_ext.replay.arms import ArmError

    with pytest.raises(ArmError, match="expected key=value"):
        parse_arms("bidkv{nonsense}", preemption_policy=None, policy_classes=[], seed=0)
