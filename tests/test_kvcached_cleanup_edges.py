"""``kvcached_provider.segments``: the cleanup on hostile or unusual hosts.

Guards what ``test_kvcached_cleanup.py`` does not: a live engine whose ``KVCACHED_IPC_NAME``
holds bytes that are not UTF-8 still keeps its record (the name is decoded as the engine's
``os.environ`` decodes it before kvcached sanitises it); a record or socket directory used
through a symlinked or relative directory is still seen as used (``/proc`` shows resolved
paths); an unrelated process holding an exclusive ``flock`` on a file in ``/dev/shm`` does
not hang the cleanup; files whose names kvcached's sanitiser cannot produce (undecodable
bytes, a newline) are not reported, so they can neither crash the report nor forge lines in
it; a process holding a removed earlier record (open or mapped) keeps the current one; a
socket directory nested deeper than kvcached's ``pp<N>/`` is refused in one line
instead of exhausting ``os.walk``'s recursion; a path a concurrent cleanup removed in the
middle counts as gone, not as "could not be removed"; and a link swapped in for the socket
directory after the checks is not followed into its target. Everything is real: files,
processes, locks and sockets; only the moment of a concurrent cleanup or a swap is injected.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcached_provider import segments
from tests.property_settings import REAL_SCHEDULER

CLI = Path(sys.executable).with_name("kvcached-provider")
# kvcached's sanitiser (kvcached/utils.py), run inside the engine on its own os.environ.
KVCACHED_NAME = ("import os\nname = ''.join(c if c.isalnum() or c in '_-' else '-' for c in "
                 "os.environ['KVCACHED_IPC_NAME'])[:64]\nprint(name, flush=True)\n")


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "shm"
    directory.mkdir()
    monkeypatch.setenv("KVCACHED_PROVIDER_SHM_DIR", str(directory))
    return directory


@pytest.fixture
def ipc() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def tmp() -> Iterator[Path]:
    """A short ``/tmp`` stand-in (socket paths are limited to 108 characters); removed with
    ``rm -rf``, which unlike ``shutil.rmtree`` survives a very deep tree."""
    directory = Path(tempfile.mkdtemp(prefix="kv", dir="/tmp"))
    yield directory
    subprocess.run(["rm", "-rf", str(directory)], check=True)


def record(directory: Path, name: str) -> Path:
    """A control record as kvcached writes it: three int64, ``total_size`` first (> 0)."""
    path = directory / name
    path.write_bytes(struct.pack("=qqq", 8 << 30, 0, 0))
    return path


def spawn(setup: str, env: dict[bytes, bytes] | None = None) -> tuple[subprocess.Popen[bytes],
                                                                      str]:
    """A live process that ran ``setup`` and printed one line; the line, without newline."""
    code = f"import time\n{setup}\ntime.sleep(60)\n"
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE)
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.endswith(b"\n"), line
    return child, line[:-1].decode()


def stop(child: subprocess.Popen[bytes]) -> None:
    child.kill()
    child.wait()
    if child.stdout is not None:
        child.stdout.close()


def test_an_undecodable_ipc_name_is_compared_as_kvcached_reads_it(shm: Path, ipc: str) -> None:
    """An invalid UTF-8 run in the engine's KVCACHED_IPC_NAME: kvcached reads it through
    os.environ (surrogateescape, one "-" per byte); decoding with "replace" folded the run
    into one character, named another instance and removed the live engine's record."""
    env = {os.fsencode(k): os.fsencode(v) for k, v in os.environ.items()}
    env[b"KVCACHED_IPC_NAME"] = ipc.encode() + b"\xe4\xb8"  # a truncated 3-byte sequence
    engine, name = spawn(KVCACHED_NAME, env)
    try:
        assert name == f"{ipc}--"  # what kvcached itself names the record in that process
        path = record(shm, name)
        report = segments.cleanup(name)
        assert report.kept == ((str(path), f"in use by pid {engine.pid}"),)
        assert path.exists()
    finally:
        stop(engine)


@pytest.mark.parametrize("spelling", ["symlink", "relative"])
def test_a_record_open_through_another_spelling_of_the_directory_is_kept(
    tmp_path: Path, ipc: str, spelling: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``/proc/<pid>/fd`` shows the resolved absolute path: a symlinked (``/dev/shm`` ->
    ``/run/shm``) or relative shm directory made an open record look unused."""
    real = tmp_path / "real-shm"
    real.mkdir()
    if spelling == "symlink":
        shm = tmp_path / "shm-link"
        shm.symlink_to(real)
    else:
        monkeypatch.chdir(tmp_path)
        shm = Path("real-shm")
    path = record(shm, ipc)
    holder, _ = spawn(f"f = open({str(real / ipc)!r}, 'rb')\nprint('ready', flush=True)")
    try:
        report = segments.cleanup(ipc, shm=shm)
        assert report.kept == ((str(path), f"in use by pid {holder.pid}"),)
        assert (real / ipc).exists()
    finally:
        stop(holder)
    assert segments.cleanup(ipc, shm=shm).removed == (str(path),)


@pytest.mark.parametrize("hold", ["open", "mapped"])
def test_a_process_holding_a_removed_earlier_record_keeps_the_current_one(
    shm: Path, ipc: str, hold: str
) -> None:
    """A held file that was removed reads as ``<path> (deleted)`` in ``/proc/<pid>/fd`` and
    in ``maps``. Both count as the path, so a process still holding an earlier record of
    the instance keeps the record now at that path; only the mapped one did before, and a
    process that merely had it open lost it."""
    path = record(shm, ipc)
    setup = f"f = open({str(path)!r}, 'rb')\n"
    if hold == "mapped":
        setup += "import mmap\nm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\nf.close()\n"
    holder, _ = spawn(setup + "print('ready', flush=True)")
    try:
        path.unlink()
        record(shm, ipc)  # a new file at the same path: the held one is now "(deleted)"
        report = segments.cleanup(ipc)
        assert report.kept == ((str(path), f"in use by pid {holder.pid}"),)
        assert path.exists()
    finally:
        stop(holder)
    assert segments.cleanup(ipc).removed == (str(path),)


def test_a_worker_bound_through_the_resolved_tmp_keeps_the_socket_dir(
    shm: Path, tmp: Path, ipc: str
) -> None:
    """``/proc/net/unix`` shows the path given to ``bind``: a worker that bound through the
    real directory still keeps the socket directory when the cleanup looks through a link."""
    link = tmp / "l"
    (tmp / "r").mkdir()
    link.symlink_to(tmp / "r")
    directory = segments.tp_socket_dir(ipc, link)
    directory.mkdir()
    real_socket = tmp / "r" / directory.name / "w0.sock"
    worker, _ = spawn("import socket\ns = socket.socket(socket.AF_UNIX)\n"
                      f"s.bind({str(real_socket)!r}); s.listen()\nprint('ready', flush=True)")
    try:
        assert segments.cleanup(ipc, tmp=link).kept == (
            (str(directory), f"a live process is bound to {real_socket}"),)
        assert real_socket.exists()
    finally:
        stop(worker)
    assert segments.cleanup(ipc, tmp=link).removed == (str(directory),)


def test_an_unrelated_exclusive_lock_in_shm_does_not_hang_the_cleanup(
    shm: Path, ipc: str
) -> None:
    """Every file in ``/dev/shm`` was read under a blocking shared ``flock``: any process
    holding an exclusive lock on one (record-sized or not) hung the cleanup, and with it
    the manager's shutdown hook, for as long as it held the lock."""
    other = record(shm, "other-app")
    big = shm / "other-app-data"
    big.write_bytes(bytes(4096))
    setup = ("import fcntl\nheld = []\n"
             f"for p in ({str(other)!r}, {str(big)!r}):\n"
             "    f = open(p, 'rb'); fcntl.flock(f, fcntl.LOCK_EX); held.append(f)\n"
             "print('locked', flush=True)")
    locker, _ = spawn(setup)
    try:
        with open(other, "rb") as probe, pytest.raises(BlockingIOError):  # really held
            fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
        done = subprocess.run([str(CLI), "cleanup", "--ipc", ipc], capture_output=True,
                              text=True, timeout=30)
    finally:
        stop(locker)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"left {other}: another instance's record, in use by pid {locker.pid}"]


def test_names_kvcached_cannot_produce_are_not_reported(shm: Path, ipc: str) -> None:
    """kvcached's sanitiser keeps only alphanumerics, ``_`` and ``-``: a record-sized file
    with an undecodable name crashed ``print`` under a strict UTF-8 locale (a traceback,
    not a report), and one whose name held a newline forged a ``removed`` line."""
    odd = [record(shm, os.fsdecode(b"odd\xff")), record(shm, "fake\nremoved kvcached_vLLM_1"),
           record(shm, "has space")]
    accented = record(shm, "modèle-1")  # isalnum: kvcached keeps it, so it is reported
    report = segments.cleanup(ipc)
    assert report.foreign == ((str(accented), "possibly stale record of another instance; "
                               "if no engine uses it remove it with `kvctl delete modèle-1`"),)
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}  # as under en_US.UTF-8
    done = subprocess.run([str(CLI), "cleanup", "--ipc", ipc], env=env, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.splitlines() == [f"left {line}" for line in
                                        (f"{p}: {n}" for p, n in report.foreign)]
    assert all(p.exists() for p in [*odd, accented])


@pytest.mark.parametrize("depth", [2, 1200])
def test_a_socket_dir_nested_deeper_than_kvcacheds_is_refused_in_one_line(
    shm: Path, tmp: Path, ipc: str, depth: int
) -> None:
    """kvcached nests one level (``pp<N>/``); 1,200 levels exhausted ``os.walk``'s
    recursion, a RecursionError traceback instead of a report."""
    directory = segments.tp_socket_dir(ipc, tmp)
    _mkdir_chain(directory, depth)
    with socket.socket(socket.AF_UNIX) as bound:
        bound.bind(str(directory / "w0.sock"))
    report = segments.cleanup(ipc, tmp=tmp)
    assert report.kept == ((str(directory), f"holds the directory {directory / 'pp1' / 'a'}, "
                            "nested deeper than kvcached's pp<N>/; remove it by hand if it "
                            "is stale"),)
    assert (directory / "w0.sock").exists()


def _mkdir_chain(directory: Path, depth: int) -> None:
    """``directory/pp1/a/...`` (``depth`` levels) without ``os.makedirs``, itself recursive."""
    path = directory
    path.mkdir()
    for name in ["pp1", *["a"] * (depth - 1)]:
        path = path / name
        os.mkdir(path)


def test_a_socket_dir_a_concurrent_cleanup_removed_counts_as_gone(
    shm: Path, tmp: Path, ipc: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two cleanups of one instance at once (the manager's shutdown hook and an operator):
    the one that lost the race reported "could not be removed (No such file or directory)"
    and exited 1 although nothing of the instance was left."""
    directory = segments.tp_socket_dir(ipc, tmp)
    (directory / "pp1").mkdir(parents=True)
    for path in (directory / "w0.sock", directory / "pp1" / "w1.sock"):
        with socket.socket(socket.AF_UNIX) as bound:
            bound.bind(str(path))
    checked = segments._socket_dir_refusal

    def then_the_other_cleanup_removes_it(path: Path) -> str | None:
        why = checked(path)
        shutil.rmtree(path)
        return why

    monkeypatch.setattr(segments, "_socket_dir_refusal", then_the_other_cleanup_removes_it)
    report = segments.cleanup(ipc, tmp=tmp)
    assert report.clean and report.removed == (str(directory),)
    assert not directory.exists()


def test_a_record_a_concurrent_cleanup_removed_counts_as_gone(
    shm: Path, ipc: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record the other cleanup unlinked between the listing and the checks."""
    path = record(shm, ipc)
    judged = segments._not_kvcacheds

    def after_the_other_cleanup(found: Path, socket_dir: bool) -> str | None:
        found.unlink()
        return judged(found, socket_dir)

    monkeypatch.setattr(segments, "_not_kvcacheds", after_the_other_cleanup)
    report = segments.cleanup(ipc)
    assert report.clean and report.removed == (str(path),)


def test_a_link_swapped_in_after_the_checks_is_not_followed(
    shm: Path, tmp: Path, ipc: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``/tmp`` is shared and the socket directory's name predictable: a directory replaced
    by a link between the checks and the removal had the link's target emptied (``os.walk``
    follows its top). Nothing outside the checked directory may be removed."""
    directory = segments.tp_socket_dir(ipc, tmp)
    directory.mkdir()
    victim = tmp / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("not kvcached's")
    with socket.socket(socket.AF_UNIX) as bound:
        bound.bind(str(victim / "w0.sock"))
    checked = segments._socket_dir_refusal

    def then_swapped_for_a_link(path: Path) -> str | None:
        why = checked(path)
        path.rename(tmp / "moved-aside")
        path.symlink_to(victim)
        return why

    monkeypatch.setattr(segments, "_socket_dir_refusal", then_swapped_for_a_link)
    report = segments.cleanup(ipc, tmp=tmp)
    assert report.removed == ()
    assert report.kept == ((str(directory), "could not be removed (Not a directory)"),)
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt", "w0.sock"]


_FILE_NAME = st.binary(min_size=1, max_size=10).filter(
    lambda raw: b"/" not in raw and b"\0" not in raw and raw not in (b".", b".."))


@settings(REAL_SCHEDULER, max_examples=60)
@given(names=st.lists(st.tuples(st.booleans(), _FILE_NAME), max_size=4))
def test_any_names_in_shm_give_one_clean_line_each(names: list[tuple[bool, bytes]]) -> None:
    """Whatever record-sized files lie in ``/dev/shm`` (any bytes for a name, some starting
    with the instance's own name): only the instance's leaked records (``inst``,
    ``inst_g<N>``) are removed, and every report line is one line, strict UTF-8, about a
    file that is there, whose name kvcached's sanitiser leaves as it is."""
    ipc = "inst"
    with tempfile.TemporaryDirectory() as base:
        shm = Path(base)
        record(shm, ipc)
        for prefixed, raw in names:
            record(shm, os.fsdecode(ipc.encode() + raw if prefixed else raw))
        own = sorted(str(p) for p in shm.iterdir() if re.fullmatch(r"inst(_g[0-9]+)?", p.name))
        others = {p for p in shm.iterdir() if str(p) not in own}
        report = segments.cleanup(ipc, shm=shm)
        lines = report.lines()
        assert sorted(report.removed) == own and not any(map(os.path.lexists, own))
        assert sorted(line for line in lines if line.startswith("removed ")) == sorted(
            f"removed {path}" for path in own)
        for line in lines:
            line.encode("utf-8")  # strict: no lone surrogate from an undecodable name
            assert line.isprintable(), line
        for path, _ in report.foreign:
            assert Path(path) in others
            name = Path(path).name
            assert "".join(c if c.isalnum() or c in "_-" else "-" for c in name) == name
        assert len(lines) == len(own) + len(report.kept) + len(report.foreign)
