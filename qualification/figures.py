"""Per-arm figures of a serve run beyond the gated ones (qualification.md §4).

Computed once per arm: TTFT, TPOT and E2E latency at P50/P95/P99, goodput and SLO goodput,
and Jain fairness of per-request output rates. The serve arm keeps the TTFT and E2E
P50/P95 as its gated fields and records the rest in ``extra``, so a record carries the
spec's whole metric list. All of them come from the client's own per-request timings
(streaming, so TTFT is real); requests the workload cancels on purpose are left out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from qualification.client import RequestResult
from qualification.stats import percentile

__all__ = ["SLO", "jain_fairness", "serve_figures", "tpot"]


@dataclass(frozen=True, slots=True)
class SLO:
    """The spec's SLO for goodput: a request counts when it meets all three."""

    ttft_s: float = 60.0
    tpot_s: float = 0.2
    e2e_s: float = 600.0


def tpot(result: RequestResult) -> float | None:
    """Time per output token after the first; None with fewer than two tokens."""
    if result.ttft is None or result.latency is None or result.output_tokens < 2:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def jain_fairness(values: Sequence[float]) -> float:
    """(sum x)^2 / (n * sum x^2): 1 when all equal, 1/n when one takes everything."""
    square_sum = math.fsum(v * v for v in values)
    if not values or square_sum == 0.0:
        return math.nan
    return math.fsum(values) ** 2 / (len(values) * square_sum)


def _quantiles(prefix: str, values: Sequence[float]) -> dict[str, float]:
    return {f"{prefix}_p{q}": percentile(values, q) for q in (50, 95, 99)}


def _meets(result: RequestResult, slo: SLO) -> bool:
    per_token = tpot(result)
    return (
        result.ttft is not None
        and result.latency is not None
        and result.ttft <= slo.ttft_s
        and result.latency <= slo.e2e_s
        and (per_token is None or per_token <= slo.tpot_s)
    )


def serve_figures(
    results: Sequence[RequestResult], makespan_s: float, slo: SLO = SLO()
) -> dict[str, float]:
    """The §4 figures of one arm; NaN where a figure has no data."""
    done = [r for r in results if r.ok and not r.cancelled]
    figures = {
        **_quantiles("ttft", [r.ttft for r in done if r.ttft is not None]),
        **_quantiles("tpot", [t for r in done if (t := tpot(r)) is not None]),
        **_quantiles("e2e", [r.latency for r in done if r.latency is not None]),
    }
    rates = [r.output_tokens / r.latency for r in done if r.latency]
    figures["jain_fairness"] = jain_fairness(rates)
    span = makespan_s if makespan_s > 0 else math.nan
    figures["goodput_rps"] = len(done) / span
    figures["slo_goodput_rps"] = sum(_meets(r, slo) for r in done) / span
    return figures
