"""Per-arm figures, functional gates and the per-cell verdict (qualification.md §6-§7).

Invocation appears twice, on purpose. The *gate* "policy enabled and invoked" asks that
the candidate ran with the policy enabled in every repeat and that the policy was called
at least once in the cell (the spec's "runtime effective"); without that the arms did not
differ and the cell fails. The *verdict* rule 3 is stricter: any candidate repeat with
``calls == 0`` makes the cell ``inconclusive`` because that repeat compared two built-in
runs, so no effectiveness claim is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from qualification.stats import DeltaSummary, paired_delta, summarize_deltas

__all__ = [
    "COUNTER_NAMES",
    "DELTA_METRICS",
    "EXTRA_DELTA_METRICS",
    "ArmResult",
    "CellOutcome",
    "GateResult",
    "Pair",
    "classify",
    "environment_missing",
    "evaluate_cell",
    "evaluate_gates",
]

Arm = Literal["baseline", "candidate"]
GateStatus = Literal["pass", "fail", "n/a"]
Label = Literal[
    "beneficial", "neutral", "not-beneficial-in-tested-cell", "inconclusive", "gate-failed"
]

COUNTER_NAMES = ("calls", "selections", "abstentions", "failures", "invalid_selections")
# The counters the "zero policy failures" gate reads (qualification.md §6 gate 7).
FAULT_COUNTERS = ("failures", "invalid_selections")
# Metrics reported as paired deltas; the first two decide the verdict.
DELTA_METRICS = ("throughput", "latency_p95", "ttft_p95", "latency_p50", "ttft_p50")
# The other figures an arm reports in ``extra`` (qualification.md §4: the serve arm's P99s,
# TPOT, Jain fairness and goodputs; the replay's goodput) also get a paired delta and an
# interval (§5 "and any other reported metric"; §8 reports P95 TPOT and Jain deltas).
# Each appears only in cells whose arms report it; none of them decides the verdict.
EXTRA_DELTA_METRICS = (
    "ttft_p99",
    "e2e_p99",
    "tpot_p50",
    "tpot_p95",
    "tpot_p99",
    "jain_fairness",
    "goodput_rps",
    "slo_goodput_rps",
    "goodput_req_s",
    # Replay arms: what the policy is for (qualification.md §5: "and any other reported
    # metric"); a zero baseline (no preemption) gives no ratio, which decides nothing.
    "recompute_tax",
    "preemptions_per_1k",
)
MIN_PAIRS = 3
P95_LATENCY_TOLERANCE_PCT = 5.0


@dataclass(frozen=True, slots=True)
class ArmResult:
    """Raw figures of one arm of one repeat. Times in seconds, throughput in tok/s."""

    arm: Arm
    throughput: float
    ttft_p50: float
    ttft_p95: float
    latency_p50: float
    latency_p95: float
    requests: int
    completed: int
    failed: int = 0
    starved: int = 0
    output_tokens: int = 0
    counters: Mapping[str, int] | None = None
    policy_enabled: bool | None = None
    policy_name: str | None = None
    preemptions: float | None = None
    short_hash: str | None = None
    long_hashes: tuple[str, ...] = ()
    started: bool = True
    drain_s: float | None = None
    recovery_ok: bool | None = None
    tracebacks: int | None = None
    graph_captured: bool | None = None
    tp_ranks: tuple[int, ...] | None = None
    error: str | None = None
    wall_s: float = 0.0
    command: tuple[str, ...] = ()
    extra: Mapping[str, object] = field(default_factory=dict)
    # qualification.md §2 steps 3, 4, 7 (serve arms): device snapshot, the candidate's
    # policy environment per process, the arm's log; facts, not gates.
    procedure: Mapping[str, object] = field(default_factory=dict)

    @classmethod
    def not_started(
        cls, arm: Arm, error: str, *, wall_s: float, command: tuple[str, ...], **extra: Any
    ) -> ArmResult:
        """An arm whose workload never ran (launch failure, timeout, unhealthy server)."""
        nan = float("nan")
        return cls(
            arm=arm, throughput=0.0, ttft_p50=nan, ttft_p95=nan, latency_p50=nan,
            latency_p95=nan, requests=0, completed=0, started=False, error=error,
            wall_s=wall_s, command=command, **extra,
        )

    @property
    def calls(self) -> int:
        return 0 if self.counters is None else int(self.counters.get("calls", 0))

    @property
    def invoked(self) -> bool:
        return self.calls > 0

    def as_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["invoked"] = self.invoked
        data["counters"] = None if self.counters is None else dict(self.counters)
        data["extra"] = dict(self.extra)
        data["procedure"] = dict(self.procedure)
        return data


def _figure(arm: ArmResult, metric: str) -> float:
    value = getattr(arm, metric) if metric in DELTA_METRICS else arm.extra.get(metric)
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an integer past float's range
            return math.inf if value > 0 else -math.inf
    return math.nan


@dataclass(frozen=True, slots=True)
class Pair:
    """One repetition of a cell: both arms, and which ran first."""

    cell: str
    repetition: int
    first: Arm
    baseline: ArmResult
    candidate: ArmResult

    def delta(self, metric: str) -> float:
        """(candidate / baseline - 1) x 100 % of one figure: a field of both arms, or an
        ``extra`` figure (NaN when an arm does not report it as a number)."""
        return paired_delta(_figure(self.candidate, metric), _figure(self.baseline, metric))

    def metrics(self) -> tuple[str, ...]:
        """The metrics this pair has a delta for: the gated fields, then every
        ``EXTRA_DELTA_METRICS`` figure either arm reports."""
        reported = [
            m
            for m in EXTRA_DELTA_METRICS
            if m in self.baseline.extra or m in self.candidate.extra
        ]
        return (*DELTA_METRICS, *reported)

    def as_dict(self) -> dict[str, object]:
        return {
            "cell": self.cell,
            "repetition": self.repetition,
            "first": self.first,
            "baseline": self.baseline.as_dict(),
            "candidate": self.candidate.as_dict(),
            "deltas_pct": {m: self.delta(m) for m in self.metrics()},
        }


@dataclass(frozen=True, slots=True)
class GateResult:
    name: str
    status: GateStatus
    detail: str = ""


@dataclass(frozen=True, slots=True)
class CellOutcome:
    cell: str
    pairs: tuple[Pair, ...]
    gates: tuple[GateResult, ...]
    deltas: Mapping[str, DeltaSummary]
    label: Label
    reason: str

    @property
    def gates_passed(self) -> bool:
        return all(g.status != "fail" for g in self.gates) and bool(self.pairs)

    def as_dict(self) -> dict[str, object]:
        return {
            "cell": self.cell,
            "verdict": self.label,
            "reason": self.reason,
            "gates_passed": self.gates_passed,
            "gates": [asdict(g) for g in self.gates],
            "deltas": {k: v.as_dict() for k, v in self.deltas.items()},
            "calls_per_repeat": [p.candidate.calls for p in self.pairs],
            "pairs": [p.as_dict() for p in self.pairs],
        }


def _gate(name: str, failures: Sequence[str], applicable: bool = True) -> GateResult:
    if not applicable:
        return GateResult(name, "n/a", "not applicable to this profile or cell")
    if failures:
        return GateResult(name, "fail", "; ".join(failures))
    return GateResult(name, "pass")


def _why_not_recovered(arm: ArmResult) -> str:
    if arm.started:
        return "recovery request failed"
    # Name what kept the arm from running (a manager verb, a replay exit, an unhealthy
    # server): "the server did not come up" would be wrong for most of them.
    return f"arm did not run ({arm.error})" if arm.error else "server did not come up"


def _arms(pairs: Sequence[Pair]) -> list[tuple[int, ArmResult]]:
    return [(p.repetition, a) for p in pairs for a in (p.baseline, p.candidate)]


Arms = Sequence[tuple[int, ArmResult]]


def _short_output_gate(pairs: Sequence[Pair]) -> GateResult:
    hashes = [(p.repetition, p.baseline.short_hash, p.candidate.short_hash) for p in pairs]
    return _gate(
        "short-output-identical",
        [f"repeat {r}: {b} != {c}" for r, b, c in hashes if b is None or b != c],
        applicable=any(b is not None or c is not None for _, b, c in hashes),
    )


def _failed_or_starved_gate(arms: Arms) -> GateResult:
    return _gate("no-failed-or-starved", [
        f"repeat {r} {a.arm}: failed={a.failed} starved={a.starved}"
        + (f" error={a.error}" if a.error else "")
        for r, a in arms
        if a.failed or a.starved or a.error or a.completed < a.requests
    ])


def _cancellation_gate(arms: Arms, cancel_bound_s: float | None) -> GateResult:
    return _gate(
        "cancellation-drains",
        [
            f"repeat {r} {a.arm}: drain {a.drain_s}s > bound {cancel_bound_s}s"
            for r, a in arms
            if a.drain_s is None or cancel_bound_s is None or a.drain_s > cancel_bound_s
        ],
        applicable=cancel_bound_s is not None,
    )


def _recovery_gate(arms: Arms) -> GateResult:
    return _gate("recovers-after-restart", [
        f"repeat {r} {a.arm}: " + _why_not_recovered(a)
        for r, a in arms
        if not a.started or a.recovery_ok is False
    ])


def _graph_and_ranks_gate(arms: Arms, tp: int) -> GateResult:
    # Every rank 0..tp-1 seen, counted over the ranks seen: range(tp) itself would never
    # end for a profile declaring tensor_parallel_size = 10**30.
    return _gate(
        "graph-capture-and-tp-ranks",
        [
            f"repeat {r} {a.arm}: graph_captured={a.graph_captured} tp_ranks={a.tp_ranks}"
            for r, a in arms
            if a.graph_captured is False
            or (a.tp_ranks is not None
                and len({rank for rank in a.tp_ranks if 0 <= rank < tp}) < tp)
        ],
        applicable=any(a.graph_captured is not None or a.tp_ranks is not None for _, a in arms),
    )


def _traceback_gate(arms: Arms) -> GateResult:
    return _gate(
        "zero-tracebacks",
        [f"repeat {r} {a.arm}: {a.tracebacks} traceback(s)" for r, a in arms if a.tracebacks],
        applicable=any(a.tracebacks is not None for _, a in arms),
    )


def _policy_fault_gate(arms: Arms) -> GateResult:
    faults: list[str] = []
    for r, a in arms:
        if a.arm == "candidate" and a.counters is None:
            faults.append(f"repeat {r} candidate: policy counters unavailable")
        elif a.counters is not None:
            # The candidate must report both fault counters: one it lacks is unknown, not
            # zero (export_stats() and the host's metrics carry all five).
            missing = [k for k in FAULT_COUNTERS if k not in a.counters]
            if a.arm == "candidate" and missing:
                faults.append(f"repeat {r} candidate: {', '.join(missing)} counter(s) unavailable")
            bad = {k: a.counters.get(k, 0) for k in FAULT_COUNTERS}
            if any(bad.values()):
                faults.append(f"repeat {r} {a.arm}: {bad}")
    return _gate("zero-policy-failures", faults)


def _enabled_and_invoked_gate(pairs: Sequence[Pair]) -> GateResult:
    faults = [
        f"repeat {p.repetition} candidate: policy enabled={p.candidate.policy_enabled}"
        for p in pairs
        if p.candidate.policy_enabled is not True
    ] + [
        # The baseline is the built-in victim: it may run an abstaining controller (the
        # replay's `builtin` arm) but must never override the host's choice.
        f"repeat {p.repetition} baseline: {p.baseline.counters['selections']} selection(s)"
        for p in pairs
        if p.baseline.counters is not None and p.baseline.counters.get("selections", 0) > 0
    ] + [
        # The host reports a loaded policy as enabled, but without its BIDKV_UTILITY_*
        # variables in the engine child BidKV is inert: it abstains on every call, so the
        # counters alone look healthy (§2 step 4 is what proves what it ran with).
        f"repeat {p.repetition} candidate: policy environment missing in the engine child "
        "(the policy ran inert, abstaining on every call)"
        for p in pairs
        if environment_missing(p.candidate)
    ]
    if pairs and not any(p.candidate.invoked for p in pairs):
        faults.append("the policy was never invoked in any candidate arm")
    return _gate("policy-enabled-and-invoked", faults)


def environment_missing(arm: ArmResult) -> Mapping[str, object] | None:
    """The arm's §2 step 4 record when it found no engine child carrying the policy's
    environment, else ``None``."""
    env = arm.procedure.get("policy_environment")
    return env if isinstance(env, Mapping) and env.get("status") == "missing" else None


def evaluate_gates(
    pairs: Sequence[Pair],
    *,
    cancel_bound_s: float | None,
    tensor_parallel_size: int,
) -> tuple[GateResult, ...]:
    """The functional gates; each must hold in every repeat and both arms."""
    arms = _arms(pairs)
    return (
        _short_output_gate(pairs),
        _failed_or_starved_gate(arms),
        _cancellation_gate(arms, cancel_bound_s),
        _recovery_gate(arms),
        _graph_and_ranks_gate(arms, tensor_parallel_size),
        _traceback_gate(arms),
        _policy_fault_gate(arms),
        _enabled_and_invoked_gate(pairs),
    )


def summarize_pairs(pairs: Sequence[Pair]) -> dict[str, DeltaSummary]:
    """Mean delta and interval per metric over the cell's pairs, matched by repetition:
    the gated fields always, an ``extra`` figure when any pair reports it."""
    reported = {m for p in pairs for m in p.metrics()}
    metrics = [*DELTA_METRICS, *(m for m in EXTRA_DELTA_METRICS if m in reported)]
    return {m: summarize_deltas([p.delta(m) for p in pairs]) for m in metrics}


def classify(
    n_pairs: int,
    gates_passed: bool,
    calls_per_repeat: Sequence[int],
    throughput: DeltaSummary,
    latency_p95: DeltaSummary,
) -> tuple[Label, str]:
    """qualification.md §7, rules applied in order."""
    if n_pairs < MIN_PAIRS:
        return "inconclusive", f"{n_pairs} pair(s) < {MIN_PAIRS}"
    if not gates_passed:
        return "gate-failed", "a functional gate failed; the cell is not classifiable"
    if any(c <= 0 for c in calls_per_repeat):
        zero = [i for i, c in enumerate(calls_per_repeat) if c <= 0]
        return "inconclusive", f"the policy was not invoked in repeat(s) {zero}"
    if any(math.isnan(v) for v in (throughput.low, latency_p95.high)):
        return "inconclusive", ("a delta could not be computed (a zero baseline, or a "
                                "figure an arm had no samples for)")
    thr = f"throughput {throughput.mean:+.2f}% [{throughput.low:+.2f}, {throughput.high:+.2f}]"
    lat = f"P95 latency {latency_p95.mean:+.2f}% [{latency_p95.low:+.2f}, {latency_p95.high:+.2f}]"
    if throughput.low > 0 and latency_p95.high <= P95_LATENCY_TOLERANCE_PCT:
        return "beneficial", f"{thr}; {lat}"
    if throughput.high < 0 or latency_p95.low > P95_LATENCY_TOLERANCE_PCT:
        return "not-beneficial-in-tested-cell", f"{thr}; {lat}"
    return "neutral", f"{thr}; {lat}"


def evaluate_cell(
    cell: str,
    pairs: Sequence[Pair],
    *,
    cancel_bound_s: float | None,
    tensor_parallel_size: int,
) -> CellOutcome:
    gates = evaluate_gates(
        pairs, cancel_bound_s=cancel_bound_s, tensor_parallel_size=tensor_parallel_size
    )
    deltas = summarize_pairs(pairs)
    passed = all(g.status != "fail" for g in gates) and bool(pairs)
    label, reason = classify(
        len(pairs),
        passed,
        [p.candidate.calls for p in pairs],
        deltas["throughput"],
        deltas["latency_p95"],
    )
    return CellOutcome(cell, tuple(pairs), gates, deltas, label, reason)
