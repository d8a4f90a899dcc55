"""Runtime evidence: the JSONL log a supervised host appends to, and how status reads it.

Line format (schema ``vllm-hust-plugin-evidence/0.1``)::

    {"schema", "binding_status": "bound", "event", "observation_kind", "extension_id",
     "plan_id", "launch_id", "process": {"host", "pid", "start_identity"}, "stats", ...}

The bundle writes the same lines with its own stdlib writer (``bidkv_ext.evidence``), so
neither side imports the other. ``status`` trusts an ``effective`` event only while the
process that wrote it is still the same live process: same host, same pid, and the same
``/proc/<pid>/stat`` start time (a recycled pid has a different start time).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hust_ext_manager.fileio import append_line, open_regular
from hust_ext_manager.jsonio import JSONInputError, load_json
from hust_ext_manager.state import config_path

__all__ = [
    "EVIDENCE_ENVIRONMENT",
    "EVIDENCE_SCHEMA",
    "PATH_ENV",
    "SINK",
    "evidence_path",
    "launch_environment",
    "record_event",
    "runtime_effective_evidence",
    "start_identity",
]

EVIDENCE_SCHEMA = "vllm-hust-plugin-evidence/0.1"
SINK = "hust_ext_manager.runtime_evidence:record_event"
PATH_ENV = "VLLM_HUST_EXT_EVIDENCE_PATH"
EVIDENCE_ENVIRONMENT = (
    "VLLM_ECPA_EVIDENCE_SINK",
    "VLLM_ECPA_EVIDENCE_STRICT",
    "VLLM_ECPA_PLAN_ID",
    "VLLM_ECPA_LAUNCH_ID",
    PATH_ENV,
)
_EVENTS = frozenset({"initialized", "effective", "disabled", "runtime_effective"})
_MAX_READ_BYTES = 1024 * 1024


def evidence_path() -> Path:
    override = os.environ.get(PATH_ENV)
    return Path(override) if override else config_path().with_name("runtime-evidence.jsonl")


def start_identity(pid: int) -> str | None:
    """``pid:<pid>:start_ticks:<n>`` from /proc/<pid>/stat field 22, or None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
        # The command name (field 2) may contain spaces and ')': split after the last ')'.
        ticks = raw[raw.rfind(")") + 1 :].split()[19]
        int(ticks)
    except (OSError, IndexError, ValueError):
        return None
    return f"pid:{pid}:start_ticks:{ticks}"


def _append(line: Mapping[str, Any], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(line, separators=(",", ":"), sort_keys=True) + "\n").encode("utf-8")
    append_line(target, data)


def _bound(event: Mapping[str, Any]) -> bool:
    process = event.get("process")
    return (
        event.get("schema") == EVIDENCE_SCHEMA
        and event.get("binding_status") == "bound"
        and isinstance(event.get("plan_id"), str)
        and bool(event["plan_id"])
        and isinstance(event.get("launch_id"), str)
        and bool(event["launch_id"])
        and isinstance(process, dict)
        and isinstance(process.get("host"), str)
        and isinstance(process.get("pid"), int)
        and not isinstance(process.get("pid"), bool)
        and isinstance(process.get("start_identity"), str)
    )


def _own_extension_id() -> str | None:
    enabled = [i for i in os.environ.get("VLLMHUST_EXT_ENABLED_BUNDLES", "").split(",") if i]
    return enabled[0] if len(enabled) == 1 else None


def record_event(
    event: Mapping[str, Any] | str,
    stats: Mapping[str, Any] | None = None,
    *,
    extension_id: str | None = None,
) -> None:
    """The sink named by ``VLLM_ECPA_EVIDENCE_SINK``; called inside the supervised host.

    Accepts a complete bound event (a host that builds its own events) or the
    controller's ``(event_name, stats)`` form, which is bound here from the launch
    environment.
    """
    if isinstance(event, Mapping):
        line: dict[str, Any] = dict(event)
        if not _bound(line):
            raise ValueError("host evidence must be a bound vllm-hust-plugin-evidence/0.1 event")
    else:
        if event not in _EVENTS:
            raise ValueError(f"unknown evidence event {event!r}")
        pid = os.getpid()
        line = {
            "schema": EVIDENCE_SCHEMA,
            "binding_status": "bound",
            "event": event,
            "extension_id": extension_id or _own_extension_id(),
            "plan_id": os.environ.get("VLLM_ECPA_PLAN_ID", ""),
            "launch_id": os.environ.get("VLLM_ECPA_LAUNCH_ID", ""),
            "process": {
                "host": socket.gethostname(),
                "pid": pid,
                "start_identity": start_identity(pid) or "",
            },
            "stats": dict(stats or {}),
        }
        if event == "effective":
            line["observation_kind"] = "runtime_effective"
        if not _bound(line):
            raise ValueError("evidence needs VLLM_ECPA_PLAN_ID and VLLM_ECPA_LAUNCH_ID")
    _append(line, evidence_path())


def launch_environment(bundles: Sequence[tuple[str, str, str]]) -> dict[str, str]:
    """Fresh evidence binding for one real launch; ``bundles`` = (id, version, manifest)."""
    material = json.dumps(sorted(list(b) for b in bundles), separators=(",", ":"))
    return {
        "VLLM_ECPA_EVIDENCE_SINK": SINK,
        "VLLM_ECPA_EVIDENCE_STRICT": "1",
        "VLLM_ECPA_PLAN_ID": hashlib.sha256(material.encode("utf-8")).hexdigest(),
        "VLLM_ECPA_LAUNCH_ID": str(uuid.uuid4()),
        PATH_ENV: str(evidence_path()),
    }


def _events(target: Path) -> list[dict[str, Any]]:
    try:
        with open_regular(target) as stream:
            stream.seek(0, os.SEEK_END)
            size = stream.tell()
            stream.seek(0)
            if size > _MAX_READ_BYTES:
                # The window's first line is partial, and dropped, unless the byte before
                # it ends a line: then it is whole and kept (it may be the live one).
                stream.seek(size - _MAX_READ_BYTES - 1)
                if stream.read(1) != b"\n":
                    stream.readline()
            lines = stream.readlines()
    except OSError:
        return []
    events: list[dict[str, Any]] = []
    for raw in lines:
        try:
            event = load_json(raw)
        except JSONInputError:
            continue  # a torn or corrupt line is no evidence
        if isinstance(event, dict) and _bound(event):
            events.append(event)
    return events


def _alive(process: Mapping[str, Any]) -> bool:
    same_host = bool(process["host"] == socket.gethostname())
    return same_host and process["start_identity"] == start_identity(process["pid"])


def _names_bundle(
    event: Mapping[str, Any], bundle_id: str, entry_points: set[tuple[str, str]]
) -> bool:
    if event.get("extension_id") == bundle_id:
        return True
    entry = event.get("entry_point")
    if not isinstance(entry, dict):
        return False
    group, name = entry.get("group"), entry.get("name")
    # Only strings can name an entry point; a list or object here (a malformed line) must
    # not reach the set lookup, where hashing it would raise.
    return isinstance(group, str) and isinstance(name, str) and (group, name) in entry_points


def runtime_effective_evidence(
    bundle_id: str, entry_points: set[tuple[str, str]] | None = None
) -> str | None:
    """Evidence text for the newest live ``effective`` event of this bundle, else None.

    Each live process is judged by its own newest ``effective``/``disabled`` event: a
    ``disabled`` line means *that* engine process fell back to the built-in policy, so it
    hides only that process's earlier ``effective`` line, never another live process's.
    """
    wanted = entry_points or set()
    decided: set[tuple[str, int, str]] = set()
    for event in reversed(_events(evidence_path())):
        if not _names_bundle(event, bundle_id, wanted):
            continue
        process = event["process"]
        key = (process["host"], process["pid"], process["start_identity"])
        if key in decided or not _alive(process):
            continue
        if event.get("event") == "disabled":
            decided.add(key)  # this live process has fallen back to the built-in policy
            continue
        effective = event.get("event") in ("effective", "runtime_effective") or (
            event.get("observation_kind") == "runtime_effective"
        )
        if effective:
            return (
                f"live runtime evidence launch_id={event['launch_id']} pid={process['pid']} "
                f"event={event.get('event')}"
            )
    return None
