"""``run`` and runtime evidence under conditions an operator meets: nohup, broken pipes,
full disks, malformed evidence, and several engine processes.

Guards: a forwarded signal that was ignored when the manager started (``nohup`` ignores
SIGHUP, a background job SIGINT) stays ignored and the child inherits that disposition,
while the signals it did not ignore are still forwarded; Ctrl-C before the child exists
(a slow bundle check) is exit 130 with no traceback; the shutdown report written to a
stderr nobody reads any more (``2>&1 | tee`` ended by the same Ctrl-C) neither changes
``run``'s exit status nor stops the next bundle's hook; a native manifest that cannot be
written (disk full) leaves no ``vllm-hust-ext-*`` temp directory behind; an evidence line
whose ``entry_point`` holds a list or an object is no evidence and crashes neither
``status`` nor ``run``; a ``disabled`` line hides only its own process's ``effective``
line, not another live engine process's.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bidkv_ext.evidence import evidence_line
from tests.manager_helpers import install_bundles, invoke, wait_for_text

ROOT = Path(__file__).resolve().parents[1]
BASE: dict[str, Any] = json.loads(
    (ROOT / "manifests" / "bidkv" / "vllm-hust-extension-v0.2.json").read_text()
)
DECLARED = {"protocol_versions": {"vllm.preemption-policy": "1.0"}, "host_version": "0.33.0"}
CLI = str(Path(sys.executable).with_name("vllm-hust-ext"))
PY = sys.executable
BINDING = {"VLLM_ECPA_PLAN_ID": "p", "VLLM_ECPA_LAUNCH_ID": "l"}
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _enable(tmp_path: Path, ids: list[str]) -> None:
    entries = {i: {"enabled": True, "configuration": DECLARED} for i in ids}
    (tmp_path / "config.json").write_text(
        json.dumps({"schema_version": 2, "extensions": entries})
    )


def _manager_env(tmp_path: Path, site: Path | None = None) -> dict[str, str]:
    """The environment of a real manager: no preset evidence or native variables."""
    owned = {
        "VLLM_HUST_EXT_EVIDENCE_PATH", "VLLM_EXTENSION_MANIFESTS", "VLLM_EXTENSION_BUNDLES",
        "VLLM_ECPA_EVIDENCE_SINK", "VLLM_ECPA_EVIDENCE_STRICT", "VLLM_ECPA_PLAN_ID",
        "VLLM_ECPA_LAUNCH_ID",
    }
    env = {k: v for k, v in os.environ.items() if k not in owned}
    env["VLLM_HUST_EXT_CONFIG"] = str(tmp_path / "config.json")
    if site is not None:  # first, before an inherited PYTHONPATH (see test_contract_host_module)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return env


# --- supervision: signals ignored at start ----------------------------------------------


@pytest.mark.parametrize("ignored", [signal.SIGHUP, signal.SIGINT])
def test_a_signal_ignored_at_start_stays_ignored_and_the_child_inherits_it(
    tmp_path: Path, ignored: int
) -> None:
    """``nohup vllm-hust-ext run -- vllm serve`` must survive the hang-up as ``nohup vllm
    serve`` does: the manager neither forwards an ignored signal nor takes the ``SIG_IGN``
    away from the child; SIGTERM, which it did not ignore, is still forwarded (143)."""
    ready, got = tmp_path / "ready", tmp_path / "got"
    child = (
        "import signal, sys, time\n"
        f"def on(s, f):\n    open({str(got)!r}, 'w').write(str(s)); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, on)\n"
        f"inherited = signal.getsignal({int(ignored)}) == signal.SIG_IGN\n"
        f"open({str(ready)!r}, 'w').write(str(inherited))\n"
        "time.sleep(60)\n"
    )

    def start_like_nohup() -> None:
        for signum in FORWARDED:
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(ignored, signal.SIG_IGN)

    manager = subprocess.Popen(
        [CLI, "run", "--", PY, "-c", child],
        env=_manager_env(tmp_path),
        preexec_fn=start_like_nohup,
    )
    try:
        assert wait_for_text(ready) == "True"  # the child ignores it too, as under nohup
        manager.send_signal(ignored)
        manager.send_signal(signal.SIGTERM)
        # Had the ignored signal been handled, it would be the first one: 128 + 1 or 2.
        assert manager.wait(timeout=30) == 128 + signal.SIGTERM
        assert wait_for_text(got) == str(int(signal.SIGTERM))
    finally:
        if manager.poll() is None:
            manager.kill()
            manager.wait()


def test_ctrl_c_before_the_launch_is_exit_130_without_a_traceback(tmp_path: Path) -> None:
    """Ctrl-C while ``run`` still checks the bundles (here a slow bundle check, as a slow
    service probe would be): nothing is launched, exit 130, and no traceback."""
    site = tmp_path / "site"
    site.mkdir()
    started, marker = tmp_path / "check-started", tmp_path / "launched"
    (site / "fakeresilience_check.py").write_text(
        "import time\n"
        "def check(manifest, configuration):\n"
        f"    open({str(started)!r}, 'w').write('1')\n"
        "    time.sleep(60)\n"
        "    return [(True, 'ok')]\n"
    )
    install_bundles(
        site,
        {"org.test.p": BASE},
        name="fake-resilience",
        checks={"org.test.p": "fakeresilience_check:check"},
    )
    _enable(tmp_path, ["org.test.p"])

    def default_signals() -> None:
        for signum in FORWARDED:
            signal.signal(signum, signal.SIG_DFL)

    manager = subprocess.Popen(
        [CLI, "run", "--", "touch", str(marker)],
        env=_manager_env(tmp_path, site),
        preexec_fn=default_signals,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_text(started)
        manager.send_signal(signal.SIGINT)
        _, err = manager.communicate(timeout=30)
    finally:
        if manager.poll() is None:
            manager.kill()
            manager.wait()
    assert manager.returncode == 128 + signal.SIGINT
    assert "Traceback" not in err
    assert not marker.exists()


# --- shutdown report and temp files --------------------------------------------------------


def test_a_closed_stderr_neither_changes_the_status_nor_skips_a_hook(tmp_path: Path) -> None:
    """Two bundles with shutdown hooks; the manager's stderr is a pipe whose reader is
    gone. Both hooks run, and ``run`` still exits with the child's status (3)."""
    site = tmp_path / "site"
    site.mkdir()
    marks = tmp_path / "mark-"
    (site / "fakeresilience_hook.py").write_text(
        "def on_shutdown(manifest, configuration):\n"
        f"    open({str(marks)!r} + manifest['extension_id'], 'w').write('ran')\n"
        "    return ['cleaned up ' + manifest['extension_id']]\n"
    )
    other = json.loads(json.dumps(BASE))
    other["components"] = []
    hook = "fakeresilience_hook:on_shutdown"
    install_bundles(
        site,
        {"org.test.p": BASE, "org.test.q": other},
        name="fake-resilience",
        shutdown={"org.test.p": hook, "org.test.q": hook},
    )
    _enable(tmp_path, ["org.test.p", "org.test.q"])
    reader, writer = os.pipe()
    os.close(reader)
    try:
        done = subprocess.run(
            [CLI, "run", "--", "sh", "-c", "exit 3"],
            env=_manager_env(tmp_path, site),
            stderr=writer,
            timeout=60,
        )
    finally:
        os.close(writer)
    assert done.returncode == 3
    assert sorted(p.name for p in tmp_path.glob("mark-*")) == [
        "mark-org.test.p",
        "mark-org.test.q",
    ]


def test_a_native_manifest_that_cannot_be_written_leaves_no_temp_directory(
    tmp_path: Path,
) -> None:
    """Disk full (here: a 64-byte file-size limit, so writing the manifest fails with
    EFBIG; ``tempfile``'s own 4-byte probe of the directory still passes): ``run`` is one
    error line, exit 2, nothing is launched, and the ``vllm-hust-ext-*`` directory it made
    is removed."""
    site = tmp_path / "site"
    site.mkdir()
    install_bundles(site, {"org.test.p": BASE}, name="fake-resilience")
    _enable(tmp_path, ["org.test.p"])
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = _manager_env(tmp_path, site)
    env.update(TMPDIR=str(temp), PYTHONDONTWRITEBYTECODE="1")
    marker = tmp_path / "launched"

    def no_file_growth() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.RLIM_INFINITY))

    done = subprocess.run(
        [CLI, "run", "--", "touch", str(marker)],
        env=env,
        preexec_fn=no_file_growth,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1].startswith("vllm-hust-ext: error: ")
    assert "File too large" in done.stderr.splitlines()[-1]
    assert "Traceback" not in done.stderr
    assert not marker.exists()
    assert list(temp.iterdir()) == []


# --- runtime evidence: malformed lines and several processes ----------------------------


@pytest.fixture
def evidence_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """One enabled, compatible bundle ``org.test.p``; evidence at ``tmp/evidence.jsonl``."""
    monkeypatch.setenv("VLLM_HUST_EXT_CONFIG", str(tmp_path / "config.json"))
    monkeypatch.setenv("VLLM_HUST_EXT_EVIDENCE_PATH", str(tmp_path / "evidence.jsonl"))
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    install_bundles(site, {"org.test.p": BASE}, name="fake-resilience")
    _enable(tmp_path, ["org.test.p"])
    return tmp_path / "evidence.jsonl"


def _line(event: str, *, pid: int | None = None, **extra: Any) -> str:
    line = evidence_line(event, {}, BINDING, pid=pid)
    line["extension_id"] = "org.test.p"
    line.update(extra)
    return json.dumps(line)


def _status(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code, out, err = invoke(["extension", "status", "org.test.p"], capsys)
    assert code == 0, err
    result: dict[str, Any] = json.loads(out)
    return result


@pytest.mark.parametrize("entry_point", [{"group": [], "name": "x"}, {"group": "g", "name": {}}])
def test_an_entry_point_that_is_not_a_pair_of_strings_is_no_evidence(
    evidence_site: Path, capsys: pytest.CaptureFixture[str], entry_point: dict[str, Any]
) -> None:
    """A bound, live line naming another bundle with a malformed ``entry_point`` is skipped
    (no crash of ``status`` or of ``run``'s refusal checks); the valid line before it still
    counts."""
    malformed = _line("effective", extension_id="org.other", entry_point=entry_point)
    evidence_site.write_text(_line("effective") + "\n" + malformed + "\n")
    shown = _status(capsys)
    assert shown["states"][-1] == "runtime_effective"
    code, _, err = invoke(["run", "--dry-run", "--", "h"], capsys)
    assert code == 0, err


@pytest.fixture
def second_process() -> Iterator[int]:
    """A second live process on this host (a stand-in engine process)."""
    child = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    try:
        yield child.pid
    finally:
        child.kill()
        child.wait()


def test_a_disabled_process_hides_only_its_own_effective_line(
    evidence_site: Path, capsys: pytest.CaptureFixture[str], second_process: int
) -> None:
    """Two live engine processes (data parallel) both become effective, then one falls
    back (``disabled``): the other is still running the policy, so status stays
    ``runtime_effective`` and names it. Once it falls back too, it is no longer."""
    lines = [_line("effective", pid=second_process), _line("effective"), _line("disabled")]
    evidence_site.write_text("\n".join(lines) + "\n")
    shown = _status(capsys)
    assert shown["states"][-1] == "runtime_effective"
    assert f"pid={second_process} " in shown["evidence"][-1]
    lines.append(_line("disabled", pid=second_process))
    evidence_site.write_text("\n".join(lines) + "\n")
    assert "runtime_effective" not in _status(capsys)["states"]
