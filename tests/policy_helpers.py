"""Small builders shared by the policy-level tests (no vLLM needed)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from bidkv_ext.contract import PreemptionCandidate, PreemptionContext
from kvcached_provider import signals


def raised_in_another_thread(call: Callable[[], object]) -> BaseException | None:
    """What ``call`` raises when made from a thread other than this one (None if nothing)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return errors[0] if errors else None


def cand(
    rid: str,
    *,
    computed: int = 100,
    prompt: int = 100,
    output: int = 0,
    preemptions: int = 0,
    priority: int = 0,
    arrival: float = 0.0,
    max_tokens: int = 1024,
) -> PreemptionCandidate:
    return PreemptionCandidate(
        rid, priority, arrival, prompt, output, computed, preemptions, max_tokens
    )


def ctx(
    candidates: list[PreemptionCandidate] | tuple[PreemptionCandidate, ...],
    *,
    requester: str | None = None,
    policy: str = "fcfs",
    builtin: str | None = None,
    usage: float = 0.95,
    now: float = 1.0,
) -> PreemptionContext:
    cands = tuple(candidates)
    req = requester if requester is not None else cands[-1].request_id
    return PreemptionContext(cands, policy, req, usage, now, builtin)  # type: ignore[arg-type]


class PageModelSource:
    """A signals source (``kvcached_provider.signals.signals_source``) that publishes only a
    page model: no capacity signals, so no shrink is pending."""

    def __init__(self, model: signals.PageModel) -> None:
        self.model = model

    def capacity_signals(self) -> signals.CapacitySignals | None:
        return None

    def page_model(self) -> signals.PageModel | None:
        return self.model


class Fixed:
    """A contract policy that gives one fixed answer (any object) and counts its calls."""

    def __init__(self, answer: object) -> None:
        self.answer = answer
        self.calls = 0

    def select_victim(self, context: PreemptionContext) -> Any:
        self.calls += 1
        return self.answer
