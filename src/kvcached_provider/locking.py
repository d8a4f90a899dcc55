"""Waiting for an exclusive ``flock`` with a deadline, shared by the provider's lock users."""

from __future__ import annotations

import fcntl
import time

__all__ = ["lock_exclusive_within"]


def lock_exclusive_within(fd: int, timeout_s: float, poll_s: float) -> bool:
    """Lock ``fd`` exclusively, trying every ``poll_s`` seconds; False after ``timeout_s``.

    Polls rather than blocks so that a holder that never lets go (a stopped process) costs
    the caller a bounded wait. Other ``OSError``\\s from ``flock`` propagate.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
