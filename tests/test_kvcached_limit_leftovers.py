"""``kvcached-provider limit``: what a crashed command leaves, exact sizes, and kvctl raises.

kvcached cannot be installed here, so kvcached alone is faked, at the module boundary
(``tests/fake_kvcached.py``); the state directory, mailbox and control records are real
files, the command runs as a real subprocess and is killed with a real SIGKILL. Guarded:

- a request whose command died before it could withdraw it (SIGKILL, a reboot: the mailbox
  persists) is never applied by an engine that finds it after the command's ``--timeout``:
  it is answered ``unavailable`` / ``request_expired``, and the pool keeps its capacity;
  a request found in time is still applied;
- a size given in bytes is the limit applied, to the byte, up to the largest ``total_size``
  a control record holds, which the error message names as allowed;
- a ``kvctl limit`` that raised ``total_size`` after our limit is refused like one that
  lowered it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcached_provider.limit import LimitError, LimitResponder, parse_size, set_limit
from tests.fake_kvcached import (
    FakeKvcached,
    FakeKVCacheManager,
    install,
    virtual_total,
    write_record,
)
from tests.test_kvcached_limit import BUNDLE, IPC, dirs

INT64_MAX = (1 << 63) - 1

__all__ = ["dirs"]  # a fixture, used by name


def _pool(monkeypatch: pytest.MonkeyPatch, shm: Path) -> FakeKVCacheManager:
    """The engine's (fake) pool of 4 pages and the control record kvcached writes."""
    kv: FakeKvcached = install(monkeypatch)
    manager = kv.register(FakeKVCacheManager(num_blocks=64))
    write_record(shm, IPC, virtual_total(manager))
    return manager


def _serve(responder: LimitResponder) -> int:
    """Two polls: the first gives the pool its real lock, the second answers."""
    responder.poll_once()
    return responder.poll_once()


def test_a_killed_commands_request_is_not_applied_after_its_timeout(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command SIGKILLed while waiting for an engine that is down leaves its request in
    the mailbox; the engine that starts after the command's --timeout ran out must not
    apply it (nobody saw it accepted): it answers unavailable / request_expired and the
    pool keeps its 4 pages."""
    box = dirs[0] / "mailbox" / IPC
    env = {k: v for k, v in os.environ.items() if k != "KVCACHED_IPC_NAME"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcached_provider", "limit", "--ipc", IPC, "--timeout", "0.5",
         str(2 * BUNDLE)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (box / "req-1.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no request was sent"
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (box / "req-1.json").exists()  # the crash left it behind
    time.sleep(0.7)  # past the command's 0.5 s timeout
    pool = _pool(monkeypatch, dirs[1])
    assert _serve(LimitResponder(IPC)) == 1
    answer = json.loads((box / "ans-1.json").read_text())
    assert (answer["status"], answer["reason"]) == ("unavailable", "request_expired")
    assert "nothing was applied" in answer["detail"]
    assert pool.capacity_pages == 4
    assert not list(box.glob("req-*")) and not list(box.glob("claimed-*"))


def test_a_request_found_before_its_timeout_is_applied(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The expiry refuses only late requests: one the engine finds while its command still
    waits is applied (2 of 4 pages)."""
    pool = _pool(monkeypatch, dirs[1])
    box = dirs[0] / "mailbox" / IPC
    box.mkdir(parents=True)
    (box / "req-1.json").write_text(json.dumps({
        "schema": "kvcached-provider.limit-request/1", "ipc_name": IPC,
        "limit_bytes": 2 * BUNDLE, "revision": 1, "check_startup": False,
        "request_id": "r1", "expires_at": time.time() + 60}))
    assert _serve(LimitResponder(IPC)) == 1
    answer = json.loads((box / "ans-1.json").read_text())
    assert (answer["status"], answer["request_id"]) == ("applied", "r1")
    assert pool.capacity_pages == 2


@pytest.mark.parametrize("text", ["9007199254740993", "9223372036854775000", str(INT64_MAX)])
def test_a_size_in_bytes_is_taken_to_the_byte(text: str) -> None:
    """Bytes are exact (no detour through a float, which rounds past 2**53), and the
    largest int64, which the refusal names as the maximum, is accepted."""
    assert parse_size(text) == int(text)


def test_sizes_with_units_and_fractions_stay_exact() -> None:
    """Units are binary multiples; a fraction is rounded down to whole bytes; one byte past
    the int64 maximum is refused with the one-line message naming the maximum."""
    assert parse_size("8G") == 8 << 30
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("0.3K") == 307  # 307.2 bytes
    assert parse_size("8388607.999999999999T") == 9223372036854775806
    with pytest.raises(LimitError, match=f"expected at most {INT64_MAX} bytes"):
        parse_size(str(INT64_MAX + 1))
    with pytest.raises(LimitError, match="expected at most"):
        parse_size("8388608T")


def test_a_kvctl_limit_that_raised_the_record_is_refused(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After our 2-page limit, `kvctl limit` raising total_size (not only lowering it) is
    a kvctl limit in force: the next limit is rejected / kvctl_limit_detected."""
    pool = _pool(monkeypatch, dirs[1])
    monkeypatch.setenv("KVCACHED_IPC_NAME", IPC)  # this process holds the pool
    assert set_limit(IPC, 2 * BUNDLE).status == "applied"
    marked = json.loads((dirs[0] / "instances.json").read_text())
    ours = marked["instances"][IPC]["records"][IPC]["total_size"]
    write_record(dirs[1], IPC, ours + BUNDLE)  # kvctl writes in place: same inode
    result = set_limit(IPC, 2 * BUNDLE)
    assert (result.status, result.reason) == ("rejected", "kvctl_limit_detected")
    assert pool.capacity_pages == 2
