"""Property tests: the policy controller keeps the host's per-call rules over any policy.

Guards ``bidkv_ext.controller`` against preemption-contract.md sections 4-6: a scripted
policy answers each decision with a valid candidate id (the candidate's own object, an
equal copy or a str subclass), ``None``, an unknown id, a wrong type (int, bytes, object,
an unhashable list, a str whose ``==`` raises) or an exception (from ``select_victim`` or
from its ``victim_index_hint``), over drawn candidate sets, scheduling policies and
``builtin_victim_id`` hints, with or without an evidence sink and an evidence observer
(either may raise), through the three ways a controller is built. An independent model
written here (not the controller's helpers) predicts for every call: the victim and that it
is a candidate's own ``request_id`` object, whether the policy is asked (and by which
method), the counters of ``export_stats()``, the sink and observer events with their
counter snapshots, and every log record above DEBUG (one ERROR for the one fault, nothing
per healthy decision, nothing at all once the built-in victim is in charge).

The module-level tally proves each outcome kind really occurs in the drawn examples.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Any

from hypothesis import currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from bidkv_ext.contract import PreemptionCandidate, PreemptionContext, PreemptionContextFacts
from bidkv_ext.controller import (
    PolicyController,
    PreemptionPolicyController,
    builtin_victim_id,
)
from tests.policy_helpers import raised_in_another_thread
from tests.property_settings import REAL_SCHEDULER

EXAMPLES = 300
WRONG_THREAD = "PreemptionPolicyController must be used by its scheduler thread"
KEYS = ("policy_name", "enabled", "calls", "selections", "abstentions", "failures",
        "invalid_selections")
# Ids that look alike ("a0", "a00", "0a", ...): only exact equality names a candidate.
ID_POOL = ("a0", "a00", "0a", "a1", "b0", "ab", "ba", "b00", "10", "01")
HEALTHY = ("valid-same", "valid-copy", "valid-subclass", "abstain")
FAULTS = ("unknown", "int", "bytes", "object", "list", "raising-eq", "raise")
HINT_KINDS = ("absent", "exact", "wrong", "out-of-range", "negative", "bool")
POLICY_ERRORS: tuple[type[Exception], ...] = (
    RuntimeError, ValueError, KeyError, TypeError, ZeroDivisionError, AttributeError)
# getattr(policy, "victim_index_hint", -1) reads an AttributeError as "no hint", so a
# raising hint is drawn from the others.
HINT_ERRORS: tuple[type[Exception], ...] = (RuntimeError, ValueError, KeyError, TypeError)

TALLY: Counter[str] = Counter()


def note(tag: str) -> None:
    TALLY[tag] += 1
    if currently_in_test_context():
        event(tag)


def fresh(text: str) -> str:
    """An equal str that is a distinct object (ids have two characters or more)."""
    return text[:1] + text[1:]


class HostId(str):
    """A host-side request id of a str subclass (the contract types it as ``str``)."""

    __slots__ = ()


class PolicyId(str):
    """A policy-side str subclass (numpy.str_, say): equal to a candidate id, so valid."""

    __slots__ = ()


class RaisingEqId(HostId):
    """A str whose comparison raises: validating it runs the policy's code.

    A subclass of HostId too, so that Python tries its ``__eq__`` first against every
    candidate id (plain str or HostId); were it a sibling of HostId, ``HostId == answer``
    would run str's comparison, find them equal, and the answer would rightly be valid.
    """

    __slots__ = ()
    __hash__ = str.__hash__

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("eq")

    def __ne__(self, other: object) -> bool:
        raise RuntimeError("ne")


class HintRaises:
    """Marks a step whose ``victim_index_hint`` read raises ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error


@dataclass
class Step:
    kind: str  # "decide", "wrong-thread" or "emit-effective"
    context: PreemptionContext
    answer_kind: str
    answer: object
    error: Exception | None
    hint: object  # an int-ish value, or HintRaises
    hint_kind: str
    facts: PreemptionContextFacts | None


@dataclass
class Scenario:
    configured: bool
    hinted: bool
    has_facts: bool
    wants: object  # "absent", True or False
    ctor: str
    sink_mode: str
    observer_mode: str
    steps: list[Step]


# -- the scripted policy ---------------------------------------------------------------------


class ScriptedPolicy:
    """Answers the current step's scripted answer and records every time it is asked."""

    def __init__(self) -> None:
        self.index = -1
        self.step: Step | None = None
        self.asked: list[tuple[int, str]] = []

    def _answer(self, context: PreemptionContext, route: str) -> Any:
        self.asked.append((self.index, route))
        assert self.step is not None and context is self.step.context
        if self.step.error is not None:
            raise self.step.error
        return self.step.answer

    def select_victim(self, context: PreemptionContext) -> Any:
        return self._answer(context, "plain")


def _hint(self: ScriptedPolicy) -> object:
    assert self.step is not None
    if isinstance(self.step.hint, HintRaises):
        raise self.step.hint.error
    return self.step.hint


def _with_facts(self: ScriptedPolicy, context: PreemptionContext, facts: object) -> Any:
    assert self.step is not None and facts is self.step.facts
    return self._answer(context, "facts")


def _policy_classes() -> dict[tuple[bool, bool, object], type[ScriptedPolicy]]:
    classes: dict[tuple[bool, bool, object], type[ScriptedPolicy]] = {}
    for hinted in (False, True):
        for has_facts, wants in ((False, "absent"), (True, "absent"), (True, True),
                                 (True, False)):
            namespace: dict[str, object] = {"__module__": __name__}
            if hinted:
                namespace["victim_index_hint"] = property(_hint)
            if has_facts:
                namespace["select_victim_with_facts"] = _with_facts
            if wants != "absent":
                namespace["wants_host_facts"] = wants
            name = f"Scripted_h{int(hinted)}_f{int(has_facts)}_w{wants}"
            classes[(hinted, has_facts, wants)] = type(name, (ScriptedPolicy,), namespace)
    return classes


POLICY_CLASSES = _policy_classes()


# -- strategies ------------------------------------------------------------------------------


@st.composite
def contexts(draw: st.DrawFn) -> PreemptionContext:
    allow_duplicates = draw(st.integers(0, 3)) == 0
    rids = draw(st.lists(st.sampled_from(ID_POOL), min_size=1, max_size=6,
                         unique=not allow_duplicates))
    sizes = st.integers(0, 4096)
    candidates = tuple(
        PreemptionCandidate(
            HostId(rid) if draw(st.integers(0, 4)) == 0 else fresh(rid),
            draw(st.integers(-2, 2)),
            draw(st.sampled_from((0.0, 1.0, 1.5, 2.0, 1e9))),
            draw(sizes), draw(sizes), draw(sizes), draw(st.integers(0, 3)),
            draw(st.integers(1, 4096)),
        )
        for rid in rids
    )
    hint_kind = draw(st.sampled_from(("none", "valid", "unknown")))
    hint: str | None = None
    if hint_kind == "valid":
        hint = fresh(draw(st.sampled_from(candidates)).request_id)
    elif hint_kind == "unknown":
        hint = draw(st.sampled_from(ID_POOL)) + "~"
    return PreemptionContext(
        candidates,
        draw(st.sampled_from(("fcfs", "priority"))),
        draw(st.sampled_from(candidates)).request_id,
        draw(st.floats(0.0, 1.0)),
        draw(st.floats(0.0, 1e6)),
        hint,
    )


@st.composite
def steps(draw: st.DrawFn, *, hinted: bool, healthy_only: bool) -> Step:
    kind = draw(st.sampled_from(("decide",) * 10 + ("wrong-thread", "emit-effective")))
    context = draw(contexts())
    candidates = context.candidates
    pool = HEALTHY if healthy_only else (
        HEALTHY * 3 + FAULTS + (("hint-raises",) * 3 if hinted else ()))
    answer_kind = draw(st.sampled_from(pool))
    index = draw(st.integers(0, len(candidates) - 1))
    rid = candidates[index].request_id
    error: Exception | None = None
    answer: object
    if answer_kind == "valid-same":
        answer = rid
    elif answer_kind in ("valid-copy", "raise", "hint-raises"):
        answer = fresh(rid)
    elif answer_kind == "valid-subclass":
        answer = PolicyId(rid)
    elif answer_kind == "abstain":
        answer = None
    elif answer_kind == "unknown":
        answer = draw(st.sampled_from((rid + " ", " " + rid, rid.upper() + "#", "",
                                       "A" + rid[1:], rid + "~")))
    elif answer_kind == "int":
        answer = draw(st.integers(-2, 8))
    elif answer_kind == "bytes":
        answer = rid.encode()
    elif answer_kind == "object":
        answer = object()
    elif answer_kind == "list":
        answer = [rid]
    else:
        assert answer_kind == "raising-eq"
        answer = RaisingEqId(rid)
    if answer_kind == "raise":
        error = draw(st.sampled_from(POLICY_ERRORS))("scripted failure")
    hint: object = -1
    hint_kind = "absent"
    if answer_kind == "hint-raises":
        hint_kind = "raises"
        hint = HintRaises(draw(st.sampled_from(HINT_ERRORS))("hint failure"))
    elif hinted:
        hint_kind = draw(st.sampled_from(HINT_KINDS))
        n = len(candidates)
        hint = {
            "absent": -1,
            "exact": index,
            "wrong": (index + 1) % n,
            "out-of-range": n + draw(st.integers(0, 3)),
            "negative": -draw(st.integers(2, 9)),
            "bool": True,
        }[hint_kind]
    facts = None
    if draw(st.booleans()):
        facts = PreemptionContextFacts(16, draw(st.integers(0, 3)), {})
    return Step(kind, context, answer_kind, answer, error, hint, hint_kind, facts)


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    configured = draw(st.integers(0, 9)) != 0
    hinted = draw(st.booleans())
    has_facts = draw(st.booleans())
    wants: object = draw(st.sampled_from(("absent", True, False))) if has_facts else "absent"
    healthy_only = draw(st.integers(0, 3)) == 0
    return Scenario(
        configured=configured,
        hinted=hinted,
        has_facts=has_facts,
        wants=wants,
        ctor=draw(st.sampled_from(("direct", "from_spec", "host"))),
        sink_mode=draw(st.sampled_from(("none", "ok", "raises"))),
        observer_mode=draw(st.sampled_from(("none", "ok", "raises"))),
        steps=draw(st.lists(steps(hinted=hinted, healthy_only=healthy_only),
                            min_size=1, max_size=10)),
    )


# -- the independent model -------------------------------------------------------------------


def model_builtin(context: PreemptionContext) -> tuple[str, PreemptionCandidate | None, str]:
    """preemption-contract.md §6: (victim value, the exact candidate if pinned, rule used)."""
    candidates = context.candidates
    tail = candidates[-1]
    hint = context.builtin_victim_id
    if hint is not None:
        for c in candidates:
            if c.request_id == hint:
                return hint, None, "hint"
    if context.scheduling_policy == "priority":
        best = candidates[0]
        for c in candidates[1:]:  # the first maximal one wins a tie, like max()
            if (c.priority, c.arrival_time) > (best.priority, best.arrival_time):
                best = c
        return best.request_id, best, "priority" if best is not tail else "priority-tail"
    return tail.request_id, tail, "tail"


def outcome_of(step: Step) -> str:
    """What the policy's answer is by the contract: selected, abstained, invalid, exception."""
    if step.error is not None or step.answer_kind == "hint-raises":
        return "exception"
    if step.answer_kind == "abstain":
        return "abstained"
    if step.answer_kind.startswith("valid"):
        return "selected"
    return "invalid"


@dataclass
class Model:
    name: str
    in_charge: bool
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KEYS[2:], 0))

    def snapshot(self) -> dict[str, object]:
        return {"policy_name": self.name, "enabled": self.in_charge, **self.counts}


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def loud(records: list[logging.LogRecord]) -> Counter[tuple[int, str]]:
    return Counter((r.levelno, r.getMessage()) for r in records if r.levelno > logging.DEBUG)


def quiet_count(records: list[logging.LogRecord]) -> int:
    return sum(1 for r in records if r.levelno <= logging.DEBUG)




def build(scenario: Scenario, policy: ScriptedPolicy | None, sink: Any, observer: Any
          ) -> PolicyController:
    """The controller, built the way the scenario says (§4 loading for the last two)."""
    if scenario.ctor == "direct":
        return PolicyController(policy, evidence=sink, observer=observer)
    if scenario.ctor == "from_spec":
        return PolicyController.from_spec(policy, None, evidence=sink, observer=observer)
    # The host's constructor; stock vLLM has no preemption_policy field at all.
    scheduler_config = (SimpleNamespace(preemption_policy=policy) if policy is not None
                        else SimpleNamespace())
    config = SimpleNamespace(scheduler_config=scheduler_config)
    return PreemptionPolicyController(config, evidence=sink, observer=observer)


def check_scenario(scenario: Scenario) -> None:
    """Drive one controller through the scenario, checking every step against the model."""
    policy: ScriptedPolicy | None = None
    if scenario.configured:
        key = (scenario.hinted, scenario.has_facts, scenario.wants)
        policy = POLICY_CLASSES[key]()
        name = f"{__name__}.{type(policy).__qualname__}"
        note(f"ctor-{scenario.ctor}")
    else:
        name = "builtin"
        note("no-policy")
    model = Model(name, in_charge=policy is not None)

    sink_events: list[tuple[str, dict[str, object]]] = []
    observed: list[tuple[str, str]] = []

    def sink(event_name: str, stats: dict[str, object]) -> None:
        sink_events.append((event_name, dict(stats)))
        if scenario.sink_mode == "raises":
            raise OSError("disk full")

    def observer(event_name: str, outcome: str) -> None:
        observed.append((event_name, outcome))
        if scenario.observer_mode == "raises":
            raise OSError("observer gone")

    expected_sink: list[tuple[str, dict[str, object]]] = []
    expected_observed: list[tuple[str, str]] = []
    expected_asked: list[tuple[int, str]] = []
    sink_raises = scenario.sink_mode == "raises"
    observer_raises = scenario.observer_mode == "raises"

    def expect_sink(event_name: str, loud_log: Counter[tuple[int, str]]) -> None:
        if scenario.sink_mode == "none":
            return
        expected_sink.append((event_name, model.snapshot()))
        if sink_raises:
            note("sink-raised")
            loud_log[(logging.WARNING, f"evidence sink failed for {event_name} event: disk full")
                     ] += 1

    def expect_observed(event_name: str, outcome: str) -> int:
        if scenario.observer_mode == "none":
            return 0
        expected_observed.append((event_name, outcome))
        if observer_raises:
            note("observer-raised")
        return 1 if observer_raises else 0

    logger = logging.getLogger("bidkv_ext.controller")
    handler = Records()
    old_level, old_propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        controller = build(scenario, policy,
                           None if scenario.sink_mode == "none" else sink,
                           None if scenario.observer_mode == "none" else observer)
        # Construction: the INFO line of §4, "initialized", and "resolved" for a policy.
        want_loud: Counter[tuple[int, str]] = Counter({(
            logging.INFO,
            f"Preemption policy initialized: policy={name} enabled={policy is not None}",
        ): 1})
        expect_sink("initialized", want_loud)
        want_quiet = expect_observed("resolved", "protocol-validated") if policy else 0
        assert loud(handler.records) == want_loud
        assert quiet_count(handler.records) == want_quiet
        assert controller.policy is policy

        for i, step in enumerate(scenario.steps):
            handler.records.clear()
            if policy is not None:
                policy.index, policy.step = i, step
            context = step.context
            want_loud = Counter()
            want_quiet = 0

            if step.kind == "wrong-thread":
                # §5 step 0: raises, changes no counter, asks nobody, logs nothing.
                note("wrong-thread")
                error = raised_in_another_thread(
                    partial(controller.select_victim, context, step.facts))
                assert isinstance(error, RuntimeError) and str(error) == WRONG_THREAD
            elif step.kind == "emit-effective":
                note("emit-effective")
                controller.emit_effective()
                expect_sink("effective", want_loud)
            else:
                victim = controller.select_victim(context, step.facts)
                # Always a candidate's own request_id object, never the policy's.
                assert any(victim is c.request_id for c in context.candidates), (
                    victim, step.answer_kind)
                if not model.in_charge:
                    note("after-disable" if policy is not None else "builtin-only")
                    outcome = "builtin"
                else:
                    model.counts["calls"] += 1
                    route = "facts" if step.facts is not None and scenario.has_facts else "plain"
                    note(f"route-{route}")
                    expected_asked.append((i, route))
                    outcome = outcome_of(step)
                    note(f"answer-{step.answer_kind}")
                    if outcome != "exception" and model.counts["calls"] == 1:
                        expect_sink("effective", want_loud)
                if outcome == "selected":
                    model.counts["selections"] += 1
                    want_quiet += expect_observed("invoked", "selected")
                    assert victim == step.answer
                    if step.hint_kind == "exact":
                        note("hint-shortcut")
                    elif step.hint_kind not in ("absent",):
                        note("hint-misleading")
                else:
                    if outcome in ("invalid", "exception"):
                        note(f"fault-at-call-{min(model.counts['calls'], 2)}")
                        if outcome == "invalid":
                            model.counts["invalid_selections"] += 1
                            reason = f"returned unknown request ID {step.answer!r}"
                        else:
                            reason = "raised an exception"
                        model.counts["failures"] += 1
                        model.in_charge = False
                        want_loud[(logging.ERROR, (
                            f"Preemption policy {name} failed ({reason}); disabling it and "
                            "restoring the built-in policy for this engine process"))] += 1
                        expect_sink("disabled", want_loud)
                    elif outcome == "abstained":
                        model.counts["abstentions"] += 1
                    if outcome != "builtin":
                        want_quiet += expect_observed("invoked", outcome)
                    value, pinned, rule = model_builtin(context)
                    note(f"builtin-{rule}")
                    assert victim == value, (victim, value, rule, outcome)
                    if pinned is not None:
                        assert victim is pinned.request_id
                    if rule == "hint" and value != model_builtin(
                            PreemptionContext(context.candidates, context.scheduling_policy,
                                              context.requesting_request_id,
                                              context.kv_cache_usage, context.now))[0]:
                        note("builtin-hint-decisive")
                    # The public helper agrees with the model too.
                    assert builtin_victim_id(context) == value
                    faults = [r for r in handler.records if r.levelno >= logging.ERROR]
                    if outcome == "exception":
                        [record] = faults
                        assert record.exc_info is not None
                        raised = step.error
                        if isinstance(step.hint, HintRaises):
                            raised = step.hint.error
                        assert record.exc_info[1] is raised
                    elif outcome == "invalid":
                        [record] = faults
                        assert not record.exc_info

            # After every step: the model's counters, through both read APIs.
            exported = controller.export_stats()
            assert list(exported.items()) == list(model.snapshot().items())
            stats = controller.stats
            assert [getattr(stats, k) for k in KEYS] == list(model.snapshot().values())
            # §5: a fault counts once in failures (an invalid id in invalid_selections too),
            # and once the built-in victim is in charge no counter moves (step 1), so over
            # the whole life: calls = selections + abstentions + failures.
            counts = model.counts
            assert counts["calls"] == (counts["selections"] + counts["abstentions"]
                                       + counts["failures"])
            assert counts["invalid_selections"] <= counts["failures"] <= 1
            assert controller.enabled is model.in_charge
            assert controller.policy is (policy if model.in_charge else None)
            wants = model.in_charge and scenario.has_facts and scenario.wants is not False
            assert controller.wants_facts is wants
            if policy is not None:
                assert policy.asked == expected_asked
            assert loud(handler.records) == want_loud, (step.kind, step.answer_kind)
            assert quiet_count(handler.records) == want_quiet
            assert sink_events == expected_sink
            assert observed == expected_observed
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        logger.propagate = old_propagate

    duplicates = any(len({c.request_id for c in s.context.candidates}) < len(s.context.candidates)
                     for s in scenario.steps)
    if duplicates:
        note("duplicate-ids")
    if any(type(c.request_id) is HostId for s in scenario.steps for c in s.context.candidates):
        note("subclass-candidate-id")
    if model.in_charge and model.counts["calls"] >= 5:
        note("long-healthy-run")


@settings(REAL_SCHEDULER, max_examples=EXAMPLES)
@given(scenarios())
def _run_scenarios(scenario: Scenario) -> None:
    """The Hypothesis driver; run from the test below so the tally is checked after it."""
    check_scenario(scenario)


REQUIRED = frozenset(
    [f"answer-{k}" for k in (*HEALTHY, *FAULTS, "hint-raises")]
    + [f"ctor-{k}" for k in ("direct", "from_spec", "host")]
    + [f"builtin-{k}" for k in ("hint", "hint-decisive", "priority", "priority-tail", "tail")]
    + ["route-plain", "route-facts", "after-disable", "builtin-only", "no-policy",
       "wrong-thread", "emit-effective", "hint-shortcut", "hint-misleading", "sink-raised",
       "observer-raised", "fault-at-call-1", "fault-at-call-2", "duplicate-ids",
       "subclass-candidate-id", "long-healthy-run"]
)


def test_controller_follows_the_host_rules_over_scripted_policies() -> None:
    """Over drawn candidate sets, hints and scripted answers, every call matches the model:
    victim (a candidate's own id object), who is asked, counters, evidence and logs; and
    every outcome kind of the model occurs in the examples (non-vacuity)."""
    TALLY.clear()
    _run_scenarios()
    missing = sorted(REQUIRED - TALLY.keys())
    assert not missing, f"outcome kinds never drawn: {missing}; tally={dict(TALLY)}"
