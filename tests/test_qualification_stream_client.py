"""The qualification client's reading of one streamed completion, against a real HTTP server.

Guards (``qualification.client.stream_completion``): only ``data:`` lines count; TTFT is
the first chunk that carries text, not the first byte; the output-token count is the
server's ``usage`` when it sends one and the number of text chunks otherwise; the prompt
count comes from ``usage`` too; a stream that ends without ``[DONE]``, a chunk that is not
a JSON object, and a non-200 answer are failures with a one-line reason and never raise; a
request past its timeout is starved (``timed_out``), one past its cancel time is cancelled
and is not an error. The server is a real ``http.server`` on a loopback port speaking
server-sent events as vLLM's ``/v1/completions`` does.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import aiohttp
import pytest

from qualification.client import RequestResult, RequestSpec, Sampling, stream_completion

SAMPLING = Sampling(model="m", temperature=0.0, seed=1, ignore_eos=True)
# prompt -> (status, list of (delay before, raw line)); the prompt picks the behaviour.
SCRIPTS: dict[str, tuple[int, list[tuple[float, str]]]] = {
    "usage": (200, [
        (0.0, ": keep-alive comment"),
        (0.0, 'data: {"choices": [{"text": ""}]}'),       # no text yet: not the first token
        (0.2, 'data: {"choices": [{"text": "Hel"}]}'),
        (0.0, 'event: ignored'),
        (0.0, 'data: {"choices": [{"text": "lo"}]}'),
        (0.0, 'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}'),
        (0.0, "data: [DONE]"),
    ]),
    "no-usage": (200, [
        (0.0, 'data: {"choices": [{"text": "a"}]}'),
        (0.0, 'data: {"choices": [{"text": "b"}, {"text": "c"}]}'),
        (0.0, 'data: {"usage": {"completion_tokens": true, "prompt_tokens": -1}}'),
        (0.0, "data: [DONE]"),
    ]),
    "no-done": (200, [(0.0, 'data: {"choices": [{"text": "a"}]}')]),
    "not-object": (200, [(0.0, "data: [1, 2]"), (0.0, "data: [DONE]")]),
    "slow": (200, [(0.0, 'data: {"choices": [{"text": "a"}]}'), (3.0, "data: [DONE]")]),
}


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        if body["prompt"] == "busy":
            payload = b"overloaded\nretry later"
            self.send_response(503)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        status, lines = SCRIPTS[body["prompt"]]
        self.send_response(status)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for delay, line in lines:
                time.sleep(delay)
                self.wfile.write(f"{line}\n\n".encode())
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up: cancelled or timed out

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _one(base_url: str, prompt: str, *, timeout_s: float = 10.0,
         cancel_at_s: float | None = None) -> RequestResult:
    async def go() -> RequestResult:
        origin = time.monotonic()
        async with aiohttp.ClientSession() as session:
            spec = RequestSpec(index=3, prompt=prompt, max_tokens=8, cancel_at_s=cancel_at_s)
            return await stream_completion(session, base_url, SAMPLING, spec, timeout_s, origin)

    return asyncio.run(go())


def test_usage_counts_and_ttft_at_the_first_text(base_url: str) -> None:
    r = _one(base_url, "usage")
    assert r.ok and r.index == 3 and r.status == 200 and r.error is None
    assert r.text == "Hello" and r.output_tokens == 5 and r.prompt_tokens == 7
    assert r.ttft is not None and r.ttft >= 0.2  # the empty chunk before did not count
    assert r.latency is not None and r.latency >= r.ttft
    assert not r.timed_out and not r.cancelled


def test_chunks_counted_without_a_valid_usage(base_url: str) -> None:
    r = _one(base_url, "no-usage")
    assert r.ok and r.text == "abc" and r.output_tokens == 3 and r.prompt_tokens is None


@pytest.mark.parametrize(("prompt", "error"), [
    ("no-done", "stream ended without [DONE]"),
    ("not-object", "stream chunk is not a JSON object: [1, 2]"),
    ("busy", "HTTP 503: overloaded\nretry later"),
])
def test_failures_are_results_not_exceptions(base_url: str, prompt: str, error: str) -> None:
    r = _one(base_url, prompt)
    assert not r.ok and r.error == error and r.latency is None
    assert not r.timed_out and not r.cancelled


def test_timeout_is_starved(base_url: str) -> None:
    r = _one(base_url, "slow", timeout_s=0.5)
    assert not r.ok and r.timed_out and not r.cancelled
    assert r.error == "timed out after 0.5s" and r.text == "a"


def test_cancel_before_the_timeout_is_cancelled_not_an_error(base_url: str) -> None:
    r = _one(base_url, "slow", timeout_s=10.0, cancel_at_s=0.5)
    assert not r.ok and r.cancelled and not r.timed_out and r.error is None


def test_cancel_after_the_timeout_is_starved(base_url: str) -> None:
    r = _one(base_url, "slow", timeout_s=0.5, cancel_at_s=5.0)
    assert r.timed_out and not r.cancelled
