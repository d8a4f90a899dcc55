"""Helpers shared by the qualification tests that drive a stand-in ``vllm serve``: the
manager's executable (and a mark that skips a test without it), a free port, the HTTP
plumbing every stand-in engine script shares (each test file writes its own handler, which
models its own faults), and the serve profile text that runs one."""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path

import pytest

MANAGER = shutil.which("vllm-hust-ext") or str(Path(sys.executable).parent / "vllm-hust-ext")
needs_manager = pytest.mark.skipif(
    not Path(MANAGER).is_file(), reason="vllm-hust-ext is not installed"
)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the stand-in binds it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_STAND_IN_IMPORTS = """\
import json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT = int(sys.argv[sys.argv.index("--port") + 1])
"""

_STAND_IN_TAIL = """
    def _chunk(self, obj):
        self.wfile.write(f"data: {json.dumps(obj)}\\n\\n".encode())
        self.wfile.flush()

    def _send(self, body, kind="text/plain"):
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
"""


def stand_in_script(about: str, setup: str, handler: str) -> str:
    """The text of a stand-in for ``vllm serve``, run by this interpreter: ``about`` (its
    ``#`` comment lines), the shared imports (json, os, sys, threading, time, http.server)
    and ``PORT`` (its ``--port`` argument), ``setup`` (its own imports and module-level
    state), then ``class Handler`` (HTTP/1.0: one request a connection) with ``handler``'s
    methods plus the shared ``_chunk(obj)`` (one flushed server-sent event), ``_send(body,
    kind)`` (a 200 response) and a silent ``log_message``, serving 127.0.0.1:PORT until
    it is stopped."""
    return (
        f"#!{sys.executable}\n{about}{_STAND_IN_IMPORTS}{setup}\n\n"
        'class Handler(BaseHTTPRequestHandler):\n    protocol_version = "HTTP/1.0"\n\n'
        f"{handler}{_STAND_IN_TAIL}"
    )


def serve_profile(
    tmp: Path,
    name: str,
    engine: str,
    *,
    server: str,
    workload: str,
    cells: str,
    top: str = "",
    accelerator: str = "cuda",
    shutdown_grace_seconds: int = 2,
    port: int | None = None,
    graph_mode: str | None = None,
    ready_timeout_s: int = 30,
) -> Path:
    """Writes ``engine`` (a stand-in script) to ``tmp/fake-vllm`` and a one-repeat serve
    profile named ``name`` that launches it to ``tmp/<name>.toml``; returns that path.

    The profile's shared parts: model "m", any host version, the manager configured for
    the preemption-policy protocol 1.0, the server on ``port`` (a free one by default) in
    eager mode unless ``graph_mode`` is given, stopped within 5 s. What differs is passed
    as TOML lines: ``top`` (more top-level keys), ``server`` (more [server] keys),
    ``workload`` (the [workload] keys) and ``cells`` (the one [[cells]] table's keys)."""
    script = tmp / "fake-vllm"
    script.write_text(engine)
    script.chmod(0o755)
    execution = f'graph_mode = "{graph_mode}"' if graph_mode else "enforce_eager = true"
    profile = tmp / f"{name}.toml"
    profile.write_text(
        f"""\
name = "{name}"
kind = "serve"
accelerator = "{accelerator}"
model = "m"
host_version_range = ">=0"
repeats = 1
{top}[manager]
configuration = {{ protocol_versions = {{ "vllm.preemption-policy" = "1.0" }} }}
shutdown_grace_seconds = {shutdown_grace_seconds}
[server]
command = ["{script}"]
port = {port or free_port()}
{execution}
ready_timeout_s = {ready_timeout_s}
stop_timeout_s = 5
{server}[workload]
{workload}[[cells]]
{cells}"""
    )
    return profile
