"""Guards the exact edges of the verdict rules (qualification.md §7) and of the baseline
gate, which the interval tests of ``test_qualification_verdict.py`` approach only to 0.1
point: a P95-latency CI upper bound of exactly +5 % is still `beneficial` (rule 4, "≤"), a
lower bound of exactly +5 % is not yet `not-beneficial-in-tested-cell` (rule 5, ">"), a
P95-latency interval that could not be computed leaves the cell `inconclusive` even when
throughput is clearly down, and a baseline that overrode the built-in victim once fails."""

from __future__ import annotations

import math

from qualification.stats import DeltaSummary
from qualification.verdict import ArmResult, Pair, classify, evaluate_gates

CALLS = [10, 10, 10]


def _interval(low: float, high: float) -> DeltaSummary:
    """A three-pair summary with the given 95 % interval (the other fields follow)."""
    mean = (low + high) / 2
    return DeltaSummary(3, (mean,) * 3, mean, 0.0, 4.303, (high - low) / 2, low, high)


def test_a_latency_ci_high_of_exactly_5pct_is_beneficial() -> None:
    """Rule 4: throughput CI low > 0 and P95-latency CI high ≤ +5 %; 5.0 itself qualifies."""
    label, _ = classify(3, True, CALLS, _interval(1.0, 3.0), _interval(-1.0, 5.0))
    assert label == "beneficial"


def test_a_latency_ci_low_of_exactly_5pct_is_neutral() -> None:
    """Rule 5 needs the P95-latency CI low *above* +5 %: at exactly 5.0, with throughput
    flat, the cell is `neutral`; just above it, `not-beneficial-in-tested-cell`."""
    flat = _interval(-1.0, 1.0)
    assert classify(3, True, CALLS, flat, _interval(5.0, 7.0))[0] == "neutral"
    above = _interval(math.nextafter(5.0, math.inf), 7.0)
    assert classify(3, True, CALLS, flat, above)[0] == "not-beneficial-in-tested-cell"


def test_an_uncomputable_latency_interval_is_inconclusive_even_with_throughput_down() -> None:
    """A NaN P95-latency interval (a zero baseline, no samples) decides nothing: the cell is
    `inconclusive`, not `not-beneficial` on throughput alone."""
    nan = math.nan
    latency = DeltaSummary(3, (nan,) * 3, nan, nan, nan, nan, nan, nan)
    label, reason = classify(3, True, CALLS, _interval(-9.0, -3.0), latency)
    assert label == "inconclusive" and "could not be computed" in reason


def _arm(arm: str, selections: int) -> ArmResult:
    counters = {"calls": 4, "selections": selections, "abstentions": 4 - selections,
                "failures": 0, "invalid_selections": 0}
    return ArmResult(arm=arm, throughput=100.0, ttft_p50=0.1, ttft_p95=0.2,  # type: ignore[arg-type]
                     latency_p50=5.0, latency_p95=10.0, requests=4, completed=4,
                     counters=counters, policy_enabled=arm == "candidate", short_hash="abc")


def test_a_baseline_that_overrode_the_builtin_victim_once_fails_the_gate() -> None:
    """README "Functional gates": the baseline never overrides the built-in victim; a single
    selection in one repeat fails `policy-enabled-and-invoked`, none passes it."""
    def gate(baseline_selections: int) -> str:
        pairs = [Pair("cell", r, "baseline", _arm("baseline", baseline_selections if r == 1
                                                  else 0), _arm("candidate", 1))
                 for r in range(3)]
        gates = evaluate_gates(pairs, cancel_bound_s=None, tensor_parallel_size=1)
        return {g.name: g.status for g in gates}["policy-enabled-and-invoked"]

    assert gate(0) == "pass"
    assert gate(1) == "fail"
