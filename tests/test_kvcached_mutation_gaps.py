"""Behaviour of ``kvcached_provider`` that a mutation audit found no test guarding.

Each test here failed under one deliberate mutation of the provider that every other test
let pass (named in the test's docstring). Guarded:

- cleanup removes only the instance's own records: a record of another instance whose name
  merely has the same length and a ``_g<N>`` suffix is reported, never removed;
- a control record longer than ``RECORD_SIZE`` bytes is refused in one line, not unpacked;
- ``--timeout`` accepts its documented maximum (the interval is ``(0, 3600]``);
- the start-up ``kvctl`` comparison reads the segment the pool names (``ipc_name``,
  kvcached 0.1.6), and for a pool that names none the ``<ipc>_g<N>`` record of its group;
- ``--adopt`` sticks: once a limit was applied to a segment, its marker replaces the
  start-up comparison, so the next limit is not refused for the adopted total;
- the engine refuses a request naming another instance, and the command never takes an
  answer bearing another request's id, even when no engine answers in time;
- a name that only begins like a default ``kvcached_<engine>_<pgid>`` name ties no process
  group to the instance, and the cleanup reports its records sorted;
- ``limit`` reads only the instance's records (an unrelated ``<ipc>_gpu...`` file is not
  one), a failed request write leaves no temporary file in the mailbox, a request the
  engine claimed as the first timeout ran out still gets its answer, and a responder
  started twice runs one thread;
- the state file is read and saved only under ``instances.lock`` (a command waits while
  another holder has it locked), so concurrent commands for different instances lose no update.

kvcached is faked at the module boundary (``tests/fake_kvcached.py``); files, locks, processes
and the ``/proc`` reading are real. Only a full disk (``os.replace`` failing) is injected,
and in one test this test plays the engine's part in the mailbox exchange.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from kvcached_provider import limit, segments
from kvcached_provider.cli import main
from kvcached_provider.limit import LimitError, LimitResponder, LimitResult, set_limit
from tests.fake_kvcached import (
    FakeKvcached,
    FakeKVCacheManager,
    install,
    provider_dirs,
    virtual_total,
    write_record,
)

IPC = "inst1"


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    return provider_dirs(tmp_path, monkeypatch, IPC)


@pytest.fixture
def kv(monkeypatch: pytest.MonkeyPatch) -> FakeKvcached:
    return install(monkeypatch)


def _limit(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["limit", "--ipc", IPC, *argv])
    return code, capsys.readouterr().out


def test_a_same_length_name_with_a_group_suffix_is_another_instance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutant: ``is_instance_record`` without its ``startswith(ipc)`` test took
    ``u<hex>_g1`` for group 1 of ``t<hex>`` and the cleanup removed another instance's
    record. README: other instances' records are only reported, never deleted."""
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("KVCACHED_PROVIDER_SHM_DIR", str(shm))
    suffix = uuid.uuid4().hex[:12]
    ipc, other = f"t{suffix}", f"u{suffix}_g1"
    (shm / other).write_bytes(struct.pack("=qqq", 8 << 30, 0, 0))
    report = segments.cleanup(ipc, tmp=tmp_path)
    assert report.removed == () and report.kept == ()
    assert [path for path, _ in report.foreign] == [str(shm / other)]
    assert (shm / other).exists()


def test_a_record_longer_than_a_control_record_is_refused(tmp_path: Path) -> None:
    """Mutant: ``len(data) < RECORD_SIZE`` accepted a longer file and failed unpacking it
    with a ``struct.error`` traceback instead of the one-line refusal."""
    (tmp_path / IPC).write_bytes(bytes(limit.RECORD_SIZE + 8))
    with pytest.raises(LimitError, match=rf"expected {limit.RECORD_SIZE} bytes, found "
                                         rf"{limit.RECORD_SIZE + 1}$"):
        limit.read_control_record(IPC, tmp_path)


def test_the_largest_timeout_is_accepted() -> None:
    """Mutant: ``seconds < MAX_TIMEOUT_S`` refused ``--timeout 3600``, the upper end of the
    documented interval ``(0, 3600]``."""
    assert limit.validate_timeout(limit.MAX_TIMEOUT_S) == 3600.0
    with pytest.raises(LimitError, match=r"expected seconds in \(0, 3600\]"):
        limit.validate_timeout(3600.5)


def test_the_startup_check_reads_the_segment_the_pool_names(
    kv: FakeKvcached, dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Mutant: ignoring the pool's ``ipc_name`` read ``<ipc>_g1`` for a group-1 pool that
    shares the instance's segment (vLLM's groups do), and missed the kvctl limit there."""
    pool = kv.register(FakeKVCacheManager(num_blocks=64, group_id=1))
    assert pool.ipc_name == IPC
    write_record(dirs[1], IPC, virtual_total(pool) // 2)  # `kvctl limit` before first use
    code, out = _limit(capsys, "16M")
    assert code == 1 and out.split()[0] == "rejected" and "reason=kvctl_limit_detected" in out, out
    assert pool.capacity_pages == 4  # nothing applied


def test_a_pool_naming_no_segment_is_checked_at_its_group_record(
    kv: FakeKvcached, dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Mutant: ``_record_name`` giving group 1 the group-0 name read ``<ipc>`` for a pool of
    a release before 0.1.6 (no ``ipc_name``), whose group 1 uses ``<ipc>_g1``."""
    pool = kv.register(FakeKVCacheManager(num_blocks=64, group_id=1))
    del pool.ipc_name
    write_record(dirs[1], f"{IPC}_g1", virtual_total(pool) // 2)
    code, out = _limit(capsys, "16M")
    assert code == 1 and f"{dirs[1] / IPC}_g1 holds total_size" in out
    assert pool.capacity_pages == 4


def test_an_adopted_total_is_not_refused_on_the_next_limit(
    kv: FakeKvcached, dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Mutant: ``check_startup = not adopt`` (ignoring the marker) repeated the start-up
    comparison after an adopted limit. limit.py: the comparison applies only with no marker
    for the segment, i.e. before its first accepted limit."""
    pool = kv.register(FakeKVCacheManager(num_blocks=64))
    write_record(dirs[1], IPC, virtual_total(pool) // 2)  # a total that is no kvctl limit
    assert _limit(capsys, "--adopt", "24M")[0] == 0
    code, out = _limit(capsys, "16M")
    assert code == 0 and out.split()[0] == "applied" and "revision=2" in out
    assert pool.capacity_pages == 2


def _blocked_on(inode: int) -> bool:
    """Whether some process waits for a lock on ``inode`` (a ``->`` line in /proc/locks)."""
    for line in Path("/proc/locks").read_text(encoding="utf-8").splitlines():
        fields = line.split()
        if "->" in fields and any(f.endswith(f":{inode}") for f in fields):
            return True
    return False


def test_the_state_file_is_changed_only_under_its_lock(
    kv: FakeKvcached, dirs: tuple[Path, Path]
) -> None:
    """Mutant: ``_RevisionStore.locked`` without its ``flock`` let a command read and save
    ``instances.json`` while another held ``instances.lock``, so concurrent commands for
    different instances could overwrite each other's revisions. The wait is observed in
    ``/proc/locks`` (a blocked ``flock``), not timed."""
    pool = kv.register(FakeKVCacheManager(num_blocks=64))
    write_record(dirs[1], IPC, virtual_total(pool))
    dirs[0].mkdir(parents=True, exist_ok=True)
    held = os.open(dirs[0] / "instances.lock", os.O_RDWR | os.O_CREAT, 0o600)
    results: list[LimitResult] = []
    command = threading.Thread(target=lambda: results.append(set_limit(IPC, 16 << 20)))
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        command.start()
        inode = os.fstat(held).st_ino
        while command.is_alive() and not _blocked_on(inode):
            time.sleep(0.01)
        waited = command.is_alive()
        saved_meanwhile = (dirs[0] / "instances.json").exists()
    finally:
        os.close(held)  # releases the lock
    command.join(30)
    assert waited and not saved_meanwhile
    assert [r.status for r in results] == ["applied"] and pool.capacity_pages == 2


def test_a_request_naming_another_instance_is_refused_not_applied(
    kv: FakeKvcached, dirs: tuple[Path, Path]
) -> None:
    """Mutant: the responder without its ``ipc_name`` test applied a request for instance
    ``other`` found in ``inst1``'s mailbox to ``inst1``'s pools."""
    pool = kv.register(FakeKVCacheManager(num_blocks=64))
    write_record(dirs[1], IPC, virtual_total(pool))
    box = dirs[0] / "mailbox" / IPC
    box.mkdir(parents=True)
    (box / "req-3.json").write_text(json.dumps({
        "schema": "kvcached-provider.limit-request/1", "ipc_name": "other",
        "limit_bytes": 16 << 20, "revision": 3, "check_startup": False, "request_id": "r3"}))
    responder = LimitResponder(IPC)
    assert responder.poll_once() == 0  # the pool gets its real lock first
    assert responder.poll_once() == 1
    answer = json.loads((box / "ans-3.json").read_text())
    assert (answer["status"], answer["reason"]) == ("rejected", "invalid_request")
    assert pool.capacity_pages == 4 and pool.memory_limit_state()["limit_bytes"] is None


def test_another_requests_answer_is_not_taken_when_no_engine_answers(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Mutant: ``_wait_for`` returning what it last read at the deadline took an answer
    bearing another request's id (left from an earlier exchange of the same revision) as
    this request's. limit.py: the command takes only the answer bearing its own id."""
    monkeypatch.delenv("KVCACHED_IPC_NAME")  # this process holds no pools: via the mailbox
    box = dirs[0] / "mailbox" / IPC
    box.mkdir(parents=True)
    earlier = LimitResult("applied", "", IPC, 1 << 30, 1, via="engine")
    (box / "ans-1.json").write_text(json.dumps({**earlier.to_dict(), "request_id": "old"}))
    code, out = _limit(capsys, "--timeout", "0.2", "16M")
    assert code == 1 and out.split()[0] == "unavailable" and "no_engine_responder" in out
    assert not list(box.glob("req-*.json"))  # withdrawn, so it never applies


def test_a_name_that_only_begins_like_a_default_name_is_no_process_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutant: ``_DEFAULT_NAME.match`` instead of ``fullmatch`` tied the explicit name
    ``kvcached_vLLM_<pgid>x`` to process group ``<pgid>``. Only a name kvcached derived
    from a group (``kvcached_<engine>_<pgid>[_<i>]``) makes the group's processes users."""
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("KVCACHED_PROVIDER_SHM_DIR", str(shm))
    code = "import time\nprint('ready', flush=True)\ntime.sleep(60)\n"
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              start_new_session=True)  # its pgid is its pid
    try:
        assert leader.stdout is not None and leader.stdout.readline() == b"ready\n"
        name = f"kvcached_vLLM_{leader.pid}x"
        (shm / name).write_bytes(struct.pack("=qqq", 8 << 30, 0, 0))
        report = segments.cleanup(name, tmp=tmp_path)
    finally:
        leader.kill()
        leader.wait()
        leader.stdout.close()  # type: ignore[union-attr]
    assert report.removed == (str(shm / name),) and report.kept == ()


def test_records_are_reported_sorted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``_records`` without ``sorted`` reported the records in directory order;
    ``CleanupReport`` promises its paths sorted (the socket directory comes last)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("KVCACHED_PROVIDER_SHM_DIR", str(shm))
    names = [IPC, *(f"{IPC}_g{n}" for n in range(1, 12))]
    for name in reversed(names):
        (shm / name).write_bytes(struct.pack("=qqq", 8 << 30, 0, 0))
    report = segments.cleanup(IPC, dry_run=True, tmp=tmp_path)
    assert list(report.removed) == sorted(str(shm / name) for name in names)


def test_an_unrelated_file_beginning_with_the_group_prefix_is_not_read(
    kv: FakeKvcached, dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Mutant: ``_instance_records`` without the ``is_instance_record`` filter read
    ``inst1_gpu-notes`` (no ``_g<N>`` record) as a control record and the command failed."""
    pool = kv.register(FakeKVCacheManager(num_blocks=64))
    write_record(dirs[1], IPC, virtual_total(pool))
    (dirs[1] / f"{IPC}_gpu-notes").write_text("not kvcached's\n" * 10)
    code, out = _limit(capsys, "16M")
    assert code == 0 and out.split()[0] == "applied"
    state = json.loads((dirs[0] / "instances.json").read_text())
    assert list(state["instances"][IPC]["records"]) == [IPC]


def test_a_failed_request_write_leaves_no_temp_file(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Mutant: ``_write_json_atomic`` without its cleanup left ``.tmp-*`` in the mailbox
    when the request could not be written (a full disk)."""
    monkeypatch.delenv("KVCACHED_IPC_NAME")  # no pools here: the request goes by mailbox
    real = os.replace

    def full(src: str, dst: str | Path) -> None:
        if Path(dst).name.startswith("req-"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(src, dst)

    monkeypatch.setattr(os, "replace", full)
    code = main(["limit", "--ipc", IPC, "--timeout", "0.2", "16M"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot write limit request" in err and err.count("\n") == 1
    assert list((dirs[0] / "mailbox" / IPC).iterdir()) == []


def test_starting_a_responder_twice_runs_one_thread(dirs: tuple[Path, Path]) -> None:
    """Mutant: ``LimitResponder.start`` without its guard started a second polling thread."""
    responder = LimitResponder(IPC, poll_s=0.02)
    try:
        responder.start()
        responder.start()
        names = [t.name for t in threading.enumerate()]
        assert names.count("kvcached-provider-limits") == 1
    finally:
        responder.stop()
    assert "kvcached-provider-limits" not in [t.name for t in threading.enumerate()]


def test_a_request_claimed_at_the_deadline_gets_the_engines_answer(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Mutant: dropping the second wait reported ``engine_claimed_request_without_answer``
    at once when the engine had claimed the request as the first timeout ran out. limit.py:
    a claimed request gets one more timeout for its answer. Here the engine's part is
    played by this test: it claims the request, and answers only once the command found
    the request claimed (observed through ``_withdraw``), so no timing decides it."""
    monkeypatch.delenv("KVCACHED_IPC_NAME")
    box = dirs[0] / "mailbox" / IPC
    found_claimed = threading.Event()
    real_withdraw = limit._withdraw

    def observed(request: Path) -> bool:
        withdrawn = real_withdraw(request)
        if not withdrawn:
            found_claimed.set()
        return withdrawn

    monkeypatch.setattr(limit, "_withdraw", observed)
    result: list[LimitResult] = []
    command = threading.Thread(target=lambda: result.append(
        set_limit(IPC, 16 << 20, timeout_s=2.0)))
    command.start()
    try:
        while not (box / "req-1.json").exists():
            assert command.is_alive(), "the command ended without sending its request"
            time.sleep(0.01)
        claimed = box / "claimed-1-test.json"
        os.rename(box / "req-1.json", claimed)  # the engine claims it
        request_id = json.loads(claimed.read_text())["request_id"]
        assert found_claimed.wait(30), "the command never found its request claimed"
        answer = LimitResult("applied", "", IPC, 16 << 20, 1, via="engine")
        (box / "ans-1.tmp").write_text(json.dumps({**answer.to_dict(),
                                                   "request_id": request_id}))
        os.replace(box / "ans-1.tmp", box / "ans-1.json")
    finally:
        command.join(30)
    assert [(r.status, r.revision, r.via) for r in result] == [("applied", 1, "engine")]
