"""Gaps the twenty-first mutation audit (``kvcached_provider.claim``, ``locking`` and
``activation``) found in the claim tests; each test below failed under a mutant that the
whole kvcached and launch-guard test set let pass.

Guarded: a process that claims its name twice (the plugin, then a launch check in the same
process) keeps one descriptor, and its own claim is no conflict; the claims directory and
files are private to the user (0700, 0600); the holders are named also when the state
directory is reached through a symbolic link; an engine holding a name that extends
another (``llama-8000`` beside ``llama``) is not named as that other name's holder; and
where ``/proc`` cannot be listed the claim still decides, its holders unnamed. The
plugin starts its limit responder when the claim cannot be made. And the bounded lock wait
(``locking.lock_exclusive_within``, the claim's launch turn and the limit exchange) gives
up at its deadline, polling at its interval, and takes a lock let go while it waits; the
launch turn's wait is the documented 5 s (the one survivor left by the audit, killed since).
Real processes stand in for engines, as in test_kvcached_claim.py.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvcached_provider import activation, checks, claim, locking
from tests.test_kvcached_claim import NAME, _engines, _open_on, _stop, dirs

__all__ = ["dirs"]  # a fixture, used by name


@pytest.fixture
def own_claims() -> Iterator[None]:
    """Claims this test makes in the pytest process itself are released afterwards (the
    module keeps them for the life of the process, by design)."""
    before = set(claim._held)
    yield
    for path in set(claim._held) - before:
        os.close(claim._held.pop(path))


def test_claiming_twice_keeps_one_descriptor_and_is_no_conflict(
    dirs: tuple[Path, Path], own_claims: None
) -> None:
    """Mutants: ``hold`` no longer returning early for a name it holds, or no longer
    remembering it. A second ``hold`` would open (and lock) another descriptor, and a
    launch check after the plugin's own claim would find the name taken by 'a live process'
    (its own other descriptor) instead of passing."""
    path = claim.hold(NAME)
    assert claim.hold(NAME) == path
    assert len(_open_on(path)) == 1
    assert claim.claim_for_launch(NAME) is None
    assert len(_open_on(path)) == 1


def test_the_claims_are_private_to_the_user(
    dirs: tuple[Path, Path], own_claims: None
) -> None:
    """Mutants: the claims directory made with the umask's mode, the claim file 0644.
    Another user who could open a claim could lock it and refuse this user's launches."""
    state, _ = dirs
    old = os.umask(0o022)
    try:
        path = claim.hold(NAME)
    finally:
        os.umask(old)
    assert stat.S_IMODE((state / "claims").stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_holders_are_named_through_a_symlinked_state_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutant: the holders matched against the claim's path as given, not its real path.
    ``/proc/<pid>/fd`` links name the real file, so behind a symbolic link (a ``/tmp``
    or home directory that is one) every holder went unnamed."""
    real = tmp_path / "real-state"
    real.mkdir()
    state = tmp_path / "state"
    state.symlink_to(real)
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("KVCACHED_PROVIDER_STATE_DIR", str(state))
    [engine] = _engines(state, shm, NAME)
    try:
        assert claim.holders(NAME) == [engine.pid]
    finally:
        _stop([engine])


def test_a_name_extending_another_is_not_its_holder(dirs: tuple[Path, Path]) -> None:
    """Mutant: a descriptor counted as a holder when its file's path merely starts with the
    claim's. The claim of ``llama-8000`` would then name its engine among ``llama``'s
    holders too."""
    state, shm = dirs
    short, long = NAME.split("-")[0], NAME
    engines = _engines(state, shm, short, long)
    try:
        assert claim.holders(short) == [engines[0].pid]
        assert claim.holders(long) == [engines[1].pid]
    finally:
        _stop(engines)


def test_a_claim_is_decided_where_proc_cannot_be_listed(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutant: listing ``/proc`` no longer guarded. Where it cannot be listed (hidden, or
    another mount), the lock still says the name is taken; only the pids go unnamed, and
    the launch check says so instead of failing with an OSError."""
    state, shm = dirs
    monkeypatch.setattr(claim, "_PROC", state / "no-proc")
    [engine] = _engines(state, shm, NAME)
    try:
        assert claim.holders(NAME) == []
        lines = checks.check_ipc_name(NAME, shm, launching=True)
        assert [ok for ok, _ in lines] == [True, False]
        assert lines[1][1].startswith(
            f"KVCACHED_IPC_NAME {NAME!r} is claimed by a live process (pid not visible here)")
    finally:
        _stop([engine])


def test_an_unusable_claim_still_starts_the_responder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Mutant: the plugin catching only ``OSError`` from its claim. The claim's own error
    (here: the claims directory is a file) then reached the plugin's last-resort handler and
    the engine lost its limit responder too. The claim only informs launch checks: the
    responder starts, and the warning names the claim."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "claims").write_text("")
    monkeypatch.setattr(activation, "_responder", None)
    monkeypatch.setenv("KVCACHED_PROVIDER_STATE_DIR", str(state))
    monkeypatch.setenv("KVCACHED_PROVIDER_SHM_DIR", str(tmp_path))
    monkeypatch.setenv("ENABLE_KVCACHED", "true")
    monkeypatch.setenv("KVCACHED_AUTOPATCH", "1")
    monkeypatch.setenv("KVCACHED_IPC_NAME", "inst1")
    with caplog.at_level(logging.WARNING, logger="kvcached_provider.activation"):
        responder = activation.register()
    try:
        assert responder is not None and responder.ipc == "inst1"
        [record] = caplog.records
        assert record.getMessage().startswith(
            "kvcached_provider: KVCACHED_IPC_NAME 'inst1' not claimed (cannot create the "
            f"claim {state / 'claims' / 'inst1'}: ")
    finally:
        if responder is not None:
            responder.stop()



class _Clock:
    """Stands in for ``locking``'s ``time``: sleeping advances a fake monotonic clock, so
    the wait's deadline and polls are counted, not timed; ``on_sleep`` runs after each."""

    def __init__(self, on_sleep: Callable[[int], None]) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self.on_sleep = on_sleep

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        self.on_sleep(len(self.sleeps))


@pytest.mark.parametrize("release_after", [None, 3])
def test_the_bounded_lock_wait_keeps_its_deadline_and_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, release_after: int | None
) -> None:
    """Mutants: the deadline given a second of slack, the poll twenty times its interval.
    Against a lock held to the end, a 1 s wait polling every 0.125 s (exact in binary, so
    the sum is too) sleeps eight times and gives up; one let go after the third poll is
    taken then. (flock conflicts between two descriptors of one file, so one process can
    hold and wait.)"""
    path = tmp_path / "lock"
    path.touch()
    holder, waiter = os.open(path, os.O_RDONLY), os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)

        def release(count: int) -> None:
            if count == release_after:
                fcntl.flock(holder, fcntl.LOCK_UN)

        clock = _Clock(release)
        monkeypatch.setattr(locking, "time", clock)
        taken = locking.lock_exclusive_within(waiter, 1.0, 0.125)
        expected = 8 if release_after is None else release_after
        assert taken is (release_after is not None)
        assert clock.sleeps == [0.125] * expected
    finally:
        os.close(waiter)
        os.close(holder)


def test_a_launch_waits_five_seconds_for_a_held_turn_then_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launch turn (``<claim>.launch``) is held by another launcher only while it tests
    and claims; one stopped in between costs this launch 5 s (the documented bound), polled
    every 10 ms, then a refusal that names the turn file and the wait, and no claim.
    Counted on a fake clock, not timed. Left open by the twenty-first audit (the wait's
    length survived as a mutant)."""
    turn = claim.claim_path(NAME, tmp_path).with_name(f"{NAME}.launch")
    turn.parent.mkdir(parents=True)
    turn.touch()
    holder = os.open(turn, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        clock = _Clock(lambda count: None)
        monkeypatch.setattr(locking, "time", clock)
        with pytest.raises(claim.ClaimError) as refused:
            claim.claim_for_launch(NAME, tmp_path)
    finally:
        os.close(holder)
    assert str(refused.value) == (
        f"cannot test the claim {claim.claim_path(NAME, tmp_path)}: another launch has held "
        f"its turn ({NAME}.launch) for over 5 s")
    assert set(clock.sleeps) == {0.01}
    assert 5.0 <= clock.now < 5.0 + 0.01 + 1e-9
    assert claim.claim_path(NAME, tmp_path) not in claim._held
