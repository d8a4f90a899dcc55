"""Clauses of ``shared/specs/kvcached-notes.md`` that no other kvcached test guarded.

Found by a clause-by-clause audit of the notes against ``kvcached_provider``; each test
names its clause. kvcached cannot be installed here (sdists only, needs a CUDA build of
torch), so where kvcached's Python API is needed it is faked at the module boundary
(``tests/fake_kvcached.py``: fake ``kvcached``, ``kvcached.control``,
``kvcached.pool_registry`` and ``kvcached._C`` in ``sys.modules``, behaving as the notes
say); the control records are real 24-byte files, the locks real ``flock`` locks, the
installed distributions real ``*.dist-info`` metadata. Guarded:

- §5: the provider reads a control record under a shared ``flock`` on the whole file, as
  kvcached's readers do (not exclusive, not a POSIX/OFD record lock), and releases it;
  only the cleanup's report-only read goes without it;
- §2.2: kvcached's ``ValueError`` for pools without virtual capacity is answered as a
  refusal (``rejected`` / ``invalid_request``, exit 1), never raised out of the command;
- §2.2: the revisioned API is process-local: pools registered in a process whose
  ``KVCACHED_IPC_NAME`` names another instance are never limited for this one, neither by
  the command nor by that process's responder;
- §2.2: each state kvcached answers keeps its status, reason and figures, and only
  ``applied``/``deferred`` count as accepted (exit 0); an unknown state is a refusal;
- §4: an empty ``KVCACHED_IPC_NAME`` is no instance name (kvcached then derives its own
  default name): the check fails, the plugin starts no responder, and ``limit``,
  ``cleanup`` and the shutdown hook refuse it;
- §7 check 1: an unparsable kvcached version is one failing check line, not a traceback;
- §8 (with the BidKV bundle in the same process): a registered capacity-signals source
  answers instead of kvcached's pools, and kvcached's pools answer again once it is gone.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcached_provider import activation, checks, limit, segments, signals
from kvcached_provider.cli import main
from kvcached_provider.limit import LimitError, LimitResponder
from kvcached_provider.signals import CapacitySignals, PageModel
from tests.fake_kvcached import (
    FakeKvcached,
    FakeKVCacheManager,
    virtual_total,
    write_record,
)
from tests.test_kvcached_limit import IPC, dirs, kv

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = json.loads(
    (ROOT / "manifests/kvcached/vllm-hust-extension-v0.2.json").read_text(encoding="utf-8"))
__all__ = ["dirs", "kv"]  # fixtures, used by name


@pytest.fixture(autouse=True)
def _fresh_signals_cache() -> Iterator[None]:
    signals.reset_cache()
    yield
    signals.reset_cache()


def _limit(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["limit", "--ipc", IPC, *argv])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------- §5 shared flock on reads


def _locks_held_by_others(path: Path) -> tuple[bool, bool]:
    """(an exclusive flock is refused, a shared flock is refused) for a new open of
    ``path``: what another kvcached reader or writer would meet right now."""
    probe = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            exclusive_refused = False
            fcntl.flock(probe, fcntl.LOCK_UN)
        except BlockingIOError:
            exclusive_refused = True
        try:
            fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
            shared_refused = False
        except BlockingIOError:
            shared_refused = True
    finally:
        os.close(probe)
    return exclusive_refused, shared_refused


def test_the_control_record_is_read_under_a_shared_flock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Notes §5: readers take ``flock(LOCK_SH)`` on the whole file, writers
    ``flock(LOCK_EX)``, and no OFD/POSIX record locks are used. So while the provider reads
    a record a ``kvctl limit`` (exclusive) must wait, another reader must not. The moment of
    the read is observed by wrapping ``os.pread``; the locks probed are real."""
    path = write_record(tmp_path, IPC, 7 << 20, 3 << 20)
    seen: list[tuple[bool, bool]] = []
    real_pread = os.pread

    def observed_pread(fd: int, length: int, offset: int) -> bytes:
        seen.append(_locks_held_by_others(path))
        return real_pread(fd, length, offset)

    monkeypatch.setattr(os, "pread", observed_pread)
    record = limit.read_control_record(IPC, tmp_path)
    assert record is not None
    assert (record.total_size, record.used_size, record.prealloc_size) == (7 << 20, 3 << 20, 0)
    assert seen == [(True, False)]  # exclusive refused, shared granted: a shared flock
    assert _locks_held_by_others(path) == (False, False)  # released after the read
    # The cleanup only reports what it sees and reads without the lock (documented).
    assert limit.read_control_record(IPC, tmp_path, lock=False) is not None
    assert seen[1:] == [(False, False)]


# ------------------------------------------------------------- §2.2 errors and answers


def test_pools_without_virtual_capacity_are_refused_not_raised(
    kv: FakeKvcached, dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Notes §2.2: zero total virtual capacity makes ``set_instance_memory_limit`` raise
    ``ValueError("registered KV pools have no virtual capacity")``. The command reports it
    as a refusal with kvcached's message (exit 1), not a traceback."""
    kv.register(FakeKVCacheManager(num_blocks=0))
    code, out, err = _limit(capsys, "1G")
    assert (code, err) == (1, "")
    assert out.split()[0] == "rejected" and "reason=invalid_request" in out
    assert "ValueError: registered KV pools have no virtual capacity" in out


def test_pools_of_another_instance_are_not_limited_here(
    kv: FakeKvcached, dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Notes §2.2: the revisioned API acts on every pool registered in the calling process.
    A process whose pools belong to instance ``other`` must not apply a limit meant for
    ``inst1``: the command goes to ``inst1``'s engine (none answers here), and this
    process's responder for ``inst1`` claims nothing."""
    pool = kv.register(FakeKVCacheManager(num_blocks=64))
    write_record(dirs[1], "other", virtual_total(pool))
    monkeypatch.setenv("KVCACHED_IPC_NAME", "other")
    code, out, _ = _limit(capsys, "--timeout", "0.2", "16M")
    assert code == 1
    assert out.split()[0] == "unavailable" and "reason=no_engine_responder" in out
    assert "via=engine" in out
    assert pool.capacity_pages == 4 and pool.memory_limit_state()["limit_bytes"] is None
    box = dirs[0] / "mailbox" / IPC
    (box / "req-9.json").write_text(json.dumps({
        "schema": "kvcached-provider.limit-request/1", "ipc_name": IPC,
        "limit_bytes": 16 << 20, "revision": 9, "check_startup": False}))
    responder = LimitResponder(IPC)
    assert [responder.poll_once(), responder.poll_once()] == [0, 0]
    assert [p.name for p in box.iterdir()] == ["req-9.json"]
    assert pool.capacity_pages == 4


_FIGURES = {"limit_bytes": 5 << 30, "effective_limit_bytes": 3 << 30, "revision": 1,
            "mapped_bytes": 4 << 30, "remaining_bytes": 0, "overage_bytes": 1 << 30}


@pytest.mark.parametrize(("status", "reason", "accepted"), [
    ("applied", "", True),
    ("deferred", "inuse_capacity_above_limit", True),
    ("stale", "", False),
    ("conflict", "revision_reused_with_different_limit", False),
    ("unavailable", "no_registered_kv_cache_pool", False),
    ("rejected", "quarantined_pages_prevent_resize", False),
])
def test_each_kvcached_answer_keeps_its_status_and_reason(
    kv: FakeKvcached, dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], status: str, reason: str, accepted: bool,
) -> None:
    """Notes §2.2: the instance answer's states and reasons (``rejected`` being the one
    0.1.6 adds), its keys, and the provider's reading: ``applied``/``deferred`` accepted,
    the other four failures. kvcached's answer is given verbatim by the fake control
    module, so the command's own handling of each state is what is checked."""
    pool_state = {"pool_name": "block_pool", "group_id": 0,
                  "current_capacity_bytes": 8 << 30, "status": status, "reason": reason,
                  **_FIGURES}
    answer = {"status": status, "reason": reason, **_FIGURES, "pools": [pool_state]}

    def answer_as_kvcached(limit_bytes: int, *, revision: int) -> dict[str, Any]:
        assert (limit_bytes, revision) == (5 << 30, 1)
        return answer

    kv.register(FakeKVCacheManager(num_blocks=64))
    monkeypatch.setattr(kv_control(), "set_instance_memory_limit", answer_as_kvcached)
    code, out, err = _limit(capsys, "--adopt", "--json", "5G")
    assert err == "" and code == (0 if accepted else 1)
    result = json.loads(out)
    assert {k: result[k] for k in ("status", "reason", *_FIGURES)} == {
        "status": status, "reason": reason, **_FIGURES}
    assert result["pools"] == [pool_state] and result["via"] == "in-process"


def test_an_unknown_kvcached_state_is_a_refusal(
    kv: FakeKvcached, dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    kv.register(FakeKVCacheManager(num_blocks=64))
    monkeypatch.setattr(kv_control(), "set_instance_memory_limit",
                        lambda limit_bytes, *, revision: {"status": "retired", **_FIGURES})
    code, out, _ = _limit(capsys, "--adopt", "5G")
    assert code == 1
    assert out.split()[0] == "rejected" and "reason=unknown_status" in out
    assert "kvcached answered an unknown status 'retired'" in out


def kv_control() -> Any:
    """The fake ``kvcached.control`` module installed for this test."""
    return sys.modules["kvcached.control"]


# ------------------------------------------------------------- §4 empty KVCACHED_IPC_NAME


def test_an_empty_ipc_name_is_no_instance_name(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """kvcached treats an empty ``KVCACHED_IPC_NAME`` as unset and derives
    ``kvcached_<engine>_<pgid>``, which neither kvctl nor the provider can be told in
    advance: the planned name must be refused wherever it is used."""
    [(ok, line)] = checks.check_ipc_name("", dirs[1])
    assert not ok and line.startswith("KVCACHED_IPC_NAME '' is invalid")
    failed = [text for good, text in checks.check(
        MANIFEST, {"environment": {"KVCACHED_IPC_NAME": ""}}) if not good]
    assert any(text.startswith("KVCACHED_IPC_NAME '' is invalid") for text in failed)

    monkeypatch.setattr(activation, "_responder", None)
    monkeypatch.setenv("ENABLE_KVCACHED", "true")
    monkeypatch.setenv("KVCACHED_IPC_NAME", "")
    assert activation.register() is None and activation._responder is None

    with pytest.raises(LimitError, match=r"--ipc '' is invalid"):
        limit.validate_ipc_name("")
    assert main(["limit", "--ipc", "", "1G"]) == 2
    assert main(["cleanup", "--ipc", ""]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(e.startswith("kvcached-provider: error: ") for e in err)
    assert segments.on_shutdown(MANIFEST, {"environment": {"KVCACHED_IPC_NAME": ""}}) == [
        "KVCACHED_IPC_NAME is invalid (''), so this instance's kvcached segments cannot be "
        "told from others': nothing removed"]


# ------------------------------------------------------------- §7 check 1 error line


def test_an_unparsable_kvcached_version_is_one_failing_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Check 1 reads kvcached's version from its metadata; one that is no version at all
    (a hand-built or vendored install) is a failing line naming it, and ``check()`` keeps
    it as that line rather than as an unexpected failure."""
    info = tmp_path / "kvcached-custom.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvcached\nVersion: custom\n")
    (info / "RECORD").write_text(f"{info.name}/METADATA,,\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    expected = (False, "kvcached reports an unparsable version 'custom'; reinstall it with "
                       "`pip install --force-reinstall 'kvcached>=0.1.6' --no-build-isolation`")
    assert checks.check_kvcached_version() == expected
    assert checks.check(MANIFEST, {})[0] == expected


# ------------------------------------------------------------- §8 beside the BidKV bundle


class _Published:
    """A host's own capacity source (the replay's elastic pool publishes one)."""

    def __init__(self, published: CapacitySignals) -> None:
        self.published = published

    def capacity_signals(self) -> CapacitySignals:
        return self.published

    def page_model(self) -> PageModel:
        return PageModel(blocks_per_page=16, num_blocks=64)


def test_a_registered_source_answers_instead_of_kvcached_pools(kv: FakeKvcached) -> None:
    """The BidKV policy reads ``current_signals()`` in the scheduler process. When a host
    registers its own source there while kvcached pools exist too, the source is the
    explicit statement and answers; kvcached's pools answer again once it is withdrawn."""
    pool = kv.register(FakeKVCacheManager(num_blocks=64, physical_free_pages=3))
    assert pool.alloc(40) is not None
    pool.set_memory_limit(2 * (8 << 20), revision=1)  # kvcached is shrinking
    published = CapacitySignals(in_shrink=False, available_blocks=5, memory_limit_bytes=None,
                                effective_limit_bytes=None, mapped_bytes=None,
                                physical_free_pages=None, pools=())
    with signals.signals_source(_Published(published)):
        assert signals.current_signals() is published
    after = signals.current_signals()
    assert after is not None and after.in_shrink and after.available_blocks == 8


# --- the fake itself: §2.1's allocator, so the tests above exercise what the notes say ---


def test_the_fake_counts_reserved_pages_as_room_for_fresh_ones() -> None:
    """§2.1: ``available_size()`` = holes + min(virtual free pages, physical free pages +
    reserved pages) x blocks per page; pages mapped afresh come out of the reserve (as a
    real pool's did: tests/test_kvcached_fidelity.py)."""
    pool = FakeKVCacheManager(num_blocks=64, physical_free_pages=0)  # 4 pages of 16 blocks
    assert pool.available_size() == 0 and pool.alloc(1) is None
    pool.reserved_pages = 2
    assert pool.available_size() == 32
    assert pool.alloc(20) is not None and pool.inuse_pages() == 2
    assert pool.reserved_pages == 0
    assert pool.available_size() == 12  # the holes on the second page only


def test_the_fake_allocates_best_fit_on_partly_used_pages_before_fresh_ones() -> None:
    """§2.1: allocation takes partly used pages first, best fit (the smallest page that
    holds the whole run, else the emptiest), then fresh pages; block 0 is the null block
    when asked for, as vLLM asks."""
    pool = FakeKVCacheManager(num_blocks=64, reserve_null_block=True)
    assert 0 not in (pool.alloc(63) or [])
    assert pool.alloc(1) is None  # 63 usable blocks, all taken
    pool.free([*range(1, 9), 20, 21])  # 8 holes on page 0, 2 on page 1
    assert pool.alloc(2) == [20, 21]  # page 1 holds the run exactly: best fit
    assert pool.alloc(3) == [1, 2, 3]
    pool.free(range(32, 48))  # page 2 empty again: no longer mapped
    assert pool.alloc(6) == [4, 5, 6, 7, 8, 32]  # the holes first, then a fresh page
