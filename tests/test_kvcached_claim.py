"""A second launch under the KVCACHED_IPC_NAME of an engine that is still starting is refused.

kvcached creates an instance's control record only once the engine allocates its KV cache,
after the model has loaded; until then the record check saw nothing and a second ``run``
under the same name passed, to share the first engine's record and limits later. Guarded:
the bundle's vLLM plugin (``activation.register()``, which vLLM calls in each engine process
before loading the model) claims the name with a file lock; the launch check
(``check_ipc_name(..., launching=True)``, and ``vllm-hust-ext run``) fails while a live
process holds it, naming the pid, though no control record exists; ``status`` is not
affected; the claim ends with the process, SIGKILL included; a process that merely exports
the variable (a shell) claims nothing; a plugin with kvcached off claims nothing; a FIFO at
the claim's path hangs neither the plugin nor the check. A passing launch check claims the
name for the launcher (``run`` outlives its engine), so a second launch in the engine's
first seconds is refused; launchers testing at once let exactly one through; one stuck in
its turn delays the next by at most the turn wait; a claim whose lock fails or is
interrupted keeps no descriptor, and a failed launch claim is one line, not a traceback. Real
processes stand in for the engine: they run the real plugin, without kvcached (which needs a
CUDA build).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcached_provider import checks, claim

# Of this run (engines are started with it in their environment), shaped like "llama-8000".
NAME = f"llama-{os.getpid()}"
_ENGINE = (
    "import sys, time\n"
    "import kvcached_provider.activation as a\n"
    "a.register()\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n"
)


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    state, shm = tmp_path / "state", tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("KVCACHED_PROVIDER_STATE_DIR", str(state))
    monkeypatch.setenv("KVCACHED_PROVIDER_SHM_DIR", str(shm))
    return state, shm


def _engine_env(state: Path, shm: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVCACHED_", "ENABLE_KVCACHED", "VLLM_"))}
    return {**env, "KVCACHED_PROVIDER_STATE_DIR": str(state),
            "KVCACHED_PROVIDER_SHM_DIR": str(shm), "KVCACHED_IPC_NAME": NAME, **extra}


def _engines(state: Path, shm: Path, *names: str) -> list[subprocess.Popen[str]]:
    """One process per name that loaded the bundle's plugin with kvcached on, as an engine
    does (so each claims its name); all of them stopped if one fails to come up."""
    procs = [subprocess.Popen(
        [sys.executable, "-c", _ENGINE], text=True, stdout=subprocess.PIPE,
        env=_engine_env(state, shm, ENABLE_KVCACHED="true", KVCACHED_AUTOPATCH="1",
                        KVCACHED_IPC_NAME=name)) for name in names]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    except BaseException:
        _stop(procs)
        raise
    return procs


@pytest.fixture
def engine(dirs: tuple[Path, Path]) -> Iterator[subprocess.Popen[str]]:
    """A process that loaded the bundle's plugin with kvcached on, as an engine does."""
    [proc] = _engines(*dirs, NAME)
    try:
        yield proc
    finally:
        _stop([proc])


def test_a_starting_engine_s_name_fails_the_launch_check(
    engine: subprocess.Popen[str], dirs: tuple[Path, Path]
) -> None:
    _, shm = dirs
    assert not (shm / NAME).exists()  # no control record yet: the model is "loading"
    lines = checks.check_ipc_name(NAME, shm, launching=True)
    assert [ok for ok, _ in lines] == [True, False]
    assert lines[1][1].startswith(f"KVCACHED_IPC_NAME {NAME!r} is claimed by pid {engine.pid} "
                                  f"(claim {claim.claim_path(NAME)}): an engine already runs "
                                  "or is starting under it")
    assert "vllm-hust-ext extension configure org.vllm-hust.kvcached" in lines[1][1]
    # status (perhaps of that very engine) only describes the name
    assert checks.check_ipc_name(NAME, shm) == [(True, f"KVCACHED_IPC_NAME is {NAME!r}")]


def test_the_claim_ends_with_the_engine(engine: subprocess.Popen[str],
                                        dirs: tuple[Path, Path]) -> None:
    _, shm = dirs
    assert claim.holders(NAME) == [engine.pid]
    engine.kill()  # SIGKILL: no exit handler runs, the kernel drops the lock
    engine.wait()
    assert claim.holders(NAME) is None
    assert checks.check_ipc_name(NAME, shm, launching=True) == [
        (True, f"KVCACHED_IPC_NAME is {NAME!r}")]


@pytest.mark.parametrize("switch", [
    {"ENABLE_KVCACHED": "true", "KVCACHED_AUTOPATCH": "1"},  # a shell exporting the bundle's
    {"ENABLE_KVCACHED": "false"},  # vLLM loads the plugin in engines without kvcached too
])
def test_only_an_engine_with_kvcached_on_claims(dirs: tuple[Path, Path],
                                                switch: dict[str, str]) -> None:
    """A shell with the bundle's variables in its profile is not an engine: it must not
    block launches (finding engines by their environment would); nor is a vLLM process
    that loaded the plugin with kvcached off."""
    state, shm = dirs
    shell = switch["ENABLE_KVCACHED"] == "true"
    code = "import time; print('ready', flush=True); time.sleep(120)" if shell else _ENGINE
    proc = subprocess.Popen([sys.executable, "-c", code], text=True, stdout=subprocess.PIPE,
                            env=_engine_env(state, shm, **switch))
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        assert not (state / "claims").exists()
        assert claim.holders(NAME) is None
        assert checks.check_ipc_name(NAME, shm, launching=True) == [
            (True, f"KVCACHED_IPC_NAME is {NAME!r}")]
    finally:
        proc.kill()
        proc.wait()


def test_the_bundle_check_fails_only_for_a_launch(
    engine: subprocess.Popen[str], dirs: tuple[Path, Path]
) -> None:
    """``check`` with the launch command (what ``run`` passes) fails on the claim; without
    one (``status``) it does not. tests/test_kvcached_activation.py runs the real ``run``."""
    manifest = json.loads(Path(__file__).resolve().parents[1].joinpath(
        "manifests/kvcached/vllm-hust-extension-v0.2.json").read_text(encoding="utf-8"))
    found = checks.check(manifest, {"environment": {"KVCACHED_IPC_NAME": NAME}},
                         {"enabled_bundles": {}, "command": ["vllm", "serve", "m"]})
    failed = [line for ok, line in found if not ok]
    assert f"KVCACHED_IPC_NAME {NAME!r} is claimed by pid {engine.pid} " \
        f"(claim {claim.claim_path(NAME)})" in "\n".join(failed)
    status = checks.check(manifest, {"environment": {"KVCACHED_IPC_NAME": NAME}},
                          {"enabled_bundles": {}})
    assert not any("is claimed by" in line for _, line in status)


def test_an_unusable_state_directory_does_not_stop_the_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim needs the state directory; without it the engine still starts (the
    plugin never raises) and the launch check falls back to the record check."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("KVCACHED_PROVIDER_STATE_DIR", str(blocker))
    with pytest.raises(claim.ClaimError, match=r"^cannot create the claim .*/file/claims/x: "):
        claim.hold("x")
    with pytest.raises(claim.ClaimError, match=r"^cannot read the claim .*: Not a directory$"):
        claim.holders("x")
    assert checks.check_ipc_name("x", tmp_path, launching=True) == [
        (True, "KVCACHED_IPC_NAME is 'x'")]


@pytest.mark.parametrize("call", ["holders", "hold"])
def test_a_fifo_at_the_claim_path_hangs_nothing(dirs: tuple[Path, Path], call: str) -> None:
    """Opening a FIFO for reading waits for a writer; the claim opens without waiting, so a
    FIFO planted at its path cannot hang an engine's start-up or a launch check (a
    subprocess with a timeout, so that the old blocking open fails the test, not hangs it)."""
    state, shm = dirs
    (state / "claims").mkdir(parents=True)
    os.mkfifo(state / "claims" / NAME)
    done = subprocess.run(
        [sys.executable, "-c",
         f"from kvcached_provider import claim; print(claim.{call}({NAME!r}))"],
        env=_engine_env(state, shm), capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    expected = "None" if call == "holders" else str(state / "claims" / NAME)
    assert done.stdout.strip() == expected


_LAUNCHER = (
    "import sys\n"
    "from kvcached_provider import checks\n"
    "sys.stdin.readline()  # the go signal: every launcher tests at once\n"
    f"lines = checks.check_ipc_name({NAME!r}, None, launching=True)\n"
    "print('pass' if all(ok for ok, _ in lines) else 'refused', flush=True)\n"
    "sys.stdin.readline()  # stays alive, as run does while its engine runs\n"
)


def _launchers(state: Path, shm: Path, count: int) -> list[subprocess.Popen[str]]:
    return [subprocess.Popen([sys.executable, "-c", _LAUNCHER], text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env=_engine_env(state, shm)) for _ in range(count)]


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_passing_launch_check_claims_the_name_for_the_launcher(
    dirs: tuple[Path, Path]
) -> None:
    """``run`` outlives its engine, so the claim its check takes covers the engine's first
    seconds, before vLLM loads the plugin: while the first launcher lives, a second
    launch check fails naming it, with no engine and no record anywhere. It used to pass
    (only engines claimed the name)."""
    state, shm = dirs
    [first] = _launchers(state, shm, 1)
    try:
        assert first.stdin is not None and first.stdout is not None
        first.stdin.write("go\n")
        first.stdin.flush()
        assert first.stdout.readline() == "pass\n"
        assert claim.holders(NAME) == [first.pid]
        lines = checks.check_ipc_name(NAME, shm, launching=True)
        assert [ok for ok, _ in lines] == [True, False]
        assert lines[1][1].startswith(f"KVCACHED_IPC_NAME {NAME!r} is claimed by pid "
                                      f"{first.pid} ")
    finally:
        _stop([first])
    assert checks.check_ipc_name(NAME, shm, launching=True) == [
        (True, f"KVCACHED_IPC_NAME is {NAME!r}")]


def test_launch_checks_at_the_same_moment_let_exactly_one_through(
    dirs: tuple[Path, Path]
) -> None:
    """Eight launchers test the same name at once: one passes and holds it, the other
    seven are refused (test and claim are one step per launcher). Before, all eight
    passed."""
    state, shm = dirs
    launchers = _launchers(state, shm, 8)
    try:
        for proc in launchers:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        answers = [proc.stdout.readline() if proc.stdout else "" for proc in launchers]
        assert sorted(answers) == ["pass\n"] + ["refused\n"] * 7
        winner = launchers[answers.index("pass\n")]
        assert claim.holders(NAME) == [winner.pid]
    finally:
        _stop(launchers)


def test_a_launcher_stuck_in_its_turn_does_not_hang_the_next(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launcher stopped between test and claim (here a process holding the turn lock
    for good) costs the next launch at most the turn wait, then the claim is reported
    unusable and the check falls back to the record check (no conflict line)."""
    state, shm = dirs
    (state / "claims").mkdir(parents=True)
    turn = state / "claims" / f"{NAME}.launch"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time\n"
         f"fd = os.open({str(turn)!r}, os.O_RDONLY | os.O_CREAT, 0o600)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\n"
         "print('ready', flush=True)\n"
         "time.sleep(120)\n"],
        text=True, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        monkeypatch.setattr(claim, "_TURN_WAIT_SECONDS", 0.2)
        with pytest.raises(claim.ClaimError, match=(
                rf"^cannot test the claim .*/claims/{NAME}: another launch has held its "
                rf"turn \({NAME}\.launch\) for over 0\.2 s$")):
            claim.claim_for_launch(NAME)
        assert checks.check_ipc_name(NAME, shm, launching=True) == [
            (True, f"KVCACHED_IPC_NAME is {NAME!r}")]
        assert claim.holders(NAME) is None  # nothing was claimed
    finally:
        _stop([holder])


class _FailingSharedLock:
    """Stands in for the claim module's ``fcntl``: a shared lock fails with ``error``, any
    other call is the real one. Fault injection: these failures (ENOLCK on a file system
    without flock, an interrupt while the engine waits out a launch check) cannot be
    produced on demand here."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __getattr__(self, name: str) -> object:
        return getattr(fcntl, name)

    def flock(self, fd: int, operation: int) -> None:
        if operation == fcntl.LOCK_SH:
            raise self.error
        fcntl.flock(fd, operation)


def _open_on(path: Path) -> list[str]:
    """This process's descriptors open on ``path``."""
    target = os.path.realpath(path)
    fds = Path("/proc/self/fd")
    return [fd.name for fd in fds.iterdir()
            if os.path.realpath(fds / fd.name) == target]


def test_a_claim_whose_shared_lock_fails_is_refused_in_one_line_and_leaks_nothing(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a free name's exclusive test, the launch claim's shared lock failing (ENOLCK)
    is a ClaimError naming the claim, so the launch check falls back to the record check;
    the descriptor is closed and the name stays free. It used to raise the bare OSError
    (a traceback in ``run``) and keep the descriptor, holding the exclusive lock."""
    state, shm = dirs
    path = state / "claims" / NAME
    monkeypatch.setattr(claim, "fcntl", _FailingSharedLock(OSError(37, "No locks available")))
    with pytest.raises(claim.ClaimError, match=(
            rf"^cannot lock the claim .*/claims/{NAME}: No locks available$")):
        claim.claim_for_launch(NAME)
    assert _open_on(path) == [] and path not in claim._held
    assert checks.check_ipc_name(NAME, shm, launching=True) == [
        (True, f"KVCACHED_IPC_NAME is {NAME!r}")]
    assert _open_on(path) == []
    monkeypatch.setattr(claim, "fcntl", fcntl)  # the real one (undo() would drop `dirs`)
    assert claim.holders(NAME) is None  # free: no exclusive lock was left behind


def test_an_engine_interrupted_while_claiming_keeps_no_descriptor(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine interrupted while it waits for the shared lock (Ctrl-C during a launch
    check's instant) lets the interrupt through and closes the claim's descriptor; it used
    to keep it open (only an OSError closed it)."""
    state, _ = dirs
    path = state / "claims" / NAME
    monkeypatch.setattr(claim, "fcntl", _FailingSharedLock(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        claim.hold(NAME)
    assert _open_on(path) == [] and path not in claim._held
