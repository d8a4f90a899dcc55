"""The ``vllm.preemption-policy.v1`` contract, as the vLLM-HUST host defines it.

The host module ``vllm.v1.core.sched.preemption`` is not in any installable vLLM, so this
module is a faithful local definition: the same names, field order, frozen and slotted
types, and the same runtime-checkable protocol. Policies written against these types run
unchanged on a vLLM-HUST host, because they only use attribute access.

Extra facts (not part of the contract)
--------------------------------------
A host *may* attach optional facts to a candidate; the vLLM-HUST host attaches none, so a
policy must behave sensibly when they are absent. Our CPU host adapter
(:mod:`bidkv_ext.hosts.vllm`) passes them through :class:`CandidateFacts`, keyed by request
id, in :attr:`PreemptionContextFacts.facts` -- a side channel that leaves the contract types
untouched. The fields are:

``exclusive_blocks``
    Blocks of the candidate whose reference count is 1: exactly what preempting it returns
    to the free pool now.
``cached_blocks``
    Blocks of the candidate that carry a prefix-cache hash. After preemption they sit in
    the free queue as evictable blocks and, unless evicted meanwhile, come back as prefix
    hits when the request is re-admitted.
``total_blocks``
    All blocks the candidate holds (shared and exclusive).
``pages_released`` (optional, elastic KV only)
    Physical KV pages that preempting the candidate would return to the device: pages
    whose every block is either free or held by this candidate alone. Hosts without
    elastic KV (kvcached) leave it ``None``.
``needed_blocks`` (context level, :attr:`PreemptionContextFacts.needed_blocks`)
    How many blocks the requester still lacks for this step (the shortfall).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter, indexOf
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from bidkv_ext.controller import PreemptionPolicyController

__all__ = [
    "PREEMPTION_POLICY_API_VERSION",
    "CandidateFacts",
    "PreemptionCandidate",
    "PreemptionContext",
    "PreemptionContextFacts",
    "PreemptionPolicy",
    "PreemptionPolicyController",
    "PreemptionPolicyStats",
    "PreemptionSchedulingPolicy",
    "candidate_index",
]

PREEMPTION_POLICY_API_VERSION = "1.0"

PreemptionSchedulingPolicy = Literal["fcfs", "priority"]


@dataclass(frozen=True, slots=True)
class PreemptionCandidate:
    """One running request, as the host snapshots it. Field order is part of the contract."""

    request_id: str
    priority: int
    arrival_time: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    num_preemptions: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class PreemptionContext:
    """One victim decision. ``candidates`` is the running list in its order."""

    candidates: tuple[PreemptionCandidate, ...]
    scheduling_policy: PreemptionSchedulingPolicy
    requesting_request_id: str
    kv_cache_usage: float
    now: float
    builtin_victim_id: str | None = None


@runtime_checkable
class PreemptionPolicy(Protocol):
    """A victim selector. Return a candidate's ``request_id``, or ``None`` to abstain."""

    def select_victim(self, context: PreemptionContext) -> str | None: ...


@dataclass(slots=True)
class PreemptionPolicyStats:
    """Controller counters, with the host's field names and defaults."""

    policy_name: str = "builtin"
    enabled: bool = False
    calls: int = 0
    selections: int = 0
    abstentions: int = 0
    failures: int = 0
    invalid_selections: int = 0


@dataclass(frozen=True, slots=True)
class CandidateFacts:
    """Optional per-candidate facts a host may supply (see the module docstring)."""

    exclusive_blocks: int
    cached_blocks: int
    total_blocks: int
    pages_released: int | None = None


@dataclass(frozen=True, slots=True)
class PreemptionContextFacts:
    """Optional per-decision facts: block size, shortfall and per-candidate block counts."""

    block_size: int
    needed_blocks: int
    facts: Mapping[str, CandidateFacts] = field(default_factory=dict)


_request_id = attrgetter("request_id")


def candidate_index(candidates: Sequence[object], request_id: object) -> int:
    """Position of ``request_id`` among the candidates, or -1.

    A C-level scan that stops at the match and allocates nothing: a Python loop over 1024
    candidates would cost more than a whole victim decision.
    """
    # The host's built-in victim is the tail of the running list under FCFS, and the
    # tail is where a decision most often points: one comparison before the scan.
    last = len(candidates) - 1
    if last >= 0 and _request_id(candidates[last]) == request_id:
        return last
    try:
        return indexOf(map(_request_id, candidates), request_id)
    except ValueError:
        return -1


def __getattr__(name: str) -> object:
    # The host module exports its controller beside the types; ours lives in
    # bidkv_ext.controller, which imports this module, so it is resolved on first access.
    if name == "PreemptionPolicyController":
        from bidkv_ext.controller import PreemptionPolicyController

        return PreemptionPolicyController
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
