"""Looking at and reading the paths a user names (options, profiles, the release tree).

Python 3.11's ``Path.exists()``, ``is_file()`` and ``is_dir()`` raise OSError for a name
longer than the file system allows (ENAMETOOLONG) or a directory without search
permission (EACCES), and answer False for a symbolic-link loop (ELOOP) as though nothing
were there; a plain ``open`` of a FIFO blocks until a writer comes (a shell's unnamed pipe
has one from the start). These helpers turn each case into an answer or a one-line
refusal naming the path.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Literal

from qualification.errors import QualificationError

__all__ = ["PathKind", "path_kind", "read_regular"]

PathKind = Literal["missing", "file", "directory", "other"]


def path_kind(path: Path, what: str, expected: str) -> PathKind:
    """What is at ``path``, links followed: a regular file, a directory, something else
    (a FIFO, a socket, a device) or nothing (no such entry, or a parent that is a file).

    A path that cannot be examined is refused: QualificationError
    ``"<what>: cannot be examined (<reason>); expected <expected>"``.
    """
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise QualificationError(
            f"{what}: cannot be examined ({reason}); expected {expected}"
        ) from None
    if stat.S_ISREG(mode):
        return "file"
    return "directory" if stat.S_ISDIR(mode) else "other"


def read_regular(path: Path, *, unnamed_pipe: bool = False) -> bytes:
    """The bytes of the regular file at ``path``.

    Opened non-blocking and checked on the descriptor, so a FIFO (or a device) at the path
    is refused at once rather than blocking the reader forever or never ending; that is an
    OSError (EINVAL, "not a regular file") for the caller to name, like any unreadable file.
    With ``unnamed_pipe`` a shell's pipe (``/dev/stdin`` in a pipeline, ``<(...)``) is read
    to its end: its writer exists from the moment it is made, unlike a named FIFO's.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if unnamed_pipe and stat.S_ISFIFO(mode) and _is_unnamed_pipe(fd):
            os.set_blocking(fd, True)
        elif not stat.S_ISREG(mode):
            # Before fdopen(): it raises on a directory without closing a descriptor it
            # was given.
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        stream = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with stream:
        return stream.read()


def _is_unnamed_pipe(fd: int) -> bool:
    """Whether the FIFO open at ``fd`` has no name (Linux shows ``pipe:[inode]``); where
    /proc cannot say, it counts as named."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
    except OSError:
        return False
