"""Driving ``vllm-hust-ext`` for one arm, always with a private state file.

Each arm gets its own directory holding ``config.json`` (``VLLM_HUST_EXT_CONFIG``) and,
next to it, the manager's ``runtime-evidence.jsonl``; qualification never touches the
user's state. The baseline arm disables the bundle (built-in victim), the candidate arm
configures (when the profile declares host facts) and enables it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from qualification.errors import ManagerVerbError, QualificationError, unparsable_reason
from qualification.profile import ManagerSpec

__all__ = ["ManagerSession", "require_tool"]

Arm = Literal["baseline", "candidate"]

# The manager refuses a real launch when any of these is already set (manager-protocol
# §6.3), so a qualification run started from inside a managed process must drop them.
_OWNED_BY_MANAGER = (
    "VLLM_ECPA_EVIDENCE_SINK",
    "VLLM_ECPA_EVIDENCE_STRICT",
    "VLLM_ECPA_PLAN_ID",
    "VLLM_ECPA_LAUNCH_ID",
    "VLLM_HUST_EXT_EVIDENCE_PATH",
    "VLLM_EXTENSION_MANIFESTS",
    "VLLM_EXTENSION_BUNDLES",
)


def resolve_tool(command: Sequence[str]) -> list[str] | None:
    """The argv with its program found on PATH or, failing that, next to this interpreter
    (``.venv/bin/python -m qualification`` without an activated venv)."""
    if not command:
        return None
    found = shutil.which(command[0])
    if found is None:
        sibling = Path(sys.executable).parent / command[0]
        # os.path.isfile, not Path.is_file: a name no file can have (too long, a NUL) is
        # not found, as shutil.which has it, rather than an OSError traceback.
        found = str(sibling) if os.path.isfile(sibling) and os.access(sibling, os.X_OK) else None
    return None if found is None else [found, *command[1:]]


def require_tool(command: Sequence[str], what: str) -> list[str]:
    resolved = resolve_tool(command)
    if resolved is None:
        first = command[0] if command else "<empty>"
        raise QualificationError(f"{what}: command {first!r} not found on PATH; install it first")
    return resolved


@dataclass(frozen=True, slots=True)
class ManagerSession:
    spec: ManagerSpec
    state_dir: Path
    base_env: Mapping[str, str]

    @property
    def config_path(self) -> Path:
        return self.state_dir / "config.json"

    @property
    def evidence_path(self) -> Path:
        return self.state_dir / "runtime-evidence.jsonl"

    def environment(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in self.base_env.items() if k not in _OWNED_BY_MANAGER}
        env.update(extra or {})
        env["VLLM_HUST_EXT_CONFIG"] = str(self.config_path)
        return env

    @property
    def program(self) -> list[str]:
        return require_tool(self.spec.command, "the vLLM-HUST extension manager")

    def _verb(self, *args: str) -> str:
        command = [*self.program, *args]
        proc = subprocess.run(
            command, env=self.environment(), capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise ManagerVerbError(f"{' '.join(command)} failed (exit {proc.returncode}): {last}")
        return proc.stdout

    def prepare(self, arm: Arm) -> None:
        """Put the private state in the arm's shape."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        ext = self.spec.extension_id
        if arm == "baseline":
            self._verb("extension", "disable", ext)
            return
        if self.spec.configuration:
            cfg = self.state_dir / "extension-configuration.json"
            cfg.write_text(json.dumps(self.spec.configuration, sort_keys=True), encoding="utf-8")
            self._verb("extension", "configure", ext, "--file", str(cfg))
        self._verb("extension", "enable", ext)

    def run_argv(self, command: Sequence[str], *, dry_run: bool = False) -> list[str]:
        argv = [*self.program, "run"]
        if dry_run:
            argv.append("--dry-run")
        else:
            argv += ["--shutdown-grace-seconds", f"{self.spec.shutdown_grace_seconds:g}"]
        return [*argv, "--", *command]

    def dry_run(self, command: Sequence[str], extra_env: Mapping[str, str]) -> dict[str, object]:
        """The manager's rendered launch (``run --dry-run``) for this arm's state."""
        argv = self.run_argv(command, dry_run=True)
        proc = subprocess.run(
            argv, env=self.environment(extra_env), capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise QualificationError(f"vllm-hust-ext run --dry-run refused: {last}")
        try:
            rendered = json.loads(proc.stdout)
        except (ValueError, RecursionError) as exc:
            raise QualificationError(
                f"vllm-hust-ext run --dry-run printed no JSON: {unparsable_reason(exc)}"
            ) from exc
        if not isinstance(rendered, dict):
            raise QualificationError("vllm-hust-ext run --dry-run printed a non-object")
        return rendered
