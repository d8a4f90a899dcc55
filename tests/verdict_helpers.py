"""The one ``ArmResult`` builder the qualification verdict, traceability and mutation-gap
tests share: an arm that passes every functional gate (all requests completed, equal short
output hashes, the candidate invoked with the policy enabled, the baseline selecting
nothing), with any field overridden by keyword."""

from __future__ import annotations

from typing import Any

from qualification.verdict import COUNTER_NAMES, ArmResult


def arm_result(arm: str, throughput: float = 100.0, p95: float = 10.0, *, calls: int = 10,
               **kw: Any) -> ArmResult:
    """Arm ``arm`` ("baseline" or "candidate") of one pair; the candidate made ``calls``
    policy calls, selecting a victim in one of them when it made any."""
    counters = dict.fromkeys(COUNTER_NAMES, 0)
    if arm == "candidate":
        counters.update(calls=calls, selections=1 if calls else 0,
                        abstentions=max(calls - 1, 0))
    fields: dict[str, Any] = {
        "ttft_p50": 0.1, "ttft_p95": 0.2, "latency_p50": p95 / 2, "requests": 4,
        "completed": 4, "counters": counters, "policy_enabled": arm == "candidate",
        "short_hash": "abc",
    }
    fields.update(kw)
    return ArmResult(arm=arm, throughput=throughput, latency_p95=p95, **fields)
