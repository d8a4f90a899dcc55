"""``kvcached-provider limit``: result states, revisions, and refusing to mix with kvctl.

kvcached cannot be installed here, so these tests fake it at the module boundary: fake
``kvcached``, ``kvcached.control``, ``kvcached.pool_registry`` and ``kvcached._C`` modules
(``tests/fake_kvcached.py``, behaviour from the kvcached spec: revision rules, status
precedence, result keys) are put into ``sys.modules``; the ``/dev/shm`` control records are
real 24-byte files in a temporary directory. Guarded: every printed state (applied,
deferred, stale, conflict, unavailable, rejected) and its exit code; revisions persisted
atomically, never reused (also across concurrent commands), advanced past a stale answer;
refusal when a ``kvctl`` limit changed the control record or is in force on first use (but
not after an engine restart: markers are bound to the segment's inode); the engine-side
responder answering a command run in another process, and answering a malformed request (a
FIFO planted as a request included, never waited on); the activation plugin starting it only
when enabled, never raising, and retrying a failed start; bad input as one-line errors (a
FIFO at the state file refused at once); ``main()`` putting the SIGTERM handler back when it
returns.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import platformdirs
import pytest

from kvcached_provider import activation
from kvcached_provider.cli import main
from kvcached_provider.limit import LimitError, LimitResponder, parse_size, set_limit
from tests.fake_kvcached import (
    FakeKvcached,
    FakeKVCacheManager,
    install,
    provider_dirs,
    virtual_total,
    write_record,
)
from tests.lock_helpers import lock_is_held

IPC = "inst1"
START = LimitResponder.start  # kept before any test patches it
BUNDLE = 8 << 20  # page bundle of the default fake pool: 1 MiB x 4 layers x 2 buffers


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    return provider_dirs(tmp_path, monkeypatch, IPC)


@pytest.fixture
def kv(monkeypatch: pytest.MonkeyPatch) -> FakeKvcached:
    return install(monkeypatch)


@pytest.fixture
def pool(kv: FakeKvcached, dirs: tuple[Path, Path]) -> FakeKVCacheManager:
    """One registered pool of 4 pages, with the control record kvcached writes at start-up."""
    manager = kv.register(FakeKVCacheManager(num_blocks=64))
    write_record(dirs[1], IPC, virtual_total(manager))
    return manager


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["limit", "--ipc", IPC, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def stored(state: Path) -> dict[str, object]:
    data: dict[str, object] = json.loads((state / "instances.json").read_text())["instances"][IPC]
    return data


@pytest.mark.parametrize(("text", "expected"), [
    ("512M", 512 << 20), ("8G", 8 << 30), ("8g", 8 << 30), ("1.5GiB", 3 << 29),
    ("4096", 4096), ("2T", 2 << 40), ("64KB", 64 << 10), ("0", 0),
])
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "8X", "-1G", "G", "1 2G", "\u0663M", "\uff18G"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(LimitError, match="expected a number with an optional unit"):
        parse_size(text)


def test_applied_then_next_revision(pool: FakeKVCacheManager, dirs: tuple[Path, Path],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "16M")
    assert code == 0
    assert out.split()[0] == "applied"
    assert "revision=1" in out and "via=in-process" in out
    assert pool.capacity_pages == 2
    entry = stored(dirs[0])
    assert entry["revision"] == 1 and entry["status"] == "applied"
    assert entry["records"] == {IPC: {"inode": os.stat(dirs[1] / IPC).st_ino,
                                      "total_size": virtual_total(pool)}}
    code, out, _ = run(capsys, "--json", "24M")
    result = json.loads(out)
    assert code == 0 and result["status"] == "applied" and result["revision"] == 2
    assert result["effective_limit_bytes"] == 3 * BUNDLE
    assert not list(dirs[0].glob(".instances-*"))  # atomic writes leave no temp file


def test_deferred_is_accepted(pool: FakeKVCacheManager, capsys: pytest.CaptureFixture[str]
                              ) -> None:
    assert pool.alloc(40) is not None  # 3 pages in use
    code, out, _ = run(capsys, "8M")
    assert code == 0
    assert out.split()[0] == "deferred" and "reason=inuse_capacity_above_limit" in out
    assert pool.in_shrink


def test_stale_advances_the_counter(pool: FakeKVCacheManager, dirs: tuple[Path, Path],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    pool.set_memory_limit(32 << 20, revision=10)  # another controller got there first
    code, out, _ = run(capsys, "16M")
    assert code == 1 and out.split()[0] == "stale"
    assert stored(dirs[0])["revision"] == 10
    code, out, _ = run(capsys, "16M")
    assert code == 0 and out.split()[0] == "applied" and "revision=11" in out


def test_conflict_when_a_revision_is_reused(pool: FakeKVCacheManager, dirs: tuple[Path, Path],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "16M")[0] == 0
    (dirs[0] / "instances.json").unlink()  # lost state: the counter restarts at 1
    code, out, _ = run(capsys, "24M")
    assert code == 1
    assert out.split()[0] == "conflict" and "revision_reused_with_different_limit" in out


def test_rejected_by_quarantined_pages(pool: FakeKVCacheManager,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    pool.quarantined = True
    code, out, _ = run(capsys, "16M")
    assert code == 1 and out.split()[0] == "rejected"
    assert "quarantined_pages_prevent_resize" in out


def test_unavailable_without_engine(dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("KVCACHED_IPC_NAME")
    code, out, _ = run(capsys, "--timeout", "0.2", "1G")
    assert code == 1
    assert out.split()[0] == "unavailable" and "reason=no_engine_responder" in out
    assert "nothing was applied" in out
    assert not list((dirs[0] / "mailbox" / IPC).iterdir())  # the request was withdrawn
    assert stored(dirs[0])["revision"] == 1  # consumed, so never reused


def test_kvctl_change_after_our_limit_is_refused(
    pool: FakeKVCacheManager, dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(capsys, "16M")[0] == 0
    write_record(dirs[1], IPC, 8 << 20)  # `kvctl limit inst1 8M` rewrites total_size in place
    code, out, _ = run(capsys, "24M")
    assert code == 1
    assert out.split()[0] == "rejected" and "reason=kvctl_limit_detected" in out
    assert "a `kvctl limit` was applied to this instance" in out
    assert pool.capacity_pages == 2  # nothing sent
    assert stored(dirs[0])["revision"] == 1  # refusal consumes no revision
    # The engine restarts: a new segment (new inode) frees the instance for us again.
    write_record(dirs[1], IPC, virtual_total(pool), replace=True)
    code, out, _ = run(capsys, "24M")
    assert code == 0 and "revision=2" in out


def test_kvctl_limit_before_first_use_is_refused_unless_adopted(
    pool: FakeKVCacheManager, dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    write_record(dirs[1], IPC, 16 << 20)  # kvctl set a limit before we ever did
    code, out, _ = run(capsys, "24M")
    assert code == 1
    assert out.split()[0] == "rejected" and "not the pool's virtual capacity" in out
    # A refusal records no marker for the segment, so asking again is still refused.
    code, out, _ = run(capsys, "24M")
    assert code == 1
    assert out.split()[0] == "rejected" and "not the pool's virtual capacity" in out
    code, out, _ = run(capsys, "--adopt", "24M")
    assert code == 0 and out.split()[0] == "applied"


def test_an_engine_restart_with_a_new_size_is_not_taken_for_kvctl(
    kv: FakeKvcached, pool: FakeKVCacheManager, dirs: tuple[Path, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A marker applies only to the segment (inode) it was taken from: after an engine
    restart whose new segment holds a different total_size (a bigger pool), the next limit
    is applied rather than refused as a kvctl change."""
    assert run(capsys, "16M")[0] == 0
    kv.registry.pools.clear()  # the engine restarts with twice the pool
    bigger = kv.register(FakeKVCacheManager(num_blocks=128))
    write_record(dirs[1], IPC, virtual_total(bigger), replace=True)
    assert virtual_total(bigger) != stored(dirs[0])["records"][IPC]["total_size"]  # type: ignore[index]
    code, out, _ = run(capsys, "24M")
    assert code == 0 and out.split()[0] == "applied" and "revision=2" in out
    assert bigger.capacity_pages == 3


def test_bad_input_is_one_line(dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
                               ) -> None:
    assert main(["limit", "--ipc", "bad name", "1G"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcached-provider: error: --ipc 'bad name' is invalid")
    assert err.count("\n") == 1
    assert main(["limit", "--ipc", IPC, "--timeout", "0", "1G"]) == 2
    assert "--timeout 0 is invalid" in capsys.readouterr().err


@pytest.mark.parametrize("document", [
    {"schema_version": 7},
    # Schema 1, but an entry kvcached would refuse (a negative revision) or with a key
    # outside the schema, or a top-level key outside it: a save would drop what it held.
    {"schema_version": 1, "instances": {IPC: {"revision": -1}}},
    {"schema_version": 1, "instances": {IPC: {"revision": 3, "owner": "someone"}}},
    {"schema_version": 1, "instances": {}, "owners": {}},
], ids=["schema-7", "negative-revision", "unknown-entry-key", "unknown-top-level-key"])
def test_corrupt_state_is_refused_and_kept(
    pool: FakeKVCacheManager, dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str],
    document: dict[str, Any],
) -> None:
    dirs[0].mkdir()
    bad = dirs[0] / "instances.json"
    bad.write_text(json.dumps(document))
    before = bad.read_bytes()
    code, _, err = run(capsys, "1G")
    assert code == 2
    assert "is not a kvcached-provider state file (schema 1)" in err
    assert err.count("\n") == 1
    assert bad.read_bytes() == before and pool.capacity_pages == 4


def _default_sigint() -> None:
    # A shell starts background jobs with SIGINT ignored and children inherit it, so a suite
    # run in the background would send Ctrl-C to a command that ignores it. The command
    # must meet Ctrl-C as it does in a terminal: SIGINT at its default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cli(env_update: dict[str, str], *argv: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "KVCACHED_IPC_NAME"}
    env.update(env_update)
    return subprocess.Popen([sys.executable, "-m", "kvcached_provider", "limit", *argv],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)


def _limit_through_engine() -> tuple[int, dict[str, Any], str]:
    """``kvcached-provider limit --json 16M`` in a child without pools, answered by a
    responder running here (which holds the fake pool): exit code, JSON result, stderr."""
    responder = LimitResponder(IPC, poll_s=0.02)
    responder.start()
    try:
        proc = _cli({}, "--ipc", IPC, "--timeout", "20", "--json", "16M")
        out, err = proc.communicate(timeout=60)
    finally:
        responder.stop()
    return proc.returncode, json.loads(out), err


def test_engine_responder_answers_another_process(
    pool: FakeKVCacheManager, dirs: tuple[Path, Path]
) -> None:
    """The command runs in a child without pools; the responder here holds the (fake) pool."""
    returncode, result, err = _limit_through_engine()
    assert returncode == 0, err
    assert result["status"] == "applied" and result["via"] == "engine"
    assert result["revision"] == 1
    assert pool.capacity_pages == 2
    assert not list((dirs[0] / "mailbox" / IPC).iterdir())


def test_responder_claims_nothing_without_pools(kv: FakeKvcached, dirs: tuple[Path, Path]
                                                ) -> None:
    box = dirs[0] / "mailbox" / IPC
    box.mkdir(parents=True)
    (box / "req-1.json").write_text("{}")
    assert LimitResponder(IPC).poll_once() == 0
    assert (box / "req-1.json").exists()


def _request(dirs: tuple[Path, Path], revision: int, limit: int, **body: Any) -> Path:
    """A request as the command drops it into the instance's mailbox (``body`` replaces or
    adds fields); returns the mailbox."""
    box = dirs[0] / "mailbox" / IPC
    box.mkdir(parents=True, exist_ok=True)
    (box / f"req-{revision}.json").write_text(json.dumps({
        "schema": "kvcached-provider.limit-request/1", "ipc_name": IPC, "limit_bytes": limit,
        "revision": revision, "check_startup": False, **body}))
    return box


def test_the_responder_locks_a_pool_before_it_applies_limits(
    pool: FakeKVCacheManager, dirs: tuple[Path, Path]
) -> None:
    """kvcached gives a pool only a no-op lock under vLLM's synchronous scheduling (only the
    scheduler thread touches it then), but the responder applies limits from its own
    thread: it first gives the pool a real lock, answers from the next poll on, and then
    waits for a scheduler call that holds the lock instead of racing it."""
    box = _request(dirs, 1, 2 * BUNDLE)
    responder = LimitResponder(IPC)
    assert responder.poll_once() == 0  # the pool got its lock; nothing applied yet
    assert isinstance(pool._lock, type(threading.RLock()))
    assert (box / "req-1.json").exists() and pool.capacity_pages == 4
    pool._lock.acquire()  # the scheduler is inside alloc()/free()
    worker = threading.Thread(target=responder.poll_once)
    worker.start()
    worker.join(timeout=0.5)
    assert worker.is_alive() and pool.capacity_pages == 4 and not (box / "ans-1.json").exists()
    pool._lock.release()
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert json.loads((box / "ans-1.json").read_text())["status"] == "applied"
    assert pool.capacity_pages == 2


@pytest.mark.parametrize(("error", "reason"), [
    (RuntimeError("mapping safety cannot be established"), "kvcached_error"),
    (AssertionError("new_mem_size must be non-negative"), "kvcached_error"),
])
def test_a_kvcached_exception_is_answered_not_lost(
    pool: FakeKVCacheManager, dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
    error: Exception, reason: str,
) -> None:
    """kvcached's transactions raise (StateConsistencyError, MapQuarantinedError are
    RuntimeErrors): the claimed request still gets an answer, so the command reports a
    refusal at once instead of waiting twice its timeout for one that never comes."""
    def raising(limit_bytes: int, *, revision: int) -> dict[str, object]:
        raise error
    monkeypatch.setattr(pool, "set_memory_limit", raising)
    box = _request(dirs, 1, 2 * BUNDLE)
    responder = LimitResponder(IPC)
    responder.poll_once()  # locks the pool
    assert responder.poll_once() == 1
    answer = json.loads((box / "ans-1.json").read_text())
    assert answer["status"] == "rejected" and answer["reason"] == reason
    assert type(error).__name__ in answer["detail"]
    assert [p.name for p in box.iterdir()] == ["ans-1.json"]


@pytest.mark.parametrize("body", [
    "{bad",
    "[]",
    json.dumps({"schema": "kvcached-provider.limit-request/1", "ipc_name": IPC}),
    json.dumps({"schema": "kvcached-provider.limit-request/1", "ipc_name": IPC,
                "revision": 1, "limit_bytes": "lots"}),
])
def test_a_malformed_request_is_answered_invalid_request(
    pool: FakeKVCacheManager, dirs: tuple[Path, Path], body: str
) -> None:
    """Every claimed request gets an answer: a malformed ``req-*.json`` (bad JSON, not an
    object, missing or bad fields) is answered rejected/invalid_request with its revision,
    and nothing is applied."""
    box = dirs[0] / "mailbox" / IPC
    box.mkdir(parents=True)
    (box / "req-1.json").write_text(body)
    responder = LimitResponder(IPC)
    responder.poll_once()  # locks the pool
    assert responder.poll_once() == 1
    answer = json.loads((box / "ans-1.json").read_text())
    assert answer["status"] == "rejected" and answer["reason"] == "invalid_request"
    assert answer["revision"] == 1
    assert [p.name for p in box.iterdir()] == ["ans-1.json"]
    assert pool.capacity_pages == 4


def test_concurrent_commands_never_share_a_revision(
    pool: FakeKVCacheManager, dirs: tuple[Path, Path]
) -> None:
    """Commands for one instance queue (each waits for the one before at most its
    --timeout) and each gets its own revision."""
    responder = LimitResponder(IPC, poll_s=0.02)
    responder.start()
    try:
        procs = [_cli({}, "--ipc", IPC, "--timeout", "20", "--json", f"{i + 1}G")
                 for i in range(4)]
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            results.append(json.loads(out))
    finally:
        responder.stop()
    assert sorted(r["revision"] for r in results) == [1, 2, 3, 4]
    assert {r["status"] for r in results} == {"applied"}
    assert stored(dirs[0])["revision"] == 4


def test_limit_rejects_negative(dirs: tuple[Path, Path]) -> None:
    with pytest.raises(LimitError, match="expected a non-negative size"):
        set_limit(IPC, -1)


def test_activation_plugin_starts_responder_only_when_enabled(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(activation, "_responder", None)
    monkeypatch.delenv("ENABLE_KVCACHED", raising=False)
    assert activation.register() is None
    monkeypatch.setenv("ENABLE_KVCACHED", " true")  # kvcached reads it untrimmed: off
    assert activation.register() is None
    monkeypatch.setenv("ENABLE_KVCACHED", "TRUE")
    monkeypatch.setenv("KVCACHED_IPC_NAME", "not valid!")
    assert activation.register() is None
    monkeypatch.setenv("KVCACHED_IPC_NAME", IPC)
    responder = activation.register()
    try:
        assert responder is not None and responder.ipc == IPC
        assert activation.register() is responder  # one per process
    finally:
        assert responder is not None
        responder.stop()



def test_activation_plugin_never_raises(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any failure starting the responder, not only a bad name, is logged and the engine
    starts without it: a plugin exception would stop vLLM. The failed responder is not
    kept, so a later call starts one that serves."""
    monkeypatch.setattr(activation, "_responder", None)
    monkeypatch.setenv("ENABLE_KVCACHED", "true")

    def refuse(self: LimitResponder) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(LimitResponder, "start", refuse)
    assert activation.register() is None
    # The failed responder is not kept: a later call (another plugin load in the same
    # process) starts a working one instead of returning one that never served.
    monkeypatch.setattr(LimitResponder, "start", START)
    responder = activation.register()
    try:
        assert responder is not None and responder._thread is not None
        assert responder._thread.is_alive()
    finally:
        assert responder is not None
        responder.stop()


def _cli_within(seconds: float, *argv: str) -> tuple[int, str]:
    """Run the command in a child; fail, instead of hanging the suite, past ``seconds``."""
    proc = _cli({}, *argv)
    try:
        _, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"kvcached-provider limit {' '.join(argv)} still running after {seconds} s")
    return proc.returncode, err


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e999", "1e308", "3601"])
def test_timeout_must_be_finite(dirs: tuple[Path, Path], value: str) -> None:
    """--timeout nan used to wait forever, and inf or 1e308 never timed out: bad input now."""
    code, err = _cli_within(10, "--ipc", IPC, f"--timeout={value}", "1G")
    assert code == 2
    assert "is invalid: expected seconds in (0, 3600]" in err
    assert err.count("\n") == 1
    assert not (dirs[0] / "instances.json").exists()  # refused before reserving a revision


def test_set_limit_refuses_nan_timeout(dirs: tuple[Path, Path]) -> None:
    """The library entry refuses a NaN timeout too, instead of polling forever."""
    errors: list[Exception] = []

    def call() -> None:
        try:
            set_limit(IPC, 1 << 30, timeout_s=float("nan"))
        except LimitError as exc:
            errors.append(exc)

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(timeout=5)
    assert not worker.is_alive(), "set_limit(timeout_s=nan) is still waiting"
    assert errors and "expected seconds in (0, 3600]" in str(errors[0])


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_limit_withdraws_its_request(
    dirs: tuple[Path, Path], signum: int, status: int
) -> None:
    """Ctrl-C or SIGTERM while the command waits for the engine withdraws the request, so
    an abandoned limit never applies when an engine of the instance next serves the
    mailbox; the command says so in one line and exits 128 + the signal."""
    box = dirs[0] / "mailbox" / IPC
    proc = _cli({}, "--ipc", IPC, "--timeout", "60", "1G")
    deadline = time.monotonic() + 30
    while not (box / "req-1.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == status, err
    assert err == ("kvcached-provider: interrupted while waiting for the engine; the request "
                   "was withdrawn and nothing was applied\n")
    assert list(box.iterdir()) == []
    # The revision was reserved before the request was sent, so it is never reused.
    assert stored(dirs[0])["revision"] == 1


def test_main_restores_the_sigterm_handler(dirs: tuple[Path, Path],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``main()`` turns SIGTERM into an interrupt only while a command runs: a caller's
    handler is back afterwards, also when the command fails."""
    before = signal.getsignal(signal.SIGTERM)
    assert main(["limit", "--ipc", "not valid!", "1G"]) == 2
    assert main(["cleanup", "--ipc", "not valid!"]) == 2
    assert signal.getsignal(signal.SIGTERM) is before
    capsys.readouterr()


def test_oversized_limit_is_refused(dirs: tuple[Path, Path],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A size beyond int64 (or so long it parses as inf) is one-line bad input, not a traceback."""
    for text in ["1" * 400, "8388608T"]:
        code, _, err = run(capsys, text)
        assert code == 2 and err.count("\n") == 1
        assert "expected at most 9223372036854775807 bytes" in err


@pytest.mark.parametrize("body", ["{bad", "[]", "{}"])
def test_malformed_answer_is_named_and_request_withdrawn(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, body: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A malformed answer file is reported by path with what was expected, and the request
    is withdrawn so that it cannot apply later."""
    monkeypatch.delenv("KVCACHED_IPC_NAME")
    box = dirs[0] / "mailbox" / IPC
    box.mkdir(parents=True)
    (box / "ans-1.json").write_text(body)
    code, _, err = run(capsys, "--timeout", "0.1", "1G")
    assert code == 2 and err.count("\n") == 1
    assert f"{box / 'ans-1.json'} is not a valid limit answer: expected the JSON object" in err
    assert "the request was withdrawn" in err
    assert not (box / "req-1.json").exists()


def test_mailbox_that_is_a_file_is_refused(dirs: tuple[Path, Path],
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A regular file where the instance's mailbox directory belongs is a one-line error."""
    monkeypatch.delenv("KVCACHED_IPC_NAME")
    (dirs[0] / "mailbox").mkdir(parents=True)
    (dirs[0] / "mailbox" / IPC).write_text("")
    code, _, err = run(capsys, "--timeout", "0.1", "1G")
    assert code == 2 and err.count("\n") == 1
    assert f"mailbox {dirs[0] / 'mailbox' / IPC} is not usable: expected a directory" in err


@pytest.mark.parametrize("name", [IPC, f"{IPC}_g1"])
def test_control_record_that_is_a_directory_is_refused(
    dirs: tuple[Path, Path], name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory at a control record's path (group 0 or another KV group) is a one-line
    error naming the path, not an IsADirectoryError."""
    (dirs[1] / name).mkdir()
    code, _, err = run(capsys, "--timeout", "0.1", "1G")
    assert code == 2 and err.count("\n") == 1
    assert (f"{dirs[1] / name} is not a kvcached control record: expected a regular file "
            "of 24 bytes, found a directory") in err


def test_control_record_that_is_a_fifo_does_not_hang(dirs: tuple[Path, Path]) -> None:
    """A FIFO at the control record's path is refused at once instead of blocking in open."""
    os.mkfifo(dirs[1] / IPC)
    code, err = _cli_within(10, "--ipc", IPC, "--timeout", "0.1", "1G")
    assert code == 2 and err.count("\n") == 1
    assert "expected a regular file of 24 bytes, found a FIFO" in err


def test_a_state_file_that_is_a_fifo_does_not_hang(dirs: tuple[Path, Path]) -> None:
    """A FIFO at ``instances.json`` (which a plain open() would wait on) is refused at once,
    in one line naming it, and left in place."""
    dirs[0].mkdir()
    state = dirs[0] / "instances.json"
    os.mkfifo(state)
    code, err = _cli_within(10, "--ipc", IPC, "--timeout", "0.1", "1G")
    assert code == 2 and err.count("\n") == 1
    assert f"cannot read {state}: " in err and "expected a regular file, found a FIFO" in err
    assert state.is_fifo()


def test_a_request_that_is_a_fifo_is_answered_not_waited_on(
    pool: FakeKVCacheManager, dirs: tuple[Path, Path]
) -> None:
    """A FIFO planted in the mailbox as ``req-1.json`` must not hang the engine's responder
    thread: it is claimed and answered rejected/invalid_request like any malformed request,
    and nothing is applied."""
    box = dirs[0] / "mailbox" / IPC
    box.mkdir(parents=True)
    os.mkfifo(box / "req-1.json")
    responder = LimitResponder(IPC)
    responder.poll_once()  # locks the pool
    answered: list[int] = []
    worker = threading.Thread(target=lambda: answered.append(responder.poll_once()),
                              daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "the responder blocked on the FIFO"
    assert answered == [1]
    answer = json.loads((box / "ans-1.json").read_text())
    assert answer["status"] == "rejected" and answer["reason"] == "invalid_request"
    assert "expected a regular file, found a FIFO" in answer["detail"]
    assert pool.capacity_pages == 4


def test_a_name_with_a_trailing_newline_is_refused(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The name pattern ended in `$` (matches before a final newline): `inst1\\n` created a
    mailbox directory and state key of that name."""
    assert main(["limit", "--ipc", f"{IPC}\n", "--timeout", "0.1", "1G"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        f"kvcached-provider: error: --ipc '{IPC}\\n' is invalid: expected the instance's "
        "KVCACHED_IPC_NAME, 1-64 characters from [A-Za-z0-9_-]\n")
    assert not dirs[0].exists()
    with pytest.raises(LimitError, match="is invalid"):
        set_limit(f"{IPC}\n", 1 << 30, timeout_s=0.1)
    monkeypatch.setattr(activation, "_responder", None)
    monkeypatch.setenv("ENABLE_KVCACHED", "true")
    monkeypatch.setenv("KVCACHED_IPC_NAME", f"{IPC}\n")
    assert activation.register() is None


@pytest.mark.parametrize("value", [" ", "\t\n"])
def test_a_blank_state_dir_setting_is_one_line(tmp_path: Path, value: str) -> None:
    """A blank KVCACHED_PROVIDER_STATE_DIR created a directory named like it in the cwd."""
    env = {**os.environ, "KVCACHED_PROVIDER_STATE_DIR": value,
           "KVCACHED_PROVIDER_SHM_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "kvcached_provider", "limit", "--ipc", IPC,
                           "--timeout", "0.1", "1G"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"kvcached-provider: error: KVCACHED_PROVIDER_STATE_DIR={value!r} is invalid: expected "
        "a directory path, or the variable unset or empty for the default "
        f"{platformdirs.user_state_path('kvcached-provider')}"]
    assert list(tmp_path.iterdir()) == []


def _disk_full_on(monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    """Make the ``call``-th fsync of a state save fail as on a full disk (tests run as root,
    so a read-only directory would not stop the write)."""
    calls = iter(range(1, 100))
    real = os.fsync

    def fsync(fd: int) -> None:
        if next(calls) == call:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_full_disk_before_sending_is_one_line_and_keeps_the_state(
    pool: FakeKVCacheManager, dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    state = dirs[0] / "instances.json"
    assert run(capsys, "24M")[0] == 0
    before = state.read_bytes()
    _disk_full_on(monkeypatch, 1)  # reserving revision 2 fails: nothing is sent
    code, out, err = run(capsys, "16M")
    assert code == 2 and out == ""
    assert err == (f"kvcached-provider: error: cannot save {state}: No space left on device; "
                   "its previous content is kept: free space or set "
                   "KVCACHED_PROVIDER_STATE_DIR to a writable directory\n")
    assert state.read_bytes() == before
    assert sorted(p.name for p in dirs[0].iterdir()) == ["instances.json", "instances.lock",
                                                         "locks"]
    assert pool.capacity_pages == 3  # still the 24M limit: 16M was never sent


def test_a_full_disk_after_applying_says_what_was_applied(
    pool: FakeKVCacheManager, dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _disk_full_on(monkeypatch, 2)  # the revision is reserved; recording the outcome fails
    code, out, err = run(capsys, "24M")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("kvcached-provider: error: limit applied at revision 1 (via "
                          "in-process), but cannot save ")
    assert stored(dirs[0])["revision"] == 1  # never reused


def test_a_control_record_locked_by_another_process_times_out_in_one_line(
    pool: FakeKVCacheManager, dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Notes section 5: readers take ``flock(LOCK_SH)`` on the control record. That lock was
    taken blocking, inside the state file's lock: a process holding the record's exclusive
    lock hung ``limit --timeout 0.3`` (and every other instance's ``limit`` behind the state
    lock) until it let go. Now the command gives up after its timeout, in one line naming
    the record, sends nothing, and the state file's lock stays free while it waits."""
    import fcntl

    state, shm = dirs
    holder = os.open(shm / IPC, os.O_RDWR)  # another open file: flock conflicts with it
    fcntl.flock(holder, fcntl.LOCK_EX)
    free_while_waiting: list[bool] = []

    def probe_state_lock() -> None:
        time.sleep(0.1)
        free_while_waiting.append(not lock_is_held(state / "instances.lock"))

    prober = threading.Thread(target=probe_state_lock)
    # The holder lets go after 3 s, so that a regression fails the asserts below instead
    # of hanging the suite.
    release = threading.Timer(3.0, fcntl.flock, (holder, fcntl.LOCK_UN))
    try:
        prober.start()
        release.start()
        started = time.monotonic()
        code, out, err = run(capsys, "--timeout", "0.3", "16M")
        took = time.monotonic() - started
    finally:
        prober.join()
        release.cancel()
        release.join()
        os.close(holder)
    assert code == 2 and out == ""
    assert err == (f"kvcached-provider: error: kvcached control record {shm / IPC} stayed "
                   f"locked by another process for 0.3 s: expected it free between "
                   f"kvcached's writes (find the holder with `fuser {shm / IPC}`); nothing "
                   "was sent\n")
    assert took < 3.0  # bounded by the timeout, not by the holder
    assert free_while_waiting == [True]
    assert pool.capacity_pages == 4  # nothing applied
    assert run(capsys, "16M")[0] == 0  # and the next command goes through


@pytest.mark.parametrize("where", ["instances.json", "locks/inst1.lock"])
def test_a_directory_where_a_state_file_belongs_is_named_with_what_was_expected(
    pool: FakeKVCacheManager, dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str],
    where: str,
) -> None:
    """A directory in place of the state file said ``[Errno 21] Is a directory: 5`` (the
    5 a file descriptor), and one in place of an instance's lock file named only the state
    directory. Each line now names the path and what was expected there."""
    state = dirs[0]
    (state / where).mkdir(parents=True)
    code, out, err = run(capsys, "16M")
    assert code == 2 and out == "" and err.count("\n") == 1
    if where == "instances.json":
        assert err == (f"kvcached-provider: error: cannot read {state / where}: [Errno 22] "
                       "expected a regular file, found a directory\n")
    else:
        assert err == (f"kvcached-provider: error: cannot use state directory {state} "
                       f"({state / where}: Is a directory); set KVCACHED_PROVIDER_STATE_DIR "
                       "to a writable directory\n")
    assert pool.capacity_pages == 4
