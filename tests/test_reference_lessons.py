"""Lessons of the reference BidKV (reference-lessons.md) that no other test pinned down.

Found by a lesson-by-lesson audit of the spec against ``bidkv_ext``; each test names the
section it guards. Behaviours guarded:

* §5 and the disabled-initialisation pitfall: the reference built its config without
  validation when no ``additional_config`` was given. A policy built without a config (or
  by ``from_vllm_config`` with none) validates the environment even while it is disabled
  or killed, so a bad value fails start-up instead of waiting for the day it is enabled.
* §5 and §10 "no silent strategy fallback": the research hooks' ``BIDKV_STRATEGY`` set
  with the policy enabled is refused (the reference raised too), naming
  ``BIDKV_UTILITY_STRATEGY``; with the policy disabled it is ignored.
* §5: the kill switch is read once, at construction (rollback means a new process):
  changing the variable later does not change a running policy; a new one picks it up.
* §4 and §10 "honest counters": whenever the policy does not choose (disabled, killed,
  nothing to free, a liveness barrier) it returns ``None``, so the controller counts an
  abstention, never a selection, and the host's victim is used; with every candidate at
  0 computed tokens that is the host's victim, not the oldest request (§3).
* §7.5 and §10 logging discipline: no decision logs above DEBUG, on any path; with DEBUG
  off the selector does not call its logger at all.
* Per-decision cost: the liveness guard scans the candidates only when the strategy's
  choice has spent its budget, and the strategy is asked once on the common path.
* §1, §2 and §10 "protect near-complete requests": the completion term protects a request
  close to its cap; a missing ``max_tokens`` (0 or negative) counts as
  ``default_max_tokens`` (the reference's fallback, 1024), and a request past its cap has
  no work left (remaining clamps at 0).
* §4 gating and §7.1: there is no KV gate and no cooldown; no strategy's choice depends on
  ``kv_cache_usage`` (a missing value included) or on the clock.
* §4: an empty candidate set is an abstention, not a policy fault: the controller raises
  the contract's empty-set error and the policy stays in charge.
* §6: ``BaselineRegistry.create_default_registry()`` mutates the registry and returns
  ``None``; every registered strategy answers ``.name`` with the name it is found under;
  ``get`` of an unknown name lists every registered name, sorted.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Iterator
from typing import Any

import pytest

from bidkv_ext import BaselineRegistry, BidKVConfig, BidkvPreemptionPolicy, ConfigError
from bidkv_ext import create_default_registry as module_create_default_registry
from bidkv_ext.contract import PreemptionCandidate, PreemptionContext
from bidkv_ext.controller import PolicyController, builtin_victim_id
from bidkv_ext.guards import LivenessGuard, LivenessVerdict
from bidkv_ext.strategies import STRATEGY_NAMES
from bidkv_ext.strategies.utility import UtilityParams, UtilityStrategy
from tests.policy_helpers import cand, ctx


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No BIDKV_UTILITY_* variable from the caller's shell leaks into a test."""
    for name in list(os.environ):
        if name.startswith("BIDKV_UTILITY_"):
            monkeypatch.delenv(name)
    yield monkeypatch


def mixed() -> list[PreemptionCandidate]:
    """Four decoding requests of different sizes; the requester is the last one."""
    return [cand("a", computed=900, output=40, arrival=1.0),
            cand("b", computed=300, output=40, arrival=2.0),
            cand("c", computed=1500, output=40, arrival=3.0),
            cand("d", computed=200, output=40, arrival=4.0)]


# ---------------------------------------------------------------- §5 initialisation


@pytest.mark.parametrize("switches", [{}, {"BIDKV_UTILITY_ENABLE": "0"},
                                      {"BIDKV_UTILITY_ENABLE": "1",
                                       "BIDKV_UTILITY_KILL_SWITCH": "1"}])
def test_a_disabled_policy_still_validates_its_environment(
    clean_env: pytest.MonkeyPatch, switches: dict[str, str]
) -> None:
    """The reference's ``from_additional_config(None)`` returned the environment's config
    unvalidated; here a policy built without a config, or from an engine config without
    ``additional_config``, refuses a bad value although it is inert."""
    for name, value in switches.items():
        clean_env.setenv(name, value)
    clean_env.setenv("BIDKV_UTILITY_LIVENESS_PREEMPTIONS", "-1")
    with pytest.raises(ConfigError, match="BIDKV_UTILITY_LIVENESS_PREEMPTIONS='-1' is invalid"):
        BidkvPreemptionPolicy()

    class NoAdditional:
        additional_config = None

    with pytest.raises(ConfigError, match="BIDKV_UTILITY_LIVENESS_PREEMPTIONS"):
        BidkvPreemptionPolicy.from_vllm_config(NoAdditional())
    clean_env.setenv("BIDKV_UTILITY_LIVENESS_PREEMPTIONS", "3")
    inert = BidkvPreemptionPolicy()
    assert not inert.config.is_active and inert.config.liveness_preemptions == 3
    assert inert.select_victim(ctx(mixed())) is None


@pytest.mark.parametrize("enable", ["1", "0"])
def test_the_research_strategy_variable_is_refused_with_the_policy_enabled(
    clean_env: pytest.MonkeyPatch, enable: str
) -> None:
    """§5 and §10 "no silent strategy fallback": the reference raised when its research
    hook's ``BIDKV_STRATEGY`` was set together with ``BIDKV_UTILITY_ENABLE=1``. Read
    nowhere here, it would leave a migrating user on another rule without a word, so an
    enabled policy refuses it in one line naming the variable to use; a disabled one
    ignores it, as the reference did."""
    clean_env.delenv("BIDKV_STRATEGY", raising=False)
    clean_env.setenv("BIDKV_UTILITY_ENABLE", enable)
    clean_env.setenv("BIDKV_STRATEGY", "largest-first")
    if enable == "1":
        with pytest.raises(ConfigError, match=r"^BIDKV_STRATEGY .* set BIDKV_UTILITY_STRATEGY"):
            BidkvPreemptionPolicy()
        with pytest.raises(ConfigError, match="BIDKV_STRATEGY"):
            BidKVConfig.from_sources({"bidkv": {"enabled": True}}, {"BIDKV_STRATEGY": "x"})
    else:
        assert not BidkvPreemptionPolicy().config.enabled
    clean_env.delenv("BIDKV_STRATEGY")
    assert BidkvPreemptionPolicy().config.enabled is (enable == "1")


def test_the_kill_switch_is_read_once_at_construction(clean_env: pytest.MonkeyPatch) -> None:
    """§5: the kill switch is static; rolling back means starting a new process."""
    clean_env.setenv("BIDKV_UTILITY_ENABLE", "1")
    running = BidkvPreemptionPolicy()
    clean_env.setenv("BIDKV_UTILITY_KILL_SWITCH", "1")
    assert running.select_victim(ctx(mixed())) is not None
    killed = BidkvPreemptionPolicy()
    assert killed.select_victim(ctx(mixed())) is None
    clean_env.delenv("BIDKV_UTILITY_KILL_SWITCH")
    assert killed.select_victim(ctx(mixed())) is None
    assert BidkvPreemptionPolicy().select_victim(ctx(mixed())) is not None


# ---------------------------------------------------------------- §4/§10 honest counters


def _abstaining_cases() -> list[tuple[str, BidKVConfig, PreemptionContext]]:
    zero = [cand(f"z{i}", computed=0, prompt=50, arrival=float(i)) for i in range(4)]
    many_zero = [cand(f"z{i}", computed=0, prompt=50, arrival=float(i)) for i in range(64)]
    spent = [dataclasses.replace(c, num_preemptions=1) for c in mixed()]
    return [
        ("disabled", BidKVConfig(), ctx(mixed())),
        ("killed", BidKVConfig(enabled=True, kill_switch=True), ctx(mixed())),
        # Nobody frees a block: U = 0 for all, so the host decides (not the oldest, z0).
        ("nothing to free", BidKVConfig(enabled=True), ctx(zero, requester="z2")),
        ("nothing to free, array path", BidKVConfig(enabled=True),
         ctx(many_zero, requester="z5")),
        # Every candidate has spent its budget at first sight: the epoch's barrier.
        ("barrier", BidKVConfig(enabled=True, liveness_preemptions=1), ctx(spent)),
    ]


@pytest.mark.parametrize("case", range(5), ids=[c[0] for c in _abstaining_cases()])
def test_a_decision_the_policy_does_not_take_is_an_abstention(case: int) -> None:
    """The reference returned its default victim when disabled, gated or guarded, so the
    host counted a selection it did not make. Here each of those is ``None``: the
    controller books an abstention and preempts the host's own victim."""
    _, config, context = _abstaining_cases()[case]
    policy = BidkvPreemptionPolicy(config)
    assert policy.select_victim(context) is None
    fresh = BidkvPreemptionPolicy(config)
    controller = PolicyController(fresh)
    assert controller.select_victim(context) == builtin_victim_id(context)
    stats = controller.export_stats()
    assert (stats["calls"], stats["selections"], stats["abstentions"], stats["failures"]) == (
        1, 0, 1, 0)
    assert stats["enabled"] is True
    if case == 4:
        assert fresh.barrier_decisions == 1


# ---------------------------------------------------------------- §7.5 logging, cost


def _decisions() -> list[tuple[BidKVConfig, PreemptionContext]]:
    """One decision down each path: a selection, a cascade-guard pick of the requester, a
    liveness filter, a barrier, an abstention on nothing to free, an inactive policy."""
    prefill = [cand("mid", computed=1800, output=5, prompt=1795),
               cand("req", computed=1500, output=0, prompt=6000)]
    # bidkv's favourite in mixed() is "d", the least computed.
    favourite_spent = [*mixed()[:3], dataclasses.replace(mixed()[3], num_preemptions=1)]
    spent = [dataclasses.replace(c, num_preemptions=1) for c in mixed()]
    zero = [cand(f"z{i}", computed=0) for i in range(3)]
    on = BidKVConfig(enabled=True)
    return [
        (on, ctx(mixed())),
        (BidKVConfig(enabled=True, prefix_caching=False), ctx(prefill, requester="req")),
        (BidKVConfig(enabled=True, liveness_preemptions=1), ctx(favourite_spent)),
        (BidKVConfig(enabled=True, liveness_preemptions=1), ctx(spent)),
        (on, ctx(zero)),
        (BidKVConfig(), ctx(mixed())),
    ]


def test_no_decision_logs_above_debug(caplog: pytest.LogCaptureFixture) -> None:
    """The reference logged every decision at INFO or WARNING (``UTILITY_ACTIVE``,
    ``FALLBACK``, ``LIVENESS_ABSTAIN``, ``CASCADE_ABSTAIN``). Here, on every path, nothing
    above DEBUG, and at most one DEBUG line per decision."""
    decisions = _decisions()
    policies = [BidkvPreemptionPolicy(config) for config, _ in decisions]
    caplog.set_level(logging.DEBUG)
    answers = [policy.select_victim(context)
               for policy, (_, context) in zip(policies, decisions, strict=True)]
    assert answers[1] == "req"  # the cascade guard's path was taken
    assert policies[3].barrier_decisions == 1  # and the barrier's
    loud = [(r.name, r.levelname, r.getMessage()) for r in caplog.records
            if r.levelno > logging.DEBUG]
    assert loud == []
    assert len(caplog.records) <= len(decisions)


def test_with_debug_off_the_selector_never_calls_its_logger(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Per-decision cost: with DEBUG off no logging call (and no argument formatting) is
    made on the hot path."""
    logger = logging.getLogger("bidkv_ext.selector")
    caplog.set_level(logging.INFO, logger=logger.name)
    called: list[str] = []
    for method in ("debug", "info", "warning", "error", "log", "exception"):
        monkeypatch.setattr(logger, method,
                            lambda *args, _m=method, **kwargs: called.append(_m))
    decisions = _decisions()
    for config, context in decisions:
        BidkvPreemptionPolicy(config).select_victim(context)
    assert called == []


def test_the_guard_scans_only_when_the_favourite_has_spent_its_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/policy.md, Guards: "one O(1) check of the chosen victim; the candidates are
    filtered only when that victim has spent its budget". On the common path the strategy
    is asked once and the guard never scans."""
    filters: list[int] = []
    chooses: list[int] = []
    real_filter = LivenessGuard.filter
    real_choose = UtilityStrategy.choose

    def counting_filter(self: LivenessGuard, candidates: Any) -> LivenessVerdict:
        filters.append(len(candidates))
        return real_filter(self, candidates)

    def counting_choose(self: UtilityStrategy, *args: Any) -> Any:
        chooses.append(1)
        return real_choose(self, *args)

    monkeypatch.setattr(LivenessGuard, "filter", counting_filter)
    monkeypatch.setattr(UtilityStrategy, "choose", counting_choose)
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, liveness_preemptions=2))
    fresh = mixed()
    victim = policy.select_victim(ctx(fresh))
    assert victim is not None
    assert (filters, chooses) == ([], [1])
    # The favourite has spent its budget (2 preemptions, none booked to an older epoch):
    # now, and only now, the guard scans, and the strategy chooses among the eligible.
    spent = [dataclasses.replace(c, num_preemptions=2) if c.request_id == victim else c
             for c in fresh]
    second = policy.select_victim(ctx(spent))
    assert second is not None and second != victim
    assert (filters, chooses) == ([4], [1, 1, 1])


# ---------------------------------------------------------------- §1/§2 completion term


def _score(candidate: PreemptionCandidate, **settings: Any) -> float:
    config = BidKVConfig(**settings)
    return UtilityStrategy(UtilityParams.from_config(config)).utility(candidate, 1)


def test_a_request_near_its_cap_is_protected() -> None:
    """The reference's -25 % interactive regression came from evicting a nearly complete
    large request; the completion term makes such a request a worse victim than an equal
    one far from its cap."""
    near = cand("near", computed=1200, output=1020, max_tokens=1024, arrival=1.0)
    far = cand("far", computed=1200, output=20, max_tokens=4096, arrival=2.0)
    requester = cand("req", computed=5000, output=5, arrival=3.0)  # costlier than both
    for order in ([near, far, requester], [far, near, requester]):
        policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True))
        assert policy.select_victim(ctx(order, requester="req", builtin="near")) == "far"
    # Without the term the two are equal and the tie goes to the host's victim.
    flat = BidkvPreemptionPolicy(BidKVConfig(enabled=True, completion_weight=0.0))
    assert flat.select_victim(ctx([near, far, requester], requester="req",
                                  builtin="near")) == "near"


@pytest.mark.parametrize("missing", [0, -1])
def test_a_missing_max_tokens_counts_as_default_max_tokens(missing: int) -> None:
    """§1: when ``max_tokens`` is missing or not positive the reference used
    ``utility_default_max_tokens`` (1024); so does the completion term here, configured
    value included."""
    unknown = cand("v", computed=320, output=100, max_tokens=missing)
    assert _score(unknown) == _score(dataclasses.replace(unknown, max_tokens=1024))
    assert _score(unknown) != _score(dataclasses.replace(unknown, max_tokens=256))
    assert _score(unknown, default_max_tokens=300) == _score(
        dataclasses.replace(unknown, max_tokens=300))


def test_a_request_past_its_cap_has_no_work_left() -> None:
    """Remaining work clamps at 0: a request past its cap is protected exactly as much as
    one at its cap (the largest factor, 1 + completion_weight), never less."""
    at_cap = cand("v", computed=320, output=500, max_tokens=500)
    past = dataclasses.replace(at_cap, num_output_tokens=700)
    assert _score(past) == _score(at_cap)
    delta = (64.0 + 320.0) * (1.0 + 1.0)
    assert _score(at_cap) == pytest.approx(1.0 / (delta + BidKVConfig().epsilon), rel=1e-12)


# ---------------------------------------------------------------- §4 gating, §7.1


@pytest.mark.parametrize("name", sorted(STRATEGY_NAMES))
def test_no_strategy_depends_on_kv_usage_or_the_clock(name: str) -> None:
    """The reference refused utility below a KV gate or within a cooldown (and raised
    ``TypeError`` formatting a missing usage). Here no such gate exists: the same
    candidates give the same choice whatever ``kv_cache_usage`` and ``now`` say, and
    back-to-back decisions at one instant are all taken."""
    config = BidKVConfig(enabled=True, strategy=name)
    candidates = tuple(mixed())
    expected = BidkvPreemptionPolicy(config).select_victim(ctx(candidates))
    for usage in (0.0, 0.5, 1.0, math.nan, None):
        for now in (0.0, 1.0, 1e9):
            context = PreemptionContext(candidates, "fcfs", "d", usage, now)  # type: ignore[arg-type]
            assert BidkvPreemptionPolicy(config).select_victim(context) == expected
    if expected is not None:
        same_instant = BidkvPreemptionPolicy(config)
        answers = [same_instant.select_victim(ctx(candidates, now=5.0)) for _ in range(3)]
        assert None not in answers


# ---------------------------------------------------------------- §4 empty set


@pytest.mark.parametrize("name", sorted(STRATEGY_NAMES))
def test_an_empty_candidate_set_is_not_a_policy_fault(name: str) -> None:
    """The reference's selector raised ``ValueError`` on an empty tuple, which a host
    controller treats as a fault (the policy is disabled for the process). Here the policy
    abstains; the controller raises the contract's empty-set error and keeps the policy."""
    policy = BidkvPreemptionPolicy(BidKVConfig(enabled=True, strategy=name))
    empty = PreemptionContext((), "fcfs", "x", 0.5, 1.0)
    assert policy.select_victim(empty) is None
    controller = PolicyController(BidkvPreemptionPolicy(BidKVConfig(enabled=True, strategy=name)))
    with pytest.raises(ValueError, match="cannot select a preemption victim from an empty set"):
        controller.select_victim(empty)
    stats = controller.export_stats()
    assert stats["enabled"] is True and stats["failures"] == 0
    assert controller.select_victim(ctx(mixed())) in {c.request_id for c in mixed()}


# ---------------------------------------------------------------- §6 registry


def test_create_default_registry_mutates_and_returns_none() -> None:
    """§6: the reference's ``create_default_registry()`` adds the built-ins to the registry
    it is called on and returns ``None``; the module-level spelling returns a new one."""
    registry = BaselineRegistry()
    result: object = registry.create_default_registry()  # type: ignore[func-returns-value]
    assert result is None
    assert registry.list_strategies() == sorted(STRATEGY_NAMES)
    for name in registry.list_strategies():
        assert registry.get(name).name == name
    assert module_create_default_registry().list_strategies() == registry.list_strategies()
    with pytest.raises(KeyError) as info:
        registry.get("pe-sjf")
    assert str(info.value).strip("'\"").endswith(
        "registered: " + ", ".join(sorted(STRATEGY_NAMES)))
