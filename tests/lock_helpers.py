"""Asking whether someone holds a file's ``flock``, from inside the test process."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


def lock_is_held(path: Path) -> bool:
    """Whether an exclusive ``flock`` on ``path`` would have to wait right now.

    ``flock`` locks belong to open file descriptions, so this fresh descriptor conflicts
    with a lock held elsewhere in the same process too. Creates ``path`` if missing.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock this probe took
