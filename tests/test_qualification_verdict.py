"""Guards the per-cell verdict rules (qualification.md §7, one test per label, including
`inconclusive` when a candidate repeat made zero policy calls, rule 1 before rule 2, and
strict throughput bounds), the functional gates (a candidate missing a fault counter, a
repeat without short outputs and a baseline that selected a victim all fail; a drain at
the bound passes), and the arm-order alternation."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from qualification.runner import arm_order
from qualification.verdict import Pair, evaluate_cell
from tests.verdict_helpers import arm_result


def _pairs(
    candidate: Sequence[tuple[float, float]],
    calls: Sequence[int] | None = None,
    baseline_kw: dict[str, object] | None = None,
    **kw: object,
) -> list[Pair]:
    calls = calls or [10] * len(candidate)
    return [
        Pair(
            "cell",
            r,
            "baseline",
            arm_result("baseline", 100.0, 10.0, **(baseline_kw or {})),
            arm_result("candidate", thr, p95, calls=c, **kw),
        )
        for r, ((thr, p95), c) in enumerate(zip(candidate, calls, strict=True))
    ]


def _verdict(pairs: list[Pair]) -> str:
    return evaluate_cell("cell", pairs, cancel_bound_s=None, tensor_parallel_size=1).label


def test_beneficial() -> None:
    # throughput +5, +6, +7 % (CI > 0); P95 latency -1..+1 % (CI upper <= +5 %)
    assert _verdict(_pairs([(105, 9.9), (106, 10.0), (107, 10.1)])) == "beneficial"


def test_beneficial_needs_latency_bound() -> None:
    # throughput clearly up but P95 latency interval reaches above +5 %
    assert _verdict(_pairs([(105, 10.4), (106, 10.6), (107, 10.8)])) == "neutral"


def test_not_beneficial_by_throughput() -> None:
    # the spec's interactive cell: -25.94, -25.01, -25.00 %
    outcome = evaluate_cell(
        "cell",
        _pairs([(74.06, 13.4), (74.99, 13.5), (75.0, 13.45)]),
        cancel_bound_s=None,
        tensor_parallel_size=1,
    )
    assert outcome.label == "not-beneficial-in-tested-cell"
    assert outcome.deltas["throughput"].high < 0


def test_not_beneficial_by_latency_alone() -> None:
    assert _verdict(_pairs([(99, 11.0), (101, 11.1), (100, 10.9)])) == (
        "not-beneficial-in-tested-cell"
    )


def test_neutral_when_intervals_overlap() -> None:
    assert _verdict(_pairs([(101.23, 9.9), (99.5, 10.1), (100.4, 10.0)])) == "neutral"


def test_inconclusive_when_a_repeat_has_zero_calls() -> None:
    # the spec's ascending-mixed cell: calls 63, 0, 63
    pairs = _pairs([(100.33, 9.97), (238.38, 4.0), (100.12, 9.99)], calls=[63, 0, 63])
    outcome = evaluate_cell("cell", pairs, cancel_bound_s=None, tensor_parallel_size=1)
    assert outcome.label == "inconclusive"
    assert "[1]" in outcome.reason
    assert outcome.gates_passed  # invoked in some repeat: runtime effective, gates hold


def test_inconclusive_with_fewer_than_three_pairs() -> None:
    assert _verdict(_pairs([(110, 9.0), (111, 9.0)])) == "inconclusive"


def test_gate_failure_is_not_classifiable() -> None:
    pairs = _pairs([(105, 9.9), (106, 10.0), (107, 10.1)])
    bad = arm_result("candidate", 106, 10.0, failed=1, completed=3)
    pairs[1] = Pair("cell", 1, "candidate", pairs[1].baseline, bad)
    outcome = evaluate_cell("cell", pairs, cancel_bound_s=None, tensor_parallel_size=1)
    assert outcome.label == "gate-failed"
    failed = [g.name for g in outcome.gates if g.status == "fail"]
    assert failed == ["no-failed-or-starved"]


@pytest.mark.parametrize(
    ("change", "gate"),
    [
        ({"short_hash": "zzz"}, "short-output-identical"),
        ({"starved": 1}, "no-failed-or-starved"),
        ({"policy_enabled": False}, "policy-enabled-and-invoked"),
        ({"counters": None}, "zero-policy-failures"),
        ({"started": False}, "recovers-after-restart"),
        ({"recovery_ok": False}, "recovers-after-restart"),
        ({"tracebacks": 2}, "zero-tracebacks"),
        ({"graph_captured": False}, "graph-capture-and-tp-ranks"),
    ],
)
def test_each_gate_fails_the_cell(change: dict[str, object], gate: str) -> None:
    pairs = _pairs([(105, 9.9), (106, 10.0), (107, 10.1)], **change)
    outcome = evaluate_cell("cell", pairs, cancel_bound_s=None, tensor_parallel_size=1)
    assert gate in [g.name for g in outcome.gates if g.status == "fail"]
    assert outcome.label == "gate-failed"


def test_policy_failures_fail_the_gate() -> None:
    counters = {
        "calls": 5,
        "selections": 1,
        "abstentions": 3,
        "failures": 1,
        "invalid_selections": 0,
    }
    pairs = _pairs([(105, 9.9), (106, 10.0), (107, 10.1)], counters=counters)
    outcome = evaluate_cell("cell", pairs, cancel_bound_s=None, tensor_parallel_size=1)
    assert [g.name for g in outcome.gates if g.status == "fail"] == ["zero-policy-failures"]


@pytest.mark.parametrize("absent", ["failures", "invalid_selections"])
def test_a_missing_fault_counter_fails_the_gate(absent: str) -> None:
    """qualification.md §6 gate 7 (zero policy failures and invalid selections): a
    candidate whose counters lack one of the two is unknown, not zero, so the gate fails
    and the cell is not classified; the baseline (built-in victim) need not report them."""
    counters = {"calls": 5, "selections": 1, "abstentions": 4, "failures": 0,
                "invalid_selections": 0}
    del counters[absent]
    pairs = _pairs([(105, 9.9), (106, 10.0), (107, 10.1)], counters=counters)
    outcome = evaluate_cell("cell", pairs, cancel_bound_s=None, tensor_parallel_size=1)
    gate = {g.name: g for g in outcome.gates}["zero-policy-failures"]
    assert gate.status == "fail"
    assert f"{absent} counter(s) unavailable" in gate.detail
    assert outcome.label == "gate-failed"
    baseline_only = _pairs([(105, 9.9), (106, 10.0), (107, 10.1)], baseline_kw={"counters": {}})
    outcome = evaluate_cell("cell", baseline_only, cancel_bound_s=None, tensor_parallel_size=1)
    assert outcome.gates_passed and outcome.label == "beneficial"


def test_never_invoked_fails_the_gate() -> None:
    pairs = _pairs([(105, 9.9), (106, 10.0), (107, 10.1)], calls=[0, 0, 0])
    outcome = evaluate_cell("cell", pairs, cancel_bound_s=None, tensor_parallel_size=1)
    assert "policy-enabled-and-invoked" in [g.name for g in outcome.gates if g.status == "fail"]


def test_cancellation_drain_bound() -> None:
    pairs = _pairs(
        [(105, 9.9), (106, 10.0), (107, 10.1)], baseline_kw={"drain_s": 0.3}, drain_s=0.4
    )
    ok = evaluate_cell("cell", pairs, cancel_bound_s=1.0, tensor_parallel_size=1)
    slow = evaluate_cell("cell", pairs, cancel_bound_s=0.1, tensor_parallel_size=1)
    assert {g.name: g.status for g in ok.gates}["cancellation-drains"] == "pass"
    assert {g.name: g.status for g in slow.gates}["cancellation-drains"] == "fail"


def test_all_tp_ranks_must_be_seen() -> None:
    pairs = _pairs([(105, 9.9), (106, 10.0), (107, 10.1)], tp_ranks=(0, 1, 3))
    outcome = evaluate_cell("cell", pairs, cancel_bound_s=None, tensor_parallel_size=4)
    assert {g.name: g.status for g in outcome.gates}["graph-capture-and-tp-ranks"] == "fail"


def test_arm_order_alternates_across_cells_and_reverses_each_repeat() -> None:
    assert arm_order(0, 0) == ("baseline", "candidate")
    assert arm_order(0, 1) == ("candidate", "baseline")
    assert arm_order(1, 0) == ("candidate", "baseline")
    assert arm_order(1, 1) == ("baseline", "candidate")


# --- the +5 % P95-latency edge (§7 rules 4-5) ----------------------------------------------
# Three pairs, latency deltas mean - s, mean, mean + s: the sample deviation is s and the
# half-width t(0.975, 2) * s / sqrt(3), with t = 4.303 from the spec's table (§5).
_T3 = 4.303
_EDGE_SPREAD = 1.0  # s, in percentage points
_HALF = _T3 * _EDGE_SPREAD / 3**0.5


def _edge_pairs(mean_latency_delta: float, throughput: Sequence[float]) -> list[Pair]:
    """Pairs whose P95-latency deltas (baseline 10.0 s) have the given mean and spread."""
    deltas = [mean_latency_delta + k * _EDGE_SPREAD for k in (-1, 0, 1)]
    return _pairs([(thr, 10.0 * (1 + d / 100)) for thr, d in zip(throughput, deltas, strict=True)])


def _edge_outcome(bound: str, target: float, throughput: Sequence[float]) -> tuple[str, float]:
    """The label of a cell whose P95-latency CI `bound` ("high"/"low") sits at `target` %,
    and the bound actually reached (checked to be within 0.01 of the target)."""
    mean = target - _HALF if bound == "high" else target + _HALF
    outcome = evaluate_cell(
        "cell", _edge_pairs(mean, throughput), cancel_bound_s=None, tensor_parallel_size=1
    )
    reached = getattr(outcome.deltas["latency_p95"], bound)
    assert reached == pytest.approx(target, abs=0.01)
    return outcome.label, reached


UP = (105.0, 106.0, 107.0)  # throughput CI [+3.5, +8.5] %: clears the beneficial bar
FLAT = (99.0, 101.0, 100.0)  # throughput CI straddles 0: neither bar by throughput


def test_beneficial_with_latency_ci_high_just_under_5pct() -> None:
    """Rule 4: P95-latency CI upper bound 4.9 % <= +5 % with throughput CI low > 0 is
    `beneficial` (a tolerance below 4.9 %, e.g. 3 %, would call it neutral)."""
    label, high = _edge_outcome("high", 4.9, UP)
    assert high < 5.0
    assert label == "beneficial"


def test_neutral_with_latency_ci_high_just_over_5pct() -> None:
    """Rule 4 fails by 0.1 point: P95-latency CI upper bound 5.1 % > +5 % keeps a cell with
    throughput clearly up at `neutral` (a tolerance above 5.1 %, e.g. 7 %, would call it
    beneficial); the low bound is far below 5 %, so rule 5 does not apply either."""
    label, high = _edge_outcome("high", 5.1, UP)
    assert high > 5.0
    assert label == "neutral"


def test_not_beneficial_with_latency_ci_low_just_over_5pct() -> None:
    """Rule 5: P95-latency CI lower bound 5.1 % > +5 % is `not-beneficial-in-tested-cell`
    even though throughput is flat (a tolerance above 5.1 %, e.g. 7 %, would call it
    neutral)."""
    label, low = _edge_outcome("low", 5.1, FLAT)
    assert low > 5.0
    assert label == "not-beneficial-in-tested-cell"


def test_neutral_with_latency_ci_low_just_under_5pct() -> None:
    """Rule 5 fails by 0.1 point: P95-latency CI lower bound 4.9 % (<= +5 %) with flat
    throughput is `neutral` (a tolerance below 4.9 %, e.g. 3 %, would call it
    not-beneficial)."""
    label, low = _edge_outcome("low", 4.9, FLAT)
    assert low < 5.0
    assert label == "neutral"


# --- clauses pinned by the conformance audit ------------------------------------------------


def test_a_baseline_that_overrode_the_builtin_victim_fails_the_gate() -> None:
    """README "Functional gates": the baseline is the built-in victim; a baseline arm whose
    controller made a selection (2 here) fails the cell."""
    baseline_counters = {"calls": 2, "selections": 2, "abstentions": 0, "failures": 0,
                         "invalid_selections": 0}
    pairs = _pairs([(105, 9.9), (106, 10.0), (107, 10.1)],
                   baseline_kw={"counters": baseline_counters})
    outcome = evaluate_cell("cell", pairs, cancel_bound_s=None, tensor_parallel_size=1)
    gate = {g.name: g for g in outcome.gates}["policy-enabled-and-invoked"]
    assert gate.status == "fail" and "baseline: 2 selection(s)" in gate.detail
    assert outcome.label == "gate-failed"


def test_a_drain_exactly_at_the_bound_passes() -> None:
    """qualification.md §6 gate 3 ("within 1 s"): 1.0 s against a 1.0 s bound drains in
    time; 1.01 s does not."""
    pairs = _pairs([(105, 9.9), (106, 10.0), (107, 10.1)], baseline_kw={"drain_s": 1.0},
                   drain_s=1.0)
    gates = evaluate_cell("cell", pairs, cancel_bound_s=1.0, tensor_parallel_size=1).gates
    assert {g.name: g.status for g in gates}["cancellation-drains"] == "pass"
    late = _pairs([(105, 9.9), (106, 10.0), (107, 10.1)], baseline_kw={"drain_s": 1.0},
                  drain_s=1.01)
    gates = evaluate_cell("cell", late, cancel_bound_s=1.0, tensor_parallel_size=1).gates
    assert {g.name: g.status for g in gates}["cancellation-drains"] == "fail"


def test_a_repeat_without_short_outputs_fails_the_equality_gate() -> None:
    """qualification.md §6 gate 1 holds in every repeat: repeat 1 whose arms both lack the
    warm-up hash (None == None) is unknown, not equal, so the gate fails."""
    pairs = _pairs([(105, 9.9), (106, 10.0), (107, 10.1)])
    pairs[1] = Pair("cell", 1, "candidate",
                    arm_result("baseline", 100.0, 10.0, short_hash=None),
                    arm_result("candidate", 106, 10.0, short_hash=None))
    outcome = evaluate_cell("cell", pairs, cancel_bound_s=None, tensor_parallel_size=1)
    gate = {g.name: g for g in outcome.gates}["short-output-identical"]
    assert gate.status == "fail" and gate.detail == "repeat 1: None != None"


def test_fewer_than_three_pairs_is_inconclusive_before_a_failed_gate() -> None:
    """qualification.md §7 rules in order: with 2 pairs rule 1 labels the cell
    `inconclusive` even though a gate failed; the failed gate still fails the cell."""
    outcome = evaluate_cell("cell", _pairs([(105, 9.9), (106, 10.0)], starved=1),
                            cancel_bound_s=None, tensor_parallel_size=1)
    assert outcome.label == "inconclusive" and "2 pair(s) < 3" in outcome.reason
    assert not outcome.gates_passed


def test_identical_arms_are_neutral() -> None:
    """qualification.md §7 rules 4-5 use strict bounds on throughput: three pairs with
    candidate == baseline give deltas 0, 0, 0 and the interval [0, 0], which clears
    neither "low > 0" nor "high < 0", so the cell is `neutral`."""
    outcome = evaluate_cell("cell", _pairs([(100.0, 10.0)] * 3), cancel_bound_s=None,
                            tensor_parallel_size=1)
    thr = outcome.deltas["throughput"]
    assert (thr.low, thr.high) == (0.0, 0.0)
    assert outcome.label == "neutral"


@pytest.mark.parametrize("status", ["missing", "carried", "no-engine-child", "unavailable"])
def test_a_candidate_without_its_policy_environment_fails_the_enabled_gate(status: str) -> None:
    """BidKV loaded without its BIDKV_UTILITY_* variables in the engine child is inert:
    the host still reports it enabled and counts its calls (all abstentions), so the
    gate must read §2 step 4's environment check: ``missing`` fails it; a carried
    environment, or a check that could not be made, does not."""
    inert = {"calls": 10, "selections": 0, "abstentions": 10, "failures": 0,
             "invalid_selections": 0}
    pairs = _pairs([(105, 9.9), (106, 10.0), (107, 10.1)], counters=inert,
                   procedure={"policy_environment": {"status": status, "detail": "x"}})
    gate = {g.name: g for g in evaluate_cell(
        "cell", pairs, cancel_bound_s=None, tensor_parallel_size=1).gates
    }["policy-enabled-and-invoked"]
    if status == "missing":
        assert gate.status == "fail"
        assert "repeat 2 candidate: policy environment missing in the engine child" in gate.detail
    else:
        assert gate.status == "pass"
