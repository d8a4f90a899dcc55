"""Opening the files a user's settings name without ever waiting on them.

The state file and the evidence log live at paths a user can set, so they may name a
FIFO, a device or a directory. A plain ``open()`` of a FIFO blocks until the other end
opens, which would hang a ``vllm-hust-ext`` command (or an engine writing evidence)
forever. These helpers open with ``O_NONBLOCK`` and check the opened descriptor, so such a
path fails at once with an ``OSError`` naming it. A file read once may also be a shell's
unnamed pipe (``--file <(...)``), whose writer is there from the start.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

__all__ = ["NotARegularFileError", "append_line", "open_regular", "read_named_file"]


class NotARegularFileError(OSError):
    """The path exists but is a FIFO, device, socket or directory."""

    def __init__(self, path: Path) -> None:
        super().__init__(errno.EINVAL, "not a regular file", str(path))


def open_regular(path: Path, *, unnamed_pipe: bool = False) -> BinaryIO:
    """``path`` opened for binary reading; :class:`NotARegularFileError` if it is not a
    regular file (checked on the descriptor, so a swap after a check cannot slip by).

    With ``unnamed_pipe`` an unnamed pipe is read too (a shell pipeline's ``/dev/stdin``,
    a process substitution's ``/dev/fd/N``): its writer exists from the moment it is made,
    so the read ends when the writer does. A named FIFO's writer may never come.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if unnamed_pipe and stat.S_ISFIFO(mode) and _is_unnamed_pipe(fd):
            os.set_blocking(fd, True)  # wait for the writer's data, to its end
        elif not stat.S_ISREG(mode):
            raise NotARegularFileError(path)
        # O_NONBLOCK changes nothing for a regular file's reads.
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _is_unnamed_pipe(fd: int) -> bool:
    """Whether the FIFO open at ``fd`` is a pipe without a name (Linux names it
    ``pipe:[inode]``); where /proc cannot say, it counts as named."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
    except OSError:
        return False


def read_named_file(path: Path, what: str, expected: str, *,
                    unnamed_pipe: bool = False) -> bytes:
    """The bytes of a file a user names on the command line (``what``, e.g. ``--config
    F``); ValueError ``"<what> is not a regular file: expected <expected>"`` for a FIFO,
    device or directory, or ``"<what> cannot be read (<reason>): expected <expected>"``.
    ``unnamed_pipe``: also read a shell's pipe (see :func:`open_regular`)."""
    try:
        with open_regular(path, unnamed_pipe=unnamed_pipe) as stream:
            return stream.read()
    except NotARegularFileError:
        kind = "a regular file or an unnamed pipe" if unnamed_pipe else "a regular file"
        raise ValueError(f"{what} is not {kind}: expected {expected}") from None
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ValueError(f"{what} cannot be read ({reason}): expected {expected}") from None


def append_line(path: Path, data: bytes) -> None:
    """Append ``data`` with one ``write()`` on an ``O_APPEND`` descriptor, so lines from
    concurrent writers never interleave; created 0600. A FIFO with no reader fails at once
    (ENXIO) instead of blocking."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC,
                 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
