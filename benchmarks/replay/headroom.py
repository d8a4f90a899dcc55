"""Probe rules around the peers: how much room does victim choice leave?

    .venv/bin/python benchmarks/replay/headroom.py nopc [--traces DIR] [--no-write]
    .venv/bin/python benchmarks/replay/headroom.py pc   [--traces DIR] [--no-write]

``nopc``: issue 8 asks for a recompute tax of at most 0.85 x LCF's with prefix caching off.
This suite asks whether that is reachable by victim choice at all: it replays the two Azure
conversation cells without prefix caching over the five slices of ``run.py slices`` with a
family of rules around LCF, including *oracle* rules that read each request's true
remaining output (``--max-tokens exact`` makes ``max_tokens`` the trace length, so
``max_tokens - num_output_tokens`` is the truth). No online policy has that information,
so the best oracle figure bounds what a smarter disruption estimate could buy here.

``pc``: with prefix caching the built-in victim beats LCF on recompute tax at moderate
pressure while LCF keeps the lower P95 TTFT. This suite tries rules between the two on the
two prefix-caching cells (vLLM's default cap, as in ``run.py slices``) and reports both
metrics against the best peer of each slice. It also runs bidkv with a liveness threshold of
2 (instead of 4) and the clairvoyant reference, to place the guard's own trade-off.

The rules are scratch probes, defined below and loaded with ``--policy-class``; none ships
in the bundle. Results go between the ``headroom`` / ``headroom-pc`` markers of
``README.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bidkv_ext.contract import PreemptionCandidate, PreemptionContext

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))  # workers import the probe rules as ``headroom:Name``
from run import (  # noqa: E402
    BUILTIN,
    LCF,
    SLICE_STARTS,
    Arms,
    metric_of,
    over_slices,
    ratio_of,
    replay_arms,
    write_section,
)

Key = Callable[[PreemptionCandidate], float]
CELLS = {
    "conv-nopc-moderate": ("--num-gpu-blocks", "1600"),
    "conv-nopc-heavy": ("--num-gpu-blocks", "1000"),
}
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


PC_PROBES = (LargeEnough256, LargeEnough512Newest, HostVictimIfLarge, CappedLossHostTie)
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
PC_CELLS = {
    "conv-pc-moderate": ("--num-gpu-blocks", "1200"),
    "conv-pc-heavy": ("--num-gpu-blocks", "600"),
}
SUITES = {
    # suite: (cells, common knobs, peer arms, probe classes, README marker)
    "nopc": (CELLS, COMMON, PEERS, PROBES, "headroom"),
    "pc": (PC_CELLS, ("--duration", "300"),
           "builtin,least-computed-first,bidkv,bidkv{liveness_preemptions=2},clairvoyant",
           PC_PROBES, "headroom-pc"),
}


def _replay(job: tuple[Path, str, str, int, Path]) -> Arms:
    trace, suite, cell, start, out_root = job
    cells, common, peers, probes, _ = SUITES[suite]
    argv = ["--trace", str(trace), *common, *cells[cell], "--start", str(start),
            "--policies", peers]
    for probe in probes:
        argv += ["--policy-class", f"headroom:{probe.__name__}"]
    return replay_arms(argv, out_root / f"headroom-{cell}-{start}", f"{cell} at start {start}")


def _table(results: dict[str, list[Arms]]) -> str:
    lines = ["| rule | " + " | ".join(f"{cell}: tax / LCF (median, min-max)" for cell in results)
             + " |", "|---|" + "---|" * len(results)]
    for label in next(iter(results.values()))[0]:
        cells = []
        for runs in results.values():
            ratios = [ratio_of(metric_of(r[label], "tax"), metric_of(r[LCF], "tax")) for r in runs]
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
                values = [ratio_of(metric_of(r[label], metric),
                               min(metric_of(r[p], metric) for p in (BUILTIN, LCF))) for r in runs]
                cells.append(f"{statistics.median(values):.3f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("--traces", type=Path, default=ROOT.parents[1].parent / "shared" / "traces")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "bidkv-headroom")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    trace = args.traces / "azure_llm_2023_conv.csv"
    cells, common, _, _, marker = SUITES[args.suite]
    started = time.perf_counter()
    results = over_slices(_replay, {
        cell: [(trace, args.suite, cell, start, args.out) for start in SLICE_STARTS]
        for cell in cells
    })
    table = _table(results) if args.suite == "nopc" else _best_peer_table(results)
    text = (table + f"\n\nSlices: 300 s windows starting at "
            f"{', '.join(map(str, SLICE_STARTS))} s; knobs `{' '.join(common)}` plus the "
            f"cell's `--num-gpu-blocks`.\n"
            f"Total wall time: {time.perf_counter() - started:.0f} s.\n")
    print(text)
    if not args.no_write:
        write_section(marker, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
