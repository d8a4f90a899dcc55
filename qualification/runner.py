"""``run PROFILE``: paired arms per cell and repeat, gates, verdicts and the record.

Arm order within a pair is ``(cell_index + repetition) % 2``: 0 runs the baseline first,
1 the candidate first, so order alternates across cells and reverses on every repeat
(cancelling warm-up and drift effects). Every arm is a fresh process launched through
``vllm-hust-ext run`` with its own manager state directory.
"""

from __future__ import annotations

import ast
import datetime as _dt
import importlib.metadata
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from qualification import RECORD_SCHEMA
from qualification.errors import ManagerVerbError, QualificationError
from qualification.manager import Arm, ManagerSession, require_tool
from qualification.paths import path_kind
from qualification.procedure import snapshot_command
from qualification.profile import CellSpec, Profile
from qualification.report import (
    gate_summary,
    procedure_notes,
    write_json_atomic,
    write_markdown,
    write_plot,
)
from qualification.serve import ServeArm, serve_command, serve_environment
from qualification.verdict import ArmResult, CellOutcome, Pair, evaluate_cell

__all__ = ["RunResult", "arm_order", "launch_plan", "run_profile"]

REPO_ROOT = Path(__file__).resolve().parent.parent


class ArmRunner(Protocol):
    def __call__(
        self, arm: Arm, cell: CellSpec, repetition: int, arm_dir: Path, session: ManagerSession
    ) -> ArmResult: ...


@dataclass(frozen=True, slots=True)
class RunResult:
    record_path: Path
    report_path: Path
    plot_path: Path
    record: Mapping[str, object]
    outcomes: tuple[CellOutcome, ...]

    @property
    def passed(self) -> bool:
        gate = self.record["gate"]
        assert isinstance(gate, Mapping)
        return bool(gate["passed"])


def arm_order(cell_index: int, repetition: int) -> tuple[Arm, Arm]:
    if (cell_index + repetition) % 2 == 0:
        return ("baseline", "candidate")
    return ("candidate", "baseline")


def _serve_runner(profile: Profile) -> ArmRunner:
    def run(
        arm: Arm, cell: CellSpec, repetition: int, arm_dir: Path, session: ManagerSession
    ) -> ArmResult:
        return ServeArm(profile, session, arm_dir / "engine.log").run(arm, cell, repetition)

    return run


def _replay_runner(profile: Profile) -> ArmRunner:
    from qualification.replay import run_replay_arm

    def run(
        arm: Arm, cell: CellSpec, repetition: int, arm_dir: Path, session: ManagerSession
    ) -> ArmResult:
        return run_replay_arm(profile, session, arm, cell, repetition, arm_dir)

    return run


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=False
        )
    except OSError:
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _dist_version(name: str) -> str | None:
    """The installed distribution's Version field; None when it is not installed or its
    METADATA has no (or an empty) Version. Read through ``get_all``: ``version()`` gives
    None or "" there on 3.11, and a KeyError once importlib drops that deprecated None."""
    try:
        values = importlib.metadata.distribution(name).metadata.get_all("Version")
    except importlib.metadata.PackageNotFoundError:
        return None
    return str(values[0]) if values and values[0] else None


def _declared(variable: str, what: str) -> str | None:
    """An operator's declaration of a lane fact; printable text on one line."""
    declared = os.environ.get(variable)
    if declared and not declared.isprintable():  # a line break would break report.md
        raise QualificationError(
            f"{variable} {declared!r} is invalid: expected {what} (printable text on one "
            "line)"
        )
    return declared or None


def _commit(distribution: str, variable: str) -> str | None:
    """The installed ``distribution``'s commit: declared in ``variable``, else from a VCS
    install's ``direct_url.json`` (wheels from an index carry none)."""
    declared = _declared(variable, f"the commit id of {distribution}")
    if declared:
        return declared
    try:
        dist = importlib.metadata.distribution(distribution)
        text = dist.read_text("direct_url.json") or ""
    except importlib.metadata.PackageNotFoundError:
        return None
    marker = '"commit_id": "'
    return text.split(marker, 1)[1].split('"', 1)[0] if marker in text else None


def _host_commit() -> str | None:
    # vLLM-HUST builds expose their commit; stock wheels do not. An operator may declare it.
    return _commit("vllm", "VLLM_HUST_COMMIT")


def _ascend_commit() -> str | None:
    return _commit("vllm-ascend", "VLLM_ASCEND_HUST_COMMIT")


def _image_digest() -> str | None:
    # The container image the lane ran in, when the operator names it (§1: "image digests
    # recorded per lane"); nothing in the image says so itself.
    return _declared("QUALIFICATION_IMAGE_DIGEST", "the image digest")


def _check_declarations(kind: str) -> None:
    """Read every lane fact the operator may declare, as the record will: a bad one is
    refused before --out and the first arm exist, not after every arm has run."""
    _host_commit()
    _image_digest()
    if kind == "ascend":
        _ascend_commit()


def _accelerator_facts(kind: str) -> dict[str, object]:
    facts: dict[str, object] = {"kind": kind}
    probes = {
        "cuda": [
            "nvidia-smi",
            "--query-gpu=name,driver_version,memory.total",
            "--format=csv,noheader",
        ],
        "ascend": ["npu-smi", "info"],
    }
    probe = probes.get(kind)
    if probe and shutil.which(probe[0]):
        out = subprocess.run(probe, capture_output=True, text=True, check=False)
        facts["devices"] = out.stdout.strip().splitlines()[:16]
    facts["torch"] = _dist_version("torch")
    facts["cuda"] = _torch_cuda()
    if kind == "ascend":
        # qualification.md §1: the Ascend host is vLLM-HUST core plus its Ascend plugin;
        # every part's version and commit is recorded.
        facts["vllm_ascend"] = {"version": _dist_version("vllm-ascend"),
                                "commit": _ascend_commit()}
        facts["torch_npu"] = _dist_version("torch-npu")
    facts["image_digest"] = _image_digest()
    return facts


def _torch_cuda() -> str | None:
    """The CUDA version torch was built with (``torch.version.cuda``, qualification.md §9
    "record ... CUDA"), read from torch's ``version.py`` without importing torch; None
    for a CPU or ROCm build, or when torch is not installed."""
    try:
        path = Path(str(importlib.metadata.distribution("torch").locate_file("torch/version.py")))
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (importlib.metadata.PackageNotFoundError, OSError, UnicodeDecodeError,
            SyntaxError, ValueError):
        return None
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "cuda" for t in targets):
            value = getattr(node, "value", None)
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                return value.value
            return None
    return None


def host_facts(profile: Profile) -> dict[str, object]:
    version = profile.host_version or _dist_version("vllm")
    in_range: bool | None = None
    if version is not None:
        try:
            in_range = Version(version) in SpecifierSet(profile.host_version_range)
        except InvalidVersion:
            in_range = False
    return {
        "name": "vllm",
        "version": version,
        "commit": _host_commit(),
        "in_profile_range": in_range,
    }


def _extension_facts(extension_id: str) -> dict[str, object]:
    from qualification.release import read_version

    return {
        "id": extension_id,
        "version": read_version(REPO_ROOT, []),
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain")),
    }


def _check_tools(profile: Profile) -> None:
    require_tool(profile.manager.command, "the vLLM-HUST extension manager")
    if profile.kind == "replay":
        assert profile.replay is not None
        require_tool(profile.replay.command, "trace replay")
    else:
        assert profile.server is not None
        require_tool(profile.server.command, "the vLLM server")


def _run_arm(
    arm_runner: ArmRunner,
    arm: Arm,
    cell: CellSpec,
    repetition: int,
    arm_dir: Path,
    session: ManagerSession,
) -> ArmResult:
    started = time.monotonic()
    try:
        return arm_runner(arm, cell, repetition, arm_dir, session)
    except ManagerVerbError as exc:
        # The manager refused this arm's state (e.g. `extension enable`): the arm did not
        # run and its gate fails with the verb's line; the arms already run are kept.
        return ArmResult.not_started(arm, str(exc), wall_s=time.monotonic() - started, command=())


def run_profile(
    profile: Profile,
    out_dir: Path,
    *,
    repeats: int | None = None,
    arm_runner: ArmRunner | None = None,
    log: Callable[[str], None] = lambda _m: None,
) -> RunResult:
    n = repeats or profile.repeats
    # Bad input found only later would come after --out and the first arm exist: check the
    # operator's declarations and format every replay argument of the run first.
    _check_declarations(profile.accelerator)
    if profile.kind == "replay":
        launch_plan(profile, repeats=n)
    if arm_runner is None:
        _check_tools(profile)
        arm_runner = _serve_runner(profile) if profile.kind == "serve" else _replay_runner(profile)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QualificationError(
            f"output directory {out_dir}: cannot be created ({exc}); expected a writable directory"
        ) from None
    outcomes: list[CellOutcome] = []
    for ci, cell in enumerate(profile.cells):
        pairs: list[Pair] = []
        for rep in range(n):
            order = arm_order(ci, rep)
            results: dict[Arm, ArmResult] = {}
            for arm in order:
                arm_dir = out_dir / "cells" / cell.name / f"rep-{rep}" / arm
                session = ManagerSession(profile.manager, arm_dir / "manager", dict(os.environ))
                log(f"[{cell.name} rep {rep}] {arm} arm ...")
                results[arm] = _run_arm(arm_runner, arm, cell, rep, arm_dir, session)
                log(
                    f"[{cell.name} rep {rep}] {arm}: {results[arm].throughput:.2f} tok/s, "
                    f"calls={results[arm].calls}"
                )
            pairs.append(Pair(cell.name, rep, order[0], results["baseline"], results["candidate"]))
        bound = profile.workload.cancel_drain_bound_s if cell.cancel_after_s is not None else None
        outcomes.append(
            evaluate_cell(
                cell.name,
                pairs,
                cancel_bound_s=bound,
                tensor_parallel_size=profile.tensor_parallel_size,
            )
        )
        log(f"[{cell.name}] verdict: {outcomes[-1].label} ({outcomes[-1].reason})")
    record = build_record(profile, outcomes, n)
    record_path = out_dir / "record.json"
    report_path = out_dir / "report.md"
    plot_path = out_dir / "deltas.png"
    write_json_atomic(record_path, record)
    write_markdown(report_path, record, outcomes)
    write_plot(plot_path, outcomes)
    return RunResult(record_path, report_path, plot_path, record, tuple(outcomes))


def build_record(profile: Profile, outcomes: list[CellOutcome], repeats: int) -> dict[str, object]:
    digest = profile.source_sha256  # the file actually loaded, not the bundled namesake
    server = profile.server
    return {
        "schema": RECORD_SCHEMA,
        "created_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "profile": {
            "name": profile.name,
            "kind": profile.kind,
            "accelerator": profile.accelerator,
            "model": profile.model,
            "tensor_parallel_size": profile.tensor_parallel_size,
            "execution_mode": profile.execution_mode,
            "graph_mode": None if server is None or server.enforce_eager else server.graph_mode,
            "kv_cache_memory_bytes": None if server is None else server.kv_cache_memory_bytes,
            "num_gpu_blocks_override": None if server is None else server.num_gpu_blocks_override,
            "host_version_range": profile.host_version_range,
            "repeats": repeats,
            "sha256": digest,
            "definition": profile.model_dump(mode="json"),
        },
        "extension": _extension_facts(profile.manager.extension_id),
        "host": host_facts(profile),
        "accelerator": _accelerator_facts(profile.accelerator),
        "platform": {"python": platform.python_version(), "machine": platform.machine()},
        "cells": [o.as_dict() for o in outcomes],
        "blocked_cells": list(profile.blocked_cells),
        # qualification.md §3: a cell declared but not run is reported `blocked`.
        "verdicts": {
            **{o.cell: o.label for o in outcomes},
            **dict.fromkeys(profile.blocked_cells, "blocked"),
        },
        "gate": gate_summary(outcomes),
        # qualification.md §2 step 4: arms whose engine children lacked BIDKV_UTILITY_*.
        "procedure_notes": procedure_notes(outcomes),
    }


def launch_plan(profile: Profile, *, repeats: int | None = None) -> dict[str, object]:
    """What ``run`` would launch, without launching (``run --dry-run``)."""
    n = repeats or profile.repeats
    arms: list[dict[str, object]] = []
    for ci, cell in enumerate(profile.cells):
        for rep in range(n):
            for arm in arm_order(ci, rep):
                entry: dict[str, object] = {"cell": cell.name, "repetition": rep, "arm": arm}
                if profile.kind == "serve":
                    assert profile.server is not None
                    entry["command"] = serve_command(profile)
                    entry["environment"] = serve_environment(profile.server, arm)
                    # qualification.md §2 step 3, run after /health ([] when none).
                    entry["device_snapshot_command"] = list(
                        snapshot_command(
                            profile.server.device_snapshot_command, profile.accelerator
                        )
                    )
                else:
                    from qualification.replay import replay_command

                    out = Path("<out>") / "cells" / cell.name / f"rep-{rep}" / arm / "replay"
                    entry["command"] = replay_command(profile, arm, cell, rep, out)
                    entry["environment"] = dict(
                        profile.replay.environment if profile.replay else {}
                    )
                entry["manager_argv"] = [
                    *profile.manager.command,
                    "run",
                    "--",
                    *entry["command"],  # type: ignore[misc]
                ]
                arms.append(entry)
    return {"profile": profile.name, "repeats": n, "arms": arms}


def render_with_manager(profile: Profile, plan: dict[str, object], state_root: Path) -> None:
    """Add the manager's own ``run --dry-run`` rendering of the first baseline and candidate
    arms (private state, declared host facts from ``[manager] dry_run_configuration``)."""
    require_tool(profile.manager.command, "the vLLM-HUST extension manager")
    spec = profile.manager.model_copy(
        update={
            "configuration": {
                **profile.manager.configuration,
                **profile.manager.dry_run_configuration,
            }
        }
    )
    rendered: dict[str, object] = {}
    arms = plan["arms"]
    assert isinstance(arms, list)
    arm: Arm
    for arm in ("baseline", "candidate"):
        entry = next(a for a in arms if a["arm"] == arm)
        session = ManagerSession(spec, state_root / arm, dict(os.environ))
        session.prepare(arm)
        try:
            rendered[arm] = session.dry_run(entry["command"], entry["environment"])
        except QualificationError as exc:
            # e.g. stock vLLM here: the manager refuses `vllm serve` with the bundle
            # enabled because the host lacks the contract; that refusal is the answer.
            rendered[arm] = {"refused": str(exc)}
    plan["manager_dry_run"] = rendered


def ensure_out_dir(out: Path | None, profile: Profile) -> Path:
    if out is not None:
        expected = "a directory or a new path"
        if path_kind(out, f"--out {out}", expected) not in ("missing", "directory"):
            raise QualificationError(
                f"--out {out}: exists and is not a directory; expected {expected}"
            )
        return out
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    return REPO_ROOT / "qualification" / "records" / f"{profile.name}-{stamp}"
