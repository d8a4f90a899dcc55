"""``BidkvPreemptionPolicy``: the ``vllm.preemption-policy.v1`` implementation.

Load it on a vLLM-HUST host with ``--preemption-policy
bidkv_ext.selector.BidkvPreemptionPolicy`` (the manifest's component renders exactly that),
or on stock vLLM through :mod:`bidkv_ext.hosts.vllm`. The host calls
:meth:`BidkvPreemptionPolicy.from_vllm_config`; the configuration comes from
``BIDKV_UTILITY_*`` variables and ``additional_config["bidkv"]`` (see :mod:`bidkv_ext.config`).

Per decision: the kill switch / disabled check, then the configured strategy, whose choice
the liveness guard checks when the strategy is ``bidkv`` (the other strategies are the
plain rules their names say). Inactive policies abstain (the host uses its built-in
victim), so installing and loading the bundle changes nothing until it is enabled.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from bidkv_ext.config import BidKVConfig
from bidkv_ext.contract import PreemptionContext, PreemptionContextFacts
from bidkv_ext.controller import builtin_victim, builtin_victim_id
from bidkv_ext.guards import LivenessGuard
from bidkv_ext.strategies import StrategyRegistry, VictimStrategy, default_registry
from bidkv_ext.strategies.utility import UtilityStrategy

__all__ = ["BidkvPreemptionPolicy", "DecisionStats"]

logger = logging.getLogger("bidkv_ext.selector")


@dataclass(frozen=True, slots=True)
class DecisionStats:
    """What the policy decided, by kind, since it was built
    (:meth:`BidkvPreemptionPolicy.decision_stats`).

    The reference BidKV logged a tag and the ``r`` of every decision, and its qualification
    counted them in the engine log. This policy logs decisions only at DEBUG (it runs in
    the scheduler loop), so it counts them instead. The controller's own counters (calls,
    selections, abstentions, ...) say how often the policy answered; these say why.
    """

    selections: int
    """Victims named (the controller's ``selections`` unless it rejected one)."""
    cascade_selections: int
    """Of those, requesters named by the cascade guard."""
    liveness_reselections: int
    """Of those, named after the favourite had spent its liveness budget."""
    strategy_abstentions: int
    """Decisions left to the host because the strategy named nobody (no barrier)."""
    barrier_decisions: int
    """Decisions left to the host by the liveness guard, each starting an epoch."""
    liveness_epochs: int
    """Epochs the liveness guard has started (one per barrier decision)."""
    useful_blocks: int | None
    """Sum of ``r`` over the victims named: blocks freed that the requesters could use.
    None for a strategy that does not score ``r``."""


class BidkvPreemptionPolicy:
    """Victim selection by utility U = r / (delta + epsilon), with a per-epoch liveness bound."""

    vllm_preemption_policy_api_version = 1

    __slots__ = (
        "_active",
        "_guard",
        "_scorer",
        "_strategy",
        "barrier_decisions",
        "cascade_selections",
        "config",
        "liveness_reselections",
        "registry",
        "selections",
        "strategy_abstentions",
        "useful_blocks",
        "victim_index_hint",
    )

    def __init__(
        self,
        config: BidKVConfig | None = None,
        *,
        registry: StrategyRegistry | None = None,
    ) -> None:
        self.config = config if config is not None else BidKVConfig.from_sources(None, os.environ)
        self.registry = registry if registry is not None else default_registry(self.config)
        self._strategy: VictimStrategy = self.registry.get(self.config.strategy)
        # The strategy that scores r (bidkv), whose last choice the counts read; None for
        # the others.
        self._scorer = self._strategy if isinstance(self._strategy, UtilityStrategy) else None
        # The liveness guard is BidKV's, as the reference applied it on its utility path
        # only: every other strategy is the plain rule its name says (preempt-evict is
        # vLLM's LIFO victim however often the tail was preempted before).
        self._guard = LivenessGuard(
            self.config.liveness_preemptions if self._scorer is not None else 0
        )
        self._active = self.config.is_active
        self.victim_index_hint = -1
        # Decision counts (decision_stats): plain integers, so the hot path only adds.
        self.selections = 0
        self.cascade_selections = 0
        self.liveness_reselections = 0
        self.strategy_abstentions = 0
        self.barrier_decisions = 0
        self.useful_blocks = 0

    @classmethod
    def from_vllm_config(cls, vllm_config: object) -> BidkvPreemptionPolicy:
        """The host's preferred constructor: ``additional_config`` over env over defaults."""
        additional = getattr(vllm_config, "additional_config", None)
        if additional is not None and not isinstance(additional, Mapping):
            additional = None
        return cls(
            BidKVConfig.from_sources(additional, os.environ, **_engine_facts(vllm_config))
        )

    @property
    def strategy(self) -> VictimStrategy:
        return self._strategy

    @property
    def liveness(self) -> LivenessGuard:
        return self._guard

    def decision_stats(self) -> DecisionStats:
        """The decision counts so far (see :class:`DecisionStats`)."""
        return DecisionStats(
            selections=self.selections,
            cascade_selections=self.cascade_selections,
            liveness_reselections=self.liveness_reselections,
            strategy_abstentions=self.strategy_abstentions,
            barrier_decisions=self.barrier_decisions,
            liveness_epochs=self._guard.epochs,
            useful_blocks=self.useful_blocks if self._scorer is not None else None,
        )

    @property
    def wants_host_facts(self) -> bool:
        """Whether a host should compute :class:`PreemptionContextFacts` for this policy."""
        return self._active and bool(getattr(self._strategy, "uses_facts", False))

    def select_victim(self, context: PreemptionContext) -> str | None:
        return self.select_victim_with_facts(context, None)

    def select_victim_with_facts(
        self, context: PreemptionContext, facts: PreemptionContextFacts | None
    ) -> str | None:
        """Like :meth:`select_victim`, using optional host facts (absent on vLLM-HUST)."""
        if not self._active:
            return None
        candidates = context.candidates
        guard = self._guard
        strategy = self._strategy
        choice = strategy.choose(candidates, context, facts)
        direct = True
        reselected = False
        if choice is not None and not guard.allows(choice):
            # Rare path: the favourite spent its budget in this epoch. Choosing among the
            # eligible candidates is the same as choosing among all when the favourite is
            # eligible, so the common case costs one O(1) check instead of a scan.
            favourite = choice
            verdict = guard.filter(candidates)
            if verdict.barrier:
                self._barrier(context)
                return None
            choice = strategy.choose(verdict.eligible, context, facts)
            direct = verdict.eligible is candidates
            if (
                choice is not None
                and context.scheduling_policy == "priority"
                and choice.priority < favourite.priority
            ):
                # The guard must never make the victim more urgent than the strategy's own
                # choice (operator priorities first): the favourite's class has spent its
                # budget, so this is a barrier decision (the host's least urgent victim).
                self._barrier(context)
                return None
            reselected = choice is not None
            self.liveness_reselections += reselected
        if choice is None:
            self._abstain(context)
            return None
        # Where the victim sits in context.candidates, when the strategy knows it cheaply:
        # lets PolicyController validate the answer in O(1) instead of a scan.
        self.victim_index_hint = getattr(strategy, "last_index", -1) if direct else -1
        self.selections += 1
        scorer = self._scorer
        cascade = False
        if scorer is not None:
            self.useful_blocks += scorer.last_useful_blocks
            cascade = scorer.last_cascade
            self.cascade_selections += cascade
        if logger.isEnabledFor(logging.DEBUG):
            self._log_selection(choice.request_id, context, cascade, reselected)
        return choice.request_id

    def _log_selection(
        self, victim: str, context: PreemptionContext, cascade: bool, reselected: bool
    ) -> None:
        # One tagged line per decision, at DEBUG only: the reference's log tags, by kind.
        tag = "BIDKV_CASCADE" if cascade else "BIDKV_RESELECT" if reselected else "BIDKV_SELECT"
        scorer = self._scorer
        r = scorer.last_useful_blocks if scorer is not None else None
        logger.debug(
            "%s victim=%s requester=%s r=%s", tag, victim, context.requesting_request_id, r
        )

    def _abstain(self, context: PreemptionContext) -> None:
        # An abstention hands the decision to the host's victim. When that one has spent
        # its budget, this is the epoch's barrier decision: without it, a strategy that
        # abstains (every eligible candidate frees nothing) would let the host preempt the
        # same request past threshold + 1 in one epoch.
        guard = self._guard
        if guard.threshold and context.candidates and not guard.allows(builtin_victim(context)):
            self._barrier(context)
            return
        self.strategy_abstentions += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("BIDKV_ABSTAIN requester=%s", context.requesting_request_id)

    def _barrier(self, context: PreemptionContext) -> None:
        # Every candidate spent its budget in this epoch: one built-in decision, new epoch.
        self.barrier_decisions += 1
        self._guard.start_epoch(context.candidates, builtin_victim_id(context))
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "BIDKV_BARRIER requester=%s epoch=%d",
                context.requesting_request_id, self._guard.epochs,
            )


def _engine_facts(vllm_config: object) -> dict[str, Any]:
    """Block size, prefix caching and the prefill chunk, read from the engine config when
    it is a real one.

    They describe the engine rather than the policy, so they override any configured value.
    A step prefills at most ``max_num_batched_tokens`` of one request, and at most
    ``long_prefill_token_threshold`` when that is set (> 0).
    """
    cache = getattr(vllm_config, "cache_config", None)
    facts: dict[str, Any] = {}
    block_size = getattr(cache, "block_size", None)
    if _positive_int(block_size):
        facts["block_size"] = block_size
    prefix = getattr(cache, "enable_prefix_caching", None)
    if isinstance(prefix, bool):
        facts["prefix_caching"] = prefix
    scheduler = getattr(vllm_config, "scheduler_config", None)
    budget = getattr(scheduler, "max_num_batched_tokens", None)
    if _positive_int(budget):
        long_prefill = getattr(scheduler, "long_prefill_token_threshold", None)
        facts["prefill_chunk_tokens"] = (
            min(budget, long_prefill) if _positive_int(long_prefill) else budget)
    return facts


def _positive_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
