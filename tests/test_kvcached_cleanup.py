"""``kvcached_provider.segments``: an instance's leaked segments are removed at shutdown.

Guards kvcached-notes.md §7 check 9: the instance's control records (``<ipc>``,
``<ipc>_g<N>``) and its TP socket directory are removed once nothing uses them; a record or
directory still used by a live process (its environment names the instance as kvcached
sanitises and truncates it, it leads the group a default name was derived from even under a
command name holding ``) ``, or it holds the file open or mapped) is kept and the pid
named, while a process holding another instance's record does not keep this one; other
instances' records are reported as possibly stale and never touched; a socket directory
holding anything but sockets (or a link) is kept, and so is anything under the instance's
names that is not what kvcached leaves there, a dangling link included. Everything here is
real: files in a temporary ``/dev/shm`` stand-in, real Unix sockets, real processes found
through ``/proc``, the real ``kvcached-provider`` console script. No kvcached module is
involved (the cleanup never imports it).
"""

from __future__ import annotations

import json
import os
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

from kvcached_provider import segments

ROOT = Path(__file__).resolve().parents[1]
CLI = Path(sys.executable).with_name("kvcached-provider")


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "shm"
    directory.mkdir()
    monkeypatch.setenv("KVCACHED_PROVIDER_SHM_DIR", str(directory))
    return directory


@pytest.fixture
def ipc() -> Iterator[str]:
    """A fresh instance name; its real ``/tmp`` socket directory is removed afterwards."""
    name = f"t{uuid.uuid4().hex[:12]}"
    yield name
    directory = segments.tp_socket_dir(name)
    if directory.exists():
        subprocess.run(["rm", "-rf", str(directory)], check=True)


@pytest.fixture
def tmp() -> Iterator[Path]:
    """A short ``/tmp`` stand-in: Unix socket paths are limited to 108 characters."""
    directory = Path(tempfile.mkdtemp(prefix="kv", dir="/tmp"))
    yield directory
    shutil.rmtree(directory)


def record(shm: Path, name: str) -> Path:
    """A control record as kvcached writes it: three int64, ``total_size`` first (> 0)."""
    path = shm / name
    path.write_bytes(struct.pack("=qqq", 8 << 30, 0, 0))
    return path


def socket_dir(ipc: str, tmp: Path | None = None) -> Path:
    """kvcached's TP socket directory with a bound worker socket in it (and one in pp1/)."""
    directory = segments.tp_socket_dir(ipc, tmp)
    (directory / "pp1").mkdir(parents=True)
    for path in (directory / "w0.sock", directory / "pp1" / "w1.sock"):
        with socket.socket(socket.AF_UNIX) as bound:
            bound.bind(str(path))
    return directory


def sleeper(env: dict[str, str], *, setup: str = "",
            new_session: bool = False) -> subprocess.Popen[bytes]:
    """A live process with ``env`` that ran ``setup`` (Python), ready when it prints; with
    ``new_session`` it leads its own process group (pgid == pid)."""
    code = f"import time\n{setup}\nprint('ready', flush=True)\ntime.sleep(60)\n"
    child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **env},
                             stdout=subprocess.PIPE, start_new_session=new_session)
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    return child


def listener(path: Path) -> subprocess.Popen[bytes]:
    """A live process listening on a Unix socket bound at ``path``, spelled as given (a
    worker shows in ``/proc/net/unix`` by that spelling)."""
    return sleeper({}, setup="import socket\ns = socket.socket(socket.AF_UNIX)\n"
                   f"s.bind({str(path)!r}); s.listen()")


def stop(child: subprocess.Popen[bytes]) -> None:
    child.kill()
    child.wait()


def test_socket_dir_name_follows_kvcached() -> None:
    # kvcached's tp_ipc_util: /tmp/kvcached-tp-<name>-<uuid5(NAMESPACE_DNS, name).hex[:8]>
    expected = uuid.uuid5(uuid.NAMESPACE_DNS, "llama-8000").hex[:8]
    assert segments.tp_socket_dir("llama-8000") == Path(f"/tmp/kvcached-tp-llama-8000-{expected}")


def test_leaked_records_and_socket_dir_are_removed(shm: Path, tmp: Path, ipc: str) -> None:
    own = [record(shm, ipc), record(shm, f"{ipc}_g1"), record(shm, f"{ipc}_g12")]
    sockets = socket_dir(ipc, tmp)
    report = segments.cleanup(ipc, tmp=tmp)
    assert report.clean and report.kept == () and report.foreign == ()
    assert sorted(report.removed) == sorted(str(p) for p in [*own, sockets])
    assert not any(p.exists() for p in own) and not sockets.exists()
    assert report.lines()[0].startswith("removed ")


def test_dry_run_removes_nothing(shm: Path, tmp: Path, ipc: str) -> None:
    path = record(shm, ipc)
    sockets = socket_dir(ipc, tmp)
    report = segments.cleanup(ipc, dry_run=True, tmp=tmp)
    assert report.lines() == [f"would remove {path}", f"would remove {sockets}"]
    assert path.exists() and (sockets / "w0.sock").exists()


def test_nothing_to_do_says_so(shm: Path, tmp: Path, ipc: str) -> None:
    report = segments.cleanup(ipc, tmp=tmp)
    assert report.lines() == [f"no leaked kvcached segment of instance {ipc!r}"]


def test_a_live_engine_keeps_its_records(shm: Path, tmp: Path, ipc: str) -> None:
    path = record(shm, ipc)
    sockets = socket_dir(ipc, tmp)
    engine = sleeper({"ENABLE_KVCACHED": "true", "KVCACHED_IPC_NAME": ipc})
    try:
        report = segments.cleanup(ipc, tmp=tmp)
        assert not report.clean and report.removed == ()
        assert report.kept == ((str(path), f"in use by pid {engine.pid}"),
                               (str(sockets), f"in use by pid {engine.pid}"))
        assert path.exists() and sockets.exists()
    finally:
        stop(engine)
    assert segments.cleanup(ipc, tmp=tmp).clean  # once it is gone, they go
    assert not path.exists() and not sockets.exists()


def test_a_process_holding_the_record_open_keeps_it(shm: Path, ipc: str) -> None:
    path = record(shm, ipc)
    holder = sleeper({}, setup=f"f = open({str(path)!r}, 'rb')")  # found through its fd
    try:
        report = segments.cleanup(ipc)
        assert report.kept == ((str(path), f"in use by pid {holder.pid}"),)
    finally:
        stop(holder)


def test_naming_the_instance_is_enough(shm: Path, ipc: str) -> None:
    # kvcached releases differ in how they are switched on: the name alone counts.
    path = record(shm, ipc)
    other = sleeper({"ENABLE_KVCACHED": "false", "KVCACHED_IPC_NAME": ipc})
    try:
        assert segments.cleanup(ipc).kept == ((str(path), f"in use by pid {other.pid}"),)
    finally:
        stop(other)


def test_the_name_is_compared_as_kvcached_sanitises_it(shm: Path, ipc: str) -> None:
    path = record(shm, f"{ipc}-dot")  # kvcached turns "<ipc>.dot" into "<ipc>-dot"
    engine = sleeper({"KVCACHED_IPC_NAME": f"{ipc}.dot"})
    try:
        assert segments.cleanup(f"{ipc}-dot").kept == (
            (str(path), f"in use by pid {engine.pid}"),)
    finally:
        stop(engine)


def test_a_long_name_is_compared_as_kvcached_truncates_it(shm: Path, ipc: str) -> None:
    """kvcached uses an explicit name sanitised and cut to 64 characters."""
    name = ipc + "x" * (70 - len(ipc))
    path = record(shm, name[:64])
    engine = sleeper({"KVCACHED_IPC_NAME": name})
    try:
        assert segments.cleanup(name[:64]).kept == ((str(path), f"in use by pid {engine.pid}"),)
    finally:
        stop(engine)


def test_a_process_mapping_the_record_keeps_it(shm: Path, ipc: str) -> None:
    """A process that mapped the record and closed its descriptor still uses it (libc's
    mmap: Python's ``mmap`` module would keep a duplicate descriptor open)."""
    path = record(shm, ipc)
    setup = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.mmap.restype = ctypes.c_void_p\n"
        "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,"
        " ctypes.c_int, ctypes.c_long]\n"
        f"fd = os.open({str(path)!r}, os.O_RDONLY)\n"
        "addr = libc.mmap(None, 24, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED\n"
        "assert addr not in (None, ctypes.c_void_p(-1).value)\n"
        "os.close(fd)"
    )
    holder = sleeper({}, setup=setup)
    try:
        fds = Path(f"/proc/{holder.pid}/fd").iterdir()
        assert str(path) not in {os.readlink(fd) for fd in fds}  # only the mapping is left
        assert segments.cleanup(ipc).kept == ((str(path), f"in use by pid {holder.pid}"),)
    finally:
        stop(holder)


def test_another_instances_open_record_does_not_keep_this_one(shm: Path, ipc: str) -> None:
    """Only this instance's own paths count: ``<ipc>x`` open elsewhere is another instance."""
    path = record(shm, ipc)
    other = record(shm, f"{ipc}x")
    holder = sleeper({}, setup=f"f = open({str(other)!r}, 'rb')")
    try:
        report = segments.cleanup(ipc)
    finally:
        stop(holder)
    assert report.removed == (str(path),) and report.kept == ()
    assert report.foreign == ((str(other), f"another instance's record, in use by pid "
                                           f"{holder.pid}"),)


def test_a_default_name_belongs_to_its_process_group(shm: Path) -> None:
    """Without KVCACHED_IPC_NAME kvcached names the instance kvcached_<engine>_<pgid>."""
    engine = sleeper({}, new_session=True)  # no KVCACHED_IPC_NAME; its group is its pid
    names = [f"kvcached_vLLM_{engine.pid}", f"kvcached_vLLM_{engine.pid}_1_g2"]
    paths = [record(shm, n) for n in names]
    try:
        for name, path in zip(names, paths, strict=True):
            assert segments.cleanup(name).kept == ((str(path), f"in use by pid {engine.pid}"),)
    finally:
        stop(engine)
    assert segments.cleanup(names[0]).removed == (str(paths[0]),)


def test_a_command_name_with_a_parenthesis_still_shows_its_group(
    shm: Path, tmp_path: Path
) -> None:
    """``/proc/<pid>/stat`` puts the command name in parentheses and the name may hold
    ``) ``: the group is read after the last ``)``, so the engine still counts as a user."""
    alias = tmp_path / "a) b c d"  # becomes the process's command name
    alias.symlink_to(sys.executable)
    code = "import time\nprint('ready', flush=True)\ntime.sleep(60)\n"
    engine = subprocess.Popen([str(alias), "-c", code], stdout=subprocess.PIPE,
                              start_new_session=True)
    try:
        assert engine.stdout is not None and engine.stdout.readline() == b"ready\n"
        assert Path(f"/proc/{engine.pid}/comm").read_text().strip() == "a) b c d"
        path = record(shm, f"kvcached_vLLM_{engine.pid}")
        assert segments.cleanup(path.name).kept == ((str(path), f"in use by pid {engine.pid}"),)
    finally:
        stop(engine)


def test_a_bound_socket_keeps_the_socket_dir(shm: Path, tmp: Path, ipc: str) -> None:
    # A socket fd reads as "socket:[inode]": a listening worker is seen in /proc/net/unix.
    directory = segments.tp_socket_dir(ipc, tmp)
    directory.mkdir()
    worker = listener(directory / "w0.sock")
    try:
        assert segments.cleanup(ipc, tmp=tmp).kept == (
            (str(directory), f"a live process is bound to {directory / 'w0.sock'}"),)
    finally:
        stop(worker)
    assert segments.cleanup(ipc, tmp=tmp).removed == (str(directory),)


def test_without_proc_nothing_is_removed(shm: Path, ipc: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    path = record(shm, ipc)
    monkeypatch.setattr(segments, "_PROC", shm / "no-proc")
    with pytest.raises(segments.CleanupError, match=r"cannot list processes in .*nothing "
                                                    r"removed"):
        segments.cleanup(ipc)
    assert path.exists()
    assert segments.on_shutdown({}, {"environment": {"KVCACHED_IPC_NAME": ipc}})[0].startswith(
        "cannot list processes in")


def test_an_unreadable_shm_dir_is_an_error(tmp_path: Path, ipc: str) -> None:
    with pytest.raises(segments.CleanupError, match=r"cannot list .*missing.*nothing removed"):
        segments.cleanup(ipc, shm=tmp_path / "missing")


def test_an_instance_named_like_a_group_keeps_its_record(shm: Path, ipc: str) -> None:
    # "<ipc>_g2" is either group 2 of <ipc> or a separate instance of that name.
    path = record(shm, f"{ipc}_g2")
    other = sleeper({"ENABLE_KVCACHED": "1", "KVCACHED_IPC_NAME": f"{ipc}_g2"})
    try:
        assert segments.cleanup(ipc).kept == ((str(path), f"in use by pid {other.pid}"),)
    finally:
        stop(other)


def test_other_instances_records_are_never_removed(shm: Path, ipc: str) -> None:
    stale = record(shm, "kvcached_vLLM_4242")
    # Users are found machine-wide by the name in their environment: a name of this run's
    # own, so that another run's engine cannot show up as this one's user.
    other = f"llama-{uuid.uuid4().hex[:8]}"
    live = record(shm, other)
    (shm / f"{ipc}x").write_bytes(bytes(segments.RECORD_SIZE))  # total_size 0: not a record
    (shm / "unrelated.bin").write_bytes(b"not a record")  # not record-sized: ignored
    engine = sleeper({"ENABLE_KVCACHED": "true", "KVCACHED_IPC_NAME": other})
    try:
        report = segments.cleanup(ipc)
    finally:
        stop(engine)
    assert report.removed == () and report.clean
    assert dict(report.foreign) == {
        str(stale): "possibly stale record of another instance; if no engine uses it remove "
                    "it with `kvctl delete kvcached_vLLM_4242`",
        str(live): f"another instance's record, in use by pid {engine.pid}",
    }
    assert stale.exists() and live.exists() and (shm / f"{ipc}x").exists()


def test_a_socket_dir_with_other_files_is_kept(shm: Path, tmp: Path, ipc: str) -> None:
    sockets = socket_dir(ipc, tmp)
    (sockets / "notes.txt").write_text("mine")
    report = segments.cleanup(ipc, tmp=tmp)
    assert report.kept == ((str(sockets), f"holds {sockets / 'notes.txt'}, which is not a "
                                          "socket; remove it by hand if it is stale"),)
    assert (sockets / "w0.sock").exists()


def test_a_socket_dir_holding_a_link_is_kept_whole(shm: Path, tmp: Path, ipc: str) -> None:
    sockets = socket_dir(ipc, tmp)
    (tmp / "elsewhere").mkdir()
    (sockets / "pp2").symlink_to(tmp / "elsewhere")
    report = segments.cleanup(ipc, tmp=tmp)
    assert report.kept == ((str(sockets), f"holds the link {sockets / 'pp2'}; remove it by "
                                          "hand if it is stale"),)
    assert (sockets / "w0.sock").exists() and (sockets / "pp1" / "w1.sock").exists()


def test_a_dangling_link_at_the_socket_dir_is_reported(shm: Path, tmp: Path, ipc: str) -> None:
    link = segments.tp_socket_dir(ipc, tmp)
    link.symlink_to(tmp / "gone")
    report = segments.cleanup(ipc, tmp=tmp)
    assert not report.clean
    assert report.kept == ((str(link), "a symbolic link, not kvcached's; remove it by hand if "
                                       "it is stale"),)
    assert link.is_symlink()


def test_only_what_kvcached_leaves_is_removed(shm: Path, tmp: Path, ipc: str) -> None:
    """A name alone proves nothing (kvcached-notes.md §7: never delete blindly): a record
    must be a regular 24-byte file and the socket directory a real directory."""
    (shm / ipc).mkdir()
    (shm / ipc / "data").write_text("x")
    (shm / f"{ipc}_g1").mkdir()
    (shm / f"{ipc}_g2").write_bytes(os.urandom(4096))
    (shm / f"{ipc}_g3").symlink_to(record(shm, "elsewhere"))
    leaked = record(shm, f"{ipc}_g4")
    segments.tp_socket_dir(ipc, tmp).write_text("a file, not kvcached's directory")
    report = segments.cleanup(ipc, tmp=tmp)
    assert report.removed == (str(leaked),)
    kept = dict(report.kept)
    assert kept[str(shm / ipc)].startswith("not a kvcached control record (not a regular")
    assert kept[str(shm / f"{ipc}_g1")].startswith("not a kvcached control record (not a")
    assert kept[str(shm / f"{ipc}_g2")].startswith(
        "not a kvcached control record (4096 bytes, not 24)")
    assert kept[str(shm / f"{ipc}_g3")].startswith("a symbolic link, not kvcached's")
    assert kept[str(segments.tp_socket_dir(ipc, tmp))].startswith("not a directory")
    assert all(why.endswith("remove it by hand if it is stale") for why in kept.values())
    assert (shm / ipc / "data").exists() and (shm / f"{ipc}_g2").exists()
    assert (shm / "elsewhere").exists() and segments.tp_socket_dir(ipc, tmp).exists()


def test_bad_name_is_refused(shm: Path) -> None:
    with pytest.raises(ValueError, match=r"KVCACHED_IPC_NAME '\.\./x' is invalid"):
        segments.cleanup("../x")


def test_shutdown_hook_uses_the_configured_name(shm: Path, ipc: str) -> None:
    manifest = {"activation": {"environment": {"KVCACHED_IPC_NAME": "vllm_hust_kvcached"}}}
    path = record(shm, ipc)
    lines = segments.on_shutdown(manifest, {"environment": {"KVCACHED_IPC_NAME": ipc}})
    assert lines == [f"removed {path}"] and not path.exists()
    assert segments.on_shutdown({}, {}) == [
        "KVCACHED_IPC_NAME is not set, so this instance's kvcached segments cannot be told "
        "from others': nothing removed"]
    assert "invalid ('a b')" in segments.on_shutdown(
        {}, {"environment": {"KVCACHED_IPC_NAME": "a b"}})[0]


def test_cli_cleanup(shm: Path, ipc: str) -> None:
    path = record(shm, ipc)
    sockets = socket_dir(ipc)  # the real /tmp location the command looks at
    env = {**os.environ, "KVCACHED_PROVIDER_SHM_DIR": str(shm)}
    engine = sleeper({"ENABLE_KVCACHED": "true", "KVCACHED_IPC_NAME": ipc})
    try:
        kept = subprocess.run([str(CLI), "cleanup", "--ipc", ipc], env=env,
                              capture_output=True, text=True, timeout=60)
    finally:
        stop(engine)
    assert kept.returncode == 1, kept.stderr
    assert kept.stdout.splitlines() == [f"kept {path}: in use by pid {engine.pid}",
                                        f"kept {sockets}: in use by pid {engine.pid}"]
    # The command's own environment (and so its shell's) names the instance: never a user.
    named = {**env, "ENABLE_KVCACHED": "true", "KVCACHED_IPC_NAME": ipc}
    done = subprocess.run(["sh", "-c", f"{CLI} cleanup --ipc {ipc}"], env=named,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.splitlines() == [f"removed {path}",
                                                                f"removed {sockets}"]
    bad = subprocess.run([str(CLI), "cleanup", "--ipc", "a/b"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        "kvcached-provider: error: --ipc 'a/b' is invalid: expected the instance's "
        "KVCACHED_IPC_NAME, 1-64 characters from [A-Za-z0-9_-]"]


def test_the_manager_cleans_up_after_a_launch(shm: Path, tmp_path: Path, ipc: str) -> None:
    """The whole chain through the real ``vllm-hust-ext``: enable, configure, run, clean.

    kvcached, a CUDA torch and an in-range vLLM are faked at the metadata boundary only
    (``*.dist-info`` on ``PYTHONPATH``, the autopatch ``.pth`` in the user site directory),
    so the bundle's checks pass and ``run`` launches. The launched command is a real
    process with the bundle's environment that writes the instance's control record and
    leaves a grandchild behind, as a SIGTERMed vLLM would leave its record.
    """
    from tests.test_kvcached_checks import fake_dist

    site_dir = tmp_path / "fake-site"
    site_dir.mkdir()
    fake_dist(site_dir, "kvcached", "0.1.6", {"kvcached/_C.abi3.so": b"\x7fELF"})
    fake_dist(site_dir, "torch", "2.10.0+cu128")
    fake_dist(site_dir, "vllm", "0.28.1")
    userbase = tmp_path / "userbase"
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    user_site = userbase / "lib" / version / "site-packages"
    user_site.mkdir(parents=True)
    (user_site / "kvcached_autopatch.pth").write_text("# stands in for kvcached's hook\n")
    # The fake metadata first; an inherited PYTHONPATH (a source tree under test) stays.
    pythonpath = os.pathsep.join([str(site_dir), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONUSERBASE": str(userbase),
           "VLLM_HUST_EXT_CONFIG": str(tmp_path / "config.json"),
           "KVCACHED_PROVIDER_SHM_DIR": str(shm)}
    manager = str(Path(sys.executable).with_name("vllm-hust-ext"))

    def call(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([manager, *argv], env=env, capture_output=True, text=True,
                              timeout=120)

    (tmp_path / "kv.json").write_text(json.dumps({"environment": {"KVCACHED_IPC_NAME": ipc}}))
    for argv in (["extension", "enable", "org.vllm-hust.kvcached"],
                 ["extension", "configure", "org.vllm-hust.kvcached", "--file",
                  str(tmp_path / "kv.json")]):
        assert call(*argv).returncode == 0
    shown = json.loads(call("extension", "status", "org.vllm-hust.kvcached").stdout)
    assert "degraded" not in shown["states"], shown["evidence"]
    child = (
        "import os, subprocess, sys\n"
        "assert os.environ['KVCACHED_IPC_NAME'] == sys.argv[1]\n"
        "assert os.environ['ENABLE_KVCACHED'] == 'true'\n"
        "open(os.path.join(os.environ['KVCACHED_PROVIDER_SHM_DIR'], sys.argv[1]), 'wb')"
        ".write(bytes(24))\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "sys.exit(7)\n"
    )
    done = call("run", "--shutdown-grace-seconds", "5", "--", sys.executable, "-c", child, ipc)
    assert done.returncode == 7, done.stderr
    assert not (shm / ipc).exists()
    assert done.stderr.splitlines()[-1] == (
        f"vllm-hust-ext: org.vllm-hust.kvcached: removed {shm / ipc}")


def test_an_empty_shm_dir_setting_means_dev_shm_not_the_cwd(tmp_path: Path, ipc: str) -> None:
    """KVCACHED_PROVIDER_SHM_DIR= used to be Path(""), the current directory: cleanup there
    removed any 24-byte file named like the instance."""
    bystander = record(tmp_path, ipc)
    env = {**os.environ, "KVCACHED_PROVIDER_SHM_DIR": ""}
    done = subprocess.run([str(CLI), "cleanup", "--ipc", ipc], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"no leaked kvcached segment of instance {ipc!r}"]
    assert bystander.exists()


def test_a_blank_shm_dir_setting_is_one_line(tmp_path: Path, ipc: str) -> None:
    record(tmp_path, ipc)
    env = {**os.environ, "KVCACHED_PROVIDER_SHM_DIR": " "}
    bad = subprocess.run([str(CLI), "cleanup", "--ipc", ipc], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines() == [
        "kvcached-provider: error: KVCACHED_PROVIDER_SHM_DIR=' ' is invalid: expected a "
        "directory path, or the variable unset or empty for the default /dev/shm"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [ipc]
    manifest = {"activation": {"environment": {"KVCACHED_IPC_NAME": ipc}}}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVCACHED_PROVIDER_SHM_DIR", " ")
        assert segments.on_shutdown(manifest, {})[0].startswith("KVCACHED_PROVIDER_SHM_DIR=")


def test_a_name_with_a_trailing_newline_is_refused(shm: Path, ipc: str) -> None:
    """The name pattern ended in `$`, which also matches before a final newline."""
    path = record(shm, f"{ipc}\n")
    with pytest.raises(ValueError, match=r"KVCACHED_IPC_NAME '.*\\n' is invalid"):
        segments.cleanup(f"{ipc}\n")
    bad = subprocess.run([str(CLI), "cleanup", "--ipc", f"{ipc}\n"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines() == [
        f"kvcached-provider: error: --ipc '{ipc}\\n' is invalid: expected the instance's "
        "KVCACHED_IPC_NAME, 1-64 characters from [A-Za-z0-9_-]"]
    assert "invalid" in segments.on_shutdown(
        {}, {"environment": {"KVCACHED_IPC_NAME": f"{ipc}\n"}})[0]
    assert path.exists()
