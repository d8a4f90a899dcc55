"""Policy counters and engine facts from the three places a host reports them.

Preferred: Prometheus deltas of ``vllm:preemption_policy_events{event=...}`` and the
``vllm:preemption_policy_enabled`` gauge (vLLM-HUST hosts). Then the manager's runtime
evidence JSONL (controller events carry ``export_stats()``). Last: the engine log's
``Preemption policy initialized: policy=X enabled=Y`` line (enabled flag only). The
log also gives the tensor-parallel ranks seen (``tp_ranks_from_log``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from qualification.verdict import COUNTER_NAMES

__all__ = [
    "counters_from_evidence",
    "counters_from_metrics",
    "enabled_from_log",
    "gauge",
    "metric_delta",
    "parse_prometheus",
    "policy_init_lines",
]

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_INIT_LINE = re.compile(r"Preemption policy initialized: policy=(\S+) enabled=(True|False)")

Samples = list[tuple[str, dict[str, str], float]]


def parse_prometheus(text: str) -> Samples:
    samples: Samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        samples.append((match.group(1), labels, value))
    return samples


def _sum(samples: Samples, names: Iterable[str], **labels: str) -> float | None:
    wanted = set(names)
    values = [
        v
        for n, lab, v in samples
        if n in wanted and all(lab.get(k) == want for k, want in labels.items())
    ]
    if not values:
        return None
    try:
        return math.fsum(values)
    except (ValueError, OverflowError):  # +Inf with -Inf, or a sum past float's range
        return sum(values)  # NaN or an infinity, which the readers treat as no count


def metric_delta(before: Samples, after: Samples, name: str, **labels: str) -> float | None:
    names = (name, f"{name}_total") if not name.endswith("_total") else (name,)
    end = _sum(after, names, **labels)
    if end is None:
        return None
    return end - (_sum(before, names, **labels) or 0.0)


def gauge(samples: Samples, name: str) -> float | None:
    return _sum(samples, (name,))


def counters_from_metrics(
    before: Samples, after: Samples
) -> tuple[dict[str, int] | None, bool | None]:
    counters: dict[str, int] = {}
    absent: list[str] = []
    for event in COUNTER_NAMES:
        delta = metric_delta(before, after, "vllm:preemption_policy_events", event=event)
        if delta is None:
            absent.append(event)
        elif math.isfinite(delta):  # NaN/+Inf samples: no count
            counters[event] = round(delta)
    if counters:
        # A labelled counter's series exists only once it has counted (prometheus_client
        # creates a label set on first use): within a family that is there, an event with
        # no series has counted nothing. A series whose sample is NaN/Inf stays unknown.
        counters.update(dict.fromkeys(absent, 0))
    # qualification.md section 6 gate 8: the gauge = 1. Every engine exports its own
    # series, so each must read 1: a sum >= 1 took one enabled engine out of two (or a
    # gauge of 2) for an enabled policy.
    series = [v for n, _labels, v in after if n == "vllm:preemption_policy_enabled"]
    enabled = all(v == 1 for v in series) if series else None
    return (counters or None), enabled


def _stats_objects(node: object) -> Iterable[Mapping[str, object]]:
    if isinstance(node, Mapping):
        if "calls" in node:
            yield node
        for value in node.values():
            yield from _stats_objects(value)
    elif isinstance(node, list):
        for value in node:
            yield from _stats_objects(value)


def counters_from_evidence(path: Path) -> tuple[dict[str, int] | None, bool | None, str | None]:
    """Largest counters seen in the JSONL, the last enabled flag and policy name."""
    if not path.is_file():
        return None, None, None
    counters: dict[str, int] = {}
    enabled: bool | None = None
    name: str | None = None
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            # Walked inside the try: a line nested just under json's limit overflows the walk.
            found = list(_stats_objects(json.loads(line)))
        except (ValueError, RecursionError):  # a torn line: the others still count
            continue
        for stats in found:
            for key in COUNTER_NAMES:
                value = stats.get(key)
                if isinstance(value, int):
                    counters[key] = max(counters.get(key, 0), value)
            if isinstance(stats.get("enabled"), bool):
                enabled = bool(stats["enabled"])
            if isinstance(stats.get("policy_name"), str):
                name = str(stats["policy_name"])
    return (counters or None), enabled, name


def policy_init_lines(text: str) -> list[tuple[str, bool]]:
    """Every ``Preemption policy initialized`` line's (policy, enabled), in order."""
    return [(policy, flag == "True") for policy, flag in _INIT_LINE.findall(text)]


def enabled_from_log(text: str) -> tuple[bool | None, str | None]:
    lines = policy_init_lines(text)
    if not lines:
        return None, None
    policy, enabled = lines[-1]
    return enabled and policy != "builtin", policy


def tp_ranks_from_log(text: str, pattern: str) -> tuple[int, ...]:
    """The distinct ranks ``pattern``'s one group captured in the log, ascending.

    A capture that is not a decimal number names no rank: the pattern may be loose. Any
    Unicode decimal digits count, as ``int`` reads them; other digits (``²``) do not, since
    ``int`` refuses them."""
    return tuple(sorted({int(m) for m in re.findall(pattern, text) if m.isdecimal()}))
