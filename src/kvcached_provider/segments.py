"""Removing what a kvcached instance leaks on shutdown (kvcached-notes.md §7, check 9).

kvcached keeps one 24-byte control record per instance and KV group in ``/dev/shm``
(``<ipc>`` for group 0, ``<ipc>_g<N>`` for the others), and its tensor-parallel workers
talk over Unix sockets in ``/tmp/kvcached-tp-<ipc>-<h>`` (``h``: the first 8 hex digits of
``uuid5(NAMESPACE_DNS, ipc)``, as kvcached's ``tp_ipc_util`` derives it). Both survive
SIGKILL, and on vLLM even a graceful SIGTERM (kvcached #477), so the next engine with the
same name would start from a stale limit.

The record has no owner or liveness field, and kvcached opens it only briefly around each
read or write, so "in use" is decided from the processes themselves: a live process whose
environment names the instance (``KVCACHED_IPC_NAME``, with kvcached enabled), or that
has one of the paths open or mapped. This process and its ancestors (the shell, the
manager) are never counted. Only the instance's own paths are ever removed, and only when
nothing uses them; any other control record in ``/dev/shm`` is reported as possibly stale
and left alone: it may belong to a live engine this process cannot see. (Processes of
other users cannot be inspected without privileges, but neither can their files in the
sticky ``/dev/shm`` be removed: such a record is kept as "could not be removed".)

The extension manager calls :func:`on_shutdown` through the ``vllm_hust_ext.bundle_shutdown``
entry point once the launched process group is gone; ``kvcached-provider cleanup --ipc
NAME`` does the same by hand.
"""

from __future__ import annotations

import os
import re
import stat
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvcached_provider.checks import IPC_NAME_PATTERN, planned_environment, shm_dir

__all__ = [
    "RECORD_SIZE",
    "CleanupError",
    "CleanupReport",
    "cleanup",
    "instance_users",
    "on_shutdown",
    "tp_socket_dir",
]

RECORD_SIZE = 24  # three native int64: total_size, used_size, prealloc_size
_GROUP_SUFFIX = re.compile(r"_g[0-9]+$")
_ENABLED = {b"true", b"1"}


class CleanupError(ValueError):
    """Bad input, or no way to tell used segments from leaked ones; nothing was removed."""


@dataclass(frozen=True, slots=True)
class CleanupReport:
    """What :func:`cleanup` found for one instance; paths as strings, sorted."""

    ipc: str
    removed: tuple[str, ...]
    kept: tuple[tuple[str, str], ...]  # (path, why it stays)
    foreign: tuple[tuple[str, str], ...]  # other instances' records: (path, note)
    dry_run: bool = False

    @property
    def clean(self) -> bool:
        """Nothing of this instance was left behind."""
        return not self.kept

    def lines(self) -> list[str]:
        verb = "would remove" if self.dry_run else "removed"
        out = [f"{verb} {path}" for path in self.removed]
        out += [f"kept {path}: {why}" for path, why in self.kept]
        out += [f"left {path}: {note}" for path, note in self.foreign]
        if not out:
            out.append(f"no leaked kvcached segment of instance {self.ipc!r}")
        return out


def tp_socket_dir(ipc: str, tmp: Path | None = None) -> Path:
    """kvcached's tensor-parallel socket directory for instance ``ipc``."""
    suffix = uuid.uuid5(uuid.NAMESPACE_DNS, ipc).hex[:8]
    return (tmp if tmp is not None else Path("/tmp")) / f"kvcached-tp-{ipc}-{suffix}"


def _instance_of(record_name: str) -> set[str]:
    """Instance names a record can belong to: ``a_g2`` is group 2 of ``a``, or ``a_g2``."""
    names = {record_name}
    if _GROUP_SUFFIX.search(record_name):
        names.add(_GROUP_SUFFIX.sub("", record_name))
    return names


def _ancestors() -> set[int]:
    """This process and its ancestors: they launched or asked for the cleanup."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            stat_line = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
            pid = int(stat_line[stat_line.rfind(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _kvcached_instance(pid: str) -> str | None:
    """The process's ``KVCACHED_IPC_NAME`` if it runs with kvcached enabled."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    variables = dict(item.partition(b"=")[::2] for item in raw.split(b"\0") if item)
    if variables.get(b"ENABLE_KVCACHED", b"").strip().lower() not in _ENABLED:
        return None
    name = variables.get(b"KVCACHED_IPC_NAME")
    return name.decode(errors="replace") if name else None


def _open_paths(pid: str) -> set[str]:
    """Paths a process has open (fds) or mapped."""
    found: set[str] = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        fds = list(fd_dir.iterdir())
    except OSError:
        fds = []
    for fd in fds:
        try:
            found.add(os.readlink(fd))
        except OSError:
            continue
    try:
        maps = Path(f"/proc/{pid}/maps").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return found
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6:
            found.add(parts[5].removesuffix(" (deleted)"))
    return found


def instance_users(names: Iterable[str], paths: Iterable[Path]) -> list[int]:
    """Live processes (besides this one and its ancestors) that use the instance.

    A process uses it when its environment names one of ``names`` with kvcached enabled,
    or when it has one of ``paths`` (or a file inside one of them) open or mapped.
    """
    wanted = set(names)
    prefixes = tuple(str(p) for p in paths)
    skip = _ancestors()
    users = []
    try:
        entries = list(Path("/proc").iterdir())
    except OSError as exc:  # without /proc nothing proves a segment unused: remove nothing
        raise CleanupError(f"cannot list processes in /proc ({exc.strerror or exc}), so no "
                         "segment can be shown unused; nothing removed") from exc
    for entry in entries:
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        if _kvcached_instance(entry.name) in wanted or any(
            path == prefix or path.startswith(prefix + "/")
            for path in _open_paths(entry.name)
            for prefix in prefixes
        ):
            users.append(int(entry.name))
    return sorted(users)


def _records(ipc: str, shm: Path) -> tuple[list[Path], list[Path]]:
    """The instance's control records, and every other record-sized file in ``shm``."""
    own: list[Path] = []
    other: list[Path] = []
    try:
        entries = sorted(shm.iterdir())
    except OSError:
        return own, other
    for path in entries:
        name = path.name
        if name == ipc or (name.startswith(ipc) and _GROUP_SUFFIX.fullmatch(name[len(ipc) :])):
            own.append(path)
            continue
        try:
            info = path.lstat()
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode) and info.st_size == RECORD_SIZE:
            other.append(path)
    return own, other


def _socket_dir_refusal(directory: Path) -> str | None:
    """Why ``directory`` is not just kvcached's sockets (``w*.sock``, ``pp<N>/w*.sock``)."""
    for root, dirs, files in os.walk(directory):
        for name in files:
            path = Path(root) / name
            if not stat.S_ISSOCK(path.lstat().st_mode):
                return f"holds {path}, which is not a socket; remove it by hand if it is stale"
        for name in dirs:
            if (Path(root) / name).is_symlink():
                return f"holds the link {Path(root) / name}; remove it by hand if it is stale"
    return None


def _remove_tree(directory: Path) -> None:
    for root, dirs, files in os.walk(directory, topdown=False):
        for name in files:
            os.unlink(Path(root) / name)
        for name in dirs:
            os.rmdir(Path(root) / name)
    os.rmdir(directory)


def _remove(path: Path, users: list[int], dry_run: bool) -> str | None:
    """Remove one of the instance's paths; the reason it stays, or None once it is gone."""
    if users:
        return f"in use by pid {', '.join(map(str, users))}"
    if path.is_dir() and not path.is_symlink():
        refusal = _socket_dir_refusal(path)
        if refusal is not None:
            return refusal
        if not dry_run:
            _remove_tree(path)
        return None
    if not dry_run:
        path.unlink(missing_ok=True)
    return None


def cleanup(
    ipc: str, *, dry_run: bool = False, shm: Path | None = None, tmp: Path | None = None
) -> CleanupReport:
    """Remove instance ``ipc``'s leaked control records and TP socket directory.

    Each path stays when a live process uses it (see :func:`instance_users`); records of
    other instances are only reported.
    """
    if not IPC_NAME_PATTERN.match(ipc):
        raise CleanupError(f"KVCACHED_IPC_NAME {ipc!r} is invalid: expected 1-64 characters "
                         "from [A-Za-z0-9_-]")
    shm_path = shm if shm is not None else shm_dir()
    own, other = _records(ipc, shm_path)
    sockets = tp_socket_dir(ipc, tmp)
    if sockets.exists() or sockets.is_symlink():
        own.append(sockets)
    removed: list[str] = []
    kept: list[tuple[str, str]] = []
    for path in own:
        users = instance_users(_instance_of(path.name) | {ipc}, [path])
        try:
            why = _remove(path, users, dry_run)
        except OSError as exc:
            why = f"could not be removed ({exc.strerror or exc})"
        if why is None:
            removed.append(str(path))
        else:
            kept.append((str(path), why))
    foreign = []
    for path in other:
        users = instance_users(_instance_of(path.name), [path])
        note = (f"another instance's record, in use by pid {', '.join(map(str, users))}"
                if users else "possibly stale record of another instance; if no engine uses "
                f"it remove it with `kvctl delete {path.name}`")
        foreign.append((str(path), note))
    return CleanupReport(ipc, tuple(removed), tuple(kept), tuple(foreign), dry_run)


def on_shutdown(manifest: Mapping[str, object], configuration: Mapping[str, object]) -> list[str]:
    """``vllm_hust_ext.bundle_shutdown`` hook: clean up the instance that just stopped."""
    ipc = planned_environment(manifest, configuration).get("KVCACHED_IPC_NAME")
    if ipc is None or not IPC_NAME_PATTERN.match(ipc):
        return [f"KVCACHED_IPC_NAME is {'not set' if ipc is None else f'invalid ({ipc!r})'}, "
                "so this instance's kvcached segments cannot be told from others': nothing "
                "removed"]
    return cleanup(ipc).lines()
