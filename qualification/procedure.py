"""Per-arm procedure facts of a serve arm (qualification.md §2 steps 3, 4 and 7).

Step 3: after ``/health``, one device snapshot (``nvidia-smi`` / ``npu-smi info`` by lane,
or the profile's ``device_snapshot_command``); a missing or failing command is recorded,
never fatal. Step 4 (candidate only): the ``BIDKV_UTILITY_*`` variables, and the
``VLLM_ENGINE_EXTRA_ENV_PREFIXES`` allowlist, that the manager, the engine server and
each of its child processes (the engine core) actually hold, read from
``/proc/<pid>/environ``. Without them in an engine child the reference policy initialised
disabled. Step 7: every arm is a fresh server writing its own ``engine.log``, so that file
is the arm's log slice; the record names it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from qualification.errors import one_line

__all__ = [
    "LANE_SNAPSHOT_COMMANDS",
    "POLICY_PREFIX",
    "DeviceSnapshot",
    "PolicyEnvironment",
    "ProcessEnvironment",
    "log_facts",
    "policy_environment",
    "snapshot_command",
    "snapshot_device",
]

# qualification.md §2 step 3, per lane; a profile may name its own command (or none).
LANE_SNAPSHOT_COMMANDS: Mapping[str, tuple[str, ...]] = {
    "cuda": (
        "nvidia-smi",
        "--query-gpu=index,name,memory.used,memory.total,utilization.gpu",
        "--format=csv",
    ),
    "ascend": ("npu-smi", "info"),
}
SNAPSHOT_LIMIT = 64 * 1024  # bytes of the snapshot's output kept in the record
SNAPSHOT_TIMEOUT_S = 60.0
POLICY_PREFIX = "BIDKV_UTILITY_"
PREFIX_ALLOWLIST = "VLLM_ENGINE_EXTRA_ENV_PREFIXES"
_MAX_PROCESSES = 256  # a tree bigger than this is not an engine
_VALUE_LIMIT = 256

SnapshotStatus = Literal["ok", "failed", "missing", "timeout", "none"]
EnvStatus = Literal["carried", "missing", "no-engine-child", "unavailable"]


@dataclass(frozen=True, slots=True)
class DeviceSnapshot:
    """One run of the snapshot command; ``output`` is its stdout, at most
    ``SNAPSHOT_LIMIT`` bytes, ``detail`` why it did not succeed."""

    command: tuple[str, ...]
    status: SnapshotStatus
    exit_code: int | None = None
    output: str = ""
    truncated: bool = False
    detail: str = ""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def snapshot_command(configured: Sequence[str] | None, accelerator: str) -> tuple[str, ...]:
    """The profile's command, else the lane's default (none for other accelerators)."""
    if configured is not None:
        return tuple(configured)
    return LANE_SNAPSHOT_COMMANDS.get(accelerator, ())


def _bounded(data: bytes) -> tuple[str, bool]:
    return data[:SNAPSHOT_LIMIT].decode("utf-8", "replace"), len(data) > SNAPSHOT_LIMIT


def snapshot_device(
    command: Sequence[str], timeout_s: float = SNAPSHOT_TIMEOUT_S
) -> DeviceSnapshot:
    """Run the snapshot command once; every outcome is a record, never an exception."""
    argv = tuple(command)
    if not argv:
        return DeviceSnapshot(argv, "none", detail="no snapshot command for this lane")
    program = shutil.which(argv[0])
    if program is None:
        return DeviceSnapshot(argv, "missing", detail=f"{argv[0]!r} not found on PATH")
    try:
        proc = subprocess.run(
            [program, *argv[1:]], capture_output=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        text, cut = _bounded(exc.stdout or b"")
        return DeviceSnapshot(argv, "timeout", None, text, cut, f"no exit within {timeout_s:g}s")
    except OSError as exc:
        return DeviceSnapshot(argv, "failed", detail=one_line(str(exc)))
    text, cut = _bounded(proc.stdout)
    if proc.returncode == 0:
        return DeviceSnapshot(argv, "ok", 0, text, cut)
    last = (proc.stderr.decode("utf-8", "replace").strip().splitlines() or ["(no stderr)"])[-1]
    return DeviceSnapshot(argv, "failed", proc.returncode, text, cut, one_line(last))


@dataclass(frozen=True, slots=True)
class ProcessEnvironment:
    """One process of the arm's tree: depth 0 is the manager, 1 the engine server, 2 and
    deeper its children (the engine core and its workers)."""

    pid: int
    ppid: int
    depth: int
    command: str
    policy_environment: Mapping[str, str]
    readable: bool = True


@dataclass(frozen=True, slots=True)
class PolicyEnvironment:
    """What the candidate's processes ran with (qualification.md §2 step 4)."""

    status: EnvStatus
    detail: str
    processes: tuple[ProcessEnvironment, ...] = ()

    def as_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["processes"] = [
            {**asdict(p), "policy_environment": dict(p.policy_environment)}
            for p in self.processes
        ]
        return data


def _parent_of(stat: str) -> int:
    # /proc/<pid>/stat: "pid (comm) state ppid ..."; comm may hold spaces and parentheses.
    return int(stat.rsplit(")", 1)[1].split()[1])


def _parents(proc_root: Path) -> dict[int, int]:
    parents: dict[int, int] = {}
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text(encoding="utf-8", errors="replace")
            parents[int(entry.name)] = _parent_of(stat)
        except (OSError, IndexError, ValueError):  # gone meanwhile, or unreadable
            continue
    return parents


def _tree(root: int, proc_root: Path) -> list[tuple[int, int, int]]:
    """(pid, ppid, depth) of ``root`` and its descendants, breadth first."""
    parents = _parents(proc_root)
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found = [(root, parents.get(root, 0), 0)]
    for pid, _ppid, depth in found:  # grows while iterating: breadth first
        for child in sorted(children.get(pid, [])):
            if len(found) < _MAX_PROCESSES:
                found.append((child, pid, depth + 1))
    return found


def _read_process(pid: int, ppid: int, depth: int, proc_root: Path) -> ProcessEnvironment:
    base = proc_root / str(pid)
    try:
        argv = (base / "cmdline").read_bytes().split(b"\0")
        command = one_line(b" ".join(argv).decode("utf-8", "replace").strip())[:_VALUE_LIMIT]
        raw = (base / "environ").read_bytes()
    except OSError:
        return ProcessEnvironment(pid, ppid, depth, "", {}, readable=False)
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.decode("utf-8", "replace").partition("=")
        if sep and (key.startswith(POLICY_PREFIX) or key == PREFIX_ALLOWLIST):
            env[one_line(key)] = one_line(value)[:_VALUE_LIMIT]
    return ProcessEnvironment(pid, ppid, depth, command, env)


def _carries(process: ProcessEnvironment) -> bool:
    return any(k.startswith(POLICY_PREFIX) for k in process.policy_environment)


def policy_environment(root_pid: int, proc_root: Path = Path("/proc")) -> PolicyEnvironment:
    """Read the policy environment of ``root_pid`` (the manager) and its descendants."""
    if not sys.platform.startswith("linux") or not (proc_root / str(root_pid)).is_dir():
        return PolicyEnvironment("unavailable", f"no {proc_root}/{root_pid} (Linux /proc only)")
    try:
        tree = _tree(root_pid, proc_root)
    except OSError as exc:  # /proc itself unreadable
        return PolicyEnvironment("unavailable", one_line(f"{proc_root}: {exc}"))
    processes = tuple(_read_process(pid, ppid, depth, proc_root) for pid, ppid, depth in tree)
    engine_children = [p for p in processes if p.depth >= 2]
    if not engine_children:
        return PolicyEnvironment(
            "no-engine-child", "the engine server has no child process to read", processes
        )
    carriers = [p.pid for p in engine_children if _carries(p)]
    if carriers:
        return PolicyEnvironment(
            "carried", f"{POLICY_PREFIX}* present in engine child pid(s) {carriers}", processes
        )
    return PolicyEnvironment(
        "missing",
        f"no engine child process carries {POLICY_PREFIX}*: the policy initialises disabled "
        f"there (the engine must pass them on, e.g. {PREFIX_ALLOWLIST}={POLICY_PREFIX})",
        processes,
    )


def log_facts(log_path: Path, arm_dir: Path) -> dict[str, object]:
    """Step 7: the arm's own log file (every arm is a fresh server) and its size."""
    try:
        size: int | None = log_path.stat().st_size
    except OSError:
        size = None
    try:
        shown = str(log_path.relative_to(arm_dir))
    except ValueError:
        shown = str(log_path)
    return {"path": shown, "bytes": size}

