"""Probe rules around the peers: how much room does victim choice leave?

    .venv/bin/python benchmarks/replay/headroom.py nopc [--traces DIR] [--no-write]
    .venv/bin/python benchmarks/replay/headroom.py pc   [--traces DIR] [--no-write]
    .venv/bin/python benchmarks/replay/headroom.py rollout    [--horizon S] [--samples N]
    .venv/bin/python benchmarks/replay/headroom.py rollout-pc [--horizon S] [--samples N]
                                                  [--objective tax|wait|tax-no-later]
    .venv/bin/python benchmarks/replay/headroom.py rollout-mooncake [same options]
    .venv/bin/python benchmarks/replay/headroom.py anatomy [--traces DIR] [--no-write]

``nopc``: issue 8 asks for a recompute tax of at most 0.85 x LCF's with prefix caching off.
This suite asks whether that is reachable by victim choice at all: it replays the two Azure
conversation cells without prefix caching over the first five slices of ``run.py slices``
with a family of rules around LCF, including *oracle* rules that read each request's true
remaining output (``--max-tokens exact`` makes ``max_tokens`` the trace length, so
``max_tokens - num_output_tokens`` is the truth). No online policy has that information,
so the best oracle figure bounds what a smarter estimate judging one decision at a time
could buy here (``rollout`` looks ahead instead).

``pc``: with prefix caching the built-in victim beats LCF on recompute tax at moderate
pressure while LCF keeps the lower P95 TTFT. This suite tries rules between the two on the
two prefix-caching cells (vLLM's default cap, as in ``run.py slices``, on all ten of its
slices) and reports both metrics against the best peer of each slice. It also runs bidkv
with a liveness threshold of 2 (instead of the default 8) and the clairvoyant reference, to
place the guard's own trade-off.

``rollout`` and ``rollout-pc``: the same cells (without and with prefix caching) with a
lookahead oracle (:class:`RolloutOracle`) that forks the replay at every decision, plays
each option forward through the real scheduler and keeps the cheapest. It sees the real
future, so it is not a policy; it measures how much victim choice can buy at all, which
the greedy oracles above cannot (they judge each decision alone). ``--objective`` says
what "cheapest" means: recompute tax (default), the seconds requests wait for their first
token, or tax among the options that wait no longer than LCF's (``tax-no-later``: can any
victim choice lower the tax without costing TTFT?). ``rollout-mooncake`` runs the same
oracle on the two Mooncake cells of ``run.py slices`` (prefix caching on).

``anatomy``: no probe; it takes builtin, LCF and bidkv apart on the four conversation cells
over the ten slices of ``run.py slices`` to show what their recompute tax and P95 TTFT are
made of: how large the victims are, how much of a victim is lost by the time it returns
(with prefix caching only what was evicted meanwhile), how many steps it takes to return,
and how much KV sits idle (held by no request) on average.

The rules are scratch probes, defined below and loaded with ``--policy-class``; none ships
in the bundle. Results go between the suite's markers in ``README.md`` (``headroom``,
``headroom-pc``, ``headroom-rollout``, ``headroom-rollout-pc``,
``headroom-rollout-mooncake``, ``headroom-anatomy``; a rollout with another
objective or sampled lengths appends ``-<objective>`` and ``-sampled``, and ``--known``
``-known<share>``).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import random
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from bidkv_ext.contract import PreemptionCandidate, PreemptionContext
from bidkv_ext.replay.engine import ReplayState

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))  # workers import the probe rules as ``headroom:Name``
from run import (  # noqa: E402
    ALL_SLICE_STARTS,
    BUILTIN,
    CONV,
    LCF,
    MOON,
    SLICE_CELLS,
    SLICE_STARTS,
    Arms,
    Cell,
    median_of,
    metric_of,
    over_slices,
    paired_ratios,
    replay_arms,
    saved_reports,
    slice_out,
    took_line,
    write_section,
)

Key = Callable[[PreemptionCandidate], float]
CELLS = (
    Cell("conv-nopc-moderate", CONV, ("--num-gpu-blocks", "1600")),
    Cell("conv-nopc-heavy", CONV, ("--num-gpu-blocks", "1000")),
)
COMMON = ("--duration", "300", "--no-prefix-caching", "--max-tokens", "exact")


def _computed(c: PreemptionCandidate) -> float:
    return c.num_computed_tokens


def _remaining(c: PreemptionCandidate) -> int:
    return c.max_tokens - c.num_output_tokens


class _Rule:
    """Least ``key`` wins; ties go to the newest request (scan from the tail)."""

    key: Key = staticmethod(_computed)

    def pool(self, candidates: Sequence[PreemptionCandidate]) -> Sequence[PreemptionCandidate]:
        return candidates

    def select_victim(self, context: PreemptionContext) -> str | None:
        pool = self.pool(context.candidates) or context.candidates
        return min(reversed(pool), key=self.key).request_id if pool else None


def _within(tolerance: int) -> Callable[[Sequence[PreemptionCandidate]], list[PreemptionCandidate]]:
    def pool(candidates: Sequence[PreemptionCandidate]) -> list[PreemptionCandidate]:
        low = min(c.num_computed_tokens for c in candidates) + tolerance
        return [c for c in candidates if c.num_computed_tokens <= low]

    return pool


class OracleSkipFinishing(_Rule):
    """Oracle: LCF among requests with more than 32 true output tokens still to go."""

    def pool(self, candidates: Sequence[PreemptionCandidate]) -> Sequence[PreemptionCandidate]:
        return [c for c in candidates if _remaining(c) > 32]


class OracleSkipFinishing256(_Rule):
    """Oracle: LCF among requests with more than 256 true output tokens still to go."""

    def pool(self, candidates: Sequence[PreemptionCandidate]) -> Sequence[PreemptionCandidate]:
        return [c for c in candidates if _remaining(c) > 256]


class OracleComputedMinusRemaining(_Rule):
    """Oracle: least ``computed - remaining`` (small and long-lived victims first)."""

    key = staticmethod(lambda c: c.num_computed_tokens - _remaining(c))


class OracleComputedPlusRemaining(_Rule):
    """Oracle: least ``computed + remaining`` (small and nearly finished victims first)."""

    key = staticmethod(lambda c: c.num_computed_tokens + _remaining(c))


class OracleLostPerBlockStep(_Rule):
    """Oracle: least computed tokens lost per block-step of memory the victim would hold."""

    key = staticmethod(
        lambda c: c.num_computed_tokens
        / (((c.num_computed_tokens + 15) // 16) * (_remaining(c) + 1))
    )


class OracleLongestAmongSmall(_Rule):
    """Oracle: within 64 tokens of the least computed, the most true remaining output."""

    key = staticmethod(lambda c: -_remaining(c))
    pool = staticmethod(_within(64))


class FewestPreemptionsAmongSmall(_Rule):
    """Online: within 64 tokens of the least computed, the fewest prior preemptions."""

    key = staticmethod(lambda c: c.num_preemptions)
    pool = staticmethod(_within(64))


class MostPreemptionsAmongSmall(_Rule):
    """Online: within 64 tokens of the least computed, the most prior preemptions."""

    key = staticmethod(lambda c: -c.num_preemptions)
    pool = staticmethod(_within(64))


class LeastLostPerFreedBlock(_Rule):
    """Online: within 64 tokens of the least computed, fewest tokens per freed block."""

    key = staticmethod(lambda c: c.num_computed_tokens / max(1, (c.num_computed_tokens + 15) // 16))
    pool = staticmethod(_within(64))


class _LargeEnough:
    """Prefix caching: a victim's loss is capped by what gets evicted before it returns, so
    prefer victims holding at least ``horizon`` tokens (those tie), then ``tie``."""

    horizon = 256
    newest = False

    def select_victim(self, context: PreemptionContext) -> str | None:
        cands = context.candidates
        if not cands:
            return None
        h, builtin = self.horizon, context.builtin_victim_id
        if self.newest:
            best = max(range(len(cands)), key=lambda i: (min(cands[i].num_computed_tokens, h), i))
            return cands[best].request_id
        return min(reversed(cands), key=lambda c: (
            -min(c.num_computed_tokens, h), c.request_id != builtin, c.num_computed_tokens
        )).request_id


class LargeEnough256(_LargeEnough):
    """At least 256 tokens held (ties: the host's victim, then the smallest)."""


class LargeEnough512Newest(_LargeEnough):
    """At least 512 tokens held (ties: the newest)."""

    horizon = 512
    newest = True


class HostVictimIfLarge(_Rule):
    """The host's own victim when it holds at least 256 tokens, else LCF."""

    def select_victim(self, context: PreemptionContext) -> str | None:
        builtin = context.builtin_victim_id
        for c in context.candidates:
            if c.request_id == builtin and c.num_computed_tokens >= 256:
                return builtin
        return super().select_victim(context)


class CappedLossHostTie(_Rule):
    """Least ``min(computed, 256)`` (loss capped at a horizon); ties: the host's victim."""

    def select_victim(self, context: PreemptionContext) -> str | None:
        cands, builtin = context.candidates, context.builtin_victim_id
        if not cands:
            return None
        return min(reversed(cands), key=lambda c: (
            min(c.num_computed_tokens, 256), c.request_id != builtin
        )).request_id


class HostVictimIfQueueShort(_Rule):
    """The host's victim while the queue is short, else LCF (ties to the newest).

    The queue proxy is how long ago the newest running request arrived: under a long queue
    even the newest admission waited. It compares ``now`` with ``arrival_time``, which is
    sound only in the replay (one simulated clock); the real host's two clocks differ
    (preemption-contract.md section 8), so this is a probe, not a policy.
    """

    threshold = 2.0  # seconds

    def select_victim(self, context: PreemptionContext) -> str | None:
        cands, builtin = context.candidates, context.builtin_victim_id
        if (cands and builtin is not None
                and context.now - max(c.arrival_time for c in cands) < self.threshold):
            return builtin
        return super().select_victim(context)


OBJECTIVES = ("tax", "wait", "tax-no-later")  # see _Rollout.choose
_T = TypeVar("_T")


def _objective(text: str) -> str:
    if text not in OBJECTIVES:
        raise ValueError(text)
    return text


def _samples(text: str) -> int:
    """Sampled futures per option: 0 plays the true output lengths (clairvoyant), N > 0
    averages N samples; below 0 would fork nothing and report options never played."""
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


KNOWN_SEED = 20261202  # which requests BIDKV_ROLLOUT_KNOWN keeps; fixed, so runs repeat


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:  # also refuses NaN
        raise ValueError(text)
    return value


def _horizon(text: str) -> float:
    """Simulated seconds a child plays ahead: above 0; ``inf`` plays to the end of the
    trace (NaN would too, as a deadline never reached, under a folder named for NaN)."""
    value = float(text)
    if not value > 0.0:  # also refuses NaN
        raise ValueError(text)
    return value


def _width(text: str) -> int:
    """How many of the least computed candidates to try: at least one (a negative width
    sliced candidates off the other end)."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _arg(parse: Callable[[str], _T], expected: str) -> Callable[[str], _T]:
    """``parse`` as an argparse type: a bad value is argparse's one-line usage error."""
    def convert(text: str) -> _T:
        try:
            return parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    return convert


def _env(name: str, default: str, parse: Callable[[str], _T], expected: str) -> _T:
    """A rollout knob from the environment; a bad value stops with one line naming it."""
    raw = os.environ.get(name, default)
    try:
        return parse(raw)
    except ValueError:
        raise SystemExit(f"{name}: expected {expected}, got {raw!r}") from None


# The horizon and width the README's rollout tables were made with, and the defaults:
# other values name their own report folders and README sections (--reuse must not pass
# off reports made with one horizon as another's).
STANDARD_HORIZON = 20.0
STANDARD_WIDTH = 4
# The sampled futures per option of the README's "-sampled" sections; any other count is
# named in the folder and marker (the count is not in the replay's argv, so --reuse could
# not tell otherwise).
STANDARD_SAMPLES = 2
HORIZON_EXPECTED = "a number of seconds above 0 (inf: to the end of the trace)"
WIDTH_EXPECTED = "a whole number of candidates >= 1"


class _Rollout:
    """Process-wide state of the lookahead oracle (see :class:`RolloutOracle`).

    The oracle forks the whole replay at a decision, so a child must stop at its horizon
    and report. It follows the replay as a ``ReplayObserver`` (``bidkv_ext.replay.engine``):
    after every step a child checks its deadline, and a child whose trace ends first
    reports then.
    """

    horizon = _env("BIDKV_ROLLOUT_HORIZON", f"{STANDARD_HORIZON:g}", _horizon,
                   HORIZON_EXPECTED)
    width = _env("BIDKV_ROLLOUT_WIDTH", str(STANDARD_WIDTH), _width, WIDTH_EXPECTED)
    # > 0: children do not see true output lengths; each option is played this many
    # times, each time with freshly sampled lengths (see resample), and its costs averaged.
    samples = _env("BIDKV_ROLLOUT_SAMPLES", "0", _samples, "a whole number of futures >= 0")
    # With samples > 0: the share of requests whose true output length the children keep
    # (a fixed, seeded choice of requests). Between 0 (every length sampled) and 1 (the
    # clairvoyant futures, sampled nowhere): how much a length predictor must know.
    known = _env("BIDKV_ROLLOUT_KNOWN", "0", _share, "a share between 0 and 1")
    known_ids: ClassVar[frozenset[int]] = frozenset()
    objective = _env("BIDKV_ROLLOUT_OBJECTIVE", "tax", _objective,
                     "one of " + ", ".join(OBJECTIVES))
    # A path: the parent appends one JSON line per decision (options, their costs, choice).
    log = os.environ.get("BIDKV_ROLLOUT_LOG", "")
    child = False
    deadline = math.inf
    report_fd = -1
    loop: ReplayState
    # Output lengths sorted per prompt-length bin, and all of them (see resample); built
    # once per replay in the parent, so the forks inherit them.
    pools: ClassVar[dict[int, list[int]]] = {}
    everyone: ClassVar[list[int]] = []

    @classmethod
    def start(cls, loop: ReplayState) -> None:
        cls.loop = loop
        if cls.samples:
            cls.pools = {}
            for r in loop.requests:
                cls.pools.setdefault(_bin(r.input_length), []).append(r.output_length)
            for pool in cls.pools.values():
                pool.sort()
            cls.everyone = sorted(r.output_length for r in loop.requests)
            picker = random.Random(KNOWN_SEED)
            cls.known_ids = frozenset(i for i in range(len(loop.requests))
                                      if picker.random() < cls.known)

    @classmethod
    def resample(cls, seed: int) -> None:
        """Replace every unfinished request's output length by a draw from the window's
        output lengths of requests with a similar prompt (same power-of-two bin: on the
        Azure conversation trace the prompt length is the one online predictor of output
        length), longer than what it has produced so far. Seeded per decision and sample,
        so every option of one decision plays the same sampled futures."""
        loop, rng = cls.loop, random.Random(seed)
        lengths, tokens = loop.lengths, loop.tokens
        for i, r in enumerate(loop.requests):
            if not math.isnan(loop.finish[i]):  # finished: its length no longer matters
                continue
            if i in cls.known_ids:  # the predictor knows this one: the true length stays
                continue
            so_far = tokens[i]
            for pool in (cls.pools[_bin(r.input_length)], cls.everyone):
                longer = bisect.bisect_right(pool, so_far)
                if longer < len(pool):
                    lengths[i] = pool[rng.randrange(longer, len(pool))]
                    break
            else:
                lengths[i] = so_far + 1

    @classmethod
    def cost(cls, now: float) -> tuple[float, float]:
        """(tax, wait) of the child at ``now``. Tax: positions re-executed so far plus
        those still owed (every request that lost work it has not yet redone will redo it;
        exact without prefix caching). Wait: the seconds requests that arrived by ``now``
        spent without their first token, up to ``now`` (the sum TTFT is made of)."""
        loop = cls.loop
        owed = sum(m - p for m, p in zip(loop.mark, loop.position, strict=True) if m > p)
        wait = 0.0
        for r, first in zip(loop.requests, loop.first, strict=True):
            if r.arrival > now:
                break  # requests are in arrival order
            wait += (now if math.isnan(first) or first > now else first) - r.arrival
        return float(loop.recomputed + owed), wait

    @classmethod
    def report(cls, cost: tuple[float, float]) -> None:
        os.write(cls.report_fd, struct.pack("dd", *cost))
        os._exit(0)

    @classmethod
    def choose(cls, base: str, costs: dict[str, list[float]]) -> str:
        """The option the objective prefers; ``base`` (LCF) unless another is strictly
        better. ``tax``: least tax. ``wait``: least wait. ``tax-no-later``: least tax among
        the options that wait no longer than ``base``."""
        index = 1 if cls.objective == "wait" else 0
        allowed = list(costs)
        if cls.objective == "tax-no-later":
            allowed = [rid for rid in costs if costs[rid][1] <= costs[base][1]]
        best = min(allowed, key=lambda rid: costs[rid][index])
        return best if costs[best][index] < costs[base][index] else base


def _bin(prompt_tokens: int) -> int:
    """The power-of-two prompt-length bin the sampled lengths are drawn from."""
    return prompt_tokens.bit_length()


class RolloutOracle:
    """Oracle: one-step lookahead over the real scheduler, LCF as the base policy.

    At each decision the whole replay is forked once per option (the ``width`` least
    computed candidates, the host's victim, the requester and the largest). Each child
    preempts its option, continues with LCF for ``horizon`` simulated seconds and reports
    its cost (:meth:`_Rollout.cost`); the parent keeps the cheapest option, LCF's unless
    another is strictly cheaper. The children replay the real future (arrivals and true
    output lengths), so this is clairvoyant: it shows how much a better victim choice
    could buy, not what an online rule can. With ``samples`` > 0 the children see sampled
    output lengths instead (:meth:`_Rollout.resample`), the most an online lookahead knows.
    """

    def replay_started(self, state: ReplayState) -> None:
        _Rollout.start(state)

    def replay_stepped(self, now: float) -> None:
        if _Rollout.child and now >= _Rollout.deadline:
            _Rollout.report(_Rollout.cost(now))

    def replay_ended(self, error: BaseException | None) -> None:
        if _Rollout.child:  # never let a child reach the report writer
            _Rollout.report((math.inf, math.inf) if error is not None
                            else _Rollout.cost(math.inf))

    def select_victim(self, context: PreemptionContext) -> str | None:
        cands = context.candidates
        if not cands:
            return None
        base = min(cands, key=_computed).request_id  # LCF: first minimal in running order
        if _Rollout.child:
            return base
        order = sorted(range(len(cands)), key=lambda i: cands[i].num_computed_tokens)
        options = [cands[i].request_id for i in order[: _Rollout.width]]
        present = {c.request_id for c in cands}
        for rid in (context.builtin_victim_id, context.requesting_request_id,
                    cands[order[-1]].request_id):
            if rid in present and rid not in options:
                options.append(rid)  # type: ignore[arg-type]
        children = []
        seeds = range(_Rollout.samples) if _Rollout.samples else (None,)
        for rid in options:
            for seed in seeds:
                read_fd, write_fd = os.pipe()
                pid = os.fork()
                if pid == 0:  # the child: preempt this option, play the future with LCF
                    os.close(read_fd)
                    _Rollout.child, _Rollout.report_fd = True, write_fd
                    _Rollout.deadline = context.now + _Rollout.horizon
                    if seed is not None:
                        _Rollout.resample(round(context.now * 1e6) + seed)
                    return rid
                os.close(write_fd)
                children.append((rid, pid, read_fd))
        costs = {rid: [0.0, 0.0] for rid in options}
        for rid, pid, read_fd in children:
            data = os.read(read_fd, 16)
            os.close(read_fd)
            os.waitpid(pid, 0)
            tax, wait = struct.unpack("dd", data) if len(data) == 16 else (math.inf, math.inf)
            costs[rid][0] += tax
            costs[rid][1] += wait
        chosen = _Rollout.choose(base, costs)
        if _Rollout.log:
            _log_decision(context, base, chosen, costs)
        return chosen


def _log_decision(
    context: PreemptionContext, base: str, chosen: str, costs: dict[str, list[float]]
) -> None:
    by_id = {c.request_id: c for c in context.candidates}
    options = [{
        "id": rid, "tax": tax, "wait": wait,
        "computed": by_id[rid].num_computed_tokens, "prompt": by_id[rid].num_prompt_tokens,
        "output": by_id[rid].num_output_tokens, "preemptions": by_id[rid].num_preemptions,
        "arrival": by_id[rid].arrival_time,
    } for rid, (tax, wait) in costs.items()]
    line = {"now": context.now, "base": base, "chosen": chosen,
            "requester": context.requesting_request_id, "builtin": context.builtin_victim_id,
            "candidates": len(context.candidates), "options": options}
    with open(_Rollout.log, "a") as out:
        out.write(json.dumps(line) + "\n")


PC_PROBES = (LargeEnough256, LargeEnough512Newest, HostVictimIfLarge, CappedLossHostTie,
             HostVictimIfQueueShort)
PROBES = (
    OracleSkipFinishing,
    OracleSkipFinishing256,
    OracleComputedMinusRemaining,
    OracleComputedPlusRemaining,
    OracleLostPerBlockStep,
    OracleLongestAmongSmall,
    FewestPreemptionsAmongSmall,
    MostPreemptionsAmongSmall,
    LeastLostPerFreedBlock,
)
PEERS = "builtin,least-computed-first,bidkv,clairvoyant"
PC_CELLS = (
    Cell("conv-pc-moderate", CONV, ("--num-gpu-blocks", "1200")),
    Cell("conv-pc-heavy", CONV, ("--num-gpu-blocks", "600")),
)
# The Mooncake cells of ``run.py slices`` (prefix caching on; their knobs include
# ``--duration``).
MOONCAKE_CELLS = tuple(c for c in SLICE_CELLS if c.trace == MOON)
# Suites cheap enough to run on all ten slices of ``run.py slices`` by default (the
# others, the oracles above all, run on its first five).
TEN_SLICE_SUITES = ("pc", "anatomy")
# The conversation cells of ``run.py slices``, with and without prefix caching.
ANATOMY_CELLS = tuple(c for c in SLICE_CELLS if c.trace == CONV)
SUITES = {
    # suite: (cells, common knobs, peer arms, probe classes, README marker)
    "nopc": (CELLS, COMMON, PEERS, PROBES, "headroom"),
    "pc": (PC_CELLS, ("--duration", "300"),
           "builtin,least-computed-first,bidkv,bidkv{liveness_preemptions=2},clairvoyant",
           PC_PROBES, "headroom-pc"),
    "rollout": (CELLS, ("--duration", "300", "--no-prefix-caching"),
                "least-computed-first,bidkv", (RolloutOracle,), "headroom-rollout"),
    "rollout-pc": (PC_CELLS, ("--duration", "300"), "builtin,least-computed-first,bidkv",
                   (RolloutOracle,), "headroom-rollout-pc"),
    "rollout-mooncake": (MOONCAKE_CELLS, (),
                         "builtin,least-computed-first,bidkv", (RolloutOracle,),
                         "headroom-rollout-mooncake"),
    "anatomy": (ANATOMY_CELLS, (), "builtin,least-computed-first,bidkv", (),
                "headroom-anatomy"),
}


def _argv(traces: Path, suite: str, cell: Cell, start: int) -> list[str]:
    _, common, peers, probes, _ = SUITES[suite]
    argv = ["--trace", str(traces / cell.trace), *common, *cell.args, "--start", str(start),
            "--policies", peers]
    for probe in probes:
        argv += ["--policy-class", f"headroom:{probe.__name__}"]
    return argv


def _replay(job: tuple[Path, str, Cell, int, Path, bool, str]) -> Arms:
    traces, suite, cell, start, out_root, reuse, tag = job
    return replay_arms(_argv(traces, suite, cell, start),
                       slice_out(out_root, tag, cell.name, start),
                       f"{cell.name} at start {start}", reuse)


def _table(results: dict[str, list[Arms]]) -> str:
    lines = ["| rule | " + " | ".join(f"{cell}: tax / LCF (median, min-max)" for cell in results)
             + " |", "|---|" + "---|" * len(results)]
    for label in next(iter(results.values()))[0]:
        cells = []
        for runs in results.values():
            ratios = paired_ratios(runs, "tax", label, LCF)
            cells.append(f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _best_peer_table(results: dict[str, list[Arms]]) -> str:
    """Per slice, tax and P95 TTFT against the better of builtin and LCF on that metric."""
    head = " | ".join(f"{cell}: tax / best peer | {cell}: P95 TTFT / best peer"
                      for cell in results)
    lines = [f"| rule | {head} |", "|---|" + "---|---|" * len(results)]
    for label in next(iter(results.values()))[0]:
        cells = []
        for runs in results.values():
            for metric in ("tax", "p95"):
                values = paired_ratios(runs, metric, label, BUILTIN, LCF)
                cells.append(f"{statistics.median(values):.3f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _rollout_table(results: dict[str, list[Arms]], starts: Sequence[int]) -> str:
    """Tax and P95 TTFT against LCF's, per slice and as the median."""
    label = f"headroom:{RolloutOracle.__name__}"
    lines = ["| cell | metric | " + " | ".join(f"start {s} s" for s in starts)
             + " | median |", "|---|---|" + "---|" * (len(starts) + 1)]
    for cell, runs in results.items():
        for rule in ("bidkv", label):
            for metric, name in (("tax", "tax / LCF"), ("p95", "P95 TTFT / LCF")):
                ratios = paired_ratios(runs, metric, rule, LCF)
                row = " | ".join(f"{x:.3f}" for x in ratios)
                lines.append(f"| {cell} | {rule}: {name} | {row} | "
                             f"{statistics.median(ratios):.3f} |")
    return "\n".join(lines)


def anatomy_figures(arm: dict[str, Any]) -> tuple[float, float, float]:
    """(mean victim tokens, tokens lost per preemption, share of the victims' tokens lost)
    from one arm's report: the upper bound sums each victim's computed tokens at its
    preemption; the recomputed tokens are what the victims re-executed on return."""
    preemptions = arm["preemptions"]
    if not preemptions:
        return 0.0, 0.0, 0.0
    held = arm["recompute_upper_bound_tokens"]
    lost = arm["recomputed_tokens"]
    return held / preemptions, arm["recomputed_tokens_per_preemption"], (
        lost / held if held else 0.0)


def _anatomy_table(results: dict[str, list[Arms]]) -> str:
    """Per cell and arm, medians over slices; the last three columns are per-slice ratios
    to LCF. Below the table: in how many slices builtin left more KV idle than LCF."""
    lines = ["| cell | policy | preempt/1k | victim tokens | lost / preemption | share lost "
             "| steps to return | idle KV blocks | tax / LCF | P95 TTFT / LCF | out tok/s / LCF |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for cell, runs in results.items():
        for label in (BUILTIN, LCF, "bidkv"):
            figures = [anatomy_figures(r[label]) for r in runs]
            row = [median_of(runs, label, "preemptions_per_1k"),
                   *(statistics.median(f[k] for f in figures) for k in range(3)),
                   median_of(runs, label, "steps_to_return_mean"),
                   median_of(runs, label, "kv_free_blocks_mean")]
            ratios = [statistics.median(paired_ratios(runs, m, label, LCF))
                      for m in ("tax", "p95", "throughput_output_tok_s")]
            lines.append(f"| {cell} | {label} | {row[0]:.0f} | {row[1]:.0f} | {row[2]:.0f} | "
                         f"{row[3]:.2f} | {row[4]:.1f} | {row[5]:.1f} | "
                         + " | ".join(f"{x:.3f}" for x in ratios) + " |")
        idle = sum(r[BUILTIN]["kv_free_blocks_mean"] > r[LCF]["kv_free_blocks_mean"] for r in runs)
        slower = sum(metric_of(r[BUILTIN], "p95") > metric_of(r[LCF], "p95") for r in runs)
        cheaper = sum(metric_of(r[BUILTIN], "tax") < metric_of(r[LCF], "tax") for r in runs)
        notes.append(f"- {cell}: builtin left more KV idle than LCF in {idle} of {len(runs)} "
                     f"slices, had the higher P95 TTFT in {slower} and the lower tax in "
                     f"{cheaper}.")
    return "\n".join(lines) + "\n\n" + "\n".join(notes)


def _starts(text: str) -> list[int]:
    """Distinct slice starts >= 0: a repeated one would count that slice twice in the
    medians (and two workers would write one folder)."""
    try:
        starts = [int(part) for part in text.split(",")]
    except ValueError:
        starts = []
    if not starts or min(starts) < 0 or len(set(starts)) != len(starts):
        raise argparse.ArgumentTypeError(
            f"expected distinct comma-separated whole seconds >= 0 such as 0,1400, got "
            f"{text!r}")
    return starts


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("--traces", type=Path, default=ROOT.parents[1].parent / "shared" / "traces")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "bidkv-headroom")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--reuse", action="store_true",
                        help="re-render from the reports already under --out")
    parser.add_argument("--starts", type=_starts, default=None,
                        help="comma-separated slice starts in whole seconds (default: the "
                             "first five of run.py slices; all ten for pc and anatomy)")
    parser.add_argument("--horizon", type=_arg(_horizon, HORIZON_EXPECTED),
                        default=_Rollout.horizon,
                        help="rollout: simulated seconds each child plays ahead")
    parser.add_argument("--width", type=_arg(_width, WIDTH_EXPECTED), default=_Rollout.width,
                        help="rollout: how many of the least computed candidates to try")
    parser.add_argument("--samples",
                        type=_arg(_samples, "a whole number >= 0 (0: true output lengths)"),
                        default=0,
                        help="rollout: hide true output lengths from the children and "
                             "average this many sampled futures per option (0: clairvoyant)")
    parser.add_argument("--known", type=float, default=0.0,
                        help="rollout with --samples: share of requests whose true output "
                             "length the children keep (default 0)")
    parser.add_argument("--objective", choices=OBJECTIVES, default="tax",
                        help="rollout: what the oracle minimises (recompute tax; the "
                             "seconds requests wait for their first token; or tax among "
                             "the options that wait no longer than LCF's)")
    return parser


def _export_rollout_knobs(args: argparse.Namespace) -> None:
    # Workers import this module afresh (as ``headroom``) and read these at import.
    os.environ["BIDKV_ROLLOUT_HORIZON"] = str(args.horizon)
    os.environ["BIDKV_ROLLOUT_WIDTH"] = str(args.width)
    os.environ["BIDKV_ROLLOUT_SAMPLES"] = str(args.samples)
    os.environ["BIDKV_ROLLOUT_OBJECTIVE"] = args.objective
    os.environ["BIDKV_ROLLOUT_KNOWN"] = str(args.known)


def _variant(args: argparse.Namespace) -> str:
    """The suffix naming a rollout variant in report folders and README markers."""
    rollout = args.suite.startswith("rollout")
    sampled = "" if not rollout or args.samples == 0 else (
        "-sampled" if args.samples == STANDARD_SAMPLES else f"-sampled{args.samples}")
    return (f"-{args.objective}" if rollout and args.objective != "tax" else "") + sampled + (
        f"-known{args.known:g}" if args.known else "") + (
        f"-horizon{args.horizon:g}" if rollout and args.horizon != STANDARD_HORIZON
        else "") + (
        f"-width{args.width}" if rollout and args.width != STANDARD_WIDTH else "")


def _suite_table(suite: str, results: dict[str, list[Arms]], starts: Sequence[int]) -> str:
    if suite == "nopc":
        return _table(results)
    if suite == "rollout":
        return _rollout_table(results, starts)
    if suite == "anatomy":
        return _anatomy_table(results)
    return _best_peer_table(results)


def _oracle_line(args: argparse.Namespace) -> str:
    """What the rollout oracle ran with, for the section's footer ("" for other suites)."""
    if not args.suite.startswith("rollout"):
        return ""
    return (f"; the oracle minimises {args.objective}, horizon {args.horizon:g} s, "
            f"width {args.width}, "
            + (f"{args.samples} sampled futures per option" if args.samples > 0
               else "true output lengths")
            + (f", {args.known:.0%} of the lengths known" if args.known else ""))


def main() -> int:
    parser = _parser()
    args = parser.parse_args()
    if not 0.0 <= args.known <= 1.0 or (args.known and not args.samples):
        parser.error("--known takes a share between 0 and 1, and only with --samples")
    _export_rollout_knobs(args)
    variant = _variant(args)
    tag = args.suite + variant
    starts = args.starts or list(ALL_SLICE_STARTS if args.suite in TEN_SLICE_SUITES
                                 else SLICE_STARTS)
    cells, common, _, _, marker = SUITES[args.suite]
    started = time.perf_counter()
    saved = saved_reports(args.out, tag, [(c.name, start, _argv(args.traces, args.suite, c, start))
                                          for c in cells for start in starts], args.reuse)
    results = over_slices(_replay, {
        cell.name: [(args.traces, args.suite, cell, start, args.out, args.reuse, tag)
                    for start in starts]
        for cell in cells
    })
    knobs = "; ".join(f"{c.name}: `{c.trace}` `{' '.join(c.args)}`" for c in cells)
    shared = f"`{' '.join(common)}` plus " if common else ""
    text = (_suite_table(args.suite, results, starts) + f"\n\nSlices: 300 s windows starting at "
            f"{', '.join(map(str, starts))} s; knobs {shared}the cell's ({knobs})"
            f"{_oracle_line(args)}.\n" + took_line(started, saved))
    print(text)
    if not args.no_write:
        write_section(marker + variant, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
