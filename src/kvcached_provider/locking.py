"""Waiting for an ``flock`` (exclusive or shared) with a deadline, shared by the provider's lock
users."""

from __future__ import annotations

import fcntl
import time

__all__ = ["lock_exclusive_within", "lock_within"]


def lock_within(fd: int, timeout_s: float, poll_s: float, *, shared: bool = False) -> bool:
    """Lock ``fd`` (exclusively, or ``shared``), trying every ``poll_s`` seconds; False
    after ``timeout_s``.

    Polls rather than blocks so that a holder that never lets go (a stopped process) costs
    the caller a bounded wait. Other ``OSError``\\s from ``flock`` propagate.
    """
    operation = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, operation)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)


def lock_exclusive_within(fd: int, timeout_s: float, poll_s: float) -> bool:
    """:func:`lock_within`, exclusive."""
    return lock_within(fd, timeout_s, poll_s)
