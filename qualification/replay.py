"""One arm of the CPU profile: ``vllm-hust-ext run -- bidkv-replay ...``.

The manager renders the candidate's ``--preemption-policy`` and ``--additional-config`` and
the ``BIDKV_UTILITY_*`` environment exactly as for ``vllm serve``; the replay loads the
policy through the controller in the real vLLM scheduler and writes ``report.json``. The
baseline runs with the bundle disabled and the profile's baseline arguments (the host's
built-in victim). No accelerator and no server: there is no text output, no cancellation
and no engine log, so those gates are not applicable; "recovers after restart" means the
fresh process of every arm finished.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from qualification.errors import QualificationError, unparsable_reason
from qualification.manager import Arm, ManagerSession, require_tool
from qualification.profile import CellSpec, Profile
from qualification.verdict import COUNTER_NAMES, ArmResult

__all__ = ["arm_from_report", "read_report", "replay_command", "run_replay_arm"]

REPORT_NAME = "report.json"
# A real report nests 4 deep. A value nested hundreds deep still parses but would overflow
# the stack when the record copies it (dataclasses.asdict, json.dump).
MAX_REPORT_DEPTH = 64


def replay_command(
    profile: Profile, arm: Arm, cell: CellSpec, repetition: int, out_dir: Path
) -> list[str]:
    spec = profile.replay
    assert spec is not None
    fields = {
        "seed": str(spec.base_seed + repetition),
        "repeat": str(repetition),
        "offset": str(repetition * spec.slice_stride),
        "out": str(out_dir),
        "cell": cell.name,
    }
    arm_args = spec.baseline_args if arm == "baseline" else spec.candidate_args
    args = [
        _format_arg(profile.name, a, fields) for a in (*spec.args, *cell.replay_args, *arm_args)
    ]
    return [*spec.command, *args]


def _format_arg(profile_name: str, template: str, fields: Mapping[str, str]) -> str:
    try:
        return template.format(**fields)
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as exc:
        # e.g. {nope} (KeyError), {0} (IndexError), {seed.real} (AttributeError), a lone {,
        # {seed[x]} (TypeError: string indices must be integers)
        raise QualificationError(
            f"profile {profile_name}: replay argument {template!r} has an unsupported "
            f"placeholder ({exc}); expected plain {{name}} with name one of {sorted(fields)}"
        ) from None


def _number(node: object, *keys: str) -> float:
    for key in keys:
        if not isinstance(node, Mapping):
            return float("nan")
        node = node.get(key)
    if not isinstance(node, int | float):
        return float("nan")
    try:
        return float(node)
    except OverflowError:  # an integer past float's range: infinite, as json reads 1e400
        return math.inf if node > 0 else -math.inf


_JSON_KINDS = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}


def _depth(node: object) -> int:
    """How deeply arrays and objects nest in ``node`` (iteratively: no recursion)."""
    deepest, stack = 0, [(node, 1)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, dict | list):
            deepest = max(deepest, level)
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, level + 1) for child in children)
    return deepest


def read_report(path: Path) -> dict[str, object]:
    """The replay's ``report.json`` as a JSON object, or a QualificationError naming it."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise QualificationError(
            f"bidkv-replay report {path}: cannot be read as JSON ({unparsable_reason(exc)}); "
            "expected a JSON object"
        ) from None
    if not isinstance(doc, dict):
        kind = _JSON_KINDS.get(type(doc), "a number")
        raise QualificationError(f"bidkv-replay report {path}: expected a JSON object, got {kind}")
    if _depth(doc) > MAX_REPORT_DEPTH:
        raise QualificationError(
            f"bidkv-replay report {path}: cannot be read as JSON (nested too deeply); "
            f"expected a JSON object nested at most {MAX_REPORT_DEPTH} deep"
        )
    return doc


def _count(entry: Mapping[str, object], key: str, source: str) -> int:
    value = entry.get(key)
    # NaN and infinity fail the comparison; so would int() on them.
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < math.inf:
        return int(value)
    got = repr(value) if key in entry else "nothing"
    raise QualificationError(
        f"bidkv-replay report {source}: arm {entry.get('label')!r}: expected {key!r} to be "
        f"a non-negative finite number, got {got}"
    )


def _figure(entry: Mapping[str, object], source: str, *keys: str) -> float:
    """A figure the verdict rests on: it must be in the report, as a number or as null (no
    samples, e.g. nothing completed: NaN). A missing or mistyped one is a malformed report,
    not a figure that could not be computed."""
    node: object = entry
    for key in keys:
        if not isinstance(node, Mapping) or key not in node:
            raise QualificationError(
                f"bidkv-replay report {source}: arm {entry.get('label')!r}: expected "
                f"{'.'.join(keys)!r} (a number, or null without samples), got nothing"
            )
        node = node[key]
    if node is not None and (isinstance(node, bool) or not isinstance(node, int | float)):
        raise QualificationError(
            f"bidkv-replay report {source}: arm {entry.get('label')!r}: expected "
            f"{'.'.join(keys)!r} to be a number or null, got {node!r}"
        )
    return _number(node)  # the leaf already found: NaN for null, inf past float's range


def arm_from_report(
    arm: Arm,
    doc: Mapping[str, object],
    command: list[str],
    wall_s: float,
    source: str = REPORT_NAME,
) -> ArmResult:
    """Figures of the single policy arm a qualification replay runs (``source`` names the
    report in errors)."""
    arms = doc.get("arms")
    if not isinstance(arms, list):
        raise QualificationError(f"bidkv-replay report {source}: expected an 'arms' list")
    online = [a for a in arms if isinstance(a, Mapping) and not a.get("reference")]
    if len(online) != 1:
        labels = [a.get("label") for a in online]
        raise QualificationError(
            f"bidkv-replay report {source}: expected exactly one policy arm per qualification "
            f"arm, got {labels}"
        )
    entry = online[0]
    ctrl = entry.get("controller")
    ctrl = ctrl if isinstance(ctrl, Mapping) else {}
    counters = {k: int(ctrl[k]) for k in COUNTER_NAMES if isinstance(ctrl.get(k), int)}
    requests = _count(entry, "requests", source)
    completed = _count(entry, "completed", source)
    conservation = entry.get("conservation")
    extra: dict[str, object] = {
        "label": entry.get("label"),
        "preemptions_per_1k": _number(entry, "preemptions_per_1k"),
        "recompute_tax": _number(entry, "recompute_tax"),
        "goodput_req_s": _number(entry, "goodput_req_s"),
        "ttft_p99": _number(entry, "ttft_s", "p99"),
        "e2e_p99": _number(entry, "e2e_s", "p99"),
        "tpot_p50": _number(entry, "tpot_s", "p50"),
        "tpot_p95": _number(entry, "tpot_s", "p95"),
        "tpot_p99": _number(entry, "tpot_s", "p99"),
        "conservation": dict(conservation) if isinstance(conservation, Mapping) else None,
        # qualification.md §4's policy log-tag counts and sum of r, as the policy counts them
        # (it logs decisions only at DEBUG): recorded, not gated.
        "policy_decisions": _decisions(entry.get("policy_decisions")),
    }
    enabled = ctrl.get("enabled")
    return ArmResult(
        arm=arm,
        throughput=_figure(entry, source, "throughput_output_tok_s"),
        ttft_p50=_figure(entry, source, "ttft_s", "p50"),
        ttft_p95=_figure(entry, source, "ttft_s", "p95"),
        latency_p50=_figure(entry, source, "e2e_s", "p50"),
        latency_p95=_figure(entry, source, "e2e_s", "p95"),
        requests=requests,
        completed=completed,
        failed=max(0, requests - completed),
        output_tokens=_count(entry, "output_tokens", source),
        counters=counters or None,
        policy_enabled=enabled if isinstance(enabled, bool) else None,
        policy_name=str(ctrl.get("policy_name")) if ctrl.get("policy_name") else None,
        preemptions=_number(entry, "preemptions"),
        wall_s=wall_s,
        command=tuple(command),
        extra=extra,
    )


# BidkvPreemptionPolicy.decision_stats(), as the replay writes it.
DECISION_NAMES = (
    "selections",
    "cascade_selections",
    "liveness_reselections",
    "strategy_abstentions",
    "barrier_decisions",
    "liveness_epochs",
    "useful_blocks",
)


def _decisions(node: object) -> dict[str, int | None] | None:
    """The policy's decision counts; None from a replay that wrote none (an older one, or a
    policy other than the selector). Like the controller counters, a count that is not a
    non-negative integer is left out: these are recorded, and decide nothing."""
    if not isinstance(node, Mapping):
        return None
    return {
        k: v for k in DECISION_NAMES if k in node
        if (v := node[k]) is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)
    }


def run_replay_arm(
    profile: Profile,
    session: ManagerSession,
    arm: Arm,
    cell: CellSpec,
    repetition: int,
    arm_dir: Path,
) -> ArmResult:
    spec = profile.replay
    assert spec is not None
    out = arm_dir / "replay"
    out.mkdir(parents=True, exist_ok=True)
    session.prepare(arm)
    command = replay_command(profile, arm, cell, repetition, out)
    command = require_tool(command, "trace replay")
    argv = session.run_argv(command)
    log_path = arm_dir / "replay.log"
    report = out / REPORT_NAME
    # A report left by an earlier run in a reused --out must not pass for this one's.
    report.unlink(missing_ok=True)
    started = time.monotonic()
    with log_path.open("wb") as log:
        try:
            proc = subprocess.run(
                argv,
                env=session.environment(spec.environment),
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=spec.timeout_s,
                check=False,
            )
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    wall = time.monotonic() - started
    tail = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]
    why = "timed out" if rc is None else f"exit {rc}"
    not_run = ArmResult.not_started(
        arm, f"bidkv-replay {why}: {' '.join(tail)}", wall_s=wall, command=tuple(argv)
    )
    if rc is None or not report.is_file():
        return not_run
    if rc == 0:
        try:
            return arm_from_report(arm, read_report(report), argv, wall, str(report))
        except QualificationError as exc:
            # A report the replay wrote but no arm can be read from fails this arm, with
            # the reason; it must not end the run and lose the arms already run.
            return ArmResult.not_started(
                arm, f"bidkv-replay exit 0 but its report is unusable: {exc}", wall_s=wall,
                command=tuple(argv))
    # The replay ran and wrote its report, then failed a check of its own (conservation):
    # keep its figures and fail the arm with its own line, not as one that never ran.
    try:
        result = arm_from_report(arm, read_report(report), argv, wall, str(report))
    except QualificationError:
        return not_run  # a failed run's report is no evidence; its exit line says why
    return replace(result, error=f"bidkv-replay {why} after writing its report: {' '.join(tail)}")
