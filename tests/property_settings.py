"""Hypothesis settings shared by the property tests that drive the real vLLM scheduler."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

# The same examples on every run (no randomness, no example database), so CI is
# deterministic; no deadline, since one example replays a whole workload through vLLM.
REAL_SCHEDULER = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
