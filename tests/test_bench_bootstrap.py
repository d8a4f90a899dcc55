"""``run.py slices``' bootstrap interval stays a number when a per-slice ratio is infinite.

Guarded behaviour: :func:`run.ratio_of` makes a slice's ratio ``inf`` when the peer
recomputed nothing and the arm did (the code and Mooncake cells run at a 0.01-0.2 % tax,
a handful of preemptions per slice). The 95 % percentile-bootstrap interval of the median
(linear interpolation between order statistics) must then reach ``inf``, not print
``nan``: ``np.percentile`` interpolates between two infinite medians as inf - inf. The
finite case is unchanged (numpy's linear method, checked against ``np.percentile``).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "replay"))

import run


def _slice(bidkv_tax: float, lcf_tax: float) -> dict[str, dict[str, Any]]:
    return {"bidkv": {"recompute_tax": bidkv_tax},
            "least-computed-first": {"recompute_tax": lcf_tax}}


def test_an_infinite_ratio_gives_an_infinite_upper_bound_not_nan() -> None:
    # Resamples of [0.5, inf, inf] have median 0.5 when at least two of three draws are
    # 0.5: 3 (1/3)^2 (2/3) + (1/3)^3 = 7/27 ~= 26 % of them, inf otherwise. So the 2.5th
    # percentile lies between two medians of 0.5 and the 97.5th between two infinite ones.
    low, high = run._bootstrap_median([0.5, math.inf, math.inf])
    assert low == 0.5
    assert high == math.inf


def test_slice_ratio_column_with_a_peer_that_recomputed_nothing() -> None:
    # Slice 0: LCF recomputed nothing, bidkv did: inf. Slices 1 and 2: 0.01 / 0.02 = 0.5.
    # Median 0.5; resamples have median inf only with two or three draws of slice 0
    # (7/27 of them), so the interval is [0.5, inf].
    runs = [_slice(0.01, 0.0), _slice(0.01, 0.02), _slice(0.01, 0.02)]
    assert run._ratio(runs, "tax", "bidkv", "least-computed-first") == "0.500 [0.500, inf]"


def test_percentile_next_to_an_infinite_order_statistic() -> None:
    # Between 1 and inf: at an order statistic the value itself, inside the gap inf.
    assert run._linear_percentile([1.0, math.inf], 0.0) == 1.0
    assert run._linear_percentile([1.0, math.inf], 50.0) == math.inf
    assert run._linear_percentile([1.0, math.inf], 100.0) == math.inf
    assert run._linear_percentile([1.0, 2.0, math.inf], 50.0) == 2.0


@pytest.mark.parametrize("q", [0.0, 2.5, 37.0, 50.0, 97.5, 100.0])
def test_finite_percentiles_are_numpy_linear(q: float) -> None:
    ordered = np.sort(np.random.default_rng(7).normal(size=101))
    assert run._linear_percentile(ordered, q) == pytest.approx(float(np.percentile(ordered, q)),
                                                               abs=1e-12)
