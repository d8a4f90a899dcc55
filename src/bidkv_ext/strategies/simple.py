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
    "LargestFirst",
    "LeastComputedFirst",
    "Lifo",
    "PriorityRule",
    "SeededRandom",
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
        best_left = -1
        for candidate in reversed(candidates):
            cap = candidate.max_tokens if candidate.max_tokens > 0 else fallback
            left = cap - candidate.num_output_tokens
            if left > best_left:
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
