"""The policy controller: the host-side guard around a ``vllm.preemption-policy.v1`` policy.

It follows the vLLM-HUST host's rules (preemption-contract.md, sections 4-6) and is stricter
in one place: any return value that is neither ``None`` nor a ``str`` naming a candidate is
an invalid selection, even when it is unhashable, so nothing the policy returns can escape
into the scheduler.

Per call: one thread check, one counter increment, one call into the policy and one scan
of the candidate tuple to validate the answer (no allocation on the success path).
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from bidkv_ext.contract import (
    PreemptionCandidate,
    PreemptionContext,
    PreemptionContextFacts,
    PreemptionPolicy,
    PreemptionPolicyStats,
    candidate_index,
)

__all__ = [
    "EvidenceObserver",
    "EvidenceSink",
    "PolicyController",
    "PreemptionPolicyController",
    "builtin_victim",
    "builtin_victim_id",
    "load_policy",
    "policy_name_of",
]

logger = logging.getLogger("bidkv_ext.controller")

_NOT_A_POLICY = "preemption_policy must resolve to an object implementing PreemptionPolicy"
_WRONG_THREAD = "PreemptionPolicyController must be used by its scheduler thread"


# Receives controller lifecycle events ("initialized", "effective", "disabled") with the
# exported counters; any failure in it is swallowed.
EvidenceSink = Callable[[str, dict[str, object]], None]
# The guarded host's evidence observer (preemption-contract.md §5): called as
# observer(event, outcome) with ("resolved", "protocol-validated") once a policy is in
# charge, and ("invoked", "selected" | "abstained" | "invalid" | "exception") per call.
# Any failure in it is swallowed and never changes the victim.
EvidenceObserver = Callable[[str, str], None]


def builtin_victim(context: PreemptionContext) -> PreemptionCandidate:
    """The host's own victim: ``builtin_victim_id`` if valid, else priority max or the tail."""
    candidates = context.candidates
    if not candidates:
        raise ValueError("cannot select a preemption victim from an empty set")
    hinted = context.builtin_victim_id
    if hinted is not None:
        index = candidate_index(candidates, hinted)
        if index >= 0:
            return candidates[index]
    if context.scheduling_policy == "priority":
        return max(candidates, key=lambda c: (c.priority, c.arrival_time))
    return candidates[-1]


def builtin_victim_id(context: PreemptionContext) -> str:
    """The id of :func:`builtin_victim`."""
    return builtin_victim(context).request_id


def policy_name_of(policy: object) -> str:
    kind = type(policy)
    return f"{kind.__module__}.{kind.__qualname__}"


def _resolve_qualname(path: str) -> Any:
    # vLLM's resolve_obj_by_qualname: "package.module.Object" (dots only).
    module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"preemption_policy must be a dotted path 'module.Object', got {path!r}")
    return getattr(importlib.import_module(module_name), attr)


def load_policy(spec: object, vllm_config: object | None = None) -> PreemptionPolicy | None:
    """Load a policy by the host's rules: None, a dotted path, a class, or an instance.

    Nothing is wrapped in ``try``: import errors, constructor exceptions and configuration
    errors propagate, so a broken policy fails engine start-up with its own message.
    """
    if spec is None:
        return None
    obj = _resolve_qualname(spec) if isinstance(spec, str) else spec
    # The host's order (preemption-contract.md §4), instances included: an instance whose
    # class offers from_vllm_config is re-created from the engine config, as vLLM-HUST
    # does, so a policy behaves here as it will there. Pass a class to configure it that
    # way, or an instance of a class without the factory to use it as it is.
    factory = getattr(obj, "from_vllm_config", None)
    if callable(factory):
        if not isinstance(obj, type):
            logger.warning(
                "preemption_policy is an instance of %s; as on vLLM-HUST it is rebuilt with "
                "from_vllm_config, so settings given to the instance do not apply (pass the "
                "class and configure it through additional_config)", policy_name_of(obj))
        result = factory(vllm_config)
    elif isinstance(obj, type):
        result = obj()
    else:
        result = obj
    if not isinstance(result, PreemptionPolicy):
        raise TypeError(_NOT_A_POLICY)
    return result


def _named_candidate(
    candidates: Sequence[PreemptionCandidate], result: object, hint: object
) -> str | None:
    """The candidate's own id object that ``result`` names, or None.

    Any str names a candidate (a str subclass such as numpy.str_ included); the candidate's
    own object is returned, never the policy's. The caller runs this inside a ``try``: the
    comparisons run the result's code too.
    """
    if not isinstance(result, str):
        return None
    # A cooperative policy says where its victim sits; one comparison proves it.
    if type(hint) is int and 0 <= hint < len(candidates):
        found = candidates[hint].request_id
        if found == result:
            return found
    index = candidate_index(candidates, result)
    return candidates[index].request_id if index >= 0 else None


class PolicyController:
    """Counts, validates and contains one policy for the life of an engine process."""

    __slots__ = (
        "_evidence",
        "_observer",
        "_owner",
        "_policy",
        "_select_with_facts",
        "_stats",
        "_wants_facts",
    )

    def __init__(
        self,
        policy: PreemptionPolicy | None,
        *,
        evidence: EvidenceSink | None = None,
        observer: EvidenceObserver | None = None,
    ) -> None:
        if policy is not None and not isinstance(policy, PreemptionPolicy):
            raise TypeError(_NOT_A_POLICY)
        self._owner = threading.get_ident()
        self._policy = policy
        self._evidence = evidence
        self._observer = observer
        self._select_with_facts: Callable[..., object] | None = getattr(
            policy, "select_victim_with_facts", None
        )
        # Read once, here: an error in it fails start-up like any constructor error,
        # instead of escaping into the scheduler at a decision.
        self._wants_facts = self._select_with_facts is not None and bool(
            getattr(policy, "wants_host_facts", True)
        )
        name = "builtin" if policy is None else policy_name_of(policy)
        self._stats = PreemptionPolicyStats(policy_name=name, enabled=policy is not None)
        logger.info(
            "Preemption policy initialized: policy=%s enabled=%s", name, self._stats.enabled
        )
        self._emit("initialized")
        if policy is not None:
            self._observe("resolved", "protocol-validated")

    @classmethod
    def from_spec(
        cls,
        spec: object,
        vllm_config: object | None = None,
        *,
        evidence: EvidenceSink | None = None,
        observer: EvidenceObserver | None = None,
    ) -> PolicyController:
        # Not cls(...): a subclass may take another constructor (PreemptionPolicyController).
        return PolicyController(
            load_policy(spec, vllm_config), evidence=evidence, observer=observer
        )

    @property
    def stats(self) -> PreemptionPolicyStats:
        return self._stats

    @property
    def enabled(self) -> bool:
        return self._stats.enabled

    @property
    def policy(self) -> PreemptionPolicy | None:
        """The policy in charge; None for the built-in victim, also after a fallback."""
        return self._policy

    @property
    def wants_facts(self) -> bool:
        """True when the policy takes host facts; only then should a host compute them.

        The policy's ``wants_host_facts`` is read once, at construction.
        """
        return self._wants_facts

    def check_thread(self) -> None:
        """The single-thread guard alone, for a host that skips :meth:`select_victim`."""
        if threading.get_ident() != self._owner:
            raise RuntimeError(_WRONG_THREAD)

    def select_victim(
        self, context: PreemptionContext, facts: PreemptionContextFacts | None = None
    ) -> str:
        """Return the id to preempt; never raises except for the thread guard and no candidates."""
        self.check_thread()
        policy = self._policy
        if policy is None:
            return builtin_victim_id(context)
        stats = self._stats
        stats.calls += 1
        try:
            if facts is not None and self._select_with_facts is not None:
                result = self._select_with_facts(context, facts)
            else:
                result = policy.select_victim(context)
            # Read inside the try: it is the policy's code too (a property may raise).
            hint = getattr(policy, "victim_index_hint", -1) if result is not None else -1
        except Exception:
            # One ERROR record, traceback attached (the contract's "exactly one ERROR line").
            self._disable("raised an exception", exc_info=True)
            if self._observer is not None:
                self._observe("invoked", "exception")
            return builtin_victim_id(context)
        if stats.calls == 1:
            self._emit("effective")
        if result is None:
            stats.abstentions += 1
            if self._observer is not None:
                self._observe("invoked", "abstained")
            return builtin_victim_id(context)
        try:
            found = _named_candidate(context.candidates, result, hint)
        except Exception:
            # The result's own code raised (a str subclass's __eq__, say): it names nothing.
            found = None
        if found is not None:
            stats.selections += 1
            if self._observer is not None:
                self._observe("invoked", "selected")
            return found
        stats.invalid_selections += 1
        self._disable(f"returned unknown request ID {_safe_repr(result)}")
        if self._observer is not None:
            self._observe("invoked", "invalid")
        return builtin_victim_id(context)

    def export_stats(self) -> dict[str, object]:
        s = self._stats
        return {
            "policy_name": s.policy_name,
            "enabled": s.enabled,
            "calls": s.calls,
            "selections": s.selections,
            "abstentions": s.abstentions,
            "failures": s.failures,
            "invalid_selections": s.invalid_selections,
        }

    def emit_effective(self) -> None:
        """Record an ``effective`` evidence event with the current counters."""
        self._emit("effective")

    def _disable(self, reason: str, *, exc_info: bool = False) -> None:
        stats = self._stats
        stats.failures += 1
        stats.enabled = False
        self._policy = None
        self._select_with_facts = None
        self._wants_facts = False
        logger.error(
            "Preemption policy %s failed (%s); disabling it and restoring the built-in "
            "policy for this engine process",
            stats.policy_name,
            reason,
            exc_info=exc_info,
        )
        self._emit("disabled")

    def _emit(self, event: str) -> None:
        sink = self._evidence
        if sink is None:
            return
        try:
            sink(event, self.export_stats())
        except Exception as exc:  # evidence must never change a decision
            # Only a strict sink raises (VLLM_ECPA_EVIDENCE_STRICT=1): say so where an
            # operator looks. Events are lifecycle ones (a few per process), not per call.
            logger.warning("evidence sink failed for %s event: %s", event, exc)

    def _observe(self, event: str, outcome: str) -> None:
        observer = self._observer
        if observer is None:
            return
        try:
            observer(event, outcome)
        except Exception as exc:  # evidence must never change a decision
            # DEBUG only: an observer sees every call, and the hot path must not log.
            logger.debug("evidence observer failed for %s/%s: %s", event, outcome, exc)


class PreemptionPolicyController(PolicyController):
    """The host module's name and constructor: ``PreemptionPolicyController(vllm_config)``.

    Loads ``vllm_config.scheduler_config.preemption_policy`` (vLLM-HUST's field; absent on
    stock vLLM, which means no policy) by the loading rules, then behaves exactly like
    :class:`PolicyController`.
    """

    __slots__ = ()

    def __init__(
        self,
        vllm_config: object,
        *,
        evidence: EvidenceSink | None = None,
        observer: EvidenceObserver | None = None,
    ) -> None:
        spec = getattr(getattr(vllm_config, "scheduler_config", None), "preemption_policy", None)
        super().__init__(load_policy(spec, vllm_config), evidence=evidence, observer=observer)


def _safe_repr(value: object) -> str:
    try:
        return repr(value)
    except Exception:
        return f"<unrepresentable {type(value).__name__}>"

