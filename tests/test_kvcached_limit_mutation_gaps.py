"""``kvcached-provider limit``: what a deep mutation audit of ``limit.py`` found unguarded.

Each test failed under one deliberate mutation of ``src/kvcached_provider/limit.py`` that
every other test let pass (named in its docstring). kvcached is faked at the module boundary
(``tests/fake_kvcached.py``); the state directory, mailbox and control records are real
files. Guarded:

- a limit's answer keeps kvcached's ``remaining_bytes`` (effective - mapped) and ``overage_bytes``;
- a limit of 0 bytes is non-negative, so it is sent and applied;
- a ``kvctl limit`` that raised ``total_size`` before our first limit is refused like a lower one;
- after an engine restart (new segment) a ``kvctl limit`` before our first limit on it is refused;
- the start-up comparison checks every pool, not only the first;
- via the mailbox the start-up comparison runs when the command asks for it, and only then;
- a request of another schema is answered ``rejected`` / ``invalid_request`` and never applied;
- a ``kvcached.control`` whose import fails is answered ``unavailable``, not raised;
- a registry that raises is no pools: the responder claims nothing and raises nothing;
- an answer that is not UTF-8 is a one-line error, and the request is withdrawn;
- an answer bearing the request's id but no valid result is a one-line error naming it;
- the responder keeps serving after a poll that failed (an answer it could not write);
- the responder's thread never keeps its process from exiting;
- a responder is only made for a valid instance name (its mailbox path is built from it);
- a bad ``KVCACHED_PROVIDER_STATE_DIR`` is a ``LimitError`` from the library entry too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvcached_provider.cli import main
from kvcached_provider.limit import LimitError, LimitResponder, LimitResult, set_limit
from tests.fake_kvcached import FakeKvcached, FakeKVCacheManager, virtual_total, write_record
from tests.test_kvcached_limit import (
    BUNDLE,
    IPC,
    _limit_through_engine,
    _request,
    dirs,
    kv,
    pool,
)
from tests.test_kvcached_limit_leftovers import _serve

__all__ = ["dirs", "kv", "pool"]  # fixtures, used by name


def _answer(box: Path, revision: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((box / f"ans-{revision}.json").read_text())
    return data


def test_an_answer_keeps_remaining_and_overage_bytes(pool: FakeKVCacheManager) -> None:
    """Mutants: ``remaining_bytes``/``overage_bytes`` dropped from kvcached's answer. Notes
    §2.2: remaining = max(0, effective - mapped), overage = max(0, mapped - effective)."""
    assert pool.alloc(10) is not None  # 1 page mapped
    result = set_limit(IPC, 3 * BUNDLE)
    assert (result.status, result.effective_limit_bytes, result.mapped_bytes) == (
        "applied", 3 * BUNDLE, BUNDLE)
    assert (result.remaining_bytes, result.overage_bytes) == (2 * BUNDLE, 0)
    assert pool.alloc(30) is not None  # 3 pages mapped
    result = set_limit(IPC, BUNDLE)
    assert (result.status, result.mapped_bytes) == ("deferred", 3 * BUNDLE)
    assert (result.remaining_bytes, result.overage_bytes) == (0, 2 * BUNDLE)


def test_a_zero_limit_is_applied(pool: FakeKVCacheManager) -> None:
    """Mutant: ``limit_bytes <= 0`` refused 0, which is non-negative (the refusal says so,
    and kvcached takes any non-negative limit)."""
    result = set_limit(IPC, 0)
    assert (result.status, result.limit_bytes, result.revision) == ("applied", 0, 1)
    assert pool.capacity_pages == 0


def test_a_kvctl_limit_above_capacity_before_first_use_is_refused(
    pool: FakeKVCacheManager, dirs: tuple[Path, Path]
) -> None:
    """Mutant: the start-up comparison ``total_size < capacity`` missed a ``kvctl limit``
    that raised the record. limit.py: any difference means a kvctl limit is in force."""
    write_record(dirs[1], IPC, virtual_total(pool) + BUNDLE)
    result = set_limit(IPC, 2 * BUNDLE)
    assert (result.status, result.reason) == ("rejected", "kvctl_limit_detected")
    assert pool.capacity_pages == 4


def test_after_an_engine_restart_a_kvctl_limit_on_the_new_segment_is_refused(
    kv: FakeKvcached, pool: FakeKVCacheManager, dirs: tuple[Path, Path]
) -> None:
    """Mutant: a marker whose segment was recreated still counted as a marker, so the
    start-up comparison was skipped. limit.py: a new inode drops the old marker, and with
    no marker the pool's record is compared with its virtual capacity."""
    assert set_limit(IPC, 2 * BUNDLE).status == "applied"
    kv.registry.pools.clear()  # the engine restarts: a new pool and a new segment
    fresh = kv.register(FakeKVCacheManager(num_blocks=64))
    write_record(dirs[1], IPC, virtual_total(fresh), replace=True)
    write_record(dirs[1], IPC, BUNDLE)  # `kvctl limit inst1 8M` before our first limit
    result = set_limit(IPC, 3 * BUNDLE)
    assert (result.status, result.reason) == ("rejected", "kvctl_limit_detected")
    assert "not the pool's virtual capacity" in result.detail
    assert fresh.capacity_pages == 4


def test_the_startup_check_covers_every_pool(
    kv: FakeKvcached, dirs: tuple[Path, Path]
) -> None:
    """Mutant: returning after the first pool missed a kvctl limit on the segment of the
    second (a group owning ``<ipc>_g1``)."""
    first = kv.register(FakeKVCacheManager(num_blocks=64))
    second = kv.register(FakeKVCacheManager(num_blocks=64, group_id=1))
    second.ipc_name = f"{IPC}_g1"
    write_record(dirs[1], IPC, virtual_total(first))
    write_record(dirs[1], f"{IPC}_g1", virtual_total(second) // 2)
    result = set_limit(IPC, 4 * BUNDLE)
    assert (result.status, result.reason) == ("rejected", "kvctl_limit_detected")
    assert f"{dirs[1] / IPC}_g1 holds total_size" in result.detail
    assert first.capacity_pages == 4 and second.capacity_pages == 4


def test_the_engine_runs_the_startup_check_a_command_asks_for(
    pool: FakeKVCacheManager, dirs: tuple[Path, Path]
) -> None:
    """Mutants: the command sending ``check_startup: false``, or the engine ignoring it,
    applied a first limit over a kvctl limit in force when sent through the mailbox."""
    write_record(dirs[1], IPC, virtual_total(pool) // 2)  # kvctl limit before first use
    returncode, result, err = _limit_through_engine()
    assert (returncode, result["status"], result["via"]) == (1, "rejected", "engine"), err
    assert result["reason"] == "kvctl_limit_detected"
    assert pool.capacity_pages == 4


def test_the_engine_skips_the_startup_check_when_not_asked(
    pool: FakeKVCacheManager, dirs: tuple[Path, Path]
) -> None:
    """Mutant: the engine always ran the start-up comparison, refusing a limit the command
    sent without it (``--adopt``, or a marker for the segment)."""
    write_record(dirs[1], IPC, virtual_total(pool) // 2)  # an adopted total
    box = _request(dirs, 1, 2 * BUNDLE, check_startup=False)
    assert _serve(LimitResponder(IPC)) == 1
    assert _answer(box, 1)["status"] == "applied"
    assert pool.capacity_pages == 2


def test_a_request_of_another_schema_is_refused(
    pool: FakeKVCacheManager, dirs: tuple[Path, Path]
) -> None:
    """Mutant: the responder without its schema test applied a request of another
    schema (whose fields may mean something else) instead of refusing it."""
    box = _request(dirs, 1, 2 * BUNDLE, schema="kvcached-provider.limit-request/2")
    assert _serve(LimitResponder(IPC)) == 1
    answer = _answer(box, 1)
    assert (answer["status"], answer["reason"]) == ("rejected", "invalid_request")
    assert pool.capacity_pages == 4 and pool.memory_limit_state()["limit_bytes"] is None


def test_an_unimportable_kvcached_control_is_answered(
    pool: FakeKVCacheManager, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Mutants: catching only ``ImportError`` let kvcached's own import failure (a missing
    CUDA library raises ``OSError``) out as a traceback; answering it ``rejected``.
    Nothing can be applied: ``unavailable`` (exit 1) with kvcached's message."""
    package = tmp_path / "kvcached_pkg"
    package.mkdir()
    (package / "control.py").write_text(
        "raise OSError('libcuda.so.1: cannot open shared object file')\n")
    monkeypatch.delitem(sys.modules, "kvcached.control")
    monkeypatch.setattr(sys.modules["kvcached"], "__path__", [str(package)])
    code = main(["limit", "--ipc", IPC, "16M"])
    out, err = capsys.readouterr()
    assert (code, err) == (1, "")
    assert out.split()[0] == "unavailable" and "reason=kvcached_not_importable" in out
    assert "libcuda.so.1" in out
    assert pool.capacity_pages == 4


def test_a_registry_that_raises_holds_no_pools(
    kv: FakeKvcached, dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutant: ``_registered_managers`` without its ``except`` raised out of the responder's
    poll. A process whose registry cannot be read holds no pools it can limit: it claims
    no request."""
    def broken(*, integration: str | None = None) -> list[Any]:
        raise RuntimeError("registry unavailable")

    monkeypatch.setattr(sys.modules["kvcached.pool_registry"],
                        "get_registered_kv_cache_pools", broken)
    box = _request(dirs, 1, 2 * BUNDLE)
    assert _serve(LimitResponder(IPC)) == 0
    assert [p.name for p in box.iterdir()] == ["req-1.json"]


def test_an_answer_that_is_not_utf8_is_one_line_and_withdraws(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Mutant: catching only ``OSError`` let a ``UnicodeDecodeError`` traceback out and left
    the request in the mailbox to apply later."""
    monkeypatch.delenv("KVCACHED_IPC_NAME")  # no pools here: the request goes by mailbox
    box = dirs[0] / "mailbox" / IPC
    box.mkdir(parents=True)
    (box / "ans-1.json").write_bytes(b"\xff\xfe{}")
    code = main(["limit", "--ipc", IPC, "--timeout", "0.1", "1G"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert f"cannot read limit answer {box / 'ans-1.json'}: not UTF-8 text" in err
    assert "the request was withdrawn" in err
    assert not (box / "req-1.json").exists()


def test_an_answer_with_the_requests_id_but_no_result_is_named(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutant: without its ``ValidationError`` handler an answer bearing the request's id
    but an unknown status escaped as a pydantic traceback. This test plays the engine."""
    monkeypatch.delenv("KVCACHED_IPC_NAME")
    box = dirs[0] / "mailbox" / IPC
    errors: list[BaseException] = []

    def command() -> None:
        try:
            set_limit(IPC, 16 << 20, timeout_s=30)
        except BaseException as exc:  # the test reports whatever was raised
            errors.append(exc)

    worker = threading.Thread(target=command)
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while not (box / "req-1.json").exists():
            assert worker.is_alive() and time.monotonic() < deadline, "no request was sent"
            time.sleep(0.01)
        claimed = box / "claimed-1-test.json"
        os.rename(box / "req-1.json", claimed)  # the engine claims it
        request_id = json.loads(claimed.read_text())["request_id"]
        bad = {**LimitResult("applied", "", IPC, 16 << 20, 1, via="engine").to_dict(),
               "status": "retired", "request_id": request_id}
        (box / "ans-1.tmp").write_text(json.dumps(bad))
        os.replace(box / "ans-1.tmp", box / "ans-1.json")
    finally:
        worker.join(60)
    assert len(errors) == 1 and type(errors[0]) is LimitError, errors
    assert str(errors[0]).startswith(f"{box / 'ans-1.json'} is not a valid limit answer: ")


def test_the_responder_keeps_serving_after_a_failed_poll(
    pool: FakeKVCacheManager, dirs: tuple[Path, Path]
) -> None:
    """Mutant: ``_run`` without its ``except`` let one failed poll (here the answer cannot
    be written: a directory stands at its path) end the thread, so no later request of the
    instance was ever answered."""
    box = _request(dirs, 1, 2 * BUNDLE)
    (box / "ans-1.json").mkdir()
    responder = LimitResponder(IPC, poll_s=0.02)
    responder.start()
    try:
        deadline = time.monotonic() + 30
        while list(box.glob("req-1.json")):
            assert time.monotonic() < deadline, "the responder never claimed revision 1"
            time.sleep(0.02)
        _request(dirs, 2, 3 * BUNDLE)
        while not (box / "ans-2.json").exists():
            assert time.monotonic() < deadline, "the responder stopped serving"
            time.sleep(0.02)
    finally:
        responder.stop()
    assert _answer(box, 2)["status"] == "applied"
    assert pool.capacity_pages == 3


def test_the_responder_thread_never_keeps_its_process_alive(dirs: tuple[Path, Path]) -> None:
    """Mutant: a non-daemon polling thread kept the engine process from exiting: the
    responder is started in every vLLM process and never stopped by vLLM."""
    code = ("from kvcached_provider.limit import LimitResponder\n"
            "LimitResponder('inst1', poll_s=0.02).start()\n")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=30, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("a process with a started responder did not exit")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", ["../other", "inst1/x", ""])
def test_a_responder_needs_a_valid_instance_name(dirs: tuple[Path, Path], name: str) -> None:
    """Mutant: ``LimitResponder`` without ``validate_ipc_name`` served ``../other``, a
    mailbox outside the state directory's ``mailbox/``."""
    with pytest.raises(LimitError, match="is invalid: expected the instance's KVCACHED_IPC_NAME"):
        LimitResponder(name)


def test_a_blank_state_dir_setting_is_a_limit_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``state_dir`` without its ``SettingError`` translation raised a bare
    ``SettingError`` from ``set_limit``; ``LimitError`` is the error for unusable local
    state."""
    monkeypatch.setenv("KVCACHED_PROVIDER_STATE_DIR", " ")
    with pytest.raises(LimitError, match="KVCACHED_PROVIDER_STATE_DIR=' ' is invalid"):
        set_limit(IPC, 1 << 30, timeout_s=0.1)
