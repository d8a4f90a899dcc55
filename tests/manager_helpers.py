"""Helpers shared by the manager's in-process CLI tests."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hust_ext_manager.cli import main


def invoke(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run ``vllm-hust-ext ARGV`` in-process: (exit code, stdout, stderr)."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = int(stop.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def install_bundles(
    site: Path,
    manifests: dict[str, dict[str, Any]],
    *,
    name: str = "fake-status",
    version: str = "1.0",
    checks: dict[str, str] | None = None,
    shutdown: dict[str, str] | None = None,
    plugins: dict[str, str] | None = None,
) -> None:
    """One fake installed distribution ``name`` ``version`` under ``site`` registering each
    manifest under its id (files listed in its RECORD), with optional bundle checks,
    shutdown hooks, and vLLM general plugins ``name -> module`` (each module shipped as a
    file in the RECORD)."""
    package = name.replace("-", "")
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines, record = ["[vllm_hust.extension_bundles]"], []
    for index, (bundle_id, document) in enumerate(manifests.items()):
        relative = f"{package}/b{index}/vllm-hust-extension-v0.2.json"
        (site / relative).parent.mkdir(parents=True)
        (site / relative).write_text(json.dumps({**document, "extension_id": bundle_id}))
        lines.append(f"{bundle_id} = {package}.b{index}")
        record.append(f"{relative},,\n")
    lines.append("[vllm_hust_ext.bundle_checks]")
    lines += [f"{k} = {v}" for k, v in (checks or {}).items()]
    lines.append("[vllm_hust_ext.bundle_shutdown]")
    lines += [f"{k} = {v}" for k, v in (shutdown or {}).items()]
    lines.append("[vllm.general_plugins]")
    for plugin, module in (plugins or {}).items():
        lines.append(f"{plugin} = {module}:register")
        relative = module.replace(".", "/") + ".py"
        (site / relative).parent.mkdir(parents=True, exist_ok=True)
        (site / relative).write_text("def register():\n    pass\n")
        record.append(f"{relative},,\n")
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    (info / "RECORD").write_text("".join(record))


def wait_for_text(path: Path, timeout: float = 30.0) -> str:
    """The stripped text of ``path`` once a process has written some, polling."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.02)
    raise AssertionError(f"{path} never appeared")


def fake_site(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unset: Iterable[str] = ()
) -> Path:
    """A private manager state file and an empty site directory on ``sys.path`` for
    ``install_bundles``; the variables in ``unset`` (ones a real launch owns) are removed."""
    monkeypatch.setenv("VLLM_HUST_EXT_CONFIG", str(tmp_path / "config.json"))
    for name in unset:
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "site"
    path.mkdir()
    monkeypatch.syspath_prepend(str(path))
    return path


class Blocked(BaseException):
    """A call that should have returned at once is still blocked (a BaseException, so the
    CLI's catch-all cannot turn it into an error line)."""


@contextlib.contextmanager
def within(seconds: float) -> Iterator[None]:
    """Fail instead of hanging: SIGALRM interrupts a blocking open() in this thread."""

    def expired(signum: int, frame: object) -> None:
        raise Blocked(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
