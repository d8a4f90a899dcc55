"""The ``bidkv`` strategy: U = r / (delta + epsilon), maximised over the candidates.

``r`` is the KV a preemption frees *that the requester can use*, and ``delta`` estimates the
disruption it causes. Unlike the reference (r = computed tokens, delta in [1, 1.8], which
ranks almost exactly like largest-first), both terms here are in the units that matter
(design and measurements: docs/policy.md):

- ``r = min(blocks freed, blocks needed)``: blocks beyond the shortfall buy nothing now and
  are recompute later. Blocks freed are the host's exclusive-block count when it supplies
  facts, else ``ceil(num_computed_tokens / block_size)``. The shortfall is the host's
  ``needed_blocks``, else one block for a decoding requester and one prefill chunk's worth
  otherwise. When some candidates free the shortfall alone, only they are ranked: the host
  preempts until allocation succeeds, so an insufficient victim starts a cascade.
- ``delta = (base_cost + recompute_weight * lost) * (1 + preempt_weight * P)
  * (1 + completion_weight * H / (H + remaining)) * (1 + first_token_weight * [no output])``

  ``lost`` is the prefill the victim must redo when it returns. Without prefix caching that
  is all its computed tokens. With prefix caching, blocks it shares with other running
  requests stay held and come back as certain hits (host facts), and the share
  ``cache_survival`` of its own full hashed blocks is assumed to survive in the evictable
  queue (default 0: under pressure the requester and its neighbours consume the freed
  blocks first; the ablation in benchmarks/replay/README.md measures other values).
  ``base_cost`` is the fixed price of any preemption (re-queueing, a blocked admission
  step), so a near-empty victim is not free. ``remaining`` (``max_tokens -
  num_output_tokens``) protects requests close to their cap, which free their KV soon
  anyway; ``P`` (prior preemptions) can protect requests already disrupted (off by
  default; the liveness guard bounds repeats instead).

Ties go to the host's built-in victim, then to the newest request. Under the ``priority``
scheduling policy only the least urgent priority class is eligible, so the policy never
overrides the operator's priorities.

Cascade guard: when even the best victim frees fewer blocks than the requester needs (so
the host would go on to preempt more), and the requester's own U times
``cascade_gain_ratio`` reaches the best U, the requester is chosen: preempting it ends the
allocation loop at once.

Elastic KV (kvcached): while ``kvcached_provider.signals.current_signals()`` reports a shrink
in progress and the host supplies per-candidate ``pages_released``, U is multiplied by
``1 + shrink_page_weight * pages_released``: only whole empty pages return memory during a
shrink. With no signals (no kvcached, no simulated pool) or no facts, nothing changes.

Decision cost (contract path, no host facts, from 48 candidates): one read of every
candidate's computed tokens (a list comprehension) into a numpy array, then array
operations (scoring 1024 candidates in Python would cost more than vLLM's own victim
scan). The least computed candidate of the ranked set, the built-in victim and the
requester are scored exactly; since
``delta >= base_cost + slope * computed``, the best of them bounds which computed counts can
still win, and only those candidates (usually a handful) are scored in Python. The result
is identical to scoring everyone (a property test checks it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from operator import attrgetter, le

import numpy as np
import numpy.typing as npt

from bidkv_ext.config import BidKVConfig
from bidkv_ext.contract import (
    CandidateFacts,
    PreemptionCandidate,
    PreemptionContext,
    PreemptionContextFacts,
    candidate_index,
)
from bidkv_ext.controller import builtin_victim_id
from bidkv_ext.strategies.base import Candidates
from kvcached_provider.signals import current_signals

__all__ = ["UtilityParams", "UtilityStrategy"]

_Counts = npt.NDArray[np.int64]

_computed = attrgetter("num_computed_tokens")
_preempted_computed = attrgetter("num_preemptions", "num_computed_tokens")
# Below this many candidates the array passes cost more than scoring everyone in Python.
_PRUNE_FROM = 48
# A window larger than this after the first cut gets a second, sharper anchor.
_REFINE_ABOVE = 16
_NEVER = 1 << 62
# More tokens than any request holds, yet below _NEVER: the cut's limit never exceeds it,
# so candidates outside the ranked set stay out however small the recompute slope.
_BEYOND_ANY = float(_NEVER >> 1)
# Computed counts are integers: half a token of slack on each bound absorbs float rounding
# (the anchor that set a bound must stay inside it); what else it admits cannot win and
# only costs its scoring. Each bound is a difference divided by the recompute slope, so its
# rounding error is relative to the terms before they cancel: _RELATIVE_SLACK of those terms
# (far above double rounding) keeps a tiny slope (1e-18) from cutting the anchor itself out.
_SLACK = 0.5
_RELATIVE_SLACK = 1e-9


@dataclass(frozen=True, slots=True)
class UtilityParams:
    """The numbers the score uses, as plain attributes for the hot path.

    Built once from a validated :class:`~bidkv_ext.config.BidKVConfig`
    (:meth:`from_config`), which owns the defaults and the bounds: there is one set of them.
    """

    block_size: int
    prefix_caching: bool
    base_cost: float
    recompute_weight: float
    completion_weight: float
    completion_horizon: float
    preempt_weight: float
    first_token_weight: float
    cache_survival: float
    epsilon: float
    default_max_tokens: int
    cascade_gain_ratio: float
    use_host_facts: bool
    shrink_page_weight: float
    prefill_chunk_tokens: int

    @classmethod
    def from_config(cls, config: object | None = None) -> UtilityParams:
        """The score's fields of ``config`` (a BidKVConfig, or any object carrying some of
        its fields); what it lacks comes from BidKVConfig's defaults."""
        defaults = BidKVConfig()
        names = [f for f in cls.__dataclass_fields__ if f in BidKVConfig.model_fields]
        return cls(**{n: getattr(config, n, getattr(defaults, n)) for n in names})


class UtilityStrategy:
    """``bidkv``: the candidate with the highest U = r / (delta + epsilon)."""

    __slots__ = (
        "_known",
        "_lost_slope",
        "_shrinking",
        "last_cascade",
        "last_index",
        "last_useful_blocks",
        "params",
    )

    name = "bidkv"

    def __init__(self, params: UtilityParams | None = None) -> None:
        self.params = params or UtilityParams.from_config()
        self._shrinking = False
        self.last_index = -1
        # About the last victim named (read by the selector's decision counts): its r, the
        # blocks it frees that the requester can use, and whether the cascade guard named it.
        self.last_useful_blocks = 0
        self.last_cascade = False
        # Positions found during one decision, by object identity; one dict reused (the
        # hot path allocates none per call).
        self._known: dict[int, int] = {}
        p = self.params
        # Lower bound of lost tokens per computed token, used to prune (see module doc).
        self._lost_slope = p.recompute_weight * (
            (1.0 - p.cache_survival) if p.prefix_caching else 1.0
        )

    @property
    def uses_facts(self) -> bool:
        return self.params.use_host_facts

    def choose(
        self,
        candidates: Candidates,
        context: PreemptionContext,
        facts: PreemptionContextFacts | None,
    ) -> PreemptionCandidate | None:
        if not candidates:
            return None
        given = candidates
        if context.scheduling_policy == "priority":
            candidates = _least_urgent(candidates)
        if facts is not None and not self.params.use_host_facts:
            facts = None
        # Positions found along the way (by object identity), so that reporting where the
        # victim sits rarely needs another scan.
        # (candidate_index checks the tail, the host's FCFS victim, before any scan.)
        known = self._known
        known.clear()
        requester = _locate(candidates, context.requesting_request_id, known)
        builtin = _locate(candidates, context.builtin_victim_id, known)
        if builtin is None and context.scheduling_policy == "priority":
            # No valid host victim named (an API 1.0 host): ties still go to the host's
            # PRIORITY victim, as the controller would fall back to it (contract section 6).
            builtin = _locate(candidates, builtin_victim_id(context), known)
        need = self._needed_blocks(self._asker(requester, candidates, context), facts)
        # Page awareness needs the host's per-candidate page counts and a live shrink;
        # without either the score is exactly the plain one.
        self._shrinking = facts is not None and _capacity_shrinking(facts)
        window: Sequence[PreemptionCandidate] | None = None
        if facts is None and len(candidates) >= _PRUNE_FROM and self._lost_slope > 0.0:
            try:
                window, builtin = self._bounded(candidates, need, known, builtin, requester)
            except OverflowError:
                # A count of 2**61 or more (no real host has one): score in Python below,
                # which takes counts up to the float range, rather than choose wrongly or
                # fail and lose the policy.
                window = None
        if window is None:
            window = self._sufficient(candidates, need, facts)
            if window is not candidates:
                # Outside the ranked set a candidate may not win, not even a tie.
                builtin = self._if_sufficient(builtin, need, facts)
        best = self._argmax(window, builtin, facts, need)
        if best is not None:
            favourite = best
            best = self._cascade_guard(best, requester, facts, need)
            self.last_cascade = best is not favourite
            freed = self._freed_blocks(best, facts)
            self.last_useful_blocks = freed if freed < need else need
        # Its position in the tuple we were given (see BidkvPreemptionPolicy).
        if best is None or candidates is not given:
            self.last_index = -1
        else:
            index = known.get(id(best))
            if index is None:
                index = candidate_index(candidates, best.request_id)
            self.last_index = index
        return best

    @staticmethod
    def _asker(
        requester: PreemptionCandidate | None,
        candidates: Candidates,
        context: PreemptionContext,
    ) -> PreemptionCandidate | None:
        """The requester whose shortfall r is capped at, also when it may not be the victim
        (a more urgent priority class, or set aside by the liveness guard): the blocks it
        needs do not change with who is eligible."""
        if requester is not None or candidates is context.candidates:
            return requester
        index = candidate_index(context.candidates, context.requesting_request_id)
        return context.candidates[index] if index >= 0 else None

    # -- scoring -----------------------------------------------------------------------

    def utility(
        self,
        candidate: PreemptionCandidate,
        need: int,
        facts: PreemptionContextFacts | None = None,
    ) -> float:
        """U for one candidate (the reference implementation of the inner loop below)."""
        p = self.params
        bs = p.block_size
        comp = candidate.num_computed_tokens
        fact: CandidateFacts | None = facts.facts.get(candidate.request_id) if facts else None
        lost: float
        if fact is not None:
            freed = fact.exclusive_blocks
            if p.prefix_caching:
                # Shared blocks stay held by their other users: certain hits on return.
                # Exclusive hashed blocks wait in the evictable queue: likely hits.
                shared = fact.total_blocks - fact.exclusive_blocks
                kept = shared + p.cache_survival * fact.cached_blocks
                lost = max(comp - bs * kept, comp % bs)
            else:
                lost = comp
        else:
            freed = -(-comp // bs)
            lost = comp - p.cache_survival * (comp - comp % bs) if p.prefix_caching else comp
        if freed <= 0:
            return 0.0
        useful = freed if freed < need else need
        cap = candidate.max_tokens if candidate.max_tokens > 0 else p.default_max_tokens
        left = max(cap - candidate.num_output_tokens, 0)
        horizon = p.completion_horizon
        preempted = candidate.num_preemptions
        if preempted < 0:
            preempted = 0  # outside the contract; 0 keeps the factor >= 1, as the bound assumes
        delta = (
            (p.base_cost + p.recompute_weight * lost)
            * (1.0 + p.preempt_weight * preempted)
            * (1.0 + p.completion_weight * horizon / (horizon + left))
            * (1.0 + (p.first_token_weight if candidate.num_output_tokens == 0 else 0.0))
        )
        u = useful / (delta + p.epsilon)
        if self._shrinking and fact is not None and fact.pages_released:
            # During an elastic-KV shrink only whole empty pages return memory: favour
            # victims whose blocks empty pages (kvcached-notes.md section 8).
            u *= 1.0 + p.shrink_page_weight * fact.pages_released
        return u

    def _argmax(
        self,
        window: Sequence[PreemptionCandidate],
        builtin: PreemptionCandidate | None,
        facts: PreemptionContextFacts | None,
        need: int,
    ) -> PreemptionCandidate | None:
        # Walk newest-first with a strict '>' so ties keep the newest; the built-in victim
        # is scored first so that it wins any tie (if pruned, it cannot reach the best).
        utility = self.utility
        best = builtin
        best_u = utility(builtin, need, facts) if builtin is not None else 0.0
        for candidate in reversed(window):
            u = utility(candidate, need, facts)
            if u > best_u:
                best, best_u = candidate, u
        if best_u <= 0.0:
            return None  # nobody frees anything: let the host decide
        return best

    def _sufficient(
        self, candidates: Candidates, need: int, facts: PreemptionContextFacts | None
    ) -> Candidates:
        """The candidates that alone free the ``need`` blocks, or all when none does.

        Preferring them avoids a cascade of victims (the host preempts until allocation
        succeeds); among them U ranks by disruption alone. A decoding requester needs one
        block, so then every candidate that holds a block qualifies.
        """
        if need <= 1:
            return candidates
        if facts is None:
            enough = self._sufficient_tokens(need)
            chosen = tuple(compress(
                candidates, map(le, repeat(enough), map(_computed, candidates))
            ))
        else:
            chosen = tuple(c for c in candidates if self._freed_blocks(c, facts) >= need)
        return chosen or candidates

    def _sufficient_tokens(self, need: int) -> int:
        # The fewest computed tokens whose blocks, ceil(tokens / block_size), reach `need`.
        return self.params.block_size * (need - 1) + 1

    def _if_sufficient(
        self,
        candidate: PreemptionCandidate | None,
        need: int,
        facts: PreemptionContextFacts | None,
    ) -> PreemptionCandidate | None:
        if candidate is None or self._freed_blocks(candidate, facts) < need:
            return None
        return candidate

    def _bounded(
        self,
        candidates: Candidates,
        need: int,
        known: dict[int, int],
        builtin: PreemptionCandidate | None,
        requester: PreemptionCandidate | None,
    ) -> tuple[Sequence[PreemptionCandidate], PreemptionCandidate | None]:
        """The candidates that can still win, in order, and the built-in victim if it is in
        the ranked set (see :meth:`_sufficient`; outside it a candidate may not win, not
        even a tie). Records the candidates' positions in ``known``."""
        # A list comprehension, not fromiter(map(attrgetter)): the attribute read
        # specialises to a slot load (about half the time per candidate on CPython 3.11).
        # fromiter over that list with a known count skips np.array's generic sequence
        # conversion (about 4 us less at 1,024 candidates).
        computed: _Counts = np.fromiter(
            [c.num_computed_tokens for c in candidates], np.int64, len(candidates)
        )
        # The ranked set: candidates that free the shortfall alone, when any does; else
        # every candidate that frees anything (U = 0 cannot win).
        most = int(computed.max())
        if most >= _BEYOND_ANY:
            # The bounds below mark and cap counts at _NEVER and _BEYOND_ANY; a count that
            # reaches them (no real host has one) is scored in Python by the caller.
            raise OverflowError("computed tokens beyond the fast path's range")
        lowest = self._sufficient_tokens(need)
        narrowed = need > 1 and most >= lowest
        if not narrowed:
            lowest = 1
        ranked = computed
        at = int(computed.argmin())
        if computed[at] < lowest:
            ranked = np.where(computed >= lowest, computed, _NEVER)
            at = int(ranked.argmin())
            if ranked[at] == _NEVER:
                return (), builtin  # nobody frees a block
        lcf = candidates[at]
        known[id(lcf)] = at
        if narrowed:
            builtin = self._if_sufficient(builtin, need, None)
            requester = self._if_sufficient(requester, need, None)
        # The best exact U among the anchors is a floor the winner must reach.
        u0 = max(self.utility(a, need) for a in (lcf, builtin, requester) if a is not None)
        positions = self._cut(ranked, need, u0)
        if len(positions) > _REFINE_ABOVE:
            # The least computed was a poor anchor (typically preempted before, so its delta
            # carries the P factor): anchor again on the least computed of the least
            # preempted inside the window, and cut with that higher floor.
            inside = [candidates[i] for i in positions.tolist()]
            u0 = max(u0, self.utility(min(inside, key=_preempted_computed), need))
            positions = positions[self._cut(ranked[positions], need, u0)]
        where = positions.tolist()
        window = [candidates[i] for i in where]
        known.update(zip(map(id, window), where, strict=True))
        return window or (lcf,), builtin

    def _cut(self, ranked: _Counts, need: int, u0: float) -> npt.NDArray[np.intp]:
        """Positions whose computed tokens can still reach ``u0``: between the floor and
        the limit (both bounds hold for every candidate when the host gives no facts)."""
        inside = ranked <= self._limit(need, u0)
        floor = self._floor(u0)
        if floor > 0.0:
            # Small candidates free fewer blocks than a prefilling requester needs:
            # U_i <= (computed_i / block_size + 1) / (base + slope * computed_i).
            inside &= ranked >= floor
        return np.flatnonzero(inside)

    def _floor(self, u0: float) -> float:
        # Solves (c / bs + 1) / (base + slope * c) = u0 for c: below it U_i < u0. Less slack.
        p = self.params
        denominator = 1.0 / p.block_size - u0 * self._lost_slope
        if denominator <= 0.0:
            return 0.0
        scale = u0 * (p.base_cost + p.epsilon)
        slack = _SLACK + _RELATIVE_SLACK * (scale + 1.0) / denominator
        return (scale - 1.0) / denominator - slack

    def _limit(self, need: int, u0: float) -> float:
        # U_i <= need / (base + slope * computed_i): only computed_i <= limit can reach u0.
        # Plus slack, and capped far below _NEVER: candidates outside the ranked set never
        # re-enter, however small the slope.
        if u0 <= 0.0:
            return _BEYOND_ANY  # every ranked candidate can tie a zero utility
        p = self.params
        reach = need / u0
        slack = _SLACK + _RELATIVE_SLACK * reach / self._lost_slope
        return min((reach - p.epsilon - p.base_cost) / self._lost_slope + slack, _BEYOND_ANY)

    def _cascade_guard(
        self,
        best: PreemptionCandidate,
        requester: PreemptionCandidate | None,
        facts: PreemptionContextFacts | None,
        need: int,
    ) -> PreemptionCandidate:
        ratio = self.params.cascade_gain_ratio
        if ratio <= 1.0 or requester is None or best is requester:
            return best
        if self._freed_blocks(best, facts) >= need:
            return best  # one victim suffices: no cascade to guard against
        if self.utility(requester, need, facts) * ratio >= self.utility(best, need, facts):
            return requester
        return best

    def _freed_blocks(
        self, candidate: PreemptionCandidate, facts: PreemptionContextFacts | None
    ) -> int:
        fact = facts.facts.get(candidate.request_id) if facts else None
        if fact is not None:
            return fact.exclusive_blocks
        return -(-candidate.num_computed_tokens // self.params.block_size)

    def _needed_blocks(
        self, requester: PreemptionCandidate | None, facts: PreemptionContextFacts | None
    ) -> int:
        if facts is not None and facts.needed_blocks > 0:
            return facts.needed_blocks
        if requester is None:
            return 1
        total = requester.num_prompt_tokens + requester.num_output_tokens
        pending = total - requester.num_computed_tokens
        if pending <= 1:
            return 1  # decoding: at most one new block per step
        chunk = min(pending, self.params.prefill_chunk_tokens)
        return max(1, -(-chunk // self.params.block_size))


def _capacity_shrinking(facts: PreemptionContextFacts) -> bool:
    if facts.in_shrink is not None:  # the host read the signals for this decision
        return facts.in_shrink
    signals = current_signals()
    return signals is not None and signals.in_shrink


def _locate(
    candidates: Candidates, request_id: str | None, known: dict[int, int]
) -> PreemptionCandidate | None:
    """The candidate with ``request_id`` (recording its position in ``known``), or None."""
    if request_id is None:
        return None
    index = candidate_index(candidates, request_id)
    if index < 0:
        return None
    candidate = candidates[index]
    known[id(candidate)] = index
    return candidate


def _least_urgent(candidates: Candidates) -> Candidates:
    priorities = [c.priority for c in candidates]
    worst = max(priorities)
    if min(priorities) == worst:
        return candidates
    return tuple(c for c in candidates if c.priority == worst)
