"""Revisioned memory limits for a kvcached instance.

kvcached offers two ways to cap an instance's KV memory, and they must never be mixed on one
instance (after ``kvctl limit X`` a revisioned limit Y is reported, but every later
allocation re-applies X):

- ``kvctl limit <ipc> <size>`` writes ``total_size`` in the instance's 24-byte control record
  ``/dev/shm/<ipc>``; a watcher thread applies it lazily.
- ``kvcached.control.set_instance_memory_limit(limit, revision=...)`` resizes the pools
  directly and answers ``applied``/``deferred``/``stale``/``conflict``/``unavailable``/
  ``rejected``. It is **process-local**: it only sees pools registered in the calling
  process, i.e. it must run inside the vLLM EngineCore (scheduler) process.

This module implements the second path for the ``kvcached-provider limit`` command.

Where the API is called
    * **In-process**: when the calling process itself has registered kvcached pools and its
      ``KVCACHED_IPC_NAME`` is the requested instance (an embedding host; our tests).
    * **Via the engine** (the normal case): the command drops a request file into a
      per-instance mailbox (``<state dir>/mailbox/<ipc>/``); :class:`LimitResponder`, started
      inside every vLLM process of the instance by our vLLM general plugin
      (:mod:`kvcached_provider.activation`), claims it only in the process that holds
      registered pools (the EngineCore), calls the API there and writes the answer.
      No answer within the timeout -> ``unavailable`` (``no_engine_responder``): nothing was
      applied, because the command withdraws the request before reporting; one the engine
      finds only after that timeout (its command died first) is answered ``unavailable``
      (``request_expired``) and never applied. Each request
      carries a random ``request_id`` that the engine echoes in its answer; the command
      takes only the answer bearing its own, never one an engine wrote for an earlier
      request of the same revision (a lost state file restarts the counter).
      The responder runs on its own thread, while kvcached locks a pool only under vLLM's
      async scheduling (a no-op lock otherwise, the scheduler thread being its only user):
      so it first gives each pool a real ``RLock``, which every mutating method takes, and
      applies from its next poll on. Whatever kvcached raises (``QuarantinedResizeError``
      when quarantined pages block the resize, ``StateConsistencyError``...) is answered as
      ``rejected`` with kvcached's reason, never left unanswered.
    CI exercises the mailbox transport with fake kvcached modules written from kvcached
    0.1.6's source (kvcached cannot be installed on our CPU CI).
    ``tests/test_kvcached_real.py`` runs it on a GPU against a real kvcached 0.1.6 pool,
    registered as kvcached's vLLM integration registers it. It has not run inside a vLLM
    EngineCore.

Revisions
    One counter per instance name, persisted atomically under a file lock in the state
    directory (``platformdirs.user_state_path("kvcached-provider")``, override
    ``KVCACHED_PROVIDER_STATE_DIR``). A revision is reserved and saved *before* it is sent,
    so no two requests -- even after a crash -- ever reuse one (a reused revision with a
    different limit is a ``conflict``). A ``stale`` answer moves the counter past the
    revision the pools reported. An engine restart resets kvcached's revision, which a
    higher revision from us always passes. The state file's lock is held only to read and
    save it; a per-instance lock (``locks/<ipc>.lock``), held from reserving a revision to
    saving its outcome, sends one instance's requests one at a time, in revision order. A
    command that finds another one of the instance still waiting gives up after its own
    timeout: ``unavailable`` / ``limit_in_progress``, nothing sent. Commands for other
    instances never wait for it.

Refusing to mix with ``kvctl`` (our design; kvcached records no owner in the segment)
    The control record has no owner field, so ownership is inferred:

    1. After each accepted limit we store, per control record of the instance
       (``<ipc>``, and ``<ipc>_g<N>`` of a KV group that owns its segment), its inode
       and ``total_size`` -- our marker. Before the next limit, a record with the same inode whose
       ``total_size`` changed means someone wrote it (``kvctl limit``): we refuse with
       ``rejected`` / ``kvctl_limit_detected``. A new inode means the engine restarted
       (a new segment); the old marker is dropped.
    2. With no marker (first limit for this segment), the process that applies the limit
       compares each pool's record ``total_size`` with the pool's virtual capacity, which
       is what kvcached writes at start-up (``mem_size x layers x buffers``); a difference
       means a ``kvctl`` limit is in force -> refused the same way. ``--adopt`` skips this
       start-up comparison for deployments where it does not hold.
    A ``kvctl limit`` issued *after* ours cannot be prevented, only detected next time.
"""

from __future__ import annotations

import contextlib
import decimal
import errno
import fcntl
import importlib
import json
import math
import os
import re
import secrets
import stat
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import platformdirs
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from kvcached_provider.checks import (
    GROUP_SUFFIX,
    IPC_NAME_PATTERN,
    SettingError,
    env_directory,
    shm_dir,
)
from kvcached_provider.locking import lock_exclusive_within, lock_within

__all__ = [
    "ACCEPTED_STATES",
    "RECORD_SIZE",
    "ControlRecord",
    "LimitError",
    "LimitInterrupted",
    "LimitResponder",
    "LimitResult",
    "apply_here",
    "is_instance_record",
    "parse_size",
    "read_control_record",
    "set_limit",
    "state_dir",
    "validate_ipc_name",
    "validate_timeout",
]

LimitStatus = Literal["applied", "deferred", "stale", "conflict", "unavailable", "rejected"]
ACCEPTED_STATES: frozenset[str] = frozenset({"applied", "deferred"})
_RECORD = struct.Struct("=qqq")  # total_size, used_size, prealloc_size: native int64
RECORD_SIZE = _RECORD.size
_REQUEST_SCHEMA = "kvcached-provider.limit-request/1"
_POLL_S = 0.05
_MAX_LIMIT = (1 << 63) - 1  # the control record's total_size is an int64
_RLOCK = type(threading.RLock())


class LimitError(Exception):
    """Bad input or unusable local state; the CLI prints it as one line and exits 2."""


class LimitInterrupted(LimitError):
    """Interrupted (Ctrl-C, or SIGTERM in the CLI) while waiting for the engine; the message
    says whether the request was withdrawn. ``__cause__`` is the interrupt."""


def state_dir() -> Path:
    """Where revisions and the mailbox live (per user; shared by the CLI and the engine)."""
    default = platformdirs.user_state_path("kvcached-provider")
    try:
        return env_directory("KVCACHED_PROVIDER_STATE_DIR", default)
    except SettingError as exc:
        raise LimitError(str(exc)) from exc


# re.ASCII: \d would also take other scripts' digits, which float() reads as well.
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE | re.ASCII)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``512M``, ``8G``, ``1.5GiB``, ``4096`` (bytes) -> bytes; units are binary, like kvctl."""
    match = _SIZE.match(text)
    if match is None:
        raise LimitError(
            f"size {text!r} is invalid: expected a number with an optional unit K, M, G or T "
            "(binary multiples), e.g. 512M or 8G"
        )
    number, unit, _ = match.groups()
    # Decimal at the number's own precision is exact: a float would round a size in bytes
    # past 2**53 (and refuse the int64 maximum that the message below allows).
    with decimal.localcontext(prec=len(number) + 16):
        size = decimal.Decimal(number) * _UNITS[unit.lower()]
    if size > _MAX_LIMIT:
        raise LimitError(
            f"size {text!r} is invalid: expected at most {_MAX_LIMIT} bytes, the largest "
            "total_size a kvcached control record holds"
        )
    return int(size)


def validate_ipc_name(name: str) -> str:
    if not IPC_NAME_PATTERN.fullmatch(name):
        raise LimitError(
            f"--ipc {name!r} is invalid: expected the instance's KVCACHED_IPC_NAME, 1-64 "
            "characters from [A-Za-z0-9_-]"
        )
    return name


MAX_TIMEOUT_S = 3600.0


def validate_timeout(seconds: float) -> float:
    """``--timeout``: NaN would never expire, and inf or an absurd value never time out."""
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_TIMEOUT_S:
        raise LimitError(
            f"--timeout {seconds:g} is invalid: expected seconds in (0, {MAX_TIMEOUT_S:g}]"
        )
    return seconds


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class LimitResult:
    """The outcome of one limit request, as printed by the CLI and sent over the mailbox."""

    status: LimitStatus
    reason: str
    ipc_name: str
    limit_bytes: int
    revision: int
    via: str = "none"  # "in-process", "engine" or "none" (refused before sending)
    detail: str = ""
    effective_limit_bytes: int = 0
    mapped_bytes: int = 0
    remaining_bytes: int = 0
    overage_bytes: int = 0
    pools: tuple[dict[str, Any], ...] = field(default_factory=tuple)

    @property
    def accepted(self) -> bool:
        return self.status in ACCEPTED_STATES

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["pools"] = [dict(p) for p in self.pools]
        return data

    @classmethod
    def from_kvcached(cls, raw: Mapping[str, Any], *, ipc_name: str, via: str) -> LimitResult:
        """Normalise ``set_instance_memory_limit``'s answer (a plain dict)."""
        status = str(raw.get("status", ""))
        if status not in {"applied", "deferred", "stale", "conflict", "unavailable", "rejected"}:
            return cls.refused(
                ipc_name, int(raw.get("limit_bytes") or 0), int(raw.get("revision") or 0),
                status="rejected", reason="unknown_status",
                detail=f"kvcached answered an unknown status {status!r}", via=via,
            )
        return cls(
            status=status,  # type: ignore[arg-type]  # checked against the literal above
            reason=str(raw.get("reason") or ""),
            ipc_name=ipc_name,
            limit_bytes=int(raw.get("limit_bytes") or 0),
            revision=int(raw.get("revision") or 0),
            via=via,
            effective_limit_bytes=int(raw.get("effective_limit_bytes") or 0),
            mapped_bytes=int(raw.get("mapped_bytes") or 0),
            remaining_bytes=int(raw.get("remaining_bytes") or 0),
            overage_bytes=int(raw.get("overage_bytes") or 0),
            pools=tuple(dict(p) for p in raw.get("pools") or ()),
        )

    @classmethod
    def refused(
        cls, ipc_name: str, limit_bytes: int, revision: int, *, status: LimitStatus,
        reason: str, detail: str, via: str = "none",
    ) -> LimitResult:
        return cls(status=status, reason=reason, ipc_name=ipc_name, limit_bytes=limit_bytes,
                   revision=revision, via=via, detail=detail)


_RESULT_ADAPTER: TypeAdapter[LimitResult] = TypeAdapter(LimitResult)


# ------------------------------------------------------------------- control records


@dataclass(frozen=True, slots=True)
class ControlRecord:
    """kvcached's per-instance shared-memory record (``/dev/shm/<name>``, 3 x int64)."""

    name: str
    inode: int
    total_size: int
    used_size: int
    prealloc_size: int


def read_control_record(
    name: str, directory: Path | None = None, *, lock: bool = True,
    wait_s: float | None = None,
) -> ControlRecord | None:
    """Read one record under a shared ``flock``, as kvcached's readers do; None if absent.

    ``lock=False`` reads without the ``flock``, for a caller that only reports what it
    sees: any process holding an exclusive lock on the file would otherwise block it.
    ``wait_s`` bounds the wait for that lock (a command's own ``--timeout``); a record
    still locked by then is a :class:`LimitError` naming it. None waits as long as it
    takes (the engine's own reads)."""
    path = (directory if directory is not None else shm_dir()) / name
    try:
        # O_NONBLOCK: opening a FIFO planted at the path must not hang (no effect on files).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LimitError(f"cannot read kvcached control record {path}: {exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise LimitError(
                f"{path} is not a kvcached control record: expected a regular file of "
                f"{_RECORD.size} bytes, found {_file_kind(info.st_mode)}"
            )
        if lock:
            _lock_shared(fd, path, wait_s)
        data = os.pread(fd, _RECORD.size + 1, 0)
    except OSError as exc:
        raise LimitError(f"cannot read kvcached control record {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)  # closing drops the flock
    if len(data) != _RECORD.size:
        raise LimitError(
            f"{path} is not a kvcached control record: expected {_RECORD.size} bytes, "
            f"found {len(data)}"
        )
    total, used, prealloc = _RECORD.unpack(data)
    return ControlRecord(name, info.st_ino, total, used, prealloc)


def _lock_shared(fd: int, path: Path, wait_s: float | None) -> None:
    """``flock(LOCK_SH)`` on a control record, given up after ``wait_s`` seconds.

    kvcached's writers hold the exclusive lock only while they write 24 bytes, so a lock
    held for seconds is another process's doing; a command must time out, not hang.
    """
    if wait_s is None:
        fcntl.flock(fd, fcntl.LOCK_SH)
    elif not lock_within(fd, wait_s, _POLL_S, shared=True):
        raise LimitError(
            f"kvcached control record {path} stayed locked by another process for "
            f"{wait_s:g} s: expected it free between kvcached's writes (find the holder "
            f"with `fuser {path}`); nothing was sent"
        )


def _file_kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device or other special file"


def _read_text(path: Path) -> str:
    """A small file the provider writes itself, as UTF-8 text; FileNotFoundError passes.

    Opened non-blocking and checked on the descriptor: a FIFO planted at the path would
    otherwise hang the reader (a ``limit`` command, or the engine's responder thread).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        # Checked before fdopen, which refuses a directory with "Is a directory: <fd>".
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"expected a regular file, found {_file_kind(mode)}")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as stream:
        return stream.read().decode("utf-8")


def _instance_records(
    ipc: str, directory: Path | None = None, wait_s: float | None = None
) -> dict[str, ControlRecord]:
    """The records of an instance: ``<ipc>`` (group 0) and ``<ipc>_g<N>`` (other groups);
    ``wait_s`` as in :func:`read_control_record`."""
    base = directory if directory is not None else shm_dir()
    names = [ipc]
    with contextlib.suppress(OSError):
        names += sorted(p.name for p in base.glob(f"{ipc}_g*") if is_instance_record(ipc, p.name))
    records = {}
    for name in names:
        record = read_control_record(name, base, wait_s=wait_s)
        if record is not None:
            records[name] = record
    return records


def is_instance_record(ipc: str, name: str) -> bool:
    """Whether ``name`` is a record of instance ``ipc``: ``<ipc>`` or ``<ipc>_g<N>``."""
    return name == ipc or (name.startswith(ipc) and GROUP_SUFFIX.fullmatch(name[len(ipc) :])
                           is not None)


def _record_name(ipc: str, group_id: int) -> str:
    return ipc if group_id == 0 else f"{ipc}_g{group_id}"


def _segment_of(manager: Any, ipc: str) -> str:
    """The control record a pool uses: kvcached 0.1.6 names it (``ipc_name``: ``<ipc>``, or
    ``<ipc>_g<N>`` for a group that owns its segment, which only SGLang asks for); earlier
    releases are taken to use the group suffix for groups other than 0."""
    name = getattr(manager, "ipc_name", None)
    if isinstance(name, str) and name:
        return name
    return _record_name(ipc, int(getattr(manager, "group_id", 0) or 0))


# ------------------------------------------------------------------------ revisions


class _RecordMark(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    inode: int
    total_size: int


class _Instance(BaseModel):
    model_config = ConfigDict(extra="forbid")
    revision: int = Field(ge=0)
    limit_bytes: int | None = None
    status: str | None = None
    records: dict[str, _RecordMark] = Field(default_factory=dict)


class _State(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: Literal[1] = 1
    instances: dict[str, _Instance] = Field(default_factory=dict)


class _RevisionStore:
    """``instances.json`` in the state directory; every change under ``instances.lock``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / "instances.json"

    def _open_lock(self, path: Path) -> int:
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise LimitError(
                f"cannot use state directory {self.directory} ({path}: {exc.strerror}); "
                "set KVCACHED_PROVIDER_STATE_DIR to a writable directory"
            ) from exc

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The state file's lock: held only to read, change and save it, never while
        waiting for an engine."""
        fd = self._open_lock(self.directory / "instances.lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def exchange(self, ipc: str, timeout_s: float) -> Iterator[bool]:
        """Instance ``ipc``'s lock, held from reserving a revision until its outcome is
        saved, so that one instance's requests go out one at a time, in revision order.
        Yields False when another command still held it after ``timeout_s``."""
        fd = self._open_lock(self.directory / "locks" / f"{ipc}.lock")
        try:
            yield lock_exclusive_within(fd, timeout_s, _POLL_S)
        finally:
            os.close(fd)

    def load(self) -> _State:
        try:
            text = _read_text(self.path)
        except FileNotFoundError:
            return _State()
        except (OSError, UnicodeDecodeError) as exc:
            raise LimitError(f"cannot read {self.path}: {exc}") from exc
        try:
            return _State.model_validate_json(text)
        except ValidationError as exc:
            first = exc.errors()[0]
            # Keys are the file's own text: repr() keeps one with a line break on one line.
            where = ".".join(str(p) if str(p).isprintable() else repr(str(p))
                             for p in first["loc"]) or "document"
            raise LimitError(
                f"{self.path} is not a kvcached-provider state file (schema 1): {where}: "
                f"{first['msg']}; move it away to start the revision counters afresh"
            ) from exc

    def save(self, state: _State) -> None:
        """Atomic replace, so a failed save (a full disk) leaves the previous file intact."""
        payload = json.dumps(state.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
        try:
            self._replace(payload)
        except OSError as exc:
            raise LimitError(
                f"cannot save {self.path}: {exc.strerror or exc}; its previous content is "
                "kept: free space or set KVCACHED_PROVIDER_STATE_DIR to a writable directory"
            ) from exc

    def _replace(self, payload: str) -> None:
        """A temp file in the same directory, fsync, ``os.replace``; the temp file never
        outlives a failure."""
        fd, tmp = tempfile.mkstemp(prefix=".instances-", dir=self.directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(payload)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise


def _marks(records: Mapping[str, ControlRecord]) -> dict[str, _RecordMark]:
    return {n: _RecordMark(inode=r.inode, total_size=r.total_size) for n, r in records.items()}


def _kvctl_change(
    entry: _Instance | None, records: Mapping[str, ControlRecord], shm: Path
) -> tuple[str | None, bool]:
    """(violation text or None, whether a marker for the live segment exists)."""
    if entry is None or not entry.records:
        return None, False
    has_marker = False
    for name, mark in entry.records.items():
        record = records.get(name)
        if record is None or record.inode != mark.inode:
            continue  # segment gone or recreated (engine restarted): marker no longer applies
        has_marker = True
        if record.total_size != mark.total_size:
            return (
                f"control record {shm / name} holds total_size {record.total_size} bytes but "
                f"held {mark.total_size} after our revision {entry.revision}: a `kvctl limit` "
                "was applied to this instance, and mixing the two limit paths makes kvcached "
                "re-apply the kvctl limit while reporting ours; keep using kvctl for this "
                "instance, or restart the engine before using kvcached-provider",
                True,
            )
    return None, has_marker


# ------------------------------------------------------------- applying in a process


def _registered_managers() -> list[Any]:
    registry = sys.modules.get("kvcached.pool_registry")
    getter = getattr(registry, "get_registered_kv_cache_pools", None)
    if getter is None:
        return []
    try:
        return [pair[0] for pair in getter()]
    except Exception:
        return []


def _serves(ipc: str) -> bool:
    """Does this process hold the pools of instance ``ipc``?"""
    return os.environ.get("KVCACHED_IPC_NAME") == ipc and bool(_registered_managers())


def _startup_violation(ipc: str, shm: Path) -> str | None:
    for manager in _registered_managers():
        capacity = (int(manager.mem_size) * int(manager.num_layers)
                    * int(manager.num_kv_buffers))
        record = read_control_record(_segment_of(manager, ipc), shm)
        if record is not None and record.total_size != capacity:
            return (
                f"control record {shm / record.name} holds total_size {record.total_size} "
                f"bytes, not the pool's virtual capacity {capacity}, and no revisioned limit "
                "of ours is recorded for it: a `kvctl limit` is in force on this instance; "
                "keep using kvctl for it, or pass --adopt if that total is not a kvctl limit"
            )
    return None


def apply_here(
    ipc: str, limit_bytes: int, revision: int, *, check_startup: bool, via: str = "in-process",
    shm: Path | None = None,
) -> LimitResult:
    """Call kvcached's revisioned API in this process (must hold the instance's pools)."""
    shm_path = shm if shm is not None else shm_dir()
    try:
        control = sys.modules.get("kvcached.control") or importlib.import_module(
            "kvcached.control")
    except Exception as exc:
        return LimitResult.refused(ipc, limit_bytes, revision, status="unavailable",
                                   reason="kvcached_not_importable", detail=str(exc), via=via)
    if check_startup:
        violation = _startup_violation(ipc, shm_path)
        if violation is not None:
            return LimitResult.refused(ipc, limit_bytes, revision, status="rejected",
                                       reason="kvctl_limit_detected", detail=violation, via=via)
    try:
        raw = control.set_instance_memory_limit(limit_bytes, revision=revision)
    except Exception as exc:
        # kvcached 0.1.6 raises rather than answers when quarantined pages block the resize
        # (QuarantinedResizeError, a ValueError), and its transactions raise
        # StateConsistencyError / MapQuarantinedError (RuntimeErrors): each is a refusal,
        # never an exception out of the engine's responder.
        return LimitResult.refused(ipc, limit_bytes, revision, status="rejected",
                                   reason=_refusal_reason(exc),
                                   detail=f"{type(exc).__name__}: {exc}", via=via)
    return LimitResult.from_kvcached(raw, ipc_name=ipc, via=via)


def _refusal_reason(exc: Exception) -> str:
    name = type(exc).__name__
    if name == "QuarantinedResizeError":
        return "quarantined_pages_prevent_resize"  # the reason kvcached reports later
    return "invalid_request" if isinstance(exc, ValueError) else "kvcached_error"


def _lock_pools() -> int:
    """Give every registered pool a real lock; returns how many had none.

    kvcached guards a pool with an ``RLock`` only under vLLM's async scheduling and with a
    no-op lock otherwise, because then only the scheduler thread touches it. The responder
    applies limits from its own thread, so without a real lock ``set_memory_limit`` would
    race the scheduler's ``alloc``/``free``. Every mutating method reads ``self._lock`` per
    call, so a lock set here serialises them from the next call on.
    """
    upgraded = 0
    for manager in _registered_managers():
        lock = getattr(manager, "_lock", None)
        if lock is not None and not isinstance(lock, _RLOCK):
            manager._lock = threading.RLock()
            upgraded += 1
    return upgraded


# ------------------------------------------------------------------------- mailbox


def _mailbox(ipc: str, directory: Path | None = None) -> Path:
    return (directory if directory is not None else state_dir()) / "mailbox" / ipc


def _write_json_atomic(path: Path, data: Mapping[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _read_answer(path: Path) -> dict[str, Any] | None:
    """The answer file's JSON object; None while it does not exist yet."""
    try:
        text = _read_text(path)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        detail = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise LimitError(f"cannot read limit answer {path}: {detail}") from exc
    expected = "expected the JSON object an engine responder writes"
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise LimitError(f"{path} is not a valid limit answer: {expected}, but it is not "
                         f"JSON ({exc})") from exc
    if not isinstance(data, dict) or not data:
        raise LimitError(f"{path} is not a valid limit answer: {expected}, found "
                         f"{json.dumps(data)[:40]}")
    return data


def _wait_for(path: Path, request_id: str, deadline: float) -> dict[str, Any] | None:
    """The answer to request ``request_id``; None if none came by ``deadline``.

    An answer file of the same revision but another request (one an engine wrote after its
    command had given up, read again once a lost state file restarted the counter) is not
    this request's: it is passed over until the engine replaces it with this one's.
    """
    while True:
        data = _read_answer(path)
        if data is not None and data.get("request_id") == request_id:
            return data
        if time.monotonic() >= deadline:
            return None
        time.sleep(_POLL_S)


def _open_mailbox(box: Path) -> None:
    try:
        box.mkdir(parents=True, exist_ok=True, mode=0o700)
    except FileExistsError as exc:
        raise LimitError(f"mailbox {box} is not usable: expected a directory, found a file "
                         "(move it away)") from exc
    except OSError as exc:
        raise LimitError(f"mailbox {box} is not usable: {exc.strerror}; expected a writable "
                         "directory (set KVCACHED_PROVIDER_STATE_DIR to move it)") from exc


def _withdraw(request: Path) -> bool:
    """Remove an unclaimed request so it never applies; False when the engine had already
    claimed it (claiming renames it away)."""
    try:
        request.unlink()
    except FileNotFoundError:
        return False
    return True


def _wait_or_withdraw(
    request: Path, answer: Path, request_id: str, deadline: float
) -> dict[str, Any] | None:
    """``_wait_for``, but a bad answer first withdraws the request, so it never applies."""
    try:
        return _wait_for(answer, request_id, deadline)
    except LimitError as exc:
        outcome = ("the request was withdrawn and nothing was applied" if _withdraw(request)
                   else "the engine had claimed the request, so the limit may be in force")
        raise LimitError(f"{exc}; {outcome}") from exc


def _via_engine(
    ipc: str, limit_bytes: int, revision: int, *, check_startup: bool, timeout_s: float,
    directory: Path,
) -> LimitResult:
    box = _mailbox(ipc, directory)
    _open_mailbox(box)
    request = box / f"req-{revision}.json"
    answer = box / f"ans-{revision}.json"
    request_id = secrets.token_hex(16)  # the engine echoes it in this request's answer
    try:
        _write_json_atomic(request, {
            "schema": _REQUEST_SCHEMA, "ipc_name": ipc, "limit_bytes": limit_bytes,
            "revision": revision, "check_startup": check_startup, "request_id": request_id,
            # Wall clock, not monotonic: the engine reads it, possibly after a reboot.
            "expires_at": time.time() + timeout_s,
        })
    except OSError as exc:
        raise LimitError(f"cannot write limit request {request}: {exc.strerror}") from exc
    try:
        return _exchange(ipc, limit_bytes, revision, request, answer, request_id, timeout_s)
    except KeyboardInterrupt as exc:  # an abandoned request must not apply later either
        outcome = ("the request was withdrawn and nothing was applied" if _withdraw(request)
                   else "the engine had claimed the request, so the limit may be in force")
        raise LimitInterrupted(f"interrupted while waiting for the engine; {outcome}") from exc


def _exchange(
    ipc: str, limit_bytes: int, revision: int, request: Path, answer: Path, request_id: str,
    timeout_s: float,
) -> LimitResult:
    """Wait for the engine's answer to ``request``; withdraw it if none comes in time."""
    data = _wait_or_withdraw(request, answer, request_id, time.monotonic() + timeout_s)
    if data is None:
        if _withdraw(request):  # an unclaimed request must not apply later
            return LimitResult.refused(
                ipc, limit_bytes, revision, status="unavailable", reason="no_engine_responder",
                via="engine",
                detail=f"no engine process of instance {ipc!r} answered within {timeout_s:g} s "
                       "(is the engine running with org.vllm-hust.kvcached enabled, so that "
                       "its vLLM plugin serves limit requests?); nothing was applied",
            )
        # Claimed meanwhile: the engine is applying it; give it one more timeout.
        data = _wait_or_withdraw(request, answer, request_id, time.monotonic() + timeout_s)
        if data is None:
            return LimitResult.refused(
                ipc, limit_bytes, revision, status="unavailable",
                reason="engine_claimed_request_without_answer", via="engine",
                detail=f"the engine claimed revision {revision} but did not answer within "
                       f"{2 * timeout_s:g} s; the limit may be in force -- retrying uses "
                       "a higher revision and is safe",
            )
    with contextlib.suppress(FileNotFoundError):
        answer.unlink()
    try:
        return _RESULT_ADAPTER.validate_python(data)
    except ValidationError as exc:
        raise LimitError(f"{answer} is not a valid limit answer: {exc.errors()[0]['msg']}") from exc


def _expired(ipc: str, body: Mapping[str, Any], revision: int) -> LimitResult | None:
    """The refusal of a request claimed after its command's ``--timeout`` ran out, else None.

    By then the command has withdrawn it and reported ``unavailable``, or it died before it
    could (SIGKILL, a reboot: the mailbox persists), so applying it would enforce a limit
    nobody saw accepted, whenever the engine next starts. A request without ``expires_at``
    (an earlier release's) is served as before.
    """
    expires = body.get("expires_at")
    if (not isinstance(expires, int | float) or isinstance(expires, bool)
            or not time.time() > expires):
        return None
    return LimitResult.refused(
        ipc, int(body["limit_bytes"]), revision, status="unavailable", reason="request_expired",
        via="engine", detail=f"the engine found revision {revision} after its command's "
        "timeout had run out (the command gave up or died); nothing was applied",
    )


class LimitResponder:
    """Serves limit requests for instance ``ipc`` from inside an engine process.

    Runs in every vLLM process of the instance but claims requests only where kvcached
    pools are registered (the EngineCore), so exactly one process applies each request.
    Claiming is an atomic ``rename``, which also settles races with a withdrawing client.
    """

    def __init__(self, ipc: str, *, directory: Path | None = None, shm: Path | None = None,
                 poll_s: float = 0.2) -> None:
        self.ipc = validate_ipc_name(ipc)
        self.directory = directory if directory is not None else state_dir()
        self.shm = shm
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> int:
        """Answer pending requests; returns how many were answered."""
        if not _serves(self.ipc):
            return 0
        if _lock_pools():
            # A pool just got its lock: answer from the next poll on, once any call the
            # scheduler began under the no-op lock (microseconds long) has returned.
            return 0
        box = _mailbox(self.ipc, self.directory)
        try:
            pending = sorted(box.glob("req-*.json"))
        except OSError:
            return 0
        answered = 0
        for request in pending:
            claimed = request.with_name(f"claimed-{request.stem[4:]}-{os.getpid()}.json")
            try:
                os.rename(request, claimed)
            except FileNotFoundError:
                continue  # withdrawn by the client or claimed by another process
            self._answer(claimed, request.stem[4:])
            answered += 1
        return answered

    def _answer(self, claimed: Path, suffix: str) -> None:
        """Answer the request claimed as ``claimed`` (sent as ``req-<suffix>.json``) in
        ``ans-<suffix>.json``, the file its command waits on, echoing its ``request_id``."""
        request_id = ""
        try:
            body = json.loads(_read_text(claimed))
            if body.get("schema") != _REQUEST_SCHEMA or body.get("ipc_name") != self.ipc:
                raise ValueError("unexpected request schema or instance")
            request_id = str(body.get("request_id") or "")
            revision = int(body["revision"])
            result = _expired(self.ipc, body, revision) or apply_here(
                self.ipc, int(body["limit_bytes"]), revision,
                check_startup=bool(body.get("check_startup")), via="engine", shm=self.shm)
        except Exception as exc:  # every claimed request gets an answer
            revision = int(suffix) if suffix.isascii() and suffix.isdecimal() else 0
            result = LimitResult.refused(self.ipc, 0, revision, status="rejected",
                                         reason="invalid_request", detail=str(exc), via="engine")
        _write_json_atomic(claimed.with_name(f"ans-{suffix}.json"),
                           {**result.to_dict(), "request_id": request_id})
        with contextlib.suppress(FileNotFoundError):
            claimed.unlink()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="kvcached-provider-limits",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll_once()
            except Exception:  # never kill the engine over a malformed mailbox
                continue


# ---------------------------------------------------------------------- entry point


def set_limit(
    ipc: str, limit_bytes: int, *, timeout_s: float = 5.0, adopt: bool = False,
    directory: Path | None = None, shm: Path | None = None,
) -> LimitResult:
    """Apply ``limit_bytes`` to instance ``ipc`` with the next revision; see the module doc."""
    validate_ipc_name(ipc)
    validate_timeout(timeout_s)
    if limit_bytes < 0:
        raise LimitError(f"limit {limit_bytes} is invalid: expected a non-negative size")
    base = directory if directory is not None else state_dir()
    shm_path = shm if shm is not None else shm_dir()
    store = _RevisionStore(base)
    with store.exchange(ipc, timeout_s) as free:
        if not free:
            return LimitResult.refused(
                ipc, limit_bytes, 0, status="unavailable", reason="limit_in_progress",
                detail=f"another `kvcached-provider limit` for instance {ipc!r} was still "
                       f"waiting for the engine after {timeout_s:g} s; nothing was sent",
            )
        # Read before the state file's lock: a record locked by another process then
        # costs this command its timeout, and never holds up other instances' commands.
        records = _instance_records(ipc, shm_path, wait_s=timeout_s)
        with store.locked():
            state = store.load()
            entry = state.instances.get(ipc)
            revision = entry.revision + 1 if entry is not None else 1
            violation, has_marker = _kvctl_change(entry, records, shm_path)
            if violation is not None:
                return LimitResult.refused(ipc, limit_bytes, revision, status="rejected",
                                           reason="kvctl_limit_detected", detail=violation)
            # Reserve the revision before sending it, so that it is never reused.
            entry = (entry or _Instance(revision=0)).model_copy(update={"revision": revision})
            state.instances[ipc] = entry
            store.save(state)
        # The state file is free while the request is out: other instances' limits go on.
        check_startup = not has_marker and not adopt
        if _serves(ipc):
            result = apply_here(ipc, limit_bytes, revision, check_startup=check_startup,
                                shm=shm_path)
        else:
            result = _via_engine(ipc, limit_bytes, revision, check_startup=check_startup,
                                 timeout_s=timeout_s, directory=base)
        update: dict[str, Any] = {"limit_bytes": limit_bytes, "status": result.status}
        if result.accepted:
            # Unbounded: the limit is applied, and its markers must be saved with it (a
            # refusal here would leave the next command taking our limit for kvctl's).
            update["records"] = _marks(_instance_records(ipc, shm_path))
        if result.status == "stale":
            seen = [int(p.get("revision", 0) or 0) for p in result.pools]
            update["revision"] = max([revision, *seen])
        _save_outcome(store, ipc, entry.model_copy(update=update), result)
    return result


def _save_outcome(store: _RevisionStore, ipc: str, entry: _Instance, result: LimitResult
                  ) -> None:
    """Record a sent request's outcome in the state file as it is now (other instances'
    entries may have changed meanwhile); if that fails, say what the engine did, which the
    error would otherwise hide (the revision itself was saved before sending)."""
    try:
        with store.locked():
            state = store.load()
            state.instances[ipc] = entry
            store.save(state)
    except LimitError as exc:
        raise LimitError(
            f"limit {result.status} at revision {result.revision} (via {result.via}), but {exc}"
        ) from exc
