"""``kvcached-provider limit``: each answer reaches only its own request, and one waiting
command holds up no other beyond its ``--timeout``.

kvcached cannot be installed here, so kvcached alone is faked, at the module boundary
(``tests/fake_kvcached.py``: revision rules, status precedence, result keys from the
kvcached spec). Everything else is real: the state directory and mailbox are real files,
the command runs as a real subprocess, the engine-side responder is a real thread of this
process (which holds the fake pool, as the EngineCore would), and commands are stopped with
real signals. Guarded:

- an answer left in the mailbox by an earlier exchange of the same revision (a command
  that gave up while the engine was still applying, then a lost state file restarting the
  counter) is never taken as the answer to a new request: the new request gets kvcached's
  own verdict (``conflict`` for the reused revision with another limit), and no request of
  the command is left behind to apply later;
- a command waiting for an unresponsive engine does not block a limit for another instance;
- a second command for the same instance waits for the first at most its own ``--timeout``,
  then reports ``unavailable`` / ``limit_in_progress`` (exit 1) without sending anything.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvcached_provider.limit import LimitResponder, LimitResult, set_limit
from tests.fake_kvcached import (
    FakeKVCacheManager,
    virtual_total,
)
from tests.test_kvcached_limit import BUNDLE, IPC, dirs, kv, pool

__all__ = ["dirs", "kv", "pool"]  # fixtures, used by name


def _default_sigint() -> None:
    # A background shell starts children with SIGINT ignored; the command must meet it at
    # its default, as in a terminal.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cli(*argv: str) -> subprocess.Popen[str]:
    """The command in a child process that holds no pools (so it goes through the mailbox)."""
    env = {k: v for k, v in os.environ.items() if k != "KVCACHED_IPC_NAME"}
    return subprocess.Popen([sys.executable, "-m", "kvcached_provider", "limit", *argv],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)


def _finish(proc: subprocess.Popen[str], seconds: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"kvcached-provider limit still running after {seconds} s")
    return proc.returncode, out, err


def _wait_for_file(path: Path, proc: subprocess.Popen[str], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _stop(proc: subprocess.Popen[str]) -> None:
    """Ctrl-C: the command withdraws its request and exits 130."""
    proc.send_signal(signal.SIGINT)
    code, _, err = _finish(proc, 30)
    assert code == 130, err


def test_an_earlier_exchanges_answer_is_not_taken_for_a_new_request(
    pool: FakeKVCacheManager, dirs: tuple[Path, Path]
) -> None:
    box = dirs[0] / "mailbox" / IPC
    responder = LimitResponder(IPC, poll_s=0.02)
    responder.poll_once()  # gives the pool its real lock
    # 1. The scheduler holds the pool while the engine claims revision 1 (16M): the command
    #    gives up ("claimed without answer"), and the answer lands after it left.
    pool._lock.acquire()
    responder.start()
    try:
        code, out, err = _finish(_cli("--ipc", IPC, "--timeout", "0.5", "--json", "16M"), 60)
        assert code == 1, err
        assert json.loads(out)["reason"] == "engine_claimed_request_without_answer"
    finally:
        pool._lock.release()
    try:
        deadline = time.monotonic() + 10
        while not (box / "ans-1.json").exists():
            assert time.monotonic() < deadline, "the engine never answered revision 1"
            time.sleep(0.02)
        assert pool.capacity_pages == 2  # 16M is in force
        # 2. The state file is lost, so the counter restarts and revision 1 is reused with
        #    another limit: kvcached answers conflict. The answer to the earlier exchange
        #    must not be read as this one's ("applied 16M", exit 0).
        (dirs[0] / "instances.json").unlink()
        code, out, err = _finish(_cli("--ipc", IPC, "--timeout", "10", "--json", "24M"), 60)
    finally:
        responder.stop()
    result = json.loads(out)
    assert (code, result["status"], result["revision"]) == (1, "conflict", 1), (out, err)
    assert result["limit_bytes"] == 24 << 20
    assert result["reason"] == "revision_reused_with_different_limit"
    assert pool.capacity_pages == 2
    assert not list(box.glob("req-*")), "the command left its request behind to apply later"


def test_a_waiting_command_does_not_block_another_instance(
    pool: FakeKVCacheManager, dirs: tuple[Path, Path]
) -> None:
    """A command waiting for an engine that does not answer (instance ``dead``) used to
    hold the state lock for its whole wait, so a limit for any other instance stalled
    behind it for up to twice the other command's timeout."""
    waiting = _cli("--ipc", "dead", "--timeout", "6", "--json", "1G")
    try:
        _wait_for_file(dirs[0] / "mailbox" / "dead" / "req-1.json", waiting)
        results: list[LimitResult] = []
        worker = threading.Thread(target=lambda: results.append(set_limit(IPC, 2 * BUNDLE)),
                                  daemon=True)
        worker.start()
        worker.join(timeout=3)
        assert not worker.is_alive(), "a limit for inst1 waited for the command on 'dead'"
        assert results[0].status == "applied" and results[0].revision == 1
        assert pool.capacity_pages == 2
    except BaseException:
        waiting.kill()
        waiting.communicate()
        raise
    code, out, err = _finish(waiting, 60)
    assert code == 1 and json.loads(out)["reason"] == "no_engine_responder", err
    # Each command recorded its own outcome without undoing the other's.
    state = json.loads((dirs[0] / "instances.json").read_text())["instances"]
    assert (state["dead"]["revision"], state["dead"]["status"]) == (1, "unavailable")
    assert (state[IPC]["revision"], state[IPC]["status"]) == (1, "applied")
    assert state[IPC]["records"][IPC]["total_size"] == virtual_total(pool)


def test_a_second_command_for_the_instance_waits_at_most_its_timeout(
    dirs: tuple[Path, Path]
) -> None:
    """Requests of one instance are still sent one at a time, in revision order, but a
    command that finds another one waiting gives up after its own ``--timeout``."""
    box = dirs[0] / "mailbox" / IPC
    first = _cli("--ipc", IPC, "--timeout", "30", "1G")
    try:
        _wait_for_file(box / "req-1.json", first)
        code, out, err = _finish(_cli("--ipc", IPC, "--timeout", "0.5", "--json", "2G"), 15)
        assert code == 1, err
        result = json.loads(out)
        assert (result["status"], result["reason"]) == ("unavailable", "limit_in_progress")
        assert "nothing was sent" in result["detail"]
        assert sorted(p.name for p in box.iterdir()) == ["req-1.json"]  # nothing sent
    finally:
        _stop(first)
    assert json.loads((dirs[0] / "instances.json").read_text())["instances"][IPC]["revision"] == 1
