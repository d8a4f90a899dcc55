"""The qualification record (JSON), its Markdown report and the per-cell delta plot."""

from __future__ import annotations

import json
import math
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from qualification.verdict import ArmResult, CellOutcome, environment_missing

__all__ = [
    "gate_summary",
    "procedure_notes",
    "write_json_atomic",
    "write_markdown",
    "write_plot",
]


def _finite(value: object) -> object:
    """JSON has no NaN/inf: write them as null (strict parsers reject the literals)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _write_atomic(path: Path, write: Callable[[TextIO], object]) -> None:
    """Write through a temporary file beside ``path``, renamed onto it only when ``write``
    finished: a run that fails (or is killed) while writing keeps the previous file."""
    _replace_atomically(path, write, binary=False)


def _replace_atomically(path: Path, write: Callable[[Any], object], *, binary: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkstemp: its 0600 would stay on the renamed file. Mode 0o666 lets the
    # umask decide, as for any new file (report.md was 0644 when written directly).
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")
              ) as handle:
            write(handle)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: Mapping[str, object]) -> None:
    def dump(handle: TextIO) -> None:
        json.dump(_finite(data), handle, indent=2, sort_keys=True, allow_nan=False)
        handle.write("\n")

    _write_atomic(path, dump)


def gate_summary(outcomes: Sequence[CellOutcome]) -> dict[str, object]:
    failures = [
        f"{o.cell}: {g.name}: {g.detail}" for o in outcomes for g in o.gates if g.status == "fail"
    ]
    empty = [f"{o.cell}: no pairs ran" for o in outcomes if not o.pairs]
    return {
        "passed": bool(outcomes) and not failures and not empty,
        "failures": failures + empty,
        "failed_cells": sorted({o.cell for o in outcomes if not o.gates_passed}),
    }


def _fmt(value: object, spec: str = "+.2f") -> str:
    if isinstance(value, float | int) and math.isfinite(value):
        return format(value, spec)
    return "n/a"


def write_markdown(
    path: Path, record: Mapping[str, object], outcomes: Sequence[CellOutcome]
) -> None:
    """report.md: the header, the verdict per cell, counters, deltas, gates, procedure
    notes and the raw figures per repeat; written atomically."""
    lines = _header(record)
    lines += _verdict_table(record, outcomes)
    lines += ["", "## Policy counters and preemptions", ""]
    lines += _counter_totals(outcomes)
    lines += ["", "## Paired deltas", ""]
    lines += _delta_table(outcomes)
    lines += ["", "## Gates", ""]
    lines += _gate_lists(outcomes)
    lines += _procedure_section(outcomes)
    lines += _raw_table(outcomes)
    text = "\n".join(lines)
    _write_atomic(path, lambda handle: handle.write(text))


def _header(record: Mapping[str, object]) -> list[str]:
    profile, host = record["profile"], record["host"]
    ext, gate = record["extension"], record["gate"]
    assert isinstance(profile, Mapping)
    assert isinstance(host, Mapping)
    assert isinstance(ext, Mapping)
    assert isinstance(gate, Mapping)
    return [
        f"# Qualification: {profile['name']} ({'PASSED' if gate['passed'] else 'FAILED'})",
        "",
        f"- Extension: `{ext['id']}` {ext['version']} (commit {ext.get('commit') or 'n/a'})",
        f"- Host: vllm {host.get('version') or 'unknown'} (commit {host.get('commit') or 'n/a'}); "
        f"profile range `{profile['host_version_range']}`",
        f"- Accelerator: {profile['accelerator']}; model `{profile['model']}`; "
        f"TP {profile['tensor_parallel_size']}; mode {profile['execution_mode']}",
        f"- Created: {record['created_at']}",
        "",
        "A verdict applies to one cell of this lane only (qualification.md).",
        "",
    ]


def _verdict_table(record: Mapping[str, object], outcomes: Sequence[CellOutcome]) -> list[str]:
    lines = [
        "| Cell | Pairs | Calls per repeat | Throughput Δ % [95% CI] "
        "| P95 latency Δ % [95% CI] | Gates | Verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        thr, lat = o.deltas["throughput"], o.deltas["latency_p95"]
        lines.append(
            f"| {_cell_text(o.cell)} | {len(o.pairs)} | {[p.candidate.calls for p in o.pairs]} | "
            f"{_fmt(thr.mean)} [{_fmt(thr.low)}, {_fmt(thr.high)}] | "
            f"{_fmt(lat.mean)} [{_fmt(lat.low)}, {_fmt(lat.high)}] | "
            f"{'pass' if o.gates_passed else 'FAIL'} | **{o.label}** |"
        )
    blocked = record.get("blocked_cells")
    for name in blocked if isinstance(blocked, list) else []:
        lines.append(f"| {_cell_text(name)} | 0 | - | - | - | - | blocked |")
    return lines


def _gate_lists(outcomes: Sequence[CellOutcome]) -> list[str]:
    lines: list[str] = []
    for o in outcomes:
        lines += [f"### {o.cell}", ""]
        for g in o.gates:
            lines.append(f"- {g.name}: **{g.status}**" + (f" — {g.detail}" if g.detail else ""))
        lines += [f"- verdict reason: {o.reason}", ""]
    return lines


_COUNTER_KEYS = ("calls", "selections", "abstentions", "failures", "invalid_selections")


def _raw_table(outcomes: Sequence[CellOutcome]) -> list[str]:
    lines = [
        "## Raw figures per repeat",
        "",
        "| Cell | Rep | First | Arm | tok/s | TTFT P50/P95 s | Latency P50/P95 s | "
        "Done/Req | Failed | Starved | calls/sel/abst/fail/inv | Short hash |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        for p in o.pairs:
            for a in (p.baseline, p.candidate):
                c = a.counters or {}
                counters = "/".join(str(c.get(k, "-")) for k in _COUNTER_KEYS)
                lines.append(
                    f"| {_cell_text(o.cell)} | {p.repetition} | {p.first} | {a.arm} | "
                    f"{_fmt(a.throughput, '.2f')} | "
                    f"{_fmt(a.ttft_p50, '.3f')}/{_fmt(a.ttft_p95, '.3f')} | "
                    f"{_fmt(a.latency_p50, '.3f')}/{_fmt(a.latency_p95, '.3f')} | "
                    f"{a.completed}/{a.requests} | {a.failed} | {a.starved} | {counters} | "
                    f"{a.short_hash or 'n/a'} |"
                )
    lines += [
        "",
        "Long-output hashes are in the JSON record for information only: long generations "
        "diverge between two built-in runs under batching, so they are not a gate.",
        "",
    ]
    return lines


def procedure_notes(outcomes: Sequence[CellOutcome]) -> list[str]:
    """Every arm whose engine children did not carry the policy's ``BIDKV_UTILITY_*``
    environment (qualification.md §2 step 4). The policy-enabled-and-invoked gate fails on
    them too (BidKV without its environment is loaded, so reported enabled, but inert)."""
    notes = []
    for o in outcomes:
        for p in o.pairs:
            for a in (p.baseline, p.candidate):
                env = environment_missing(a)
                if env is not None:
                    notes.append(f"{o.cell} rep {p.repetition} {a.arm}: {env.get('detail')}")
    return notes


def _cell_text(value: object) -> str:
    # A profile may name a cell with a "|" (any printable directory name); unescaped, it
    # would split that row of every table.
    return str(value).replace("|", "\\|")


def _procedure_row(cell: str, rep: int, a: ArmResult) -> str:
    snap, env, log = (a.procedure.get(k) for k in ("device_snapshot", "policy_environment", "log"))
    shot = "-"
    if isinstance(snap, Mapping):
        shot = f"{snap.get('status')}" + (f": {snap['detail']}" if snap.get("detail") else "")
    carried = f"{env.get('status')}" if isinstance(env, Mapping) else "-"
    where = f"{log.get('path')} ({log.get('bytes')} bytes)" if isinstance(log, Mapping) else "-"
    return (f"| {_cell_text(cell)} | {rep} | {a.arm} | {_cell_text(shot)} | {carried} "
            f"| {_cell_text(where)} |")


def _procedure_section(outcomes: Sequence[CellOutcome]) -> list[str]:
    """qualification.md §2 steps 3, 4 and 7 per arm (serve profiles only)."""
    arms = [(o.cell, p.repetition, a) for o in outcomes for p in o.pairs
            for a in (p.baseline, p.candidate)]
    if not any(a.procedure for _, _, a in arms):
        return []
    notes = [f"- **policy environment missing**: {n}" for n in procedure_notes(outcomes)]
    lines = ["## Per-arm procedure", "", *notes, *([""] if notes else [])]
    lines += [
        "| Cell | Rep | Arm | Device snapshot | Engine children's policy environment "
        "| Log slice |",
        "|---|---|---|---|---|---|",
    ]
    lines += [_procedure_row(cell, rep, a) for cell, rep, a in arms]
    return [*lines, ""]


def _total(values: Sequence[float | int | None]) -> str:
    """A sum over the repeats, or ``n/a`` when any repeat did not report its count.

    Integer counts (the policy counters) are summed exactly: one past float's range, which
    a runtime-evidence line or a replay report can hold, made ``math.isfinite`` raise
    OverflowError and report.md was never written; and ``format(..., "g")`` showed a total
    of 1,234,567 calls as ``1.23457e+06``."""
    if not values or any(v is None for v in values):
        return "n/a"
    if all(isinstance(v, int) for v in values):
        try:
            return str(sum(v for v in values if isinstance(v, int)))
        except ValueError:  # past Python's integer-to-string digit limit
            return "n/a"
    try:
        if not all(math.isfinite(v) for v in values if v is not None):
            return "n/a"
        return format(math.fsum(v for v in values if v is not None), "g")
    except OverflowError:  # an integer past float's range among float figures
        return "n/a"


def _counter_totals(outcomes: Sequence[CellOutcome]) -> list[str]:
    """qualification.md §8's per-cell line: the candidate's calls / selections /
    abstentions (and failures / invalid selections) summed over the repeats, and each
    arm's preemptions summed over the repeats."""
    lines = [
        "| Cell | Calls / selections / abstentions | Failures / invalid | "
        "Preemptions baseline / candidate |",
        "|---|---|---|---|",
    ]
    for o in outcomes:
        arms = [p.candidate for p in o.pairs]

        def count(key: str, arms: list[ArmResult] = arms) -> str:
            return _total([None if a.counters is None else a.counters.get(key) for a in arms])

        base = _total([p.baseline.preemptions for p in o.pairs])
        cand = _total([p.candidate.preemptions for p in o.pairs])
        lines.append(
            f"| {_cell_text(o.cell)} | {count('calls')} / {count('selections')} / "
            f"{count('abstentions')} | {count('failures')} / {count('invalid_selections')} "
            f"| {base} / {cand} |"
        )
    return lines


def _delta_table(outcomes: Sequence[CellOutcome]) -> list[str]:
    """Every metric's mean paired delta with its 95 % Student-t interval and the per-repeat
    deltas (qualification.md §5, §8); only throughput and P95 latency decide a verdict."""
    lines = [
        "| Cell | Metric | n | Mean Δ % | 95% CI | Per-repeat Δ % |",
        "|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        for metric, s in o.deltas.items():
            per_repeat = ", ".join(_fmt(d) for d in s.deltas) or "-"
            lines.append(
                f"| {_cell_text(o.cell)} | {metric} | {s.n} | {_fmt(s.mean)} | "
                f"[{_fmt(s.low)}, {_fmt(s.high)}] | {per_repeat} |"
            )
    return lines


def write_plot(path: Path, outcomes: Sequence[CellOutcome]) -> None:
    """Per-cell mean paired deltas with their 95 % intervals (throughput, P95 latency)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("throughput", "Throughput Δ %"), ("latency_p95", "P95 latency Δ %"))
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.6 * max(len(outcomes), 2) + 1.5))
    for ax, (metric, title) in zip(axes, metrics, strict=True):
        ys = list(range(len(outcomes)))
        for y, o in zip(ys, outcomes, strict=True):
            s = o.deltas[metric]
            if not math.isfinite(s.mean):
                continue
            lo = s.mean - s.low if math.isfinite(s.low) else 0.0
            hi = s.high - s.mean if math.isfinite(s.high) else 0.0
            ax.errorbar([s.mean], [y], xerr=[[lo], [hi]], fmt="o", capsize=4)
            ax.scatter(s.deltas, [y] * len(s.deltas), marker="x", s=12, alpha=0.6)
        ax.axvline(0.0, color="grey", lw=0.8)
        if metric == "latency_p95":
            ax.axvline(5.0, color="red", lw=0.8, ls="--")
        ax.set_yticks(ys)
        ax.set_yticklabels([f"{o.cell}\n({o.label})" for o in outcomes], fontsize=8)
        ax.set_title(title)
    fig.tight_layout()
    try:  # like the record and the report: a failed write keeps the previous figure
        _replace_atomically(path, lambda handle: fig.savefig(handle, format="png", dpi=100),
                            binary=True)
    finally:
        plt.close(fig)
