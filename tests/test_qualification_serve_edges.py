"""Edges of a serve arm's HTTP plumbing, against real loopback servers.

Guards: a server whose ``host`` is an IPv6 literal (``::1``, as ``vllm serve --host ::1``
takes it) is reached through a bracketed URL, so its ``/health`` counts and the arm does not
wait out its whole ready timeout; a non-200 answer whose body is not UTF-8 still fails the
request with ``HTTP <status>`` as its reason, not a codec error; a second Ctrl-C while an
arm's server stops (an engine slow to stop) escalates the stop instead of leaving the manager
and engine running after the run exits 130.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from qualification.client import RequestSpec, Sampling, stream_completion
from qualification.manager import ManagerSession
from qualification.profile import load_profile
from qualification.serve import ServeArm
from tests.serve_helpers import MANAGER, needs_manager, serve_profile
from tests.test_qualification_serve_faults import FAULT_ENGINE, REPO_ROOT, _engines, _survivors


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:
        self._answer(200, b"ok")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._answer(500, b"\xff\xfe engine \xe9chec")  # Latin-1, not UTF-8

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


class _V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _serve(server: ThreadingHTTPServer) -> Iterator[int]:
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


@pytest.fixture
def v6_port() -> Iterator[int]:
    try:
        server = _V6Server(("::1", 0), _Handler)
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    yield from _serve(server)


@pytest.fixture
def v4_port() -> Iterator[int]:
    yield from _serve(ThreadingHTTPServer(("127.0.0.1", 0), _Handler))


def test_an_ipv6_host_is_reached_through_a_bracketed_url(tmp_path: Path, v6_port: int) -> None:
    profile = load_profile(str(serve_profile(
        tmp_path, "v6", "", server='host = "::1"\n', workload="",
        cells='name = "c"\nparagraph_repeats = [1]\n', port=v6_port,
    )))
    arm = ServeArm(profile, ManagerSession(profile.manager, tmp_path / "m", {}), tmp_path / "log")
    assert arm.base_url == f"http://[::1]:{v6_port}"
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = time.monotonic()
        assert arm._wait_ready(alive, 10.0)
        assert time.monotonic() - started < 5.0
    finally:
        alive.kill()
        alive.wait()


def test_an_undecodable_error_body_still_names_the_status(v4_port: int) -> None:
    async def go() -> str | None:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            result = await stream_completion(
                session, f"http://127.0.0.1:{v4_port}", Sampling("m", 0.0, 7, True),
                RequestSpec(0, "p", 4), 10.0, time.monotonic(),
            )
        assert not result.ok and result.status == 500
        return result.error

    assert asyncio.run(go()) == "HTTP 500: \ufffd\ufffd engine \ufffdchec"


@needs_manager
@pytest.mark.parametrize(("signum", "status", "said"), [
    (signal.SIGINT, 130, "interrupted"),
    (signal.SIGTERM, 128 + signal.SIGTERM, "terminated"),
], ids=["ctrl-c", "sigterm"])
def test_a_second_signal_while_the_server_stops_leaves_no_orphans(
    tmp_path: Path, signum: signal.Signals, status: int, said: str
) -> None:
    """The engine ignores SIGTERM and the manager's grace is long, so the stop takes a
    while; a second SIGINT during it used to end the run at once with the manager and
    engine still running (in their own sessions, holding the port). Now it still exits 130,
    after the manager has killed the engine. A second SIGTERM likewise (cli._on_sigterm
    handles it once) exits 143 after the stop; a mutation audit found that case unguarded
    (the handler's reset to a no-op dropped, the run exited at once)."""
    (tmp_path / "pids").mkdir()
    # The engine ignores SIGTERM but leaves a mark: the run is then inside the server's
    # stop (the manager forwards its first SIGTERM to the engine), where the second SIGINT
    # must land. (time.sleep resumes after the handler.)
    marked = tmp_path / "got-sigterm"
    engine = FAULT_ENGINE.replace(
        'if FAULT == "never-healthy":',
        f'signal.signal(signal.SIGTERM, lambda *_: open({str(marked)!r}, "w").close())\n'
        'if FAULT == "never-healthy":',
    )
    profile = serve_profile(
        tmp_path, "stop", engine, shutdown_grace_seconds=60, ready_timeout_s=60,
        server=f'environment = {{ FAKE_PID_DIR = "{tmp_path / "pids"}", '
        'FAKE_FAULT = "never-healthy" }\n',
        workload="", cells='name = "c"\nparagraph_repeats = [2]\n',
    )
    env = {**os.environ, "PATH": f"{Path(MANAGER).parent}{os.pathsep}{os.environ['PATH']}"}
    argv = [sys.executable, "-m", "qualification", "run", str(profile), "--quiet"]
    proc = subprocess.Popen(
        [*argv, "--out", str(tmp_path / "out")], cwd=REPO_ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # As from an interactive shell: an ignored SIGINT survives exec, and Python then
        # never raises KeyboardInterrupt (the suite's process may have it ignored here).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 30
        while not _engines(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _engines(tmp_path), "the first arm's engine never started"
        time.sleep(0.5)  # the engine has set its SIGTERM disposition
        proc.send_signal(signum)
        deadline = time.monotonic() + 30
        while not marked.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marked.exists(), "the run never started to stop the server"
        proc.send_signal(signum)  # the run is now waiting for the server to stop
        _, err = proc.communicate(timeout=60)
        left = _survivors(tmp_path, within_s=0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _survivors(tmp_path, within_s=0.0):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == status and err.strip() == f"qualification: {said}"
    assert not left, "the arm's manager or engine outlived the run"
