"""Behaviours a mutation audit of the controller, selector, guards and config found unguarded.

- Controller, policy name (preemption-contract.md section 4): ``module + "." + __qualname__``.
- Loading (section 4): a dotted path without an object name is refused at load; only a
  *callable* ``from_vllm_config`` is the factory; ``from_spec`` hands the engine config to it.
- Host constructor (section 5, "absent on stock vLLM"): no ``scheduler_config`` is no policy.
- Per-call rules (section 5): an empty-string answer naming no candidate is invalid, not an
  abstention; an empty-string candidate id is a valid answer; an abstention never reads the
  victim hint; a raising ``__eq__`` or ``__repr__`` of any exception type never escapes.
- Evidence (section 5, "any failure of the evidence sink is swallowed"): any ``Exception``
  from the sink or the observer, not only ``OSError``, changes no decision.
- Liveness under priority scheduling (docs/policy.md "Guards"): a spent favourite hands the
  decision to an eligible candidate of the same least urgent class, no barrier.
- Engine facts (selector ``_engine_facts``: "read from the engine config when it is a real
  one"): a boolean block size, a non-boolean prefix-caching flag and a token budget that is
  not a positive integer are no facts; the configured values stay in force.
- Host facts (docs/policy.md "Host facts (optional)"): the host computes them only for a
  policy that asks; a strategy that never reads them (or ``use_host_facts`` off) asks not.
- Liveness verdict (guards module doc, ``LivenessVerdict``): when every candidate has spent
  its budget the verdict is the barrier (no eligible candidate), otherwise it is not.
- Boolean settings (config ``_strict_bool``, its message "1/0, true/false, yes/no, on/off"):
  every listed spelling is read, in any letter case.
- Bounds (README configuration table): ``EPSILON`` is above 0; ``BLOCK_SIZE``,
  ``DEFAULT_MAX_TOKENS`` and ``PREFILL_CHUNK_TOKENS`` are whole numbers above 0,
  ``CACHE_SURVIVAL`` is 0 to 1, ``COMPLETION_HORIZON`` is above 0.
- The config is frozen (config module doc, "one validated, frozen model").
- Defaults (docs/policy.md "Coming from the reference BidKV"): epsilon is 1e-3.
- Error lines (config ``_shown``): an integer too long for ``repr()`` is described as one,
  and the message still names its source.
"""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from bidkv_ext import BidKVConfig, BidkvPreemptionPolicy, ConfigError
from bidkv_ext.contract import PreemptionContext
from bidkv_ext.controller import PolicyController, PreemptionPolicyController, load_policy
from bidkv_ext.guards import LivenessGuard
from tests.policy_helpers import Fixed, cand, ctx

POLICY_ERRORS = [ValueError, TypeError, KeyError, ZeroDivisionError, AttributeError]


def three() -> PreemptionContext:
    return ctx(
        [cand("a", arrival=1.0), cand("b", arrival=2.0), cand("c", arrival=3.0)], requester="b"
    )


def counters(controller: PolicyController) -> tuple[object, ...]:
    s = controller.export_stats()
    return (
        s["calls"],
        s["selections"],
        s["abstentions"],
        s["failures"],
        s["invalid_selections"],
        s["enabled"],
    )


class Outer:
    """Holds a nested policy class, whose ``__qualname__`` differs from its ``__name__``."""

    class Inner(Fixed):
        pass


def test_policy_name_is_module_and_qualified_name() -> None:
    """Section 4: policy_name is ``type(policy).__module__ + "." + __qualname__``."""
    controller = PolicyController(Outer.Inner("a"))
    assert controller.export_stats()["policy_name"] == f"{__name__}.Outer.Inner"


@pytest.mark.parametrize("path", ["bidkv_ext.", "bidkv_ext.selector."])
def test_a_dotted_path_without_an_object_name_is_refused(path: str) -> None:
    """Section 4, format ``package.module.ClassName``: a path ending in a dot is refused."""
    with pytest.raises(ValueError, match=r"must be a dotted path 'module\.Object'"):
        load_policy(path)


class NotAFactory:
    """A class whose ``from_vllm_config`` is a plain value, not a callable."""

    from_vllm_config = "not callable"

    def __init__(self) -> None:
        self.built_without_arguments = True

    def select_victim(self, context: PreemptionContext) -> str | None:
        return None


def test_only_a_callable_from_vllm_config_is_the_factory() -> None:
    """Section 4 step 3: without a *callable* factory a class is called with no arguments."""
    loaded = load_policy(NotAFactory, object())
    assert isinstance(loaded, NotAFactory) and loaded.built_without_arguments


class Recorder:
    """Records the engine config its factory is given."""

    def __init__(self, engine: object) -> None:
        self.engine = engine

    @classmethod
    def from_vllm_config(cls, vllm_config: object) -> Recorder:
        return cls(vllm_config)

    def select_victim(self, context: PreemptionContext) -> str | None:
        return None


def test_from_spec_hands_the_engine_config_to_the_factory() -> None:
    """Section 4 step 3: the factory is called with the whole engine config."""
    engine = object()
    controller = PolicyController.from_spec(Recorder, engine)
    policy = controller.policy
    assert isinstance(policy, Recorder) and policy.engine is engine


def test_an_engine_config_without_a_scheduler_config_means_no_policy() -> None:
    """Section 5 (host module): no ``preemption_policy`` field anywhere is no policy."""
    controller = PreemptionPolicyController(SimpleNamespace())
    assert controller.policy is None
    assert controller.select_victim(three()) == "c"
    assert controller.export_stats()["policy_name"] == "builtin"


def test_an_empty_string_naming_no_candidate_is_invalid() -> None:
    """Section 5 step 5: "" is an ID not among the candidates, not an abstention."""
    controller = PolicyController(Fixed(""))
    assert controller.select_victim(three()) == "c"
    assert counters(controller) == (1, 0, 0, 1, 1, False)


def test_an_empty_string_candidate_id_is_a_valid_answer() -> None:
    """Section 5 step 6: a str equal to a candidate id is a selection, "" included."""
    context = ctx([cand(""), cand("b")], requester="b")
    controller = PolicyController(Fixed(""))
    chosen = controller.select_victim(context)
    assert chosen == "" and chosen is context.candidates[0].request_id
    assert counters(controller) == (1, 1, 0, 0, 0, True)


class AbstainsWithBadHint(Fixed):
    """Abstains; its victim hint (a selector extension) raises if read."""

    @property
    def victim_index_hint(self) -> int:
        raise RuntimeError("no victim, no hint")


def test_an_abstention_never_reads_the_victim_hint() -> None:
    """Section 5 step 4: None is an abstention and the policy stays enabled."""
    controller = PolicyController(AbstainsWithBadHint(None))
    assert [controller.select_victim(three()) for _ in range(2)] == ["c", "c"]
    assert counters(controller) == (2, 0, 2, 0, 0, True)


def raising_eq_str(error: type[Exception]) -> str:
    """A str naming candidate "a" whose comparison raises ``error``."""

    class RaisingEq(str):
        __hash__ = str.__hash__

        def __eq__(self, other: object) -> bool:
            raise error("eq")

        def __ne__(self, other: object) -> bool:
            raise error("ne")

    return RaisingEq("a")


@pytest.mark.parametrize("error", POLICY_ERRORS)
def test_a_raising_comparison_of_any_type_never_escapes(error: type[Exception]) -> None:
    """Section 5: select_victim never raises for a policy's answer; it names nothing."""
    controller = PolicyController(Fixed(raising_eq_str(error)))
    assert controller.select_victim(three()) == "c"
    assert counters(controller) == (1, 0, 0, 1, 1, False)


class BadRepr:
    """An invalid answer whose ``repr`` raises ``error``."""

    def __init__(self, error: type[Exception]) -> None:
        self.error = error

    def __repr__(self) -> str:
        raise self.error("repr")


@pytest.mark.parametrize("error", POLICY_ERRORS)
def test_an_unrepresentable_invalid_answer_never_escapes(
    error: type[Exception], caplog: pytest.LogCaptureFixture
) -> None:
    """Section 5: the one ERROR line is written even when the answer's repr raises."""
    controller = PolicyController(Fixed(BadRepr(error)))
    with caplog.at_level(logging.ERROR, logger="bidkv_ext.controller"):
        assert controller.select_victim(three()) == "c"
    assert counters(controller) == (1, 0, 0, 1, 1, False)
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "returned unknown request ID <unrepresentable BadRepr>" in record.getMessage()


@pytest.mark.parametrize("error", [RuntimeError, ValueError, KeyError])
def test_any_sink_or_observer_failure_never_changes_the_victim(error: type[Exception]) -> None:
    """Section 5 evidence: any Exception from the sink or the observer is swallowed."""

    def sink(event: str, stats: dict[str, object]) -> None:
        raise error("sink")

    def observer(event: str, outcome: str) -> None:
        raise error("observer")

    controller = PolicyController(Fixed("a"), evidence=sink, observer=observer)
    assert [controller.select_victim(three()) for _ in range(2)] == ["a", "a"]
    assert counters(controller) == (2, 2, 0, 0, 0, True)


def test_a_spent_favourite_leaves_the_choice_inside_its_priority_class() -> None:
    """docs/policy.md "Guards": the barrier comes only when the whole class has spent."""
    cands = [
        cand("u0", computed=1000, priority=0, arrival=1.0),
        cand("lazy_big", computed=5000, priority=5, arrival=2.0),
        cand("lazy_small", computed=1000, priority=5, arrival=3.0, preemptions=1),
    ]
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, liveness_preemptions=1))
    context = ctx(cands, policy="priority", requester="u0", builtin="lazy_small")
    favourite = policy.strategy.choose(context.candidates, context, None)
    assert favourite is not None and favourite.request_id == "lazy_small"  # the spent one
    assert policy.select_victim(context) == "lazy_big"
    assert (policy.barrier_decisions, policy.liveness.epochs) == (0, 0)


@pytest.mark.parametrize(
    ("cache", "scheduler"),
    [
        ({"block_size": True}, {}),
        ({"enable_prefix_caching": 1}, {}),
        ({"enable_prefix_caching": "yes"}, {}),
        ({}, {"max_num_batched_tokens": 0}),
        ({}, {"max_num_batched_tokens": -512}),
        ({}, {"max_num_batched_tokens": True}),
        ({}, {"max_num_batched_tokens": 512.0}),
        ({}, {"max_num_batched_tokens": 4096, "long_prefill_token_threshold": True}),
        ({}, {"max_num_batched_tokens": 4096, "long_prefill_token_threshold": -1}),
    ],
)
def test_values_that_are_not_engine_facts_leave_the_settings_in_force(
    monkeypatch: pytest.MonkeyPatch, cache: dict[str, Any], scheduler: dict[str, Any]
) -> None:
    """Only a positive int (not a bool) size/budget and a bool flag are engine facts."""
    for name, value in {
        "ENABLE": "1",
        "BLOCK_SIZE": "32",
        "PREFIX_CACHING": "0",
        "PREFILL_CHUNK_TOKENS": "4096",
    }.items():
        monkeypatch.setenv(f"BIDKV_UTILITY_{name}", value)
    engine = SimpleNamespace(
        additional_config={},
        cache_config=SimpleNamespace(**cache),
        scheduler_config=SimpleNamespace(**scheduler),
    )
    config = BidkvPreemptionPolicy.from_vllm_config(engine).config
    assert (config.block_size, config.prefix_caching, config.prefill_chunk_tokens) == (
        32,
        False,
        4096,
    )


@pytest.mark.parametrize(
    "settings",
    [
        {"strategy": "lifo"},
        {"strategy": "largest-first"},
        {"strategy": "bidkv", "use_host_facts": False},
    ],
)
def test_a_strategy_that_reads_no_facts_asks_the_host_for_none(settings: dict[str, Any]) -> None:
    """docs/policy.md "Host facts": facts are computed only for a policy that asks."""
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, **settings))
    assert policy.wants_host_facts is False
    assert PolicyController(policy).wants_facts is False


def test_a_verdict_with_every_candidate_spent_is_the_barrier() -> None:
    """Guards module doc: when every candidate has reached the threshold, a barrier."""
    guard = LivenessGuard(2)
    spent = (cand("a", preemptions=2), cand("b", preemptions=3))
    verdict = guard.filter(spent)
    assert verdict.eligible == () and verdict.barrier is True
    mixed = guard.filter((*spent, cand("c", preemptions=1)))
    assert [c.request_id for c in mixed.eligible] == ["c"] and mixed.barrier is False


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("1", True),
        ("true", True),
        ("yes", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("no", False),
        ("off", False),
        ("TRUE", True),
        ("On", True),
        ("No", False),
        ("OFF", False),
    ],
)
def test_every_listed_boolean_spelling_is_read(raw: str, value: bool) -> None:
    """Config: the accepted spellings of the error message, from env and the section."""
    assert BidKVConfig.from_sources(None, {"BIDKV_UTILITY_ENABLE": raw}).enabled is value
    assert BidKVConfig.from_sources({"bidkv": {"kill_switch": raw}}, {}).kill_switch is value


@pytest.mark.parametrize(
    ("variable", "raw", "needle"),
    [
        # epsilon guards U's division and block_size divides computed tokens: zero would
        # fail (or divide by zero) at a decision instead of at start-up.
        ("BIDKV_UTILITY_EPSILON", "0", "greater than 0"),
        ("BIDKV_UTILITY_BLOCK_SIZE", "0", "greater than 0"),
        ("BIDKV_UTILITY_DEFAULT_MAX_TOKENS", "0", "greater than 0"),
        ("BIDKV_UTILITY_PREFILL_CHUNK_TOKENS", "0", "greater than 0"),
        ("BIDKV_UTILITY_COMPLETION_HORIZON", "0", "greater than 0"),
        ("BIDKV_UTILITY_CACHE_SURVIVAL", "1.5", "less than or equal to 1"),
        ("BIDKV_UTILITY_CACHE_SURVIVAL", "-0.1", "greater than or equal to 0"),
    ],
)
def test_documented_bounds_are_enforced(variable: str, raw: str, needle: str) -> None:
    """README table: out-of-range values fail start-up with one line naming the variable."""
    with pytest.raises(ConfigError, match=f"^{variable}='{raw}' is invalid: .*{needle}"):
        BidKVConfig.from_sources(None, {variable: raw})


@pytest.mark.parametrize(
    ("variable", "raw"),
    [
        ("BIDKV_UTILITY_DEFAULT_MAX_TOKENS", "1"),
        ("BIDKV_UTILITY_PREFILL_CHUNK_TOKENS", "1"),
        ("BIDKV_UTILITY_CACHE_SURVIVAL", "1"),
        ("BIDKV_UTILITY_CACHE_SURVIVAL", "0"),
    ],
)
def test_documented_bounds_include_their_edges(variable: str, raw: str) -> None:
    """README table: 1 is a whole number above 0; 0 and 1 are within "0 to 1"."""
    BidKVConfig.from_sources(None, {variable: raw})


def test_the_config_is_frozen() -> None:
    """Config module doc: one validated, frozen model; a setting cannot be changed later."""
    config = BidKVConfig(enabled=True)
    with pytest.raises(ValueError, match="frozen"):
        config.enabled = False
    assert config.enabled is True


def test_epsilon_defaults_to_one_thousandth() -> None:
    """docs/policy.md: epsilon defaults to 1e-3."""
    assert BidKVConfig().epsilon == 1e-3
    assert BidKVConfig.from_sources(None, {}).epsilon == 1e-3


def test_an_integer_too_long_to_print_is_described_in_the_error_line() -> None:
    """Config ``_shown``: the one-line error describes the integer instead of failing."""
    huge = -(10 ** (sys.get_int_max_str_digits() + 10))
    with pytest.raises(ConfigError) as caught:
        BidKVConfig.from_sources({"bidkv": {"liveness_preemptions": huge}}, {})
    limit = sys.get_int_max_str_digits()
    assert str(caught.value).startswith(
        f"additional_config['bidkv']['liveness_preemptions']=<an integer of more than "
        f"{limit} digits> is invalid: "
    )
