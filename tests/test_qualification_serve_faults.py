"""Guards a serve arm against a misbehaving server, through the real `vllm-hust-ext run`
and a real local stand-in for `vllm serve`: bytes that are not UTF-8 in /health or
/metrics are read (the valid metric lines still count), a /metrics body past the byte
limit fails the arm with its reason instead of being read into memory whole, a stream
chunk holding a lone surrogate or a usage count past 2**53 does not crash the run, a
server's multi-line error body stays one line in the record and report.md, a port already
served by another process fails the arm instead of measuring that other server, SIGTERM to
the run stops the running arm's manager and engine (exit 143, no orphan), and an engine
that ignores SIGTERM is killed. Every run here finishes with record.json, exit status 1
and no traceback; a per-test SIGALRM (or subprocess timeout) turns a hang into a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType

import pytest

from qualification.cli import main
from tests.serve_helpers import MANAGER, needs_manager, serve_profile, stand_in_script

pytestmark = needs_manager

REPO_ROOT = Path(__file__).resolve().parent.parent

FAULT_ENGINE = stand_in_script(
    about="# A stand-in for `vllm serve` that misbehaves as FAKE_FAULT says.\n",
    setup="""\
import signal

FAULT = os.environ.get("FAKE_FAULT", "")
with open(os.path.join(os.environ["FAKE_PID_DIR"], str(os.getpid())), "w") as f:
    f.write(str(os.getppid()))  # the manager
if FAULT == "ignore-sigterm":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if FAULT == "never-healthy":
    time.sleep(3600)
lock = threading.Lock()
posts = [0]
""",
    handler="""\
    def do_GET(self):
        if self.path == "/health":
            return self._send(b"\\xff\\xfe ok" if FAULT == "undecodable" else b"ok")
        if FAULT == "oversized-metrics":
            line = b"# " + b"x" * 1021 + b"\\n"
            size = int(os.environ["FAKE_METRICS_BYTES"])
            return self._send(line * (size // len(line) + 1))
        with lock:
            body = f"vllm:num_preemptions_total {posts[0]}\\n".encode()
        if FAULT == "undecodable":
            body = b"\\xff\\xfe garbage \\xc3\\n" + body + b"vllm:\\xff 1\\n"
        self._send(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with lock:
            posts[0] += 1
        if FAULT == "stall-second" and posts[0] == 2:  # the first after the warm-up
            time.sleep(8)  # past the profile's request_timeout_s
        if FAULT == "http-500":
            self.send_response(500)
            self.end_headers()
            return self.wfile.write(b"first line\\nsecond line\\n")
        chunks = [{"choices": [{"text": f" t{i}"}]} for i in range(req["max_tokens"])]
        usage = {"prompt_tokens": 3, "completion_tokens": req["max_tokens"]}
        if FAULT == "huge-usage":
            usage = {"prompt_tokens": 10**400, "completion_tokens": 10**400}
        chunks.append({"choices": [], "usage": usage})
        lines = [f"data: {json.dumps(c)}\\n\\n" for c in chunks]
        if FAULT == "lone-surrogate":
            lines.insert(1, 'data: {"choices": [{"text": "\\\\ud800"}]}\\n\\n')
        self._send("".join(lines + ["data: [DONE]\\n\\n"]).encode(), "text/event-stream")
""",
)


def _profile(
    tmp: Path,
    candidate_fault: str,
    *,
    baseline_fault: str = "",
    port: int | None = None,
    extra_env: str = "",
    request_timeout_s: int = 10,
) -> Path:
    (tmp / "pids").mkdir()
    return serve_profile(
        tmp,
        "faults",
        FAULT_ENGINE,
        shutdown_grace_seconds=1,
        port=port,
        ready_timeout_s=20,
        server=f"""\
environment = {{ FAKE_PID_DIR = "{tmp / 'pids'}", FAKE_FAULT = "{baseline_fault}" }}
candidate_environment = {{ FAKE_FAULT = "{candidate_fault}"{extra_env} }}
""",
        workload=f"request_timeout_s = {request_timeout_s}\n",
        cells="""\
name = "c"
paragraph_repeats = [2, 3]
max_tokens = 4
concurrency = 2
""",
    )


def _engines(tmp: Path) -> dict[int, int]:
    """Every engine started so far: its pid and its manager's."""
    return {int(p.name): int(p.read_text() or 0) for p in (tmp / "pids").iterdir()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) is not running.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rfind(")") + 2] != "Z"
    return True


def _survivors(tmp: Path, within_s: float = 5.0) -> list[int]:
    pids = [pid for pair in _engines(tmp).items() for pid in pair if pid > 1]
    deadline = time.monotonic() + within_s
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if _alive(pid)]


@pytest.fixture
def no_orphans(tmp_path: Path) -> Iterator[None]:
    """Fails the test when an engine or its manager outlives the run; kills leftovers."""
    yield
    if not (tmp_path / "pids").is_dir():
        return
    left = _survivors(tmp_path)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left running after the run: {left}"


@contextlib.contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    def expire(_signum: int, _frame: FrameType | None) -> None:
        pytest.fail(f"the run did not finish within {seconds}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _run(tmp: Path, profile: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    out = tmp / "out"
    with _deadline(60):
        code = main(["run", str(profile), "--out", str(out), "--quiet"])
    assert code == 1
    assert "Traceback" not in capsys.readouterr().err
    record = json.loads((out / "record.json").read_text())
    assert isinstance(record, dict)
    return record


def _arms(record: dict[str, object]) -> tuple[dict[str, object], dict[str, object]]:
    (pair,) = record["cells"][0]["pairs"]  # type: ignore[index]
    return pair["baseline"], pair["candidate"]  # type: ignore[no-any-return]


def test_undecodable_health_and_metrics_bytes_do_not_crash_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_orphans: None
) -> None:
    """aiohttp's strict UTF-8 decode raised UnicodeDecodeError out of the run; the body is
    now decoded with replacement, so the garbage lines are skipped and the valid ones count
    (2 preemptions: one per cell request)."""
    record = _run(tmp_path, _profile(tmp_path, "undecodable"), capsys)
    base, cand = _arms(record)
    for arm in (base, cand):
        assert arm["error"] is None and arm["completed"] == 2 and arm["preemptions"] == 2


def test_oversized_metrics_fails_the_arm_with_its_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_orphans: None
) -> None:
    """A /metrics body past the limit is not read (and parsed) whole: the arm fails with
    the reason, the baseline's figures are kept."""
    from qualification.client import MAX_BODY_BYTES

    size = f', FAKE_METRICS_BYTES = "{MAX_BODY_BYTES}"'
    record = _run(tmp_path, _profile(tmp_path, "oversized-metrics", extra_env=size), capsys)
    base, cand = _arms(record)
    assert base["error"] is None and base["completed"] == 2
    assert cand["completed"] == 0
    assert cand["error"] == (
        "engine sent an oversized /metrics before the workload: /metrics answered more "
        f"than {MAX_BODY_BYTES} bytes (server still running)"
    )


@pytest.mark.parametrize("fault", ["lone-surrogate", "huge-usage"])
def test_odd_but_parsable_stream_chunks_do_not_crash_the_run(
    tmp_path: Path, fault: str, capsys: pytest.CaptureFixture[str], no_orphans: None
) -> None:
    """A chunk whose text is a lone surrogate (valid JSON "\\ud800") made the output hash
    raise UnicodeEncodeError; a usage count of 10**400 made the figures raise
    OverflowError. Now the text is hashed and an out-of-range count is ignored (the
    chunk count stands in, the prompt tokens are unknown)."""
    record = _run(tmp_path, _profile(tmp_path, fault), capsys)
    base, cand = _arms(record)
    assert base["error"] is None and base["output_tokens"] == 8
    assert cand["error"] is None and cand["completed"] == 2
    assert len(cand["long_hashes"]) == 2 and len(cand["short_hash"]) == 16  # type: ignore[arg-type]
    if fault == "huge-usage":
        assert cand["output_tokens"] == 8
        assert cand["extra"]["client_prompt_tokens"] is None  # type: ignore[index]
    else:
        assert cand["short_hash"] != base["short_hash"]


def test_multi_line_error_body_stays_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_orphans: None
) -> None:
    """An HTTP 500 whose body has line breaks: the arm's error is one line, so the gate
    detail in report.md is one list item, not a broken one."""
    record = _run(tmp_path, _profile(tmp_path, "http-500"), capsys)
    _, cand = _arms(record)
    assert cand["error"] == "warm-up failed: HTTP 500: first line\\nsecond line"
    report = (tmp_path / "out" / "report.md").read_text()
    (line,) = [ln for ln in report.splitlines() if "HTTP 500" in ln]
    assert line.startswith("- no-failed-or-starved: **fail**") and "second line" in line


def test_a_request_past_its_timeout_is_starved_not_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_orphans: None
) -> None:
    """A stream the server stalls past request_timeout_s counts as starved, and only as
    starved: the record keeps failures (errors) and starvation (timeouts) apart."""
    record = _run(tmp_path, _profile(tmp_path, "stall-second", request_timeout_s=2), capsys)
    base, cand = _arms(record)
    assert (base["starved"], base["failed"]) == (0, 0)
    assert (cand["starved"], cand["failed"], cand["requests"]) == (1, 0, 2)


class _Foreign(BaseHTTPRequestHandler):
    """Another process's server: healthy, and answers everything."""

    posts = 0

    def do_GET(self) -> None:
        self._send()

    def do_POST(self) -> None:
        type(self).posts += 1
        self._send()

    def _send(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: object) -> None:
        pass


def test_port_already_served_by_another_process_fails_the_arms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_orphans: None
) -> None:
    """The arm's engine cannot bind a port another server holds, yet that server answers
    /health: the arms were measured against it. Now each arm fails, naming the port, and
    nothing is sent there."""
    foreign = ThreadingHTTPServer(("127.0.0.1", 0), _Foreign)
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    try:
        port = int(foreign.server_address[1])
        record = _run(tmp_path, _profile(tmp_path, "", port=port), capsys)
    finally:
        foreign.shutdown()
        foreign.server_close()
    assert _Foreign.posts == 0
    for arm in _arms(record):
        assert arm["started"] is False and arm["completed"] == 0
        assert arm["error"] == (
            f"port {port} on 127.0.0.1 is already in use by another process; "
            "the arm's server was not started"
        )


def test_engine_ignoring_sigterm_is_killed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_orphans: None
) -> None:
    """The stop escalates (the manager SIGKILLs the engine's group after its grace): the
    run finishes and no engine is left (checked by ``no_orphans``)."""
    record = _run(tmp_path, _profile(tmp_path, "ignore-sigterm"), capsys)
    base, cand = _arms(record)
    assert base["error"] is None and cand["error"] is None and cand["completed"] == 2
    assert len(_engines(tmp_path)) == 2


def test_sigterm_to_the_run_stops_the_arms_server(tmp_path: Path, no_orphans: None) -> None:
    """The manager and the engine run in their own sessions, so a SIGTERM to the run (a CI
    timeout, `kill`) reached neither and both were orphaned, holding the port. Now the run
    stops the arm's server first, then exits 143 with one line and no traceback."""
    profile = _profile(tmp_path, "never-healthy", baseline_fault="never-healthy")
    env = {**os.environ, "PATH": f"{Path(MANAGER).parent}{os.pathsep}{os.environ['PATH']}"}
    argv = [sys.executable, "-m", "qualification", "run", str(profile), "--quiet"]
    argv += ["--out", str(tmp_path / "out")]
    proc = subprocess.Popen(
        argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 30
        while not _engines(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _engines(tmp_path), "the first arm's engine never started"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.strip() == "qualification: terminated"
    assert not _survivors(tmp_path), "the arm's manager or engine outlived the run"
