"""Runtime evidence for a manager-supervised launch, written by the bundle itself.

The manager (official or compatible) sets ``VLLM_HUST_EXT_EVIDENCE_PATH`` plus the launch
binding (``VLLM_ECPA_PLAN_ID``, ``VLLM_ECPA_LAUNCH_ID``) when it starts a host. The
policy controller then reports ``initialized`` / ``effective`` / ``disabled`` through the
sink returned by :func:`evidence_sink_from_env`, one JSON line per event, and the
manager's ``status`` reports ``runtime_effective`` while the writing process is alive.

Standard library only: the bundle must work without any manager installed, and the
manager never imports the bundle.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path

__all__ = [
    "EVIDENCE_PATH_ENV",
    "EVIDENCE_SCHEMA",
    "EXTENSION_ID",
    "evidence_line",
    "evidence_sink_from_env",
    "start_identity",
]

EVIDENCE_SCHEMA = "vllm-hust-plugin-evidence/0.1"
EVIDENCE_PATH_ENV = "VLLM_HUST_EXT_EVIDENCE_PATH"
EXTENSION_ID = "org.vllm-hust.bidkv"

Sink = Callable[[str, dict[str, object]], None]


def start_identity(pid: int) -> str | None:
    """``pid:<pid>:start_ticks:<n>`` from ``/proc/<pid>/stat`` (field 22), None if unreadable.

    The start time tells a live process apart from a later one that reuses its pid.
    """
    try:
        raw = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
        # The command name may contain spaces or ')': the fields start after the last ')'.
        ticks = raw[raw.rfind(")") + 1 :].split()[19]
        int(ticks)
    except (OSError, IndexError, ValueError):
        return None
    return f"pid:{pid}:start_ticks:{ticks}"


def evidence_line(
    event: str,
    stats: Mapping[str, object],
    environ: Mapping[str, str],
    *,
    pid: int | None = None,
) -> dict[str, object]:
    """The JSON object for one event; bound only when the launch binding is present."""
    process_id = os.getpid() if pid is None else pid
    plan_id = environ.get("VLLM_ECPA_PLAN_ID", "")
    launch_id = environ.get("VLLM_ECPA_LAUNCH_ID", "")
    line: dict[str, object] = {
        "schema": EVIDENCE_SCHEMA,
        "binding_status": "bound" if plan_id and launch_id else "unbound",
        "event": event,
        "extension_id": EXTENSION_ID,
        "plan_id": plan_id,
        "launch_id": launch_id,
        "process": {
            "host": socket.gethostname(),
            "pid": process_id,
            "start_identity": start_identity(process_id) or "",
        },
        "stats": dict(stats),
        "recorded_at": time.time(),
    }
    if event == "effective":
        line["observation_kind"] = "runtime_effective"
    return line


def _append(path: Path, line: Mapping[str, object]) -> None:
    data = (json.dumps(line, separators=(",", ":"), sort_keys=True) + "\n").encode("utf-8")
    # O_NONBLOCK: a FIFO at the path with no reader fails at once (ENXIO) instead of
    # blocking the engine; it changes nothing for a regular file.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o600)
    try:
        # One write() on an O_APPEND descriptor: concurrent writers never interleave lines.
        os.write(fd, data)
    finally:
        os.close(fd)


def evidence_sink_from_env(environ: Mapping[str, str] = os.environ) -> Sink | None:
    """A controller evidence sink when ``VLLM_HUST_EXT_EVIDENCE_PATH`` is set, else None.

    With ``VLLM_ECPA_EVIDENCE_STRICT=1`` a failed write raises (the controller logs and
    swallows it, so a decision never changes); otherwise failures are ignored: the file
    system's, and stats that JSON cannot write (nothing is written then, not half a line).
    """
    target = environ.get(EVIDENCE_PATH_ENV)
    if not target:
        return None
    path = Path(target)
    strict = environ.get("VLLM_ECPA_EVIDENCE_STRICT") == "1"
    binding = dict(environ)  # snapshot: the launch binding is fixed for the process

    def sink(event: str, stats: dict[str, object]) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _append(path, evidence_line(event, stats, binding))
        except (OSError, TypeError, ValueError):
            # TypeError/ValueError: json.dumps refused the stats (a key or value of no JSON
            # type, a circular mapping) before anything was written.
            if strict:
                raise

    return sink
