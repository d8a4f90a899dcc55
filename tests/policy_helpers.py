"""Small builders shared by the policy-level tests (no vLLM needed)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from bidkv_ext.contract import PreemptionCandidate, PreemptionContext


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
