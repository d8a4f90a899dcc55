"""An OpenAI-compatible asyncio streaming client (``/v1/completions`` with ``stream``).

Streaming makes TTFT real: it is the time from sending to the first chunk carrying text.
Every request has its own timeout; a request that hits it counts as *starved*, one that
errors or ends without completing counts as *failed*, and one the workload cancels on
purpose (the cancel-burst cell) is neither.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

__all__ = [
    "MAX_BODY_BYTES",
    "RequestResult",
    "RequestSpec",
    "ResponseTooLarge",
    "fetch_text",
    "run_requests",
    "stream_completion",
]


# A real /metrics is well under a megabyte; one past this is garbage that would take
# gigabytes of memory to parse (fetch_text reads and decodes the whole body).
MAX_BODY_BYTES = 16 * 1024 * 1024


class ResponseTooLarge(aiohttp.ClientPayloadError):
    """A ``fetch_text`` body past its byte limit."""


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    prompt: str
    max_tokens: int
    delay_s: float = 0.0
    cancel_at_s: float | None = None


@dataclass(frozen=True, slots=True)
class RequestResult:
    index: int
    ok: bool
    status: int | None
    sent_at: float
    ttft: float | None
    latency: float | None
    output_tokens: int
    text: str
    error: str | None = None
    timed_out: bool = False
    cancelled: bool = False
    # The server's own prompt token count (the final usage chunk); None when it sent none.
    prompt_tokens: int | None = None

    @property
    def text_hash(self) -> str:
        # A stream may carry a lone surrogate (JSON "\ud800"): hash it, never raise.
        return hashlib.sha256(self.text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Sampling:
    model: str
    temperature: float
    seed: int
    ignore_eos: bool


# Counts feed float arithmetic (throughput, TPOT, recomputed tokens): one past 2**53 is
# garbage, and one past float's range would raise OverflowError there.
_MAX_TOKEN_COUNT = 2**53


def _token_count(usage: dict[str, object], key: str, default: int | None) -> int | None:
    """A non-negative integer count (at most 2**53) from a usage object, else ``default``."""
    value = usage.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_TOKEN_COUNT:
        return value
    return default


def _payload(sampling: Sampling, prompt: str, max_tokens: int) -> dict[str, object]:
    return {
        "model": sampling.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "seed": sampling.seed,
        "ignore_eos": sampling.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass(slots=True)
class _Stream:
    """What one streaming response has delivered so far (filled while it is read)."""

    sent: float
    first: float | None = None
    chunks: int = 0
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    parts: list[str] = field(default_factory=list)
    status: int | None = None
    finished: bool = False

    def take(self, line: str) -> None:
        """One line of the event stream; raises ValueError for a chunk that is not an object."""
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            self.finished = True
            return
        event = json.loads(data)
        if not isinstance(event, dict):
            raise ValueError(f"stream chunk is not a JSON object: {data[:80]}")
        usage = event.get("usage")
        if isinstance(usage, dict):
            # `include_usage`: the final chunk counts the prompt as the server tokenized
            # it, which the recomputed-prompt figure needs.
            self.usage_tokens = _token_count(usage, "completion_tokens", self.usage_tokens)
            self.prompt_tokens = _token_count(usage, "prompt_tokens", self.prompt_tokens)
        choices = event.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            text = choice.get("text") if isinstance(choice, dict) else None
            if isinstance(text, str) and text:
                if self.first is None:
                    self.first = time.monotonic()
                self.chunks += 1
                self.parts.append(text)

    def result(self, spec: RequestSpec, origin: float, ok: bool,
               **outcome: object) -> RequestResult:
        end = time.monotonic()
        return RequestResult(
            index=spec.index,
            ok=ok,
            status=self.status,
            sent_at=self.sent - origin,
            ttft=None if self.first is None else self.first - self.sent,
            latency=end - self.sent if ok else None,
            output_tokens=self.usage_tokens if self.usage_tokens is not None else self.chunks,
            text="".join(self.parts),
            prompt_tokens=self.prompt_tokens,
            **outcome,  # type: ignore[arg-type]
        )


async def _consume(session: aiohttp.ClientSession, url: str, payload: dict[str, object],
                   stream: _Stream) -> None:
    async with session.post(url, json=payload) as response:
        stream.status = response.status
        if response.status != 200:
            # Bytes, decoded leniently: an error page in another charset still names its
            # status, where ``text()`` would raise and the reason would be a codec error.
            body = (await response.read()).decode("utf-8", "replace")[:200].strip()
            raise RuntimeError(f"HTTP {response.status}: {body}")
        async for raw in response.content:
            stream.take(raw.decode("utf-8", "replace").strip())
            if stream.finished:
                break


async def stream_completion(
    session: aiohttp.ClientSession,
    base_url: str,
    sampling: Sampling,
    spec: RequestSpec,
    timeout_s: float,
    origin: float,
) -> RequestResult:
    """Send one streaming completion; never raises (errors are part of the result)."""
    stream = _Stream(sent=time.monotonic())
    elapsed = stream.sent - origin
    # A cancel before the timeout ends the request as cancelled, not starved.
    cancel = spec.cancel_at_s is not None and spec.cancel_at_s - elapsed < timeout_s
    budget = timeout_s
    if cancel and spec.cancel_at_s is not None:
        budget = max(0.0, spec.cancel_at_s - elapsed)
    payload = _payload(sampling, spec.prompt, spec.max_tokens)
    try:
        await asyncio.wait_for(
            _consume(session, f"{base_url}/v1/completions", payload, stream), timeout=budget)
    except TimeoutError:
        if cancel:
            return stream.result(spec, origin, False, cancelled=True)
        return stream.result(spec, origin, False, error=f"timed out after {timeout_s}s",
                             timed_out=True)
    except (aiohttp.ClientError, OSError, RuntimeError, ValueError) as exc:
        return stream.result(spec, origin, False, error=str(exc) or type(exc).__name__)
    if not stream.finished:
        return stream.result(spec, origin, False, error="stream ended without [DONE]")
    return stream.result(spec, origin, True)


async def run_requests(
    base_url: str,
    sampling: Sampling,
    specs: Sequence[RequestSpec],
    *,
    concurrency: int,
    timeout_s: float,
) -> tuple[list[RequestResult], float]:
    """Run a cell's requests; returns the results (in index order) and the makespan."""
    semaphore = asyncio.Semaphore(concurrency)
    origin = time.monotonic()
    connector = aiohttp.TCPConnector(limit=max(concurrency, 1) + 2)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(spec: RequestSpec) -> RequestResult:
            await asyncio.sleep(max(0.0, spec.delay_s - (time.monotonic() - origin)))
            async with semaphore:
                return await stream_completion(session, base_url, sampling, spec, timeout_s, origin)

        results = await asyncio.gather(*(one(s) for s in specs))
    makespan = time.monotonic() - origin
    return sorted(results, key=lambda r: r.index), makespan


async def fetch_text(
    base_url: str, path: str, timeout_s: float = 10.0, limit: int = MAX_BODY_BYTES
) -> tuple[int, str]:
    """GET a small endpoint (``/health``, ``/metrics``); raises aiohttp errors, and
    :class:`ResponseTooLarge` past ``limit`` bytes. The body is UTF-8 (the Prometheus text
    format's encoding); an undecodable byte becomes U+FFFD, so only its line is lost."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    body = bytearray()
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(f"{base_url}{path}") as response,
    ):
        async for chunk in response.content.iter_chunked(1 << 16):
            body += chunk
            if len(body) > limit:
                raise ResponseTooLarge(f"{path} answered more than {limit} bytes")
        return response.status, body.decode("utf-8", "replace")
