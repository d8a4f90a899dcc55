"""Removing what a kvcached instance leaks on shutdown (kvcached-notes.md §7, check 9).

kvcached keeps a 24-byte control record per instance in ``/dev/shm`` (``<ipc>``; a KV group
that owns its segment, which only SGLang asks for, uses ``<ipc>_g<N>``), and its
tensor-parallel workers
talk over Unix sockets in ``/tmp/kvcached-tp-<ipc>-<h>`` (``h``: the first 8 hex digits of
``uuid5(NAMESPACE_DNS, ipc)``, as kvcached's ``tp_ipc_util`` derives it). Both survive
SIGKILL, and on vLLM even a graceful SIGTERM (kvcached #477), so the next engine with the
same name would start from a stale limit.

The record has no owner or liveness field, and whether a process keeps it open differs
between kvcached releases (0.1.6 holds a descriptor per pool; earlier ones open it only
around each access), so "in use" is decided from one reading of ``/proc``. A live process uses
the instance when its environment names it in ``KVCACHED_IPC_NAME`` (compared as kvcached
sanitises it, whether or not kvcached is enabled there), when it belongs to the process
group a default name ``kvcached_<engine>_<pgid>`` was derived from, or when it has one of
the paths open or mapped; a socket directory is also in use while some process is bound
to a socket in it (``/proc/net/unix``: a socket fd does not show its path). This process
and its ancestors (the shell, the manager, init) are never counted.

Only the instance's own paths are removed, only when they are what kvcached leaves there (a
regular file of ``RECORD_SIZE`` bytes; a real directory holding only sockets, nested no
deeper than kvcached's ``pp<N>/``: a name alone proves nothing), and only when nothing uses
them. Any other kvcached record in ``/dev/shm`` (a name kvcached's sanitiser could produce)
is reported as possibly stale and left alone. Limits: a
process in another PID namespace that shares ``/dev/shm`` (``--ipc=host``) is invisible
here, so such deployments should run the cleanup where the engines run; and ``<ipc>_g<N>``
is taken as group ``N`` of ``<ipc>`` unless a visible process uses an instance named
``<ipc>_g<N>`` (``check_ipc_name`` warns about such names). Processes of other users cannot
be inspected without privileges, but neither can their files in the sticky ``/dev/shm``
be removed by us: such a record is kept as "could not be removed".

The extension manager calls :func:`on_shutdown` through the ``vllm_hust_ext.bundle_shutdown``
entry point once the launch has ended (after it cleaned up the process group; whatever
survives it still counts as a user here); ``kvcached-provider cleanup --ipc NAME`` does the
same by hand.
"""

from __future__ import annotations

import os
import re
import stat
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvcached_provider.checks import (
    GROUP_SUFFIX,
    IPC_NAME_PATTERN,
    SettingError,
    planned_environment,
    shm_dir,
)
from kvcached_provider.limit import (
    RECORD_SIZE,
    LimitError,
    is_instance_record,
    read_control_record,
)

__all__ = [
    "RECORD_SIZE",
    "CleanupError",
    "CleanupReport",
    "cleanup",
    "on_shutdown",
    "record_users",
    "tp_socket_dir",
]

# kvcached's own name when KVCACHED_IPC_NAME is unset: kvcached_<engine>_<pgid>[_<i>].
_DEFAULT_NAME = re.compile(r"kvcached_[A-Za-z]+_([0-9]+)(?:_[0-9]+)?")
_PROC = Path("/proc")


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
    if GROUP_SUFFIX.search(record_name):
        names.add(GROUP_SUFFIX.sub("", record_name))
    return names


def _sanitized(name: str) -> str:
    """The name kvcached uses for an explicit ``KVCACHED_IPC_NAME`` (its ``utils``)."""
    return "".join(ch if ch.isalnum() or ch in "_-" else "-" for ch in name)[:64]


@dataclass(frozen=True, slots=True)
class _Process:
    """What tells whether one live process uses a kvcached instance."""

    pid: int
    pgid: int
    ipc_name: str | None  # its KVCACHED_IPC_NAME as kvcached would use it, if set
    paths: frozenset[str]  # files it has open or mapped


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """Every other live process, and the paths of the Unix sockets someone is bound to."""

    processes: tuple[_Process, ...]
    bound_sockets: frozenset[str]

    def users(self, record_name: str, path: Path) -> list[int]:
        """Pids using the instance(s) ``record_name`` can belong to, or ``path`` itself."""
        names = _instance_of(record_name)
        # Without an explicit name kvcached uses kvcached_<engine>_<pgid>[_<i>]: then every
        # process of that group, whatever its environment, counts.
        groups = {int(m.group(1)) for n in names if (m := _DEFAULT_NAME.fullmatch(n))}
        spellings = _spellings(path)
        return sorted(p.pid for p in self.processes if p.ipc_name in names or p.pgid in groups
                      or any(_under(f, spellings) for f in p.paths))


def _spellings(path: Path) -> frozenset[str]:
    """``path`` as given and with its directory resolved: ``/proc`` shows open and mapped
    files by their resolved absolute path, bound sockets by the path given to ``bind``, so
    a relative or symlinked directory (``/dev/shm`` -> ``/run/shm``) must match either."""
    return frozenset({str(path), os.path.join(os.path.realpath(path.parent), path.name)})


def _under(found: str, spellings: frozenset[str]) -> bool:
    """Whether ``found`` is one of ``spellings`` or lies below one of them."""
    return any(found == s or found.startswith(s + "/") for s in spellings)


def _stat_field(entry: Path, index: int) -> int:
    """Field ``index`` after the command name of ``<entry>/stat`` (1: ppid, 2: pgid); -1
    if unreadable. The name may hold spaces or ')': the fields start after the last ')'."""
    try:
        stat_line = (entry / "stat").read_text(encoding="utf-8")
        return int(stat_line[stat_line.rfind(")") + 2 :].split()[index])
    except (OSError, ValueError, IndexError):
        return -1


def _ancestors() -> set[int]:
    """This process and its ancestors (init included): they launched or asked for the cleanup."""
    pids, pid = set(), os.getpid()
    while pid > 0 and pid not in pids:
        pids.add(pid)
        pid = _stat_field(_PROC / str(pid), 1)
    return pids


def _ipc_name(entry: Path) -> str | None:
    """``KVCACHED_IPC_NAME`` from a process's environment, whatever else it sets.

    ``ENABLE_KVCACHED`` is not required: releases differ in how kvcached is switched on,
    and a process that names the instance is counted rather than risk a live segment.
    """
    try:
        raw = (entry / "environ").read_bytes()
    except OSError:
        return None
    for item in raw.split(b"\0"):
        key, _, value = item.partition(b"=")
        if key == b"KVCACHED_IPC_NAME" and value:
            # Decoded as the engine's os.environ decodes it (surrogateescape), not with
            # "replace": that folds an invalid byte run into one character, so the name
            # would differ from kvcached's ("a\xe4\xb8" is "a--" there, not "a-").
            return _sanitized(os.fsdecode(value))
    return None


def _open_paths(entry: Path) -> frozenset[str]:
    """Paths a process has open (fds) or mapped.

    A file removed while held reads as ``<path> (deleted)`` in both places; it counts as
    ``<path>``, so a process still holding an earlier record of an instance keeps that
    instance's current record (when in doubt the cleanup keeps, and names the pid).
    """
    found: set[str] = set()
    try:
        fds = list((entry / "fd").iterdir())
    except OSError:
        fds = []
    for fd in fds:
        try:
            found.add(os.readlink(fd).removesuffix(" (deleted)"))
        except OSError:
            continue
    try:
        maps = (entry / "maps").read_text(encoding="utf-8", errors="replace")
    except OSError:
        maps = ""
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6:
            found.add(parts[5].removesuffix(" (deleted)"))
    return frozenset(found)


def _bound_sockets() -> frozenset[str]:
    """Paths of the Unix sockets some live process is bound to (``/proc/net/unix``).

    A socket fd reads as ``socket:[inode]``, so a listening TP worker is seen only here.
    """
    try:
        lines = (_PROC / "net" / "unix").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    return frozenset(parts[7] for line in lines.splitlines()[1:]
                     if len(parts := line.split(maxsplit=7)) == 8)


def _snapshot() -> _Snapshot:
    """Read ``/proc`` once; raises :class:`CleanupError` when it cannot be listed."""
    try:
        entries = [e for e in _PROC.iterdir() if e.name.isdigit()]
    except OSError as exc:  # without /proc nothing proves a segment unused: remove nothing
        raise CleanupError(f"cannot list processes in {_PROC} ({exc.strerror or exc}), so "
                           "no segment can be shown unused; nothing removed") from exc
    skip = _ancestors()
    processes = tuple(
        _Process(int(e.name), _stat_field(e, 2), _ipc_name(e), _open_paths(e))
        for e in entries if int(e.name) not in skip
    )
    return _Snapshot(processes, _bound_sockets())


def record_users(path: Path) -> list[int]:
    """Pids of the live processes (other than this one and its ancestors) that use the
    instance whose control record is ``path``; raises :class:`CleanupError` when ``/proc``
    cannot be listed."""
    return _snapshot().users(path.name, path)


def _is_kvcached_name(name: str) -> bool:
    """Whether kvcached could have named a record ``name``: its sanitiser keeps only
    alphanumerics, ``_`` and ``-`` (a ``_g<N>`` suffix included). Other names (undecodable
    bytes, newlines, spaces) are not kvcached's, and would garble or forge report lines."""
    return bool(name) and all(ch.isalnum() or ch in "_-" for ch in name)


def _is_record(path: Path) -> bool:
    """A file kvctl would list: a regular file of ``RECORD_SIZE`` bytes, ``total_size`` > 0.

    Read without kvcached's shared ``flock``: this only decides what to report, and any
    unrelated process holding an exclusive lock on a file in ``/dev/shm`` would otherwise
    hang the cleanup (and the manager's shutdown hook) for as long as it holds it. The
    ``lstat`` first passes over links and files of another size without opening them.
    """
    try:
        info = path.lstat()
    except OSError:
        return False
    if not stat.S_ISREG(info.st_mode) or info.st_size != RECORD_SIZE:
        return False
    try:
        record = read_control_record(path.name, path.parent, lock=False)
    except LimitError:  # gone meanwhile, unreadable, or no longer a record
        return False
    return record is not None and record.total_size > 0


def _records(ipc: str, shm: Path) -> tuple[list[Path], list[Path]]:
    """The instance's control records, and every other kvcached record in ``shm``."""
    try:
        entries = sorted(shm.iterdir())
    except OSError as exc:
        raise CleanupError(f"cannot list {shm} ({exc.strerror or exc}); nothing removed"
                           ) from exc
    own: list[Path] = []
    other: list[Path] = []
    for path in entries:
        name = path.name
        if is_instance_record(ipc, name):
            own.append(path)
        elif _is_kvcached_name(name) and _is_record(path):
            other.append(path)
    return own, other


def _socket_dir_refusal(directory: Path) -> str | None:
    """Why ``directory`` is not just kvcached's sockets (``w*.sock``, ``pp<N>/w*.sock``).

    kvcached nests at most one level (``pp<N>/``); a deeper tree is refused as soon as it is
    seen, so that a deliberately deep one cannot exhaust the recursion of ``os.walk``.
    """
    for root, dirs, files in os.walk(directory):
        for name in files:
            path = Path(root) / name
            if not stat.S_ISSOCK(path.lstat().st_mode):
                return f"holds {path}, which is not a socket; remove it by hand if it is stale"
        for name in dirs:
            if (Path(root) / name).is_symlink():
                return f"holds the link {Path(root) / name}; remove it by hand if it is stale"
        if dirs and Path(root) != directory:
            return (f"holds the directory {Path(root) / dirs[0]}, nested deeper than "
                    "kvcached's pp<N>/; remove it by hand if it is stale")
    return None


def _remove_tree(directory: Path) -> None:
    """Remove the checked socket directory without ever following a link.

    ``os.walk`` follows ``directory`` itself when it is a link: one swapped in after the
    checks (``/tmp`` is shared, the name predictable) had the files of its target removed.
    ``os.fwalk`` with ``follow_symlinks=False`` compares what it opened with an ``lstat``
    and removes each entry relative to its directory's descriptor; a swapped-in link is
    left, and the final ``rmdir`` of it fails ("Not a directory").
    """
    for _root, dirs, files, root_fd in os.fwalk(directory, topdown=False,
                                                follow_symlinks=False):
        for name in files:
            os.unlink(name, dir_fd=root_fd)
        for name in dirs:
            os.rmdir(name, dir_fd=root_fd)
    os.rmdir(directory)


def _in_use(users: list[int]) -> str:
    return f"in use by pid {', '.join(map(str, users))}"


def _not_kvcacheds(path: Path, socket_dir: bool) -> str | None:
    """Why ``path`` is not what kvcached leaves there, so not ours to remove; None if it is.

    A name alone proves nothing (kvcached-notes.md §7: unknown segments are never deleted
    blindly): a record must be a regular file of ``RECORD_SIZE`` bytes, the socket
    directory a real directory holding only sockets.
    """
    hint = "; remove it by hand if it is stale"
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        return f"a symbolic link, not kvcached's{hint}"
    if socket_dir:
        if not stat.S_ISDIR(info.st_mode):
            return f"not a directory, so not kvcached's socket directory{hint}"
        return _socket_dir_refusal(path)
    if not stat.S_ISREG(info.st_mode):
        return f"not a kvcached control record (not a regular file){hint}"
    if info.st_size != RECORD_SIZE:
        return (f"not a kvcached control record ({info.st_size} bytes, not {RECORD_SIZE})"
                f"{hint}")
    return None


def _remove(
    path: Path, owner: str, live: _Snapshot, dry_run: bool, socket_dir: bool
) -> str | None:
    """Remove one of instance ``owner``'s paths; why it stays, or None once it is gone."""
    users = live.users(owner, path)
    if users:
        return _in_use(users)
    refusal = _not_kvcacheds(path, socket_dir)
    if refusal is not None:
        return refusal
    if socket_dir:
        inside = tuple(f"{spelling}/" for spelling in _spellings(path))
        bound = sorted(s for s in live.bound_sockets if s.startswith(inside))
        if bound:
            return f"a live process is bound to {bound[0]}"
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

    Each path stays while a live process uses it (see the module docstring); records of
    other instances are only reported.
    """
    if not IPC_NAME_PATTERN.fullmatch(ipc):
        raise CleanupError(f"KVCACHED_IPC_NAME {ipc!r} is invalid: expected 1-64 characters "
                         "from [A-Za-z0-9_-]")
    shm_path = shm if shm is not None else shm_dir()
    own, other = _records(ipc, shm_path)
    sockets = tp_socket_dir(ipc, tmp)
    if sockets.exists() or sockets.is_symlink():
        own.append(sockets)
    live = _snapshot()
    removed: list[str] = []
    kept: list[tuple[str, str]] = []
    for path in own:
        # A record is named after its instance (and group); the socket directory is not.
        socket_dir = path == sockets
        try:
            why = _remove(path, ipc if socket_dir else path.name, live, dry_run, socket_dir)
        except FileNotFoundError:
            # Gone meanwhile: another cleanup of the instance (the manager's shutdown hook
            # and an operator's) removed it first. Nothing of it is left to keep.
            why = None
        except OSError as exc:
            why = f"could not be removed ({exc.strerror or exc})"
        if why is None:
            removed.append(str(path))
        else:
            kept.append((str(path), why))
    foreign = []
    for path in other:
        users = live.users(path.name, path)
        note = (f"another instance's record, {_in_use(users)}" if users else
                "possibly stale record of another instance; if no engine uses it remove it "
                f"with `kvctl delete {path.name}`")
        foreign.append((str(path), note))
    return CleanupReport(ipc, tuple(removed), tuple(kept), tuple(foreign), dry_run)


def on_shutdown(manifest: Mapping[str, object], configuration: Mapping[str, object]) -> list[str]:
    """``vllm_hust_ext.bundle_shutdown`` hook: clean up the instance that just stopped."""
    ipc = planned_environment(manifest, configuration).get("KVCACHED_IPC_NAME")
    if ipc is None or not IPC_NAME_PATTERN.fullmatch(ipc):
        return [f"KVCACHED_IPC_NAME is {'not set' if ipc is None else f'invalid ({ipc!r})'}, "
                "so this instance's kvcached segments cannot be told from others': nothing "
                "removed"]
    try:
        return cleanup(ipc).lines()
    except (CleanupError, SettingError) as exc:
        return [str(exc)]
