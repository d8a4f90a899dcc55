"""An engine's claim on its ``KVCACHED_IPC_NAME``, held from plugin load until it exits.

kvcached creates an instance's control record in ``/dev/shm`` only when the engine
allocates its KV cache, after the model has loaded (minutes, for a large model). Until then
nothing there shows that the name is taken, so a second ``run`` under the same name passed
the launch check and later shared the first engine's record and limits.

The bundle's plugin is loaded by vLLM in each engine process long before the model
(:func:`kvcached_provider.activation.register`), and takes a *shared* ``flock`` on
``<state dir>/claims/<name>``, which it keeps until the process exits; the kernel drops it
then, SIGKILL included, so a claim never outlives its engine. The launch check asks for the
same lock *exclusively* without waiting: refused means a live engine process, or a launch
of one, holds the name. A file lock tells an engine apart from a process that merely
exports the variable (a shell with it in its profile), which the process environment
cannot.

The launch check also claims the name for the launching process when it finds it free
(:func:`claim_for_launch`): ``vllm-hust-ext run`` supervises its engine and outlives it, so
the name is held from the check on, before vLLM has loaded anything, and a second launch
in the engine's first seconds is refused too. Launchers take turns on ``<claim>.launch``
for the instant of test-and-claim: ``flock`` cannot turn an exclusive lock into a shared
one atomically, so two launchers testing at once could otherwise both pass.

The claim lives in the per-user state directory of ``kvcached-provider limit``
(``KVCACHED_PROVIDER_STATE_DIR``), so it covers the engines of the user who launches. An
engine started without ``run`` claims the name only when vLLM loads its plugins.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from kvcached_provider.locking import lock_exclusive_within

__all__ = ["ClaimError", "claim_for_launch", "claim_path", "hold", "holders"]

_PROC = Path("/proc")
# O_NONBLOCK: opening a FIFO planted at the claim's path must not hang the engine or the
# launch check (no effect on a regular file, nor on flock, which LOCK_NB alone governs).
_OPEN = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK

# claim file -> descriptor holding the shared lock; never closed: the lock must last as
# long as the process. A forked child shares the parent's open file, and so its lock.
_held: dict[Path, int] = {}

# Another launcher holds the turn lock only while it tests and claims (microseconds); one
# stopped in between (SIGSTOP) must not hang this launch for ever.
_TURN_WAIT_SECONDS = 5.0
_TURN_POLL_SECONDS = 0.01


class ClaimError(Exception):
    """The claim file cannot be used; the message names it and why."""


def claim_path(ipc: str, directory: Path | None = None) -> Path:
    """Where the engines of instance ``ipc`` hold their claim."""
    if directory is None:
        from kvcached_provider.limit import LimitError, state_dir

        try:
            directory = state_dir()
        except LimitError as exc:
            raise ClaimError(str(exc)) from exc
    return directory / "claims" / ipc


def hold(ipc: str, directory: Path | None = None) -> Path:
    """Claim ``ipc`` for this process until it exits (idempotent); returns the claim file."""
    path = claim_path(ipc, directory)
    if path in _held:
        return path
    fd = _open_creating(path)
    try:
        # Blocking: a launch check holds the lock exclusively only for the instant it tests.
        _lock_shared(fd, path)
    except BaseException:  # an interrupted wait too: no descriptor outlives a failed claim
        os.close(fd)
        raise
    _held[path] = fd
    return path


def claim_for_launch(ipc: str, directory: Path | None = None) -> list[int] | None:
    """Claim ``ipc`` for this process (until it exits) unless another process holds it.

    Returns ``None`` when this process holds the claim now (also when it already did), else
    the live processes holding it, as :func:`holders` names them.
    """
    path = claim_path(ipc, directory)
    if path in _held:
        return None
    turn = _open_creating(path.with_name(path.name + ".launch"))
    try:
        _take_turn(turn, path)
        fd = _open_creating(path)
        try:
            others = _held_by_others(fd, path)
            if others is None:
                # No other holder: keep the claim, shared, so this launch's own engine can
                # join it.
                _lock_shared(fd, path)
        except BaseException:
            os.close(fd)
            raise
        if others is not None:
            os.close(fd)
            return others
        _held[path] = fd
        return None
    finally:
        os.close(turn)  # ends this launcher's turn


def _lock_shared(fd: int, path: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError as exc:
        raise ClaimError(f"cannot lock the claim {path}: {exc.strerror or exc}") from exc


def _open_creating(path: Path) -> int:
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        return os.open(path, _OPEN | os.O_CREAT, 0o600)
    except OSError as exc:
        raise ClaimError(f"cannot create the claim {path}: {exc.strerror or exc}") from exc


def _take_turn(turn: int, path: Path) -> None:
    try:
        taken = lock_exclusive_within(turn, _TURN_WAIT_SECONDS, _TURN_POLL_SECONDS)
    except OSError as exc:
        raise ClaimError(f"cannot test the claim {path}: {exc.strerror or exc}") from exc
    if not taken:
        raise ClaimError(
            f"cannot test the claim {path}: another launch has held its turn "
            f"({path.name}.launch) for over {_TURN_WAIT_SECONDS:g} s")


def holders(ipc: str, directory: Path | None = None) -> list[int] | None:
    """Live processes holding ``ipc``'s claim, or ``None`` when no process holds it.

    The lock decides; the pids, read from ``/proc``, only name them and may be an empty
    list (``/proc`` hidden, or processes of another user).
    """
    path = claim_path(ipc, directory)
    try:
        fd = os.open(path, _OPEN)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ClaimError(f"cannot read the claim {path}: {exc.strerror or exc}") from exc
    try:
        return _held_by_others(fd, path)
    finally:
        os.close(fd)  # also releases the exclusive lock, if taken


def _held_by_others(fd: int, path: Path) -> list[int] | None:
    """Ask for the claim on ``fd`` exclusively without waiting: ``None`` when granted (the
    caller then holds it exclusively), else the pids holding it, as :func:`holders`."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return _openers(path)
    except OSError as exc:
        raise ClaimError(f"cannot test the claim {path}: {exc.strerror or exc}") from exc
    return None


def _openers(path: Path) -> list[int]:
    """Pids of the other processes with ``path`` open (their descriptors link to it)."""
    target = os.path.realpath(path)
    own = os.getpid()
    found: list[int] = []
    with contextlib.suppress(OSError):
        for entry in _PROC.iterdir():
            if not entry.name.isdigit() or int(entry.name) == own:
                continue
            if _has_open(entry, target):
                found.append(int(entry.name))
    return sorted(found)


def _has_open(entry: Path, target: str) -> bool:
    try:
        fds = list((entry / "fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(fd) == target:
                return True
    return False
