"""Guards the qualification statistics: paired deltas, the Student-t 95 % interval and the
linear-interpolation percentiles, checked against values computed independently here."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from qualification.stats import paired_delta, percentile, summarize_deltas, t_quantile

# The spec's table of t(0.975, df) for df 1..9 (qualification.md §5).
T_TABLE = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262)


def test_worked_example_matches_the_spec() -> None:
    deltas = [-25.94, -25.01, -25.00]
    mean = sum(deltas) / 3  # -25.3167
    s = math.sqrt(sum((d - mean) ** 2 for d in deltas) / 2)  # 0.5399
    half = 4.303 * s / math.sqrt(3)
    summary = summarize_deltas(deltas)
    assert summary.n == 3
    assert summary.mean == pytest.approx(mean, abs=1e-12)
    assert summary.stdev == pytest.approx(statistics.stdev(deltas), abs=1e-12)
    assert summary.stdev == pytest.approx(0.540, abs=5e-4)
    assert summary.t == pytest.approx(4.303, abs=5e-4)
    assert summary.half_width == pytest.approx(half, rel=1e-3)
    assert summary.half_width == pytest.approx(1.34, abs=5e-3)
    assert summary.low == pytest.approx(-26.66, abs=5e-3)
    assert summary.high == pytest.approx(-23.98, abs=5e-3)


@pytest.mark.parametrize("df", range(1, 10))
def test_t_quantile_agrees_with_the_table(df: int) -> None:
    assert t_quantile(df + 1) == pytest.approx(T_TABLE[df - 1], abs=5e-4)


def test_t_quantile_beyond_table_approaches_normal() -> None:
    assert 1.96 < t_quantile(200) < 1.98
    assert math.isinf(t_quantile(1))


def test_paired_delta_is_relative_percent() -> None:
    assert paired_delta(75.0, 100.0) == pytest.approx(-25.0)
    assert paired_delta(101.23, 100.0) == pytest.approx(1.23)
    assert math.isnan(paired_delta(1.0, 0.0))


def test_single_pair_has_an_unbounded_interval() -> None:
    summary = summarize_deltas([3.0])
    assert summary.mean == 3.0
    assert summary.low == -math.inf and summary.high == math.inf


def test_nan_delta_poisons_the_summary() -> None:
    assert math.isnan(summarize_deltas([1.0, math.nan, 2.0]).mean)


@pytest.mark.parametrize("q", [0, 50, 95, 99, 100])
def test_percentile_is_numpy_linear(q: float) -> None:
    values = [0.7, 3.1, 1.2, 9.9, 4.4, 4.4, 2.0]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert math.isnan(percentile([], q))
