"""Peer victim rules: the baselines every comparison includes (evaluation.md section 2).

Each is one C-level scan where the rule allows it (``max``/``min`` with ``attrgetter``), so
they double as decision-cost yardsticks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from operator import attrgetter

from bidkv_ext.contract import PreemptionCandidate, PreemptionContext, PreemptionContextFacts
from bidkv_ext.strategies.base import Candidates

__all__ = [
    "Abstain",
    "CostAware",
    "LargestFirst",
    "LeastComputedFirst",
    "Lifo",
    "PriorityRule",
    "SeededRandom",
    "SglangRetract",
    "ShortestRemaining",
]

Facts = PreemptionContextFacts | None
_computed = attrgetter("num_computed_tokens")
_priority_key = attrgetter("priority", "arrival_time")


@dataclass(frozen=True, slots=True)
class Abstain:
    """Always hand the decision to the host's built-in victim."""

    name: str = "builtin"

    def choose(
        self, candidates: Candidates, context: PreemptionContext, facts: Facts
    ) -> PreemptionCandidate | None:
        return None


@dataclass(frozen=True, slots=True)
class Lifo:
    """The tail of the running list: stock vLLM's FCFS victim."""

    name: str = "lifo"

    def choose(
        self, candidates: Candidates, context: PreemptionContext, facts: Facts
    ) -> PreemptionCandidate | None:
        return candidates[-1] if candidates else None


@dataclass(frozen=True, slots=True)
class PriorityRule:
    """Least urgent, then latest arrival: stock vLLM's PRIORITY victim."""

    name: str = "priority"

    def choose(
        self, candidates: Candidates, context: PreemptionContext, facts: Facts
    ) -> PreemptionCandidate | None:
        return max(candidates, key=_priority_key) if candidates else None


@dataclass(frozen=True, slots=True)
class LargestFirst:
    """Most computed tokens; ties go to the newest (``max`` on the reversed order)."""

    name: str = "largest-first"

    def choose(
        self, candidates: Candidates, context: PreemptionContext, facts: Facts
    ) -> PreemptionCandidate | None:
        return max(reversed(candidates), key=_computed) if candidates else None


@dataclass(frozen=True, slots=True)
class LeastComputedFirst:
    """Fewest computed tokens, first minimal in running order (vLLM RFC #54644's LCF)."""

    name: str = "least-computed-first"

    def choose(
        self, candidates: Candidates, context: PreemptionContext, facts: Facts
    ) -> PreemptionCandidate | None:
        return min(candidates, key=_computed) if candidates else None


@dataclass(frozen=True, slots=True)
class ShortestRemaining:
    """Protect the requests closest to completion: the victim has the most estimated work left.

    Remaining work is ``max_tokens - num_output_tokens``; a missing ``max_tokens`` (<= 0)
    uses ``default_max_tokens``. Ties go to the newest.
    """

    name: str = "shortest-remaining"
    default_max_tokens: int = 1024

    def choose(
        self, candidates: Candidates, context: PreemptionContext, facts: Facts
    ) -> PreemptionCandidate | None:
        fallback = self.default_max_tokens
        best: PreemptionCandidate | None = None
        best_left = 0
        for candidate in reversed(candidates):
            cap = candidate.max_tokens if candidate.max_tokens > 0 else fallback
            left = cap - candidate.num_output_tokens
            # No floor on ``left``: past its cap a request still has a most-remaining one.
            if best is None or left > best_left:
                best, best_left = candidate, left
        return best


@dataclass(slots=True)
class SeededRandom:
    """Uniform choice from a per-policy RNG: reproducible for a seed, unlike the reference's."""

    seed: int = 0
    name: str = "random"
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def choose(
        self, candidates: Candidates, context: PreemptionContext, facts: Facts
    ) -> PreemptionCandidate | None:
        return candidates[self._rng.randrange(len(candidates))] if candidates else None


@dataclass(frozen=True, slots=True)
class CostAware:
    """vLLM PR #56897's rule on the contract's fields: max reclaimable blocks per current
    token, damped by generation progress: ``B / max(1, T) * (1 - O / max(1, M))``.

    ``B`` is estimated as ``ceil(num_computed_tokens / block_size)`` (the contract has no
    block counts), ``T`` is prompt + output tokens, ``O`` output tokens, ``M`` max_tokens.
    The damping is not clamped: past its cap (``O > M``) a request scores below zero, and
    the rule still takes the highest score. Ties go to the newest.
    """

    name: str = "cost-aware"
    block_size: int = 16

    def choose(
        self, candidates: Candidates, context: PreemptionContext, facts: Facts
    ) -> PreemptionCandidate | None:
        bs = self.block_size
        best: PreemptionCandidate | None = None
        best_score = 0.0
        for c in reversed(candidates):
            blocks = -(-c.num_computed_tokens // bs)
            current = max(1, c.num_prompt_tokens + c.num_output_tokens)
            score = blocks / current * (1.0 - c.num_output_tokens / max(1, c.max_tokens))
            if best is None or score > best_score:
                best, best_score = c, score
        return best


@dataclass(frozen=True, slots=True)
class SglangRetract:
    """SGLang's ``retract_decode`` order: fewest output tokens, ties to the longest prompt,
    then to the last in batch order."""

    name: str = "sglang"

    def choose(
        self, candidates: Candidates, context: PreemptionContext, facts: Facts
    ) -> PreemptionCandidate | None:
        if not candidates:
            return None
        # SGLang sorts stably with reverse=True and pops the last: among full ties it
        # retracts the last in batch order, so scan from the end.
        return min(reversed(candidates),
                   key=lambda c: (c.num_output_tokens, -c.num_prompt_tokens))
