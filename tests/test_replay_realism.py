"""The replay hides true output lengths from policies by default and runs every peer.

Guards: with ``--max-tokens model-len`` (the default) no candidate's ``max_tokens`` reveals
its trace output length (requests stop by EOS, still at exactly that length); ``exact`` is
the opt-in clairvoyant mode; peer arms run without our guards; the reference BidKV 0.2.1
rule abstains as documented, weighs preemptions by 0.3, takes 1024 for a missing
max_tokens, breaks utility ties by the earliest arrival and cascades at exactly 1.25 (never
when the requester is its own top); the clairvoyant oracle evicts the most true remaining
output (ties: least computed; a request it has no length for counts its max_tokens);
``--policies`` splits on commas outside ``{...}``, refuses an unclosed block, an empty key
and a name given twice, and ``--preemption-policy`` must be a dotted path; arms keep the
command-line order (names, host spec, classes); ``check_arms`` validates the BidKV
configuration of host and class arms that load our selector, and only of those.
"""

from __future__ import annotations

import json
import re
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


def test_clairvoyant_evicts_the_most_true_remaining_output() -> None:
    from bidkv_ext.replay.arms import ClairvoyantShortestRemaining

    oracle = ClairvoyantShortestRemaining({"a": 100, "b": 500, "c": 500, "x": 300, "y": 300})
    # True remaining: a 90, b 50, c 500 (max_tokens would say otherwise).
    cands = [cand("a", output=10, max_tokens=4096), cand("b", output=450, max_tokens=4096),
             cand("c", output=0, max_tokens=600)]
    assert oracle.select_victim(ctx(cands)) == "c"
    # Equal remaining (200): the least computed.
    tied = [cand("x", computed=100, output=100), cand("y", computed=50, output=100)]
    assert oracle.select_victim(ctx(tied)) == "y"
    assert oracle.select_victim(ctx(tied[::-1])) == "y"
    # No trace length for "u": its max_tokens stands in (1000 left against 90).
    assert oracle.select_victim(ctx([cands[0], cand("u", output=0, max_tokens=1000)])) == "u"


def test_reference_rule_weights_ties_and_cascade_boundary() -> None:
    """U = computed / (1 + 0.5 c + 0.3 P + 1e-6) with the documented constants."""
    tiny = cand("req", computed=1)
    # 1310 / 1.3 > 1000 / 1: the preempted request still wins with the 0.3 weight.
    once = cand("once", computed=1310, preemptions=1)
    assert ReferenceBidkv021().select_victim(
        ctx([cand("fresh", computed=1000), once, tiny], requester="req")) == "once"
    # Equal utility: the earliest arrival, wherever it sits.
    early, late = cand("early", computed=800, arrival=1.0), cand("late", computed=800, arrival=2.0)
    assert ReferenceBidkv021().select_victim(ctx([late, early, tiny], requester="req")) == "early"
    # Cascade guard at its boundary: 1000 x 1.25 == 1250 -> abstain; just below -> the top.
    top = cand("top", computed=1250)
    assert ReferenceBidkv021().select_victim(
        ctx([top, cand("req", computed=1000)], requester="req")) is None
    assert ReferenceBidkv021().select_victim(
        ctx([top, cand("req", computed=999)], requester="req")) == "top"
    # The requester is the top itself: no cascade to avoid, it is the victim.
    assert ReferenceBidkv021().select_victim(ctx([tiny, top], requester="top")) == "top"
    # max_tokens 0 counts as 1024: 512 outputs are half done, U = 1000 / 1.25 = 800 > 750.
    unknown = cand("unknown", computed=1000, output=512, max_tokens=0)
    assert ReferenceBidkv021().select_victim(
        ctx([unknown, cand("other", computed=750), tiny], requester="req")) == "unknown"


def test_policies_split_outside_braces_and_bad_entries_are_refused() -> None:
    from bidkv_ext.replay.arms import ArmError, parse_arms

    arms = parse_arms("bidkv{seed=1},lifo{preempt_weight=[1,2]}", preemption_policy=None,
                      policy_classes=[], seed=0)
    assert [a.label for a in arms] == ["bidkv{seed=1}", "lifo{preempt_weight=[1,2]}"]
    assert arms[1].bidkv_overrides is not None
    assert arms[1].bidkv_overrides["preempt_weight"] == [1, 2]
    for policies, message in [("bidkv{seed=1", "must end with '}'"),
                              ("bidkv{=1}", "expected key=value, got '=1'"),
                              ("lifo,builtin,lifo", "policy arms given twice: lifo")]:
        with pytest.raises(ArmError, match=re.escape(message)):
            parse_arms(policies, preemption_policy=None, policy_classes=[], seed=0)
    with pytest.raises(ArmError, match=re.escape("must be a dotted path 'module.Object'")):
        parse_arms(None, preemption_policy="bidkv_ext.selector:BidkvPreemptionPolicy",
                   policy_classes=[], seed=0)


def test_arm_order_and_which_arms_check_arms_validates() -> None:
    from bidkv_ext.replay.arms import ArmError, check_arms, parse_arms

    arms = parse_arms("lifo", preemption_policy="bidkv_ext.selector.BidkvPreemptionPolicy",
                      policy_classes=[f"{__name__}:Probe",
                                      "bidkv_ext.selector:BidkvPreemptionPolicy"], seed=0)
    assert [a.kind for a in arms] == ["named", "host", "class", "class"]
    bad = {"bidkv": {"zz": 1}}
    for arm in arms[1:2] + arms[3:]:  # the host spec and the class that are our selector
        with pytest.raises(ArmError, match=re.escape("additional_config['bidkv']['zz']")):
            check_arms([arm], bad, environ={}, block_size=16, prefix_caching=True)
    check_arms([arms[2]], bad, environ={}, block_size=16, prefix_caching=True)  # not ours
