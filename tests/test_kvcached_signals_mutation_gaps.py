"""``signals.py`` and ``segments.py``: what a mutation audit of both found unguarded.

Each test failed under one deliberate mutation of ``src/kvcached_provider/signals.py`` or
``src/kvcached_provider/segments.py`` that every other test let pass (named in its
docstring). kvcached cannot be installed here (its build needs a CUDA torch), so the signals
tests fake it at the module boundary: ``tests/fake_kvcached.py`` puts fake ``kvcached.*``
modules, with behaviour taken from ``shared/specs/kvcached-notes.md``, into ``sys.modules``,
where ``signals`` looks for its pool registry. The cleanup tests need no kvcached (the
cleanup never imports it): control records are real files in a temporary ``/dev/shm``
stand-in, sockets are real, and the processes using them are real, found through ``/proc``
(two tests read a fake ``/proc`` instead, each saying why). Guarded:

- a pool that cannot report page occupancy gives ``None`` from ``pages_released``, for no
  blocks too (signals.py, ``pages_released``);
- a page counts as emptied once the ids passed on it reach its live count, not only when
  they equal it (signals.py, ``pages_released``);
- a source whose ``capacity_signals`` raises reads as no signals (signals.py,
  ``current_signals``: "Never raises");
- a record ``<ipc>_g<N>`` is group ``N`` of ``<ipc>``: an engine naming ``<ipc>`` keeps it
  (segments.py module docstring);
- a worker bound through a symlinked ``/tmp`` spelling keeps the socket directory:
  ``/proc/net/unix`` shows the path given to ``bind`` (segments.py, ``_spellings``);
- a link in ``/dev/shm`` to a record is not reported as another instance's record
  (segments.py, ``_is_record``: a regular file; "The ``lstat`` first passes over links");
- only the variable ``KVCACHED_IPC_NAME`` itself names an instance, not one that merely
  begins like it (segments.py, ``_ipc_name``);
- a worker bound to a socket whose path holds a space keeps the socket directory: the
  path is the rest of its ``/proc/net/unix`` line (segments.py module docstring);
- a socket bound in a sibling directory whose name merely begins with the socket
  directory's does not keep it (segments.py: bound "to a socket in it");
- a process holding something below the socket directory open keeps the directory
  (segments.py, ``_under``: a path "is one of spellings or lies below one of them");
- init is an ancestor like any other and never counted, even when its environment names
  the instance (segments.py module docstring: "the shell, the manager, init"); this one
  test reads a fake ``/proc`` (``segments._PROC``), as pid 1 cannot be set up for real;
- the first socket listed in ``/proc/net/unix`` counts like any other: only the header line
  is skipped (segments.py, ``_bound_sockets``; a fake ``/proc``, since which socket the
  kernel lists first cannot be chosen).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcached_provider import segments, signals
from tests.fake_kvcached import FakeKvcached, FakeKVCacheManager
from tests.test_kvcached_cleanup import (
    ipc,
    listener,
    record,
    shm,
    sleeper,
    socket_dir,
    stop,
    tmp,
)
from tests.test_kvcached_signals import kv

__all__ = ["ipc", "kv", "shm", "tmp"]  # fixtures, used by name


@pytest.fixture(autouse=True)
def _fresh_signals(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No registry module cached and no source registered, before and after each test
    (a mutant that leaves a source registered must not leak it into other tests)."""
    monkeypatch.setattr(signals, "_source", None)
    signals.reset_cache()
    yield
    signals.reset_cache()


# ------------------------------------------------------------------ signals.py


class _FailingSource:
    """A host source whose signals fail (its bookkeeping is gone)."""

    def capacity_signals(self) -> signals.CapacitySignals | None:
        raise KeyError("host bookkeeping is gone")

    def page_model(self) -> signals.PageModel | None:
        return None


def test_a_failing_source_reads_as_no_signals() -> None:
    """Mutant: only some exceptions from a source's ``capacity_signals`` were caught, so a
    ``KeyError`` escaped into the scheduler. ``current_signals``: "Never raises"."""
    with signals.signals_source(_FailingSource()):
        assert signals.current_signals() is None


def test_a_pool_without_page_occupancy_gives_no_page_facts_even_for_no_blocks(
    kv: FakeKvcached, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutant: ``pages_released`` gave up only when the pool could neither group blocks by
    page nor report occupancy, so a pool without ``get_page_occupancy`` answered 0 for no
    blocks. ``pages_released``: ``None`` when "the pool cannot report page occupancy"."""
    pool = kv.register(FakeKVCacheManager(num_blocks=64))
    assert pool.alloc(16) is not None
    assert signals.pages_released([]) == 0  # a pool that can: no blocks empty no page
    monkeypatch.setattr(pool, "get_page_occupancy", None)
    assert signals.pages_released([]) is None
    assert signals.pages_released(range(16)) is None


def test_a_page_counts_once_the_ids_on_it_reach_its_live_count(kv: FakeKvcached) -> None:
    """Mutant: a page counted only when the ids passed on it equalled its live count, so
    more ids than live blocks emptied nothing. ``pages_released``: "a page counts as
    emptied when the number of ids passed on it reaches its count, whoever holds them"."""
    pool = kv.register(FakeKVCacheManager(num_blocks=64))
    assert pool.alloc(40) is not None  # page 2 holds 8 live blocks, 32..39
    assert signals.pages_released(range(32, 48)) == 1  # 16 ids on page 2 reach its 8
    assert signals.pages_released(range(16, 48)) == 2  # page 1 (16 of 16) and page 2


# ------------------------------------------------------------------ segments.py


def test_an_engine_naming_the_instance_keeps_its_group_record(shm: Path, ipc: str) -> None:
    """Mutant: a process counted only when its ``KVCACHED_IPC_NAME`` equals the record's
    name, so the engine of ``<ipc>`` lost the record ``<ipc>_g1`` of its KV group 1.
    segments.py: ``<ipc>_g<N>`` is taken as group ``N`` of ``<ipc>``."""
    group = record(shm, f"{ipc}_g1")
    engine = sleeper({"ENABLE_KVCACHED": "true", "KVCACHED_IPC_NAME": ipc})
    try:
        report = segments.cleanup(ipc)
        assert report.kept == ((str(group), f"in use by pid {engine.pid}"),)
        assert report.removed == () and group.exists()
    finally:
        stop(engine)
    assert segments.cleanup(ipc).removed == (str(group),)


def _tmp_spelled(tmp: Path, spelling: str) -> Path:
    """A ``/tmp`` stand-in reached through a symlink, or one whose path holds a space."""
    if spelling == "linked":
        (tmp / "r").mkdir()
        (tmp / "l").symlink_to(tmp / "r")
        return tmp / "l"
    (tmp / "a b").mkdir()
    return tmp / "a b"


@pytest.mark.parametrize("spelling", ["linked", "spaced"])
def test_a_worker_bound_under_an_unusual_tmp_spelling_keeps_the_socket_dir(
    shm: Path, tmp: Path, ipc: str, spelling: str
) -> None:
    """Mutants: ``_spellings`` kept only the resolved spelling, so a worker that bound its
    socket through a symlinked ``/tmp`` (as kvcached does, with the path as given) went
    unseen (segments.py: bound sockets show "by the path given to ``bind``"); and
    ``/proc/net/unix`` lines were split on every space, so a socket path holding one was
    dropped. Either way the socket directory of a listening worker was removed
    (segments.py: in use "while some process is bound to a socket in it")."""
    spelled = _tmp_spelled(tmp, spelling)
    directory = segments.tp_socket_dir(ipc, spelled)
    directory.mkdir()
    bound = directory / "w0.sock"
    worker = listener(bound)
    try:
        assert segments.cleanup(ipc, tmp=spelled).kept == (
            (str(directory), f"a live process is bound to {bound}"),)
        assert bound.exists()
    finally:
        stop(worker)
    assert segments.cleanup(ipc, tmp=spelled).removed == (str(directory),)


def test_a_process_holding_a_directory_inside_the_socket_dir_keeps_it(
    shm: Path, tmp: Path, ipc: str
) -> None:
    """Mutant: ``_under`` matched only the path itself, so a process with kvcached's
    ``pp1/`` open inside the socket directory did not keep it. segments.py: a path counts
    when it "is one of spellings or lies below one of them"."""
    directory = socket_dir(ipc, tmp)  # w0.sock and pp1/w1.sock, no longer bound
    holder = sleeper({}, setup=f"import os\nfd = os.open({str(directory / 'pp1')!r}, "
                     "os.O_RDONLY)")
    try:
        assert segments.cleanup(ipc, tmp=tmp).kept == (
            (str(directory), f"in use by pid {holder.pid}"),)
        assert (directory / "pp1" / "w1.sock").exists()
    finally:
        stop(holder)
    assert segments.cleanup(ipc, tmp=tmp).removed == (str(directory),)


def test_init_is_never_counted_even_when_it_names_the_instance(
    tmp_path: Path, shm: Path, ipc: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutant: the walk up the ancestors stopped before pid 1, so an init that names the
    instance (``docker run -e KVCACHED_IPC_NAME=... sh -c "...; kvcached-provider
    cleanup"``) kept its records for ever. segments.py: this process and its ancestors
    "(the shell, the manager, init) are never counted"."""
    proc = tmp_path / "proc"
    me = os.getpid()
    for pid, ppid in ((me, 1), (1, 0)):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(f"{pid} (sh) S {ppid} 1 1 0 -1\n")
    (proc / "1" / "environ").write_bytes(f"PATH=/bin\0KVCACHED_IPC_NAME={ipc}\0".encode())
    monkeypatch.setattr(segments, "_PROC", proc)
    path = record(shm, ipc)
    assert segments.cleanup(ipc).removed == (str(path),)
    assert not path.exists()


def test_a_link_to_a_record_is_not_another_instances_record(
    tmp_path: Path, shm: Path, ipc: str
) -> None:
    """Mutant: ``_is_record`` read the file with ``stat``, which follows a link, so a link
    in ``/dev/shm`` to a record elsewhere was reported as another instance's record (with
    advice to ``kvctl delete`` it). ``_is_record``: "a regular file of ``RECORD_SIZE``
    bytes"; "The ``lstat`` first passes over links"."""
    target = record(tmp_path, "elsewhere")
    (shm / "llama-9000").symlink_to(target)
    report = segments.cleanup(ipc)
    assert report.foreign == ()
    assert report.lines() == [f"no leaked kvcached segment of instance {ipc!r}"]


def test_a_socket_in_a_sibling_directory_does_not_keep_the_socket_dir(
    shm: Path, tmp: Path, ipc: str
) -> None:
    """Mutant: the bound-socket check matched any path beginning with the directory's name,
    so a worker bound in ``<dir>-x/`` (the socket directory of an instance named
    ``<ipc>-<h>``) kept this instance's leaked directory. segments.py: a socket directory
    is in use while some process is bound "to a socket in it"."""
    directory = segments.tp_socket_dir(ipc, tmp)
    directory.mkdir()
    sibling = Path(f"{directory}-x")
    sibling.mkdir()
    worker = listener(sibling / "w0.sock")
    try:
        assert segments.cleanup(ipc, tmp=tmp).removed == (str(directory),)
        assert sibling.exists() and not directory.exists()
    finally:
        stop(worker)


def test_a_variable_merely_beginning_like_the_name_variable_names_nothing(
    shm: Path, ipc: str
) -> None:
    """Mutant: any environment variable beginning with ``KVCACHED_IPC_NAME`` was read as
    the instance name, so a process with ``KVCACHED_IPC_NAME_OLD=<ipc>`` kept a leaked
    record. segments.py, ``_ipc_name``: ``KVCACHED_IPC_NAME`` from a process's environment."""
    path = record(shm, ipc)
    other = sleeper({"KVCACHED_IPC_NAME_OLD": ipc})
    try:
        assert segments.cleanup(ipc).removed == (str(path),)
    finally:
        stop(other)


def test_the_first_socket_listed_in_proc_net_unix_counts(
    tmp_path: Path, shm: Path, tmp: Path, ipc: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutant: ``_bound_sockets`` skipped the first socket line with the header, so a worker
    bound first in the kernel's list went unseen and its socket directory was removed.
    segments.py: a socket directory is in use while some process is bound to a socket in
    it (``/proc/net/unix``)."""
    directory = segments.tp_socket_dir(ipc, tmp)
    directory.mkdir()
    bound = directory / "w0.sock"
    proc = tmp_path / "proc"
    (proc / "net").mkdir(parents=True)
    (proc / "net" / "unix").write_text(
        "Num       RefCount Protocol Flags    Type St Inode Path\n"
        f"0000000000000000: 00000002 00000000 00010000 0001 01 4242 {bound}\n")
    monkeypatch.setattr(segments, "_PROC", proc)
    assert segments.cleanup(ipc, tmp=tmp).kept == (
        (str(directory), f"a live process is bound to {bound}"),)
    assert directory.exists()
