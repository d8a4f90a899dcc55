"""One arm on a real server: ``vllm-hust-ext run -- vllm serve ...`` (GPU profiles).

Per arm (qualification.md §2): fresh server, wait for ``/health``, snapshot the device
and (candidate) read the engine processes' policy environment (``procedure.py``), one
deterministic warm-up request (its hash is the short-output gate), scrape ``/metrics``,
run the cell, scrape again, and for the cancel cell wait for the engine to drain and send
the recovery request. The server is always stopped in a ``finally`` through the manager, which
forwards the signal to the engine's process group.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp

from qualification.client import (
    RequestResult,
    RequestSpec,
    ResponseTooLarge,
    Sampling,
    fetch_text,
    run_requests,
)
from qualification.errors import one_line
from qualification.evidence import (
    Samples,
    counters_from_evidence,
    counters_from_metrics,
    enabled_from_log,
    gauge,
    metric_delta,
    parse_prometheus,
    tp_ranks_from_log,
)
from qualification.figures import serve_figures
from qualification.manager import Arm, ManagerSession
from qualification.procedure import (
    log_facts,
    policy_environment,
    snapshot_command,
    snapshot_device,
)
from qualification.profile import CellSpec, Profile, ServerSpec
from qualification.verdict import ArmResult

__all__ = [
    "ServeArm",
    "build_requests",
    "client_prompt_tokens",
    "recomputed_prompt_tokens",
    "serve_command",
    "serve_environment",
]

_TRACEBACK = "Traceback (most recent call last)"


def serve_command(profile: Profile) -> list[str]:
    """The ``vllm serve`` argv for both arms (the manager adds the policy to the candidate)."""
    server = profile.server
    assert server is not None
    argv = [*server.command, profile.model, "--host", server.host, "--port", str(server.port)]
    argv += ["--tensor-parallel-size", str(profile.tensor_parallel_size)]
    argv += ["--seed", str(profile.workload.seed)]
    if server.served_model_name:
        argv += ["--served-model-name", server.served_model_name]
    if server.enforce_eager:
        argv.append("--enforce-eager")
    elif server.graph_mode:
        compilation = {
            "cudagraph_mode": server.graph_mode,
            "cudagraph_capture_sizes": list(server.cudagraph_capture_sizes),
        }
        argv += ["--compilation-config", json.dumps(compilation, separators=(",", ":"))]
    if server.kv_cache_memory_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(server.kv_cache_memory_bytes)]
    if server.num_gpu_blocks_override is not None:
        argv += ["--num-gpu-blocks-override", str(server.num_gpu_blocks_override)]
    if server.max_model_len is not None:
        argv += ["--max-model-len", str(server.max_model_len)]
    if server.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(server.max_num_seqs)]
    if server.scheduler_cls:
        argv += ["--scheduler-cls", server.scheduler_cls]
    return [*argv, *server.extra_args]


def serve_environment(server: ServerSpec, arm: Arm) -> dict[str, str]:
    env = dict(server.environment)
    if arm == "candidate":
        env.update(server.candidate_environment)
    return env


def build_requests(profile: Profile, cell: CellSpec, repetition: int) -> list[RequestSpec]:
    """N paragraphs per request, pattern and delays cycled; a per-request prefix keeps
    prompts distinct so the prefix cache cannot serve one from another."""
    count = cell.num_requests or max(len(cell.paragraph_repeats), len(cell.delays_s))
    specs = []
    for i in range(count):
        repeats = cell.paragraph_repeats[i % len(cell.paragraph_repeats)]
        delay = cell.delays_s[i % len(cell.delays_s)]
        prompt = f"Request {repetition}-{i}. " + profile.workload.paragraph * repeats
        # Every other stream from the first (0, 2, 4, ...), as the reference workload did:
        # with the cancel cell's pattern that cancels the 900- and 500-paragraph requests.
        cancel = cell.cancel_after_s if cell.cancel_after_s is not None and i % 2 == 0 else None
        specs.append(RequestSpec(i, prompt, cell.max_tokens, delay, cancel))
    return specs


# What ``fetch_text`` raises when the engine died or its /metrics stopped answering.
_UNREACHABLE = (aiohttp.ClientError, OSError, asyncio.TimeoutError)


@dataclass(frozen=True, slots=True)
class _Load:
    """What one arm's workload produced; ``error`` says why it stopped early, if it did
    (what ran before that is kept)."""

    warmup: RequestResult
    results: list[RequestResult] = field(default_factory=list)
    makespan: float = 0.0
    before: str = ""
    after: str = ""
    drain_s: float | None = None
    recovery: RequestResult | None = None
    recovery_ok: bool | None = None
    error: str | None = None


def client_prompt_tokens(results: Sequence[RequestResult]) -> int | None:
    """The prompt tokens the server reported for these requests; None when any response
    carried no usage (a cancelled or failed stream), since a partial sum would be wrong."""
    counts = [r.prompt_tokens for r in results]
    if any(c is None for c in counts):
        return None
    return sum(c for c in counts if c is not None)


def recomputed_prompt_tokens(local_compute: float | None, client: int | None) -> float | None:
    """qualification.md §4: prompt tokens computed locally beyond the prompts sent."""
    return None if local_compute is None or client is None else local_compute - client


def _port_in_use(host: str, port: int) -> bool:
    """Whether something already accepts connections where the arm's server will listen:
    its /health would answer for a server that never bound the port."""
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False


def _exit_note(proc: subprocess.Popen[bytes]) -> str:
    """Whether the server itself went away, not only its endpoint (it may take a moment)."""
    try:
        return f" (server exited with status {proc.wait(timeout=2.0)})"
    except subprocess.TimeoutExpired:
        return " (server still running)"


def _kill_manager(proc: subprocess.Popen[bytes]) -> None:
    # The manager may have exited since it was last polled: nothing is left to kill.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _hurry(proc: subprocess.Popen[bytes]) -> None:
    """Escalate a stop at once: every SIGTERM after the manager's first makes it SIGKILL
    the engine's group (repeated, since signals sent together may arrive as one)."""
    deadline = time.monotonic() + 15.0
    while proc.poll() is None and time.monotonic() < deadline:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)
    if proc.poll() is None:
        _kill_manager(proc)


@dataclass(frozen=True, slots=True)
class ServeArm:
    profile: Profile
    session: ManagerSession
    log_path: Path

    @property
    def base_url(self) -> str:
        server = self.profile.server
        assert server is not None
        # An IPv6 literal (`--host ::1`) needs brackets in a URL, or no request parses.
        host = f"[{server.host}]" if ":" in server.host else server.host
        return f"http://{host}:{server.port}"

    @property
    def sampling(self) -> Sampling:
        server = self.profile.server
        assert server is not None
        w = self.profile.workload
        return Sampling(
            server.served_model_name or self.profile.model, w.temperature, w.seed, w.ignore_eos
        )

    def run(self, arm: Arm, cell: CellSpec, repetition: int) -> ArmResult:
        server = self.profile.server
        assert server is not None
        self.session.prepare(arm)
        argv = self.session.run_argv(serve_command(self.profile))
        env = self.session.environment(serve_environment(server, arm))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        if _port_in_use(server.host, server.port):
            why = (
                f"port {server.port} on {server.host} is already in use by another process; "
                "the arm's server was not started"
            )
            return ArmResult.not_started(arm, why, wall_s=0.0, command=tuple(argv))
        down = "server did not start"
        with self.log_path.open("wb") as log:
            proc = subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                up = self._wait_ready(proc, server.ready_timeout_s)
                facts = self._procedure(arm, proc.pid) if up else {}
                load = asyncio.run(self._load(cell, repetition)) if up else None
                if load is not None and load.error:
                    load = replace(load, error=load.error + _exit_note(proc))
                elif load is None:
                    down = f"server did not become healthy within {server.ready_timeout_s:g}s"
                    if proc.poll() is not None:
                        down = f"server exited with status {proc.returncode} before /health"
            finally:
                self._stop(proc, server.stop_timeout_s)
        facts["log"] = log_facts(self.log_path, self.log_path.parent)
        if load is None:
            return self._not_started(arm, argv, down, time.monotonic() - started, facts)
        return self._result(arm, argv, load, time.monotonic() - started, facts)

    def _procedure(self, arm: Arm, manager_pid: int) -> dict[str, object]:
        """qualification.md §2 step 3 (device snapshot) and, for the candidate, step 4
        (the policy environment of the manager, the engine and its children), right after
        /health; neither ever fails the arm."""
        server = self.profile.server
        assert server is not None
        command = snapshot_command(server.device_snapshot_command, self.profile.accelerator)
        facts: dict[str, object] = {"device_snapshot": snapshot_device(command).as_dict()}
        if arm == "candidate":
            facts["policy_environment"] = policy_environment(manager_pid).as_dict()
        return facts

    def _wait_ready(self, proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            try:
                status, _ = asyncio.run(fetch_text(self.base_url, "/health", 5.0))
                if status == 200:
                    return True
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass
            time.sleep(2.0)
        return False

    async def _load(self, cell: CellSpec, repetition: int) -> _Load:
        w = self.profile.workload
        warm = RequestSpec(-1, w.warmup_prompt, w.warmup_max_tokens)
        (warmup,), _ = await run_requests(
            self.base_url, self.sampling, [warm], concurrency=1, timeout_s=w.request_timeout_s
        )
        load = _Load(warmup)
        stage = "before the workload"
        try:
            load = replace(load, before=await self._metrics())
            results, makespan = await run_requests(
                self.base_url,
                self.sampling,
                build_requests(self.profile, cell, repetition),
                concurrency=cell.concurrency,
                timeout_s=w.request_timeout_s,
            )
            load = replace(load, results=results, makespan=makespan)
            if cell.cancel_after_s is not None:
                stage = "while draining after the cancellations"
                load = replace(load, drain_s=await self._drain(w.cancel_drain_bound_s * 4))
                load = await self._recover(load)
            stage = "after the workload"
            return replace(load, after=await self._metrics())
        except _UNREACHABLE as exc:
            # The engine died (or /metrics hung) mid-arm: a failed arm with its reason,
            # never an exception that would lose the arms already finished.
            reason = str(exc) or type(exc).__name__
            what = "sent an oversized" if isinstance(exc, ResponseTooLarge) else "stopped answering"
            return replace(load, error=f"engine {what} /metrics {stage}: {reason}")

    async def _metrics(self) -> str:
        _, text = await fetch_text(self.base_url, "/metrics")
        return text

    async def _recover(self, load: _Load) -> _Load:
        w = self.profile.workload
        rec = RequestSpec(-2, w.recovery_prompt, w.recovery_max_tokens)
        # The answer must be exactly the expected text (qualification.md §6 gate 4): the
        # model has to stop at its end-of-sequence token, so this request, unlike the
        # workload's forced-length ones, never ignores it.
        sampling = replace(self.sampling, ignore_eos=False)
        (answer,), _ = await run_requests(
            self.base_url, sampling, [rec], concurrency=1, timeout_s=w.request_timeout_s
        )
        expected = w.recovery_expected
        ok = (
            answer.ok
            and answer.status == 200
            and (expected is None or answer.text.strip() == expected)
        )
        return replace(load, recovery=answer, recovery_ok=ok)

    async def _drain(self, give_up_s: float) -> float | None:
        """Seconds until the engine reports 0 running and 0 waiting (None: never)."""
        start = time.monotonic()
        while time.monotonic() - start < give_up_s:
            samples = parse_prometheus(await self._metrics())
            running = gauge(samples, "vllm:num_requests_running")
            waiting = gauge(samples, "vllm:num_requests_waiting")
            if running == 0 and waiting == 0:
                return time.monotonic() - start
            await asyncio.sleep(0.1)
        return None

    def _stop(self, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
        # The manager forwards the first SIGTERM to the engine's group and escalates to
        # SIGKILL on a second one; killing the manager itself is the last resort.
        try:
            for wait_s in (timeout_s, 15.0):
                if proc.poll() is not None:
                    return
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=wait_s)
                    return
                except subprocess.TimeoutExpired:
                    continue
        except KeyboardInterrupt:
            # A second Ctrl-C while the server stops: hurry the stop rather than exit
            # with the manager and engine still running in their own sessions.
            _hurry(proc)
            raise
        _kill_manager(proc)

    def _not_started(
        self, arm: Arm, argv: Sequence[str], why: str, wall: float, facts: dict[str, object]
    ) -> ArmResult:
        log_text = self.log_path.read_text(encoding="utf-8", errors="replace")
        # The log's last line usually says why (a manager refusal, an engine error).
        tail = log_text.strip().splitlines()[-1:]
        return ArmResult.not_started(
            arm,
            ": ".join([why, *tail]),
            wall_s=wall,
            command=tuple(argv),
            tracebacks=log_text.count(_TRACEBACK),
            policy_enabled=enabled_from_log(log_text)[0],
            procedure=facts,
        )

    def _result(
        self, arm: Arm, argv: Sequence[str], load: _Load, wall: float, facts: dict[str, object]
    ) -> ArmResult:
        server = self.profile.server
        assert server is not None
        log_text = self.log_path.read_text(encoding="utf-8", errors="replace")
        log_enabled, log_name = enabled_from_log(log_text)
        before, after = parse_prometheus(load.before), parse_prometheus(load.after)
        counters, enabled = counters_from_metrics(before, after)
        ev_counters, ev_enabled, ev_name = counters_from_evidence(self.session.evidence_path)
        counters = counters if counters is not None else ev_counters
        enabled = next((e for e in (enabled, ev_enabled, log_enabled) if e is not None), None)
        done = [r for r in load.results if r.ok]
        counted = [r for r in load.results if not r.cancelled]
        tokens = sum(r.output_tokens for r in done)
        graph = None
        if server.graph_mode and not server.enforce_eager and server.graph_capture_pattern:
            graph = server.graph_capture_pattern in log_text
        ranks = None
        if self.profile.tensor_parallel_size > 1 and server.tp_rank_pattern:
            ranks = tp_ranks_from_log(log_text, server.tp_rank_pattern)
        # Every latency figure once, from the completed requests; the gated four become
        # fields, the rest go to ``extra``.
        figures = serve_figures(load.results, load.makespan)
        return ArmResult(
            arm=arm,
            throughput=tokens / load.makespan if load.makespan > 0 else 0.0,
            ttft_p50=figures.pop("ttft_p50"),
            ttft_p95=figures.pop("ttft_p95"),
            latency_p50=figures.pop("e2e_p50"),
            latency_p95=figures.pop("e2e_p95"),
            requests=len(counted),
            completed=len(done),
            failed=sum(1 for r in counted if not r.ok and not r.timed_out),
            starved=sum(1 for r in counted if r.timed_out),
            output_tokens=tokens,
            counters=counters,
            policy_enabled=enabled,
            policy_name=ev_name or log_name,
            preemptions=metric_delta(before, after, "vllm:num_preemptions"),
            short_hash=load.warmup.text_hash if load.warmup.ok else None,
            long_hashes=tuple(r.text_hash for r in done),
            drain_s=load.drain_s,
            recovery_ok=load.recovery_ok,
            tracebacks=log_text.count(_TRACEBACK),
            graph_captured=graph,
            tp_ranks=ranks,
            error=self._error(load),
            wall_s=wall,
            command=tuple(argv),
            extra={
                "makespan_s": load.makespan,
                "cancelled": sum(r.cancelled for r in load.results),
                **figures,
                **self._prompt_tokens(load, before, after),
            },
            procedure=facts,
        )

    @staticmethod
    def _error(load: _Load) -> str | None:
        errors = [] if load.warmup.ok else [f"warm-up failed: {load.warmup.error}"]
        errors += [load.error] if load.error else []
        # One line: a server's error body may hold line breaks (report.md lists it).
        return one_line("; ".join(errors)) or None

    @staticmethod
    def _prompt_tokens(load: _Load, before: Samples, after: Samples) -> dict[str, object]:
        """Recompute shows as prompt tokens computed locally beyond the prompts sent: the
        local-compute delta between the scrapes minus the prompt tokens the server reported
        for the requests sent between them (the cell's and the recovery request)."""
        local = metric_delta(before, after, "vllm:prompt_tokens_by_source", source="local_compute")
        sent = [*load.results, *([load.recovery] if load.recovery is not None else [])]
        client = client_prompt_tokens(sent) if sent else None
        return {
            "prompt_tokens_local_compute": local,
            "client_prompt_tokens": client,
            "recomputed_prompt_tokens": recomputed_prompt_tokens(local, client),
        }
