"""PolicyController follows the host's per-call rules, counters, permanent fallback and loading.

Mirrors the conformance checklist of preemption-contract.md section 13, items 1-8 and 13.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from bidkv_ext.contract import PreemptionContext
from bidkv_ext.controller import PolicyController, builtin_victim_id, load_policy
from tests.policy_helpers import Fixed, cand, ctx, raised_in_another_thread

KEYS = ["policy_name", "enabled", "calls", "selections", "abstentions", "failures",
        "invalid_selections"]


class Boom:
    calls = 0

    def select_victim(self, context: PreemptionContext) -> str | None:
        Boom.calls += 1
        raise RuntimeError("boom")


def three() -> PreemptionContext:
    return ctx([cand("a", arrival=1.0), cand("b", arrival=2.0), cand("c", arrival=3.0)],
               requester="b")


def test_builtin_rule() -> None:
    c = three()
    assert builtin_victim_id(c) == "c"
    prio = ctx([cand("a", priority=5, arrival=1), cand("b", priority=5, arrival=2),
                cand("c", priority=1, arrival=3)], policy="priority")
    assert builtin_victim_id(prio) == "b"
    hinted = ctx(list(c.candidates), builtin="a")
    assert builtin_victim_id(hinted) == "a"
    stale = ctx(list(c.candidates), builtin="zzz")
    assert builtin_victim_id(stale) == "c"
    with pytest.raises(ValueError, match="cannot select a preemption victim from an empty set"):
        builtin_victim_id(PreemptionContext((), "fcfs", "x", 0.0, 0.0))


def test_no_policy_uses_builtin_and_counts_nothing() -> None:
    controller = PolicyController(None)
    assert controller.select_victim(three()) == "c"
    stats = controller.export_stats()
    assert list(stats) == KEYS
    assert stats == {"policy_name": "builtin", "enabled": False, "calls": 0, "selections": 0,
                     "abstentions": 0, "failures": 0, "invalid_selections": 0}


def test_selection_and_abstention_counters() -> None:
    controller = PolicyController(Fixed("a"))
    assert controller.select_victim(three()) == "a"
    abstain = PolicyController(Fixed(None))
    assert abstain.select_victim(three()) == "c"
    assert abstain.select_victim(three()) == "c"
    s = controller.export_stats()
    assert (s["calls"], s["selections"], s["abstentions"], s["enabled"]) == (1, 1, 0, True)
    a = abstain.export_stats()
    assert (a["calls"], a["selections"], a["abstentions"], a["enabled"]) == (2, 0, 2, True)
    assert s["policy_name"] == f"{Fixed.__module__}.{Fixed.__qualname__}"


class RaisingEq(str):
    """A str whose comparison raises: the policy's code, run by the controller's check."""

    __hash__ = str.__hash__

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("eq")


class RaisingClass:
    """An object that makes ``isinstance`` itself raise."""

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        raise RuntimeError("class")


@pytest.mark.parametrize("answer", ["zzz", 7, ["a"], {"a": 1}, b"a", None.__class__,
                                    RaisingEq("a")])
def test_invalid_answer_disables_for_good(answer: object, caplog: pytest.LogCaptureFixture) -> None:
    policy = Fixed(answer)
    controller = PolicyController(policy)
    assert controller.policy is policy
    with caplog.at_level(logging.ERROR, logger="bidkv_ext.controller"):
        assert controller.select_victim(three()) == "c"
        assert controller.select_victim(three()) == "c"
    assert policy.calls == 1
    assert controller.policy is None  # the built-in victim is in charge from now on
    s = controller.export_stats()
    assert (s["calls"], s["failures"], s["invalid_selections"], s["enabled"]) == (1, 1, 1, False)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "returned unknown request ID" in errors[0].getMessage()
    assert "restoring the built-in policy for this engine process" in errors[0].getMessage()


def test_an_answer_that_makes_isinstance_raise_is_invalid() -> None:
    controller = PolicyController(Fixed(RaisingClass()))
    assert controller.select_victim(three()) == "c"
    s = controller.export_stats()
    assert (s["failures"], s["invalid_selections"], s["enabled"]) == (1, 1, False)


class HintedFixed(Fixed):
    victim_index_hint = 0


def test_a_raising_answer_on_the_hinted_route_never_escapes() -> None:
    """The hint's one comparison runs the answer's code too (preemption-contract.md §5:
    select_victim never raises for a policy's answer)."""
    controller = PolicyController(HintedFixed(RaisingEq("a")))
    assert controller.select_victim(three()) == "c"
    s = controller.export_stats()
    assert (s["failures"], s["invalid_selections"], s["enabled"]) == (1, 1, False)


def test_returns_the_candidates_own_id_object() -> None:
    c = three()
    equal_but_distinct = "".join(["a"])
    chosen = PolicyController(Fixed(equal_but_distinct)).select_victim(c)
    assert chosen is c.candidates[0].request_id


def test_a_str_subclass_names_a_candidate() -> None:
    """numpy.str_ (what a policy indexing a numpy array returns) is a str: a valid answer."""
    np = pytest.importorskip("numpy")
    c = three()
    controller = PolicyController(Fixed(np.str_("b")))
    chosen = controller.select_victim(c)
    assert chosen is c.candidates[1].request_id and type(chosen) is str
    s = controller.export_stats()
    assert (s["selections"], s["failures"], s["enabled"]) == (1, 0, True)


class BadHint(Fixed):
    @property
    def victim_index_hint(self) -> int:
        raise RuntimeError("hint")


def test_policy_attribute_errors_never_escape() -> None:
    """The victim hint is the policy's code too: its error disables the policy, no escape."""
    controller = PolicyController(BadHint("a"))
    assert controller.select_victim(three()) == "c"
    s = controller.export_stats()
    assert (s["calls"], s["failures"], s["selections"], s["enabled"]) == (1, 1, 0, False)


class BadFactsFlag(Fixed):
    @property
    def wants_host_facts(self) -> bool:
        raise RuntimeError("flag")

    def select_victim_with_facts(self, context: PreemptionContext, facts: object) -> Any:
        return self.answer


def test_wants_host_facts_is_read_once_at_construction() -> None:
    """An error in it fails start-up (construction), never a decision."""
    with pytest.raises(RuntimeError, match="flag"):
        PolicyController(BadFactsFlag("a"))


def test_exception_disables_for_good(caplog: pytest.LogCaptureFixture) -> None:
    Boom.calls = 0
    controller = PolicyController(Boom())
    with caplog.at_level(logging.ERROR, logger="bidkv_ext.controller"):
        for _ in range(3):
            assert controller.select_victim(three()) == "c"
    assert Boom.calls == 1
    s = controller.export_stats()
    assert (s["calls"], s["failures"], s["invalid_selections"], s["enabled"]) == (1, 1, 0, False)
    # Exactly one ERROR record, and it carries the traceback.
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert "disabling it" in errors[0].getMessage()
    assert "raised an exception" in errors[0].getMessage()
    assert errors[0].exc_info is not None and errors[0].exc_info[0] is RuntimeError


def test_wrong_thread_raises_and_counts_nothing() -> None:
    controller = PolicyController(Fixed("a"))
    error = raised_in_another_thread(lambda: controller.select_victim(three()))
    assert isinstance(error, RuntimeError)
    assert str(error) == "PreemptionPolicyController must be used by its scheduler thread"
    assert controller.export_stats()["calls"] == 0
    none = PolicyController(None)  # the guard applies even with no policy configured
    assert isinstance(raised_in_another_thread(lambda: none.select_victim(three())),
                      RuntimeError)
    # The guard alone, for hosts that skip select_victim when no policy is in charge.
    assert str(raised_in_another_thread(none.check_thread)) == str(error)
    none.check_thread()  # the owner thread passes


def test_evidence_sink_failure_never_changes_the_victim(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A failing (strict) sink changes no decision, and the failure is visible at WARNING."""
    events: list[str] = []

    def sink(event: str, stats: dict[str, object]) -> None:
        events.append(event)
        raise OSError("disk full")

    with caplog.at_level(logging.WARNING, logger="bidkv_ext.controller"):
        controller = PolicyController(Fixed("a"), evidence=sink)
        assert controller.select_victim(three()) == "a"
    assert events == ["initialized", "effective"]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["evidence sink failed for initialized event: disk full",
                      "evidence sink failed for effective event: disk full"]
    bad = PolicyController(Fixed("zzz"), evidence=sink)
    assert bad.select_victim(three()) == "c"
    assert events[-1] == "disabled"


class Sequenced:
    """Answers from a script: an id, None, or an exception to raise."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)

    def select_victim(self, context: PreemptionContext) -> Any:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


@pytest.mark.parametrize(("answers", "outcomes"), [
    (("a", None, "c"), ["selected", "abstained", "selected"]),
    ((None, "zzz", "a"), ["abstained", "invalid"]),  # disabled after the invalid answer
    (("b", RuntimeError("boom"), "a"), ["selected", "exception"]),
])
def test_observer_sees_resolved_then_one_invoked_event_per_call(
    answers: tuple[object, ...], outcomes: list[str]
) -> None:
    """The guarded host's evidence: ("resolved", "protocol-validated"), then per call."""
    seen: list[tuple[str, str]] = []
    controller = PolicyController(Sequenced(*answers), observer=lambda e, o: seen.append((e, o)))
    for _ in answers:
        controller.select_victim(three())
    assert seen == [("resolved", "protocol-validated"), *(("invoked", o) for o in outcomes)]
    assert controller.stats.calls == len(outcomes)


def test_observer_failure_never_changes_the_victim() -> None:
    def observer(event: str, outcome: str) -> None:
        raise OSError("observer gone")

    controller = PolicyController(Fixed("a"), observer=observer)
    assert [controller.select_victim(three()) for _ in range(3)] == ["a", "a", "a"]
    assert controller.enabled and controller.stats.selections == 3
    quiet: list[tuple[str, str]] = []
    PolicyController(None, observer=lambda e, o: quiet.append((e, o))).select_victim(three())
    assert quiet == []  # no policy: nothing resolved, nothing invoked


class Hinted(Fixed):
    """Says where its victim sits, as BidKV does (the O(1) validation route)."""

    def __init__(self, answer: str, index: int) -> None:
        super().__init__(answer)
        self.victim_index_hint = index


def test_observer_on_the_hinted_route_and_through_the_host_constructor() -> None:
    from types import SimpleNamespace

    from bidkv_ext.controller import PreemptionPolicyController

    seen: list[tuple[str, str]] = []
    hinted = PolicyController(Hinted("b", 1), observer=lambda e, o: seen.append((e, o)))
    assert hinted.select_victim(three()) == "b"
    assert seen == [("resolved", "protocol-validated"), ("invoked", "selected")]
    seen.clear()
    config = SimpleNamespace(scheduler_config=SimpleNamespace(
        preemption_policy="bidkv_ext.selector.BidkvPreemptionPolicy"),
        additional_config={"bidkv": {"enabled": True}})
    host = PreemptionPolicyController(config, observer=lambda e, o: seen.append((e, o)))
    spec = PolicyController.from_spec(Fixed(None), observer=lambda e, o: seen.append((e, o)))
    host.select_victim(three())
    spec.select_victim(three())
    assert seen == [("resolved", "protocol-validated"), ("resolved", "protocol-validated"),
                    ("invoked", "selected"), ("invoked", "abstained")]


class WithFactory:
    seen: object = None

    def __init__(self, tag: str = "plain") -> None:
        self.tag = tag

    @classmethod
    def from_vllm_config(cls, vllm_config: object) -> WithFactory:
        cls.seen = vllm_config
        return cls("factory")

    def select_victim(self, context: PreemptionContext) -> str | None:
        return None


class NoArgs:
    def select_victim(self, context: PreemptionContext) -> str | None:
        return None


class Failing:
    def __init__(self) -> None:
        raise ValueError("utility_completion_weight must be non-negative")

    def select_victim(self, context: PreemptionContext) -> str | None:
        return None


def test_loading_rules() -> None:
    assert load_policy(None) is None
    sentinel = object()
    made = load_policy(WithFactory, sentinel)
    assert isinstance(made, WithFactory) and made.tag == "factory" and WithFactory.seen is sentinel
    by_path = load_policy(f"{__name__}.WithFactory", sentinel)
    assert isinstance(by_path, WithFactory) and by_path.tag == "factory"
    assert isinstance(load_policy(NoArgs), NoArgs)
    instance = NoArgs()
    assert load_policy(instance) is instance
    with pytest.raises(TypeError, match=r"^preemption_policy must resolve to an object implementing"
                       r" PreemptionPolicy$"):
        load_policy(object())
    with pytest.raises(ValueError, match="utility_completion_weight"):
        load_policy(Failing)
    with pytest.raises(ModuleNotFoundError):
        load_policy("no_such_module_xyz.Policy")
    controller = PolicyController.from_spec(f"{__name__}.NoArgs")
    assert controller.export_stats()["policy_name"] == f"{__name__}.NoArgs"
    assert controller.enabled


def test_init_log_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="bidkv_ext.controller"):
        PolicyController(NoArgs())
        PolicyController(None)
    lines = [r.getMessage() for r in caplog.records]
    assert f"Preemption policy initialized: policy={__name__}.NoArgs enabled=True" in lines
    assert "Preemption policy initialized: policy=builtin enabled=False" in lines


def test_an_instance_is_loaded_by_the_hosts_rule(caplog: pytest.LogCaptureFixture) -> None:
    """preemption-contract.md §4 step 3, as vLLM-HUST loads it: any object with a callable
    from_vllm_config is built through it, an instance included (with a warning that the
    instance's own settings do not apply); an instance without the factory is the policy."""
    engine = object()
    with caplog.at_level(logging.WARNING, logger="bidkv_ext.controller"):
        loaded = load_policy(WithFactory("configured"), engine)
        assert isinstance(loaded, WithFactory) and loaded.tag == "factory"
        assert WithFactory.seen is engine
        plain = Fixed("a")
        assert load_policy(plain, engine) is plain
        load_policy(WithFactory, engine)  # a class is the intended route: no warning
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "is an instance of" in warning.getMessage() and "WithFactory" in warning.getMessage()


class FarHint:
    """Names a valid candidate but hints an index far out of range (negative)."""

    victim_index_hint = -10

    def select_victim(self, context: PreemptionContext) -> str:
        return "a"


def test_an_out_of_range_negative_hint_still_selects() -> None:
    """The hint is only a shortcut: an out-of-range one (here -10 for three candidates)
    is ignored, the id is looked up, and a valid id counts as a selection."""
    controller = PolicyController(FarHint())
    assert controller.select_victim(three()) == "a"
    s = controller.export_stats()
    assert (s["selections"], s["invalid_selections"], s["failures"]) == (1, 0, 0)
    assert s["enabled"] is True


class FactsOnly:
    """Defines select_victim_with_facts but no wants_host_facts attribute."""

    def __init__(self) -> None:
        self.facts: list[object] = []

    def select_victim(self, context: PreemptionContext) -> str | None:
        raise AssertionError("select_victim_with_facts must be called when facts are given")

    def select_victim_with_facts(self, context: PreemptionContext, facts: object) -> str:
        self.facts.append(facts)
        return "a"


def test_wants_host_facts_defaults_to_true_for_a_facts_method() -> None:
    """A policy that defines select_victim_with_facts wants host facts unless its
    wants_host_facts says otherwise: the host computes them and that method receives them."""
    policy = FactsOnly()
    controller = PolicyController(policy)
    assert controller.wants_facts is True
    facts = object()
    assert controller.select_victim(three(), facts) == "a"  # type: ignore[arg-type]
    assert policy.facts == [facts]
    assert PolicyController(Fixed("a")).wants_facts is False  # no facts method, no facts
