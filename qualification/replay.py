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
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from qualification.errors import QualificationError
from qualification.manager import Arm, ManagerSession, require_tool
from qualification.profile import CellSpec, Profile
from qualification.verdict import COUNTER_NAMES, ArmResult

__all__ = ["arm_from_report", "replay_command", "run_replay_arm"]

REPORT_NAME = "report.json"


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
    try:
        args = [a.format(**fields) for a in (*spec.args, *cell.replay_args, *arm_args)]
    except (KeyError, IndexError, ValueError) as exc:
        raise QualificationError(
            f"profile {profile.name}: replay argument placeholder {exc} is unknown; "
            f"expected one of {sorted(fields)}"
        ) from None
    return [*spec.command, *args]


def _number(node: object, *keys: str) -> float:
    for key in keys:
        if not isinstance(node, Mapping):
            return float("nan")
        node = node.get(key)
    return float(node) if isinstance(node, int | float) else float("nan")


def arm_from_report(
    arm: Arm, doc: Mapping[str, object], command: list[str], wall_s: float
) -> ArmResult:
    """Figures of the single policy arm a qualification replay runs."""
    arms = doc.get("arms")
    if not isinstance(arms, list):
        raise QualificationError("bidkv-replay report.json has no 'arms' list")
    online = [a for a in arms if isinstance(a, Mapping) and not a.get("reference")]
    if len(online) != 1:
        labels = [a.get("label") for a in online]
        raise QualificationError(
            f"bidkv-replay report.json: expected exactly one policy arm per qualification arm, "
            f"got {labels}"
        )
    entry = online[0]
    ctrl = entry.get("controller")
    ctrl = ctrl if isinstance(ctrl, Mapping) else {}
    counters = {k: int(ctrl[k]) for k in COUNTER_NAMES if isinstance(ctrl.get(k), int)}
    requests = int(_number(entry, "requests"))
    completed = int(_number(entry, "completed"))
    conservation = entry.get("conservation")
    extra: dict[str, object] = {
        "label": entry.get("label"),
        "preemptions_per_1k": _number(entry, "preemptions_per_1k"),
        "recompute_tax": _number(entry, "recompute_tax"),
        "goodput_req_s": _number(entry, "goodput_req_s"),
        "ttft_p99": _number(entry, "ttft_s", "p99"),
        "conservation": dict(conservation) if isinstance(conservation, Mapping) else None,
    }
    enabled = ctrl.get("enabled")
    return ArmResult(
        arm=arm,
        throughput=_number(entry, "throughput_output_tok_s"),
        ttft_p50=_number(entry, "ttft_s", "p50"),
        ttft_p95=_number(entry, "ttft_s", "p95"),
        latency_p50=_number(entry, "e2e_s", "p50"),
        latency_p95=_number(entry, "e2e_s", "p95"),
        requests=requests,
        completed=completed,
        failed=max(0, requests - completed),
        output_tokens=int(_number(entry, "output_tokens")),
        counters=counters or None,
        policy_enabled=enabled if isinstance(enabled, bool) else None,
        policy_name=str(ctrl.get("policy_name")) if ctrl.get("policy_name") else None,
        preemptions=_number(entry, "preemptions"),
        wall_s=wall_s,
        command=tuple(command),
        extra=extra,
    )


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
    report = out / REPORT_NAME
    if rc != 0 or not report.is_file():
        tail = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]
        why = "timed out" if rc is None else f"exit {rc}"
        return ArmResult.not_started(
            arm, f"bidkv-replay {why}: {' '.join(tail)}", wall_s=wall, command=tuple(argv)
        )
    doc = json.loads(report.read_text(encoding="utf-8"))
    return arm_from_report(arm, doc, argv, wall)
