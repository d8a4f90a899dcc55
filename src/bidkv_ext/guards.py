"""The liveness guard: a real per-epoch bound on how often one request is preempted.

Within an *epoch*, a request that has already been preempted ``threshold`` times is not
eligible for the utility choice. When every candidate has reached the threshold, one
*progress-barrier* decision hands the choice to the host's built-in victim and a new epoch
starts. So in one epoch no request is preempted more than ``threshold + 1`` times, and a
request cannot be picked again and again while others are never touched -- the reference's
guard reset its offset after each abstention, which bounded nothing.

State is bounded: offsets are kept only for requests that were candidates at the last epoch
start (and the last barrier victim), and the table is rebuilt at every epoch start, so
requests that have left are forgotten. A request first seen after the epoch started counts
all its preemptions against the threshold (the conservative side of the bound).

Hot path: the selector asks :meth:`LivenessGuard.allows` about the strategy's choice (O(1))
and filters the candidates only when that choice has spent its budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

from bidkv_ext.contract import PreemptionCandidate

__all__ = ["LivenessGuard", "LivenessVerdict"]

_preemptions = attrgetter("num_preemptions")


@dataclass(frozen=True, slots=True)
class LivenessVerdict:
    """``eligible`` candidates for the strategy; empty means: take the barrier decision."""

    eligible: tuple[PreemptionCandidate, ...]

    @property
    def barrier(self) -> bool:
        return not self.eligible


class LivenessGuard:
    """Per-epoch preemption budget (``threshold`` 0 disables the guard)."""

    __slots__ = ("_offsets", "epochs", "threshold")

    def __init__(self, threshold: int) -> None:
        if threshold < 0:
            raise ValueError("liveness threshold must be non-negative")
        self.threshold = threshold
        self.epochs = 0
        self._offsets: dict[str, int] = {}

    @property
    def tracked(self) -> int:
        """How many requests the guard holds state for (bounded; see the module doc)."""
        return len(self._offsets)

    def allows(self, candidate: PreemptionCandidate) -> bool:
        """Whether ``candidate`` still has budget in this epoch (O(1))."""
        threshold = self.threshold
        if threshold == 0 or candidate.num_preemptions < threshold:
            return True
        return self._spent(candidate) < threshold

    def _spent(self, candidate: PreemptionCandidate) -> int:
        """Preemptions of ``candidate`` in this epoch.

        A barrier victim is booked at ``num_preemptions + 1`` before the host preempts it,
        and vLLM may still not preempt it (its blocks cannot be freed yet, e.g. under a KV
        connector with asynchronous scheduling). Seen with fewer preemptions than booked,
        its offset is lowered to what it has for good: an over-booking would hand it an
        extra preemption in this epoch, beyond the bound.
        """
        count = candidate.num_preemptions
        offset = self._offsets.get(candidate.request_id, 0)
        if offset > count:
            self._offsets[candidate.request_id] = offset = count
        return count - offset

    def filter(self, candidates: tuple[PreemptionCandidate, ...]) -> LivenessVerdict:
        threshold = self.threshold
        if threshold == 0 or not candidates:
            return LivenessVerdict(candidates)
        if max(map(_preemptions, candidates)) < threshold:
            return LivenessVerdict(candidates)
        spent = self._spent
        eligible = tuple(c for c in candidates if spent(c) < threshold)
        if len(eligible) == len(candidates):
            return LivenessVerdict(candidates)
        return LivenessVerdict(eligible)

    def start_epoch(
        self, candidates: tuple[PreemptionCandidate, ...], barrier_victim_id: str | None
    ) -> None:
        """Begin a new epoch; the barrier victim's coming preemption counts in the old one."""
        self.epochs += 1
        offsets = {c.request_id: c.num_preemptions for c in candidates if c.num_preemptions}
        if barrier_victim_id is not None:
            # Its preemption is about to happen (num_preemptions + 1): book it to the old epoch.
            for c in candidates:
                if c.request_id == barrier_victim_id:
                    offsets[barrier_victim_id] = c.num_preemptions + 1
                    break
        self._offsets = offsets
