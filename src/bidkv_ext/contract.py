"""The ``vllm.preemption-policy.v1`` contract, as the vLLM-HUST host defines it.

The host module ``vllm.v1.core.sched.preemption`` is not in any installable vLLM, so this
module is a faithful local definition: the same names, field order, frozen and slotted
types, and the same runtime-checkable protocol. Policies written against these types run
unchanged on a vLLM-HUST host, because they only use attribute access.

Where the host module is there (a vLLM-HUST install) and vLLM is already loaded when this
module is imported, as in every engine process, the contract's names here *are* the host's
(``PreemptionCandidate``, ``PreemptionContext``, ``PreemptionPolicy``,
``PreemptionPolicyStats``, ``PreemptionPolicyController`` and the API version), so
``isinstance`` against them holds for the host's own snapshots. That happens only when the
host module declares API major version 1 and the candidate and context fields in the
contract's order; otherwise a warning names the difference and the local definitions stay.

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
``in_shrink`` (context level, optional)
    Whether the elastic pool is shrinking, when the host read kvcached's capacity
    signals for this decision anyway; ``None`` leaves the reading to the policy.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from packaging.version import InvalidVersion, Version

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
    """Optional per-decision facts: block size, shortfall and per-candidate block counts.

    ``in_shrink`` is the elastic pool's shrink state when the host already read the
    capacity signals for this decision (``None``: it did not, and a policy that weighs pages
    reads them itself), so one decision queries the driver once.
    """

    block_size: int
    needed_blocks: int
    facts: Mapping[str, CandidateFacts] = field(default_factory=dict)
    in_shrink: bool | None = None


class _Identified(Protocol):
    @property
    def request_id(self) -> str: ...


def candidate_index(candidates: Sequence[_Identified], request_id: object) -> int:
    """Position of ``request_id`` among the candidates, or -1.

    A plain loop that stops at the match and allocates nothing. On CPython 3.11+ it is the
    fastest scan: the attribute read specialises to a slot load, where
    ``indexOf(map(attrgetter("request_id"), ...))`` goes through the generic attribute
    lookup (about 1.5 x the time per candidate at 1,024).
    """
    # The host's built-in victim is the tail of the running list under FCFS, and the
    # tail is where a decision most often points: one comparison before the scan.
    last = len(candidates) - 1
    if last >= 0 and candidates[last].request_id == request_id:
        return last
    index = 0
    for candidate in candidates:
        if candidate.request_id == request_id:
            return index
        index += 1  # noqa: SIM113 (enumerate costs ~1.5 x per candidate here)
    return -1


HOST_MODULE = "vllm.v1.core.sched.preemption"
# What the host module shares with this one; the facts types and candidate_index are ours.
_HOST_NAMES = (
    "PREEMPTION_POLICY_API_VERSION",
    "PreemptionCandidate",
    "PreemptionContext",
    "PreemptionPolicy",
    "PreemptionPolicyStats",
    "PreemptionPolicyController",
)


def _field_names(cls: object) -> list[str] | None:
    return [f.name for f in fields(cls)] if isinstance(cls, type) and is_dataclass(cls) else None


def _host_mismatch(host: ModuleType) -> str | None:
    """Why the host module cannot stand in for this one, or ``None`` when it can."""
    missing = [name for name in _HOST_NAMES if not hasattr(host, name)]
    if missing:
        return f"it lacks {', '.join(missing)}"
    version = str(host.PREEMPTION_POLICY_API_VERSION)
    try:
        if Version(version).major != 1:
            return f"its API version is {version!r}, expected 1.x"
    except InvalidVersion:
        return f"its API version {version!r} is not a version"
    for ours in (PreemptionCandidate, PreemptionContext):
        theirs = _field_names(getattr(host, ours.__name__))
        expected = _field_names(ours)
        if theirs != expected:
            return (f"its {ours.__name__} fields are {theirs}, expected {expected} "
                    "in this order")
    return None


def _host_contract() -> ModuleType | None:
    """The vLLM-HUST host's contract module, when vLLM is loaded and has a usable one.

    Looked up only once vLLM is imported: importing vLLM merely to look costs seconds,
    and an engine process has always loaded it before it loads a policy.
    """
    if "vllm" not in sys.modules:
        return None
    try:
        host = importlib.import_module(HOST_MODULE)
    except ImportError:  # stock vLLM: the local definitions are the contract
        return None
    why = _host_mismatch(host)
    if why is not None:
        logging.getLogger(__name__).warning(
            "%s is not used as the preemption contract: %s; bidkv_ext's own definitions "
            "stay in force", HOST_MODULE, why)
        return None
    return host


_HOST = _host_contract()
if _HOST is not None:
    # Rebinding the module's names at run time keeps the static types the local ones,
    # which the host's match field for field (checked above).
    globals().update({name: getattr(_HOST, name) for name in _HOST_NAMES
                      if name != "PreemptionPolicyController"})


def __getattr__(name: str) -> object:
    # The host module exports its controller beside the types; ours lives in
    # bidkv_ext.controller, which imports this module, so it is resolved on first access.
    if name == "PreemptionPolicyController":
        if _HOST is not None:
            return _HOST.PreemptionPolicyController
        from bidkv_ext.controller import PreemptionPolicyController

        return PreemptionPolicyController
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
