"""Bounds the replay's inputs share."""

from __future__ import annotations

__all__ = ["MAX_SIMULATED_SECONDS"]

MAX_SIMULATED_SECONDS = 1e10
"""Upper bound of a simulated time (an arrival, one step, a capacity change): about 317
years. The clock is a float; below this it still resolves about two microseconds, and no
sum of such times reaches infinity, which the report's JSON cannot hold."""
