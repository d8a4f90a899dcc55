"""The qualification client's reading of streamed completions and /metrics bodies,
against a real HTTP server.

Guards (``qualification.client``):

- ``stream_completion``: only ``data:`` lines count; TTFT is the first chunk that carries
  text, not the first byte nor the last text; the output-token count is the server's
  ``usage`` when it sends one (a count of 0 and of exactly 2**53 included; one past is no
  count, and a later usage without a valid count keeps the earlier one), the number of
  text chunks otherwise; the prompt count comes from ``usage`` too; ``[DONE]`` ends the
  request even when the server keeps the connection open; a stream that ends without
  ``[DONE]``, a chunk that is not a JSON object and every non-200 answer (a 4xx too) are
  failures with a reason and never raise; a request past its timeout is starved
  (``timed_out``), one past its cancel time is cancelled and is not an error, and a cancel
  time counts from the cell's start, not from the request's own send;
- ``run_requests`` returns the results in index order;
- ``fetch_text``: an undecodable byte becomes U+FFFD (only its line is lost, never a
  silently different number); the body limit is 16 MiB, a body of exactly the limit is
  read and one byte more is refused;
- the output hash of a lone surrogate differs from the hash of the text that replaces it
  (the short-output gate compares hashes, qualification.md section 6 gate 1).

The server is a real ``http.server`` on a loopback port speaking server-sent events as
vLLM's ``/v1/completions`` does; the prompt picks its behaviour. Several tests were found
by the eighth mutation audit and name the mutant they kill.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import ClassVar

import aiohttp
import pytest

import qualification.client
from qualification.client import (
    MAX_BODY_BYTES,
    RequestResult,
    RequestSpec,
    ResponseTooLarge,
    Sampling,
    fetch_text,
    run_requests,
    stream_completion,
)
from qualification.evidence import gauge, parse_prometheus
from tests.test_qualification_serve_edges import _serve

SAMPLING = Sampling(model="m", temperature=0.0, seed=1, ignore_eos=True)


def _data(obj: object) -> str:
    return f"data: {json.dumps(obj)}"


def _text(text: str) -> str:
    return _data({"choices": [{"text": text}]})


DONE = "data: [DONE]"
# prompt -> list of (delay before, raw line), answered with 200 and text/event-stream.
# Besides these: "status-<N>" answers status N with REFUSAL as its body, and "phased" and
# "done-held-open" are written by the handler's own methods (see there).
SCRIPTS: dict[str, list[tuple[float, str]]] = {
    "usage": [
        (0.0, ": keep-alive comment"),
        (0.0, _text("")),  # no text yet: not the first token
        (0.2, _text("Hel")),
        (0.0, "event: ignored"),
        (0.0, _text("lo")),
        (0.0, _data({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}})),
        (0.0, DONE),
    ],
    "no-usage": [
        (0.0, _text("a")),
        (0.0, _data({"choices": [{"text": "b"}, {"text": "c"}]})),
        (0.0, _data({"usage": {"completion_tokens": True, "prompt_tokens": -1}})),
        (0.0, DONE),
    ],
    "count-bounds": [
        (0.0, _text("a")),
        (0.0, _data({"choices": [], "usage": {"prompt_tokens": 0, "completion_tokens": 2**53}})),
        (0.0, DONE),
    ],
    "count-past-bound": [
        (0.0, _text("a")),
        (0.0, _text("b")),
        (0.0, _data({"choices": [],
                     "usage": {"prompt_tokens": 3, "completion_tokens": 2**53 + 1}})),
        (0.0, DONE),
    ],
    "usage-then-none": [
        (0.0, _text("a")),
        (0.0, _text("b")),
        (0.0, _data({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 5}})),
        (0.0, _data({"choices": [], "usage": {}})),  # a later usage object without counts
        (0.0, DONE),
    ],
    "no-done": [(0.0, _text("a"))],
    "not-object": [(0.0, "data: [1, 2]"), (0.0, DONE)],
    "slow": [(0.0, _text("a")), (3.0, DONE)],
}
REFUSAL = b"overloaded\nretry later"
# /metrics bodies, by path.
BODIES: dict[str, bytes] = {
    "/undecodable": b"vllm:num_preemptions_total 1\xff2\nvllm:num_requests_waiting 3\n",
    "/at-limit": b"#" * MAX_BODY_BYTES,
    "/past-limit": b"#" * (MAX_BODY_BYTES + 1),
}


class _Handler(BaseHTTPRequestHandler):
    """HTTP/1.0 (one request a connection, the body ends when the connection does)."""

    protocol_version = "HTTP/1.0"
    # The held-open stream waits on this after its [DONE]; the fixture sets it at the end.
    release = threading.Event()
    # The phase clock of test_ttft_is_the_first_chunk_carrying_text (see there).
    phase: ClassVar[list[float]] = [0.0]
    first_read = threading.Event()

    def do_GET(self) -> None:
        body = BODIES[self.path]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        prompt = body["prompt"]
        if prompt.startswith("status-"):
            self.send_response(int(prompt.removeprefix("status-")))
            self.send_header("Content-Length", str(len(REFUSAL)))
            self.end_headers()
            self.wfile.write(REFUSAL)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            if prompt == "phased":
                self._phased()
            elif prompt == "done-held-open":
                self._line(_text("a"))
                self._line(DONE)
                _Handler.release.wait(60)  # the connection stays open past [DONE]
            else:
                for delay, line in SCRIPTS[prompt]:
                    time.sleep(delay)
                    self._line(line)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up: cancelled or timed out

    def _phased(self) -> None:
        _Handler.phase[0] = 5.0
        self._line(_text("a"))
        # The second text only once the client has read the first (it read the clock then).
        _Handler.first_read.wait(30)
        _Handler.phase[0] = 7.0
        self._line(_text("b"))
        self._line(DONE)

    def _line(self, line: str) -> None:
        self.wfile.write(f"{line}\n\n".encode())
        self.wfile.flush()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def base_url() -> Iterator[str]:
    _Handler.release.clear()
    _Handler.first_read.clear()
    _Handler.phase[0] = 0.0
    for port in _serve(ThreadingHTTPServer(("127.0.0.1", 0), _Handler)):
        yield f"http://127.0.0.1:{port}"
        _Handler.release.set()


def _one(base_url: str, prompt: str, *, timeout_s: float = 10.0,
         cancel_at_s: float | None = None, started_s_ago: float = 0.0) -> RequestResult:
    async def go() -> RequestResult:
        origin = time.monotonic() - started_s_ago
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
    ("status-503", "HTTP 503: overloaded\nretry later"),
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


# ---------------------------------------------------------------- mutation-audit cases


def test_usage_counts_of_zero_and_of_exactly_2_53_are_the_servers(base_url: str) -> None:
    """client._token_count: "a non-negative integer count (at most 2**53)" is the server's
    count. Kills ``0 <= value`` -> ``0 < value`` (a prompt of 0 tokens became unknown) and
    ``value <= 2**53`` -> ``<`` (the bound itself fell back to the chunk count); one past
    the bound is no count (the chunk count stands in)."""
    r = _one(base_url, "count-bounds")
    assert r.ok and r.prompt_tokens == 0 and r.output_tokens == 2**53
    past = _one(base_url, "count-past-bound")
    assert past.ok and past.prompt_tokens == 3 and past.output_tokens == 2


def test_a_later_usage_without_counts_keeps_the_servers_count(base_url: str) -> None:
    """The output-token count is the server's usage when it sent one (the stream client's
    rule); a later usage object without a valid count does not discard it for the chunk
    count. Kills passing ``None`` instead of the count so far as ``_token_count``'s
    default for ``completion_tokens``."""
    r = _one(base_url, "usage-then-none")
    assert r.ok and r.output_tokens == 5 and r.prompt_tokens == 4


def test_ttft_is_the_first_chunk_carrying_text(
    base_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """client docstring: "TTFT ... is the time from sending to the first chunk carrying
    text". The client's clock here reads the server's phase (0 while sending, 5 once the
    first text is written, 7 once the second is), and the server writes the second text
    only after the client has read the clock for the first, so TTFT is exactly 5 and the
    latency 7 with no timing involved. Kills taking the time at every text chunk
    (``if self.first is None`` -> ``if True``: TTFT 7, the last text)."""

    def monotonic() -> float:
        if _Handler.phase[0] == 5.0:
            _Handler.first_read.set()
        return _Handler.phase[0]

    monkeypatch.setattr(qualification.client, "time", SimpleNamespace(monotonic=monotonic))
    r = _one(base_url, "phased")
    assert r.ok and r.text == "ab"
    assert (r.ttft, r.latency) == (5.0, 7.0)


def test_done_ends_the_request_even_on_a_connection_held_open(base_url: str) -> None:
    """``[DONE]`` is the end of a completed stream (a stream without it is a failure); a
    server that keeps the connection open after it has still completed the request. Kills
    dropping ``if stream.finished: break`` (the client then waits for the connection to
    close and the request is starved at its timeout)."""
    r = _one(base_url, "done-held-open", timeout_s=5.0)
    assert r.ok and not r.timed_out and r.error is None and r.text == "a"


@pytest.mark.parametrize("status", [400, 404])
def test_a_4xx_answer_is_a_failure_naming_its_status(base_url: str, status: int) -> None:
    """client docstring: a request "that errors ... counts as failed"; every non-200 answer
    is a failure with ``HTTP <status>: <body>`` as its one-line reason. Kills
    ``response.status != 200`` -> ``>= 500`` (a 4xx body was read as an event stream and
    the reason became "stream ended without [DONE]")."""
    r = _one(base_url, f"status-{status}")
    assert not r.ok and r.status == status and r.error == f"HTTP {status}: overloaded\nretry later"
    assert not r.timed_out and not r.cancelled


def test_a_cancel_time_counts_from_the_cells_start(base_url: str) -> None:
    """qualification.md §3 burst-cancel: "every other stream cancelled at 12 s" (of the
    cell), also for the streams sent at 2 s. A request sent 5 s into its cell with
    ``cancel_at_s = 5`` is cancelled at once, before it reads any text. Kills ``budget =
    max(0, cancel_at_s - elapsed)`` -> ``budget = cancel_at_s`` (5 s from its own send:
    the stream then completed)."""
    r = _one(base_url, "slow", cancel_at_s=5.0, started_s_ago=5.0)
    assert r.cancelled and not r.ok and not r.timed_out and r.error is None
    assert r.text == ""


def test_run_requests_returns_the_results_in_index_order(base_url: str) -> None:
    """client.run_requests: "returns the results (in index order)", whatever the order of
    the specs. Kills sorting by ``-index``."""
    specs = [RequestSpec(i, "count-past-bound", 4) for i in (2, 0, 1)]
    results, _ = asyncio.run(
        run_requests(base_url, SAMPLING, specs, concurrency=3, timeout_s=20.0)
    )
    assert [r.index for r in results] == [0, 1, 2] and all(r.ok for r in results)


# ---------------------------------------------------------------- fetch_text and the hash


def test_an_undecodable_byte_loses_its_line_not_its_value(base_url: str) -> None:
    """fetch_text: "an undecodable byte becomes U+FFFD, so only its line is lost". Kills
    decoding with ``errors="ignore"``: ``1\\xff2`` then read as a preemption count of 12."""
    status, text = asyncio.run(fetch_text(base_url, "/undecodable"))
    assert status == 200 and "1\ufffd2" in text
    samples = parse_prometheus(text)
    assert gauge(samples, "vllm:num_preemptions_total") is None
    assert gauge(samples, "vllm:num_requests_waiting") == 3.0


def test_the_metrics_body_limit_is_16_mib(base_url: str) -> None:
    """README: an engine whose /metrics "sends more than 16 MiB" fails the arm; a body of
    exactly 16 MiB is still read. Kills a smaller ``MAX_BODY_BYTES`` (16 KiB) and the
    check ``len(body) > limit`` -> ``> 2 * limit``."""
    assert MAX_BODY_BYTES == 16 * 1024 * 1024
    status, text = asyncio.run(fetch_text(base_url, "/at-limit"))
    assert status == 200 and len(text) == MAX_BODY_BYTES
    with pytest.raises(ResponseTooLarge, match=f"more than {MAX_BODY_BYTES} bytes"):
        asyncio.run(fetch_text(base_url, "/past-limit"))


def test_a_lone_surrogate_hashes_apart_from_its_replacement() -> None:
    """qualification.md §6 gate 1 compares the warm-up answers by hash, so two different
    answers must not share one: a lone surrogate (valid JSON "\\ud800") is hashed as
    itself, never raising. Kills encoding with ``errors="replace"`` (it then hashed as
    ``?``)."""

    def result(text: str) -> RequestResult:
        return RequestResult(0, True, 200, 0.0, 0.1, 0.2, 1, text)

    assert result("\ud800").text_hash != result("?").text_hash
    assert len(result("\ud800").text_hash) == 16
