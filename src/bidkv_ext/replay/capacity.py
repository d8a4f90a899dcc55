"""Elastic KV capacity for the replay: a capacity schedule applied with kvcached's semantics.

``bidkv-replay --capacity-schedule FILE`` lowers and raises the number of KV blocks the
real vLLM block pool may hand out, over simulated time, the way kvcached resizes its pool
(kvcached-notes.md sections 2, 5 and 8):

* **Growth is immediate**: blocks held back are returned to the pool's free queue (through
  the pool's own ``free_blocks``) at the first step at or after the change, or at the
  change itself when the engine is empty then.
* **A shrink never revokes a block a request holds**: it takes effect only as blocks become
  free. Before every scheduler step, and when the engine empties (before a gap to the next
  arrival, and at the end of the replay: the last requests' blocks are free from that
  moment), the elastic pool moves free blocks into a reserve it owns (the pool's ``touch``
  takes them out of the free queue and ``evict_blocks`` drops their prefix-cache hash, as
  the allocator does when it reuses a cached free block) until it holds
  ``usable - target`` blocks. Until then the pool is *in shrink*; blocks freed by
  preemptions inside a step can still go to the requester, as holes in mapped pages can in
  kvcached. This is stricter than kvcached 0.1.6 in one respect: the reserve keeps every
  block it took, so capacity falls monotonically to the target.
* **Pages**: block ``b`` lies on page ``b // blocks_per_page``. A page is physically free
  when all of its blocks are free or reserved. When the reserve can choose (more free blocks
  than it still needs) it takes blocks on the pages with the most free-or-reserved blocks
  first, because kvcached's shrink returns whole pages.

Default page geometry (``--blocks-per-page 32``): Llama-3.1-8B has 8 KV heads of 128 dims
in bf16, so one 16-token block of one layer holds 16 x 8 x 128 x 2 bytes x 2 (K and V)
= 64 KiB, and kvcached's default 2 MiB page holds 32 such blocks. Byte figures in the
published signals are per layer on that geometry (block = 2 MiB / blocks_per_page).

Schedule file: JSON, a list of ``{"t": seconds, "blocks": count}`` objects, or CSV with the
header ``t,blocks``. ``t`` is simulated seconds from the first arrival, strictly increasing;
``blocks`` is the usable capacity (1 .. num_gpu_blocks - 1). Before the first entry the pool
has all its usable blocks.
"""

from __future__ import annotations

import bisect
import csv
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bidkv_ext.replay import jsontext
from bidkv_ext.replay.limits import MAX_SIMULATED_SECONDS
from kvcached_provider.signals import CapacitySignals, PageModel, PoolSignals

__all__ = [
    "DEFAULT_BLOCKS_PER_PAGE",
    "PAGE_BYTES",
    "CapacityPoint",
    "CapacitySchedule",
    "CapacityScheduleError",
    "ElasticPool",
    "load_capacity_schedule",
    "parse_capacity_schedule",
]

PAGE_BYTES = 2 << 20
"""kvcached's default physical page (``KVCACHED_PAGE_SIZE_MB=2``)."""
DEFAULT_BLOCKS_PER_PAGE = 32
"""2 MiB / 64 KiB per-layer K+V block of Llama-3.1-8B at block size 16 (module doc)."""
POOL_NAME = "bidkv-replay"


class CapacityScheduleError(ValueError):
    """A capacity schedule file that cannot be used; the message is one line."""


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Bounded like an arrival: far beyond it a step's length no longer moves the clock.
    t: float = Field(ge=0, le=MAX_SIMULATED_SECONDS, allow_inf_nan=False)
    blocks: int = Field(ge=1)


@dataclass(frozen=True, slots=True)
class CapacityPoint:
    """From ``t`` simulated seconds after the first arrival, capacity is ``blocks``."""

    t: float
    blocks: int


@dataclass(frozen=True, slots=True)
class CapacitySchedule:
    """A validated, time-ordered capacity series (see the module doc)."""

    points: tuple[CapacityPoint, ...]
    source: str = ""
    _times: tuple[float, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_times", tuple(p.t for p in self.points))

    def target_at(self, t: float, full: int) -> int:
        """Capacity in force at ``t``; ``full`` before the first entry."""
        i = bisect.bisect_right(self._times, t)
        return full if i == 0 else self.points[i - 1].blocks

    def next_change_after(self, t: float) -> float | None:
        """The first entry time strictly after ``t``, or ``None``."""
        i = bisect.bisect_right(self._times, t)
        return self._times[i] if i < len(self._times) else None

    def on_clock(self, origin: float) -> CapacitySchedule:
        """The same schedule with its times on a clock that reads ``origin`` at t = 0."""
        points = tuple(CapacityPoint(origin + p.t, p.blocks) for p in self.points)
        return CapacitySchedule(points, self.source)

    def as_list(self) -> list[dict[str, float | int]]:
        return [{"t": p.t, "blocks": p.blocks} for p in self.points]


def _entry_error(source: str, index: int, exc: ValidationError) -> CapacityScheduleError:
    first = exc.errors()[0]
    where = jsontext.error_location(first["loc"], "entry")
    return CapacityScheduleError(
        f"{source}: entry {index}: {where}: {first['msg']} "
        f'(expected {{"t": seconds from 0 to {MAX_SIMULATED_SECONDS:g}, "blocks": integer >= 1}})'
    )


def parse_capacity_schedule(
    entries: Sequence[object], source: str, usable_blocks: int, *, from_text: bool = False
) -> CapacitySchedule:
    """Validate raw entries (1-based in messages) against a pool of ``usable_blocks``.

    Values must be numbers (``true`` is no block count, ``"8"`` no time); only entries read
    from CSV text (``from_text``) are numbers written as strings.
    """
    if not entries:
        raise CapacityScheduleError(
            f'{source}: expected a non-empty list of {{"t": seconds, "blocks": count}} entries'
        )
    points: list[CapacityPoint] = []
    for index, raw in enumerate(entries, start=1):
        if not isinstance(raw, Mapping):
            raise CapacityScheduleError(
                f'{source}: entry {index}: expected an object {{"t": ..., "blocks": ...}}, '
                f"got {type(raw).__name__}"
            )
        try:
            entry = _Entry.model_validate(dict(raw), strict=not from_text)
        except ValidationError as exc:
            raise _entry_error(source, index, exc) from None
        if points and entry.t <= points[-1].t:
            raise CapacityScheduleError(
                f"{source}: entry {index}: t must be greater than the previous entry's t "
                f"({points[-1].t:g}), got {entry.t:g}"
            )
        if entry.blocks > usable_blocks:
            raise CapacityScheduleError(
                f"{source}: entry {index}: blocks {entry.blocks} exceeds the usable KV blocks "
                f"({usable_blocks} = --num-gpu-blocks - 1)"
            )
        points.append(CapacityPoint(entry.t, entry.blocks))
    return CapacitySchedule(tuple(points), source)


def _csv_rows(text: str, source: str) -> list[object]:
    reader = csv.DictReader(io.StringIO(text))
    try:
        if reader.fieldnames is None or sorted(f.strip() for f in reader.fieldnames) != [
            "blocks", "t",
        ]:
            raise CapacityScheduleError(f"{source}: expected a CSV header 't,blocks'")
        rows: list[object] = []
        for row in reader:
            if None in row:  # DictReader files surplus fields under the key None
                raise CapacityScheduleError(
                    f"{source}:{reader.line_num}: more fields than the header 't,blocks'")
            rows.append({k.strip(): (v or "").strip() for k, v in row.items()})
        return rows
    except csv.Error as exc:
        # A field over csv.field_size_limit(), a NUL byte, an unterminated quote.
        raise CapacityScheduleError(
            f"{source}:{reader.line_num}: not valid CSV ({exc}); expected a header 't,blocks'"
        ) from None


def load_capacity_schedule(path: Path, usable_blocks: int) -> CapacitySchedule:
    """Read a JSON (or ``.csv``) schedule; any problem is one :class:`CapacityScheduleError`."""
    source = str(path)
    try:
        # utf-8-sig: a byte-order mark is neither part of the CSV header nor valid JSON.
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise CapacityScheduleError(f"{source}: cannot read the capacity schedule: "
                                    f"{getattr(exc, 'strerror', None) or exc}") from None
    if path.suffix.lower() == ".csv":
        return parse_capacity_schedule(_csv_rows(text, source), source, usable_blocks,
                                       from_text=True)
    try:
        value: Any = jsontext.loads(text)
    except jsontext.JsonTextError as exc:
        raise CapacityScheduleError(
            f'{source}: {exc}; expected a list of {{"t": seconds, "blocks": count}} entries'
        ) from None
    if not isinstance(value, list):
        raise CapacityScheduleError(
            f'{source}: expected a JSON list of {{"t": seconds, "blocks": count}} entries, '
            f"got {type(value).__name__}"
        )
    return parse_capacity_schedule(value, source, usable_blocks)


class ElasticPool:
    """Applies a :class:`CapacitySchedule` to a vLLM ``BlockPool`` (see the module doc).

    Also a ``kvcached_provider.signals.SignalsSource``: while registered it publishes the
    shrink state, allocatable blocks, limits and free pages, and its page model.

    Call :meth:`before_step` before each ``schedule()``, :meth:`after_schedule` after it,
    :meth:`idle` whenever the engine empties (also after the last step), and :meth:`finish`
    once at the end (it releases the reserve).
    """

    def __init__(
        self,
        block_pool: Any,
        schedule: CapacitySchedule,
        *,
        blocks_per_page: int = DEFAULT_BLOCKS_PER_PAGE,
        origin: float = 0.0,
    ) -> None:
        if blocks_per_page < 1:
            raise ValueError(f"blocks_per_page must be >= 1, got {blocks_per_page}")
        self.pool = block_pool
        self.origin = origin
        # The schedule on the replay clock, computed once. The engine jumps the clock to
        # exactly its change times; turning the clock back into schedule time (now - origin)
        # can land just below a change (1.25 + 0.015 - 1.25 < 0.015), which never applies.
        self._on_clock = schedule.on_clock(origin)
        self.usable: int = block_pool.num_gpu_blocks - 1  # block 0 is vLLM's null block
        self.model = PageModel(blocks_per_page, block_pool.num_gpu_blocks)
        self.num_pages = -(-block_pool.num_gpu_blocks // blocks_per_page)
        # Insertion order doubles as the release order (last reserved, first released).
        self._reserved: dict[int, Any] = {}
        self._reserved_on_page: dict[int, int] = {}
        self.target = self.usable
        self.in_shrink = False
        self._last_t = 0.0
        self._shrink_since: float | None = None
        # Statistics (simulated time).
        self.steps = 0
        self.steps_in_shrink = 0
        self.time_in_shrink = 0.0
        self.shrinks = 0
        self.grows = 0
        self.shrink_durations: list[float] = []
        # Per completed shrink: (physically free pages, pages the reserve amounts to).
        self.shrink_pages: list[tuple[int, int]] = []
        self.max_over_after_shrink = 0
        self.max_over_during_shrink = 0
        self.min_effective = self.usable
        self.timeline: list[tuple[float, int, int]] = [(0.0, self.usable, self.usable)]
        self.end_state: dict[str, int] | None = None

    # -- capacity -------------------------------------------------------------------------

    @property
    def reserved(self) -> int:
        return len(self._reserved)

    @property
    def effective(self) -> int:
        """Blocks the scheduler may use now (usable minus the reserve)."""
        return self.usable - len(self._reserved)

    def used(self) -> int:
        """Blocks held by requests: neither free (cached free included) nor reserved."""
        return self.usable - int(self.pool.get_num_free_blocks()) - len(self._reserved)

    def before_step(self, now: float) -> None:
        """Apply the schedule at simulated time ``now`` and reserve newly free blocks."""
        self._apply(now)
        self.steps += 1
        if self.in_shrink:
            self.steps_in_shrink += 1
            # Blocks requests still hold above the target: what the shrink waits for.
            self.max_over_during_shrink = max(self.max_over_during_shrink,
                                              self.used() - self.target)

    def idle(self, now: float, until: float | None) -> None:
        """The engine holds no request from ``now`` until ``until`` (the next arrival), or
        ever again (``until`` is ``None``: the replay ends at ``now``).

        Changes timed up to ``now`` apply now, and a pending shrink takes the blocks the
        last requests freed now, when they freed them. Left to the next step, the idle gap
        would count as time in shrink and as part of the shrink's completion time; at the
        end, the shrink would be left pending though nothing holds a block. Each change
        timed inside the gap applies at its own time (no step runs there to apply it; a
        shrink there completes at once, every block being free), so a shrink and growth
        both inside one gap are counted. Changes after the end never apply."""
        self._apply(now)
        if until is None:
            return
        change = self.next_change_after(now)
        while change is not None and change < until:
            self._apply(change)
            change = self.next_change_after(change)

    def _account(self, now: float) -> None:
        t = now - self.origin
        if self.in_shrink:
            self.time_in_shrink += max(0.0, t - self._last_t)
        self._last_t = t

    def _apply(self, now: float) -> None:
        self._account(now)
        t = now - self.origin
        target = self._on_clock.target_at(now, self.usable)
        if target != self.target:
            self._set_target(target, t)
        elif self.in_shrink:
            self._reserve_free(t)

    def after_schedule(self) -> None:
        """Record usage right after ``schedule()`` (the step's allocation peak)."""
        over = self.used() - self.target
        if self.in_shrink:
            self.max_over_during_shrink = max(self.max_over_during_shrink, over)
        else:
            self.max_over_after_shrink = max(self.max_over_after_shrink, over)

    def next_change_after(self, now: float) -> float | None:
        """Simulated time (replay clock) of the next schedule change after ``now``."""
        return self._on_clock.next_change_after(now)

    def _set_target(self, target: int, t: float) -> None:
        if target < self.target:
            self.shrinks += 1
            if self._shrink_since is None:
                self._shrink_since = t
        else:
            self.grows += 1
        self.target = target
        excess = len(self._reserved) - (self.usable - target)
        if excess > 0:
            self._release(excess)
        self._reserve_free(t)

    def _release(self, count: int) -> None:
        ids = list(self._reserved)[-count:]
        blocks = [self._reserved.pop(i) for i in ids]
        for i in ids:
            page = self.model.page_of(i)
            self._reserved_on_page[page] -= 1
        # ref_cnt 1 -> 0 and no hash: the pool puts them at the front of its free queue.
        self.pool.free_blocks(blocks)

    def _reserve_free(self, t: float) -> None:
        deficit = self.usable - self.target - len(self._reserved)
        free = self.pool.get_num_free_blocks()
        if deficit > 0 and free > 0:
            self._take(self._choose(min(deficit, free), free))
        self._update_state(t)

    def _choose(self, count: int, free: int) -> list[Any]:
        candidates: list[Any] = self.pool.free_block_queue.get_all_free_blocks()
        if count >= free:
            return candidates
        # Prefer the pages that are already mostly free or reserved, so whole pages empty.
        per_page = self.model.blocks_per_page
        by_page: dict[int, list[Any]] = {}
        for block in candidates:
            by_page.setdefault(block.block_id // per_page, []).append(block)
        reserved_on_page = self._reserved_on_page
        order = sorted(by_page, key=lambda p: (-(len(by_page[p]) + reserved_on_page.get(p, 0)), p))
        chosen: list[Any] = []
        for page in order:
            chosen.extend(by_page[page][: count - len(chosen)])
            if len(chosen) >= count:
                break
        return chosen

    def _take(self, blocks: list[Any]) -> None:
        pool = self.pool
        # touch: out of the free queue, ref_cnt 0 -> 1; evict_blocks: drop any prefix-cache
        # hash, as get_new_blocks does for a cached free block it hands out.
        pool.touch(blocks)
        pool.evict_blocks({b.block_id for b in blocks})
        per_page = self.model.blocks_per_page
        for block in blocks:
            self._reserved[block.block_id] = block
            page = block.block_id // per_page
            self._reserved_on_page[page] = self._reserved_on_page.get(page, 0) + 1

    def _update_state(self, t: float) -> None:
        shrinking = len(self._reserved) < self.usable - self.target
        if not shrinking and self._shrink_since is not None:
            # Reached (possibly at once, or by a later growth): one completed shrink.
            self.shrink_durations.append(t - self._shrink_since)
            self._shrink_since = None
            # Whole pages are what a kvcached shrink gives back to the device.
            self.shrink_pages.append((self.physical_free_pages(),
                                      len(self._reserved) // self.model.blocks_per_page))
        self.in_shrink = shrinking
        effective = self.effective
        self.min_effective = min(self.min_effective, effective)
        last = self.timeline[-1]
        if last[1] != self.target or last[2] != effective:
            self.timeline.append((t, self.target, effective))

    def finish(self) -> dict[str, object]:
        """Record the end state, release the whole reserve, and return the summary."""
        free = self.pool.get_num_free_blocks()
        self.end_state = {"free_blocks": free, "reserved_blocks": len(self._reserved)}
        if self._reserved:
            self._release(len(self._reserved))
        return self.summary()

    def summary(self) -> dict[str, object]:
        durations = self.shrink_durations
        end = self.end_state or {}
        return {
            "blocks_per_page": self.model.blocks_per_page,
            "shrinks": self.shrinks,
            "grows": self.grows,
            "shrinks_completed": len(durations),
            "shrink_completion_s": {
                "max": max(durations) if durations else None,
                "mean": sum(durations) / len(durations) if durations else None,
            },
            "free_pages_at_shrink_end": {
                "min": min((f for f, _ in self.shrink_pages), default=None),
                "reserve_pages_max": max((r for _, r in self.shrink_pages), default=None),
            },
            "steps_in_shrink": self.steps_in_shrink,
            "time_in_shrink_s": self.time_in_shrink,
            "min_effective_blocks": self.min_effective,
            "max_overcommit_after_shrink_blocks": max(0, self.max_over_after_shrink),
            "max_over_target_during_shrink_blocks": max(0, self.max_over_during_shrink),
            "free_blocks_end": end.get("free_blocks"),
            "reserved_blocks_end": end.get("reserved_blocks"),
            "reserve_released": self.end_state is not None and not self._reserved,
            "capacity_changes": len(self.timeline) - 1,
        }

    # -- pages and signals ----------------------------------------------------------------

    def physical_free_pages(self) -> int:
        """Pages whose every block is free (cached free included) or reserved."""
        per_page = self.model.blocks_per_page
        counts = dict(self._reserved_on_page)
        for block in self.pool.free_block_queue.get_all_free_blocks():
            page = block.block_id // per_page
            counts[page] = counts.get(page, 0) + 1
        size = self.model.page_size
        return sum(1 for page, n in counts.items() if n == size(page))

    def page_model(self) -> PageModel:
        return self.model

    def capacity_signals(self) -> CapacitySignals:
        block_bytes = PAGE_BYTES // self.model.blocks_per_page
        free_pages = self.physical_free_pages()
        limit = self.target * block_bytes
        effective = self.effective * block_bytes
        mapped = (self.num_pages - free_pages) * PAGE_BYTES
        available = int(self.pool.get_num_free_blocks())
        pool = PoolSignals(
            pool_name=POOL_NAME,
            group_id=0,
            in_shrink=self.in_shrink,
            available_blocks=available,
            target_num_blocks=self.target,
            limit_bytes=limit,
            effective_limit_bytes=effective,
            current_capacity_bytes=effective,
            mapped_bytes=mapped,
            physical_free_pages=free_pages,
        )
        return CapacitySignals(
            in_shrink=self.in_shrink,
            available_blocks=available,
            memory_limit_bytes=limit,
            effective_limit_bytes=effective,
            mapped_bytes=mapped,
            physical_free_pages=free_pages,
            pools=(pool,),
        )
