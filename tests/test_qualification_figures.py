"""Serve-arm figures beyond the gated ones (qualification.md §4): TPOT, P99s, Jain
fairness, goodput and SLO goodput, computed from the client's per-request timings, with
cancelled requests left out. Values are checked against hand computations; the SLO bounds
are inclusive (TTFT <= 60 s, TPOT <= 0.2 s, E2E <= 600 s), a one-token answer has no TPOT
to miss, and fairness over all-zero rates is NaN rather than a division error."""

from __future__ import annotations

import math

import pytest

from qualification.client import RequestResult
from qualification.figures import SLO, jain_fairness, serve_figures, tpot


def _result(
    index: int, ttft: float | None, latency: float | None, tokens: int, *,
    ok: bool = True, cancelled: bool = False,
) -> RequestResult:
    return RequestResult(index, ok, 200, 0.0, ttft, latency, tokens, "x", cancelled=cancelled)


def test_tpot_is_time_after_the_first_token_per_later_token() -> None:
    assert tpot(_result(0, 1.0, 11.0, 101)) == pytest.approx(0.1)
    assert tpot(_result(0, 1.0, 1.0, 1)) is None  # one token: no inter-token time
    assert tpot(_result(0, None, 3.0, 5)) is None


def test_jain_fairness_bounds() -> None:
    assert jain_fairness([2.0, 2.0, 2.0]) == pytest.approx(1.0)
    assert jain_fairness([4.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain_fairness([1.0, 3.0]) == pytest.approx(16 / (2 * 10))
    assert math.isnan(jain_fairness([]))
    assert math.isnan(jain_fairness([0.0, 0.0]))  # nobody got a token: no fairness figure


def test_serve_figures_by_hand() -> None:
    results = [
        _result(0, 1.0, 11.0, 101),   # tpot 0.1, rate 101/11, meets the SLO
        _result(1, 2.0, 42.0, 101),   # tpot 0.4: misses the TPOT SLO
        _result(2, 70.0, 80.0, 11),   # ttft 70 s: misses the TTFT SLO
        _result(3, 0.5, 0.5, 0, ok=False),           # failed: not counted
        _result(4, 1.0, 2.0, 5, cancelled=True),     # cancelled on purpose: not counted
    ]
    figures = serve_figures(results, makespan_s=100.0)
    assert figures["ttft_p50"] == pytest.approx(2.0)
    assert figures["ttft_p99"] == pytest.approx(2.0 + 0.98 * 68.0)
    assert figures["tpot_p50"] == pytest.approx(0.4)
    assert figures["e2e_p95"] == pytest.approx(42.0 + 0.9 * 38.0)
    assert figures["goodput_rps"] == pytest.approx(0.03)
    assert figures["slo_goodput_rps"] == pytest.approx(0.01)
    rates = [101 / 11, 101 / 42, 11 / 80]
    expected = sum(rates) ** 2 / (3 * sum(r * r for r in rates))
    assert figures["jain_fairness"] == pytest.approx(expected)
    loose = serve_figures(results, makespan_s=100.0, slo=SLO(ttft_s=100.0, tpot_s=1.0))
    assert loose["slo_goodput_rps"] == pytest.approx(0.03)


def test_no_completed_request_gives_nan_not_an_error() -> None:
    figures = serve_figures([_result(0, None, None, 0, ok=False)], makespan_s=0.0)
    assert math.isnan(figures["ttft_p95"]) and math.isnan(figures["goodput_rps"])


@pytest.mark.parametrize(
    ("result", "meets"),
    [
        (_result(0, 60.0, 61.0, 1), True),  # TTFT exactly 60 s
        (_result(0, 1.0, 600.0, 1), True),  # E2E exactly 600 s, one token: no TPOT
        (_result(0, 1.0, 600.5, 1), False),  # E2E over 600 s
        (_result(0, 60.5, 61.0, 1), False),  # TTFT over 60 s
        (_result(0, 1.0, 3.0, 11), True),  # TPOT exactly 0.2 s
        (_result(0, 1.0, 3.5, 11), False),  # TPOT 0.25 s
    ],
)
def test_slo_bounds_are_inclusive(result: RequestResult, meets: bool) -> None:
    """qualification.md §4: TTFT <= 60 s, TPOT <= 0.2 s, E2E <= 600 s; a request with one
    output token has no inter-token time, so only TTFT and E2E can fail it."""
    figures = serve_figures([result], makespan_s=10.0)
    assert figures["slo_goodput_rps"] == pytest.approx(0.1 if meets else 0.0)
