"""Paired deltas and Student-t intervals (qualification.md §5).

Per pair: delta = (candidate / baseline - 1) x 100 %. Over n pairs: mean +- t(0.975, n-1)
x s / sqrt(n), s the sample standard deviation (ddof=1). The quantile comes from scipy for
every n: it equals the spec's table (12.706, 4.303, ...) for n <= 10 and replaces the
table's 1.96 beyond it, which understates the width for small n > 10.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats as _scipy_stats  # type: ignore[import-untyped]

__all__ = ["DeltaSummary", "paired_delta", "percentile", "summarize_deltas", "t_quantile"]


@dataclass(frozen=True, slots=True)
class DeltaSummary:
    """Mean paired delta (%) with its two-sided 95 % Student-t interval."""

    n: int
    deltas: tuple[float, ...]
    mean: float
    stdev: float
    t: float
    half_width: float
    low: float
    high: float

    def as_dict(self) -> dict[str, object]:
        return {
            "n": self.n,
            "deltas": list(self.deltas),
            "mean": self.mean,
            "stdev": self.stdev,
            "t": self.t,
            "half_width": self.half_width,
            "ci_low": self.low,
            "ci_high": self.high,
        }


def paired_delta(candidate: float, baseline: float) -> float:
    """Relative change in percent; NaN when the baseline is zero (no meaningful ratio)."""
    if baseline == 0:
        return math.nan
    return (candidate / baseline - 1.0) * 100.0


def t_quantile(n: int, confidence: float = 0.95) -> float:
    """Two-sided Student-t quantile for n samples (df = n - 1); inf below two samples."""
    if n < 2:
        return math.inf
    return float(_scipy_stats.t.ppf(0.5 + confidence / 2.0, n - 1))


def summarize_deltas(deltas: Sequence[float], confidence: float = 0.95) -> DeltaSummary:
    values = tuple(float(d) for d in deltas)
    n = len(values)
    if n == 0 or any(math.isnan(v) for v in values):
        nan = math.nan
        return DeltaSummary(n, values, nan, nan, nan, nan, nan, nan)
    mean = math.fsum(values) / n
    if n < 2:
        return DeltaSummary(n, values, mean, math.nan, math.inf, math.inf, -math.inf, math.inf)
    stdev = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    t = t_quantile(n, confidence)
    half = t * stdev / math.sqrt(n)
    return DeltaSummary(n, values, mean, stdev, t, half, mean - half, mean + half)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default); NaN when empty."""
    data = sorted(values)
    if not data:
        return math.nan
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)
