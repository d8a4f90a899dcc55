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
the claim's path hangs neither the plugin nor the check. Real
processes stand in for the engine: they run the real plugin, without kvcached (which needs a
CUDA build).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcached_provider import checks, claim

NAME = "llama-8000"
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


@pytest.fixture
def engine(dirs: tuple[Path, Path]) -> Iterator[subprocess.Popen[str]]:
    """A process that loaded the bundle's plugin with kvcached on, as an engine does."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _ENGINE], text=True, stdout=subprocess.PIPE,
        env=_engine_env(*dirs, ENABLE_KVCACHED="true", KVCACHED_AUTOPATCH="1"))
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()


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
        assert claim.holders(NAME) is None
        assert checks.check_ipc_name(NAME, shm, launching=True) == [
            (True, f"KVCACHED_IPC_NAME is {NAME!r}")]
    finally:
        proc.kill()
        proc.wait()
    assert not (state / "claims").exists()


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
