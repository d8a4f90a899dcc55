"""How well can an online rule tell which running request finishes first?

    .venv/bin/python benchmarks/replay/predictability.py [--traces DIR] [--samples N]

Issue 8's unmet goals are met by a lookahead that knows each request's true output length,
and missed by the same lookahead on sampled lengths (docs/policy.md, "Where BidKV still
loses"). This measures, per shared trace and without the scheduler, how much of that
knowledge an online predictor could recover from what the preemption contract carries:
the prompt length ``p`` and the output so far ``k`` (and the ``max_tokens`` cap, vLLM's
default ``max_model_len - p``).

Each predictor is fitted on the first half of the trace (by arrival) and scored on the
second half. A scored sample is a *running moment*: a request, drawn with probability
proportional to its output length (long requests are running more often), at an output
position ``k`` drawn uniformly from ``0 .. L-1``. Two scores:

- **concordance** (C-index): over random pairs of moments whose remaining outputs differ,
  the share the predictor orders the same way as the truth (ties in the prediction count
  one half). 0.5 is a coin, 1.0 is clairvoyance. This is what ranking victims by remaining
  work needs.
- **AUC of finishing soon**: how well the predicted chance of finishing within the next
  ``--horizon`` tokens (BidKV's completion term uses 32) separates moments that do from
  moments that do not. 0.5 is a coin.

Predictors: ``output so far`` (mean remaining output per bucket of ``k``, the memoryless
test), ``prompt + output so far`` (per bucket of ``p`` decile and ``k``; a sparse cell falls
back to its ``k`` bucket; also with the power-of-two prompt bins that ``headroom.py``'s
sampled lookahead draws from), ``default cap`` (remaining cap ``max_model_len - p - k``, what
BidKV's completion term sees when clients leave ``max_tokens`` unset). The table goes to
the ``predictability`` markers of ``benchmarks/replay/README.md``.
"""

from __future__ import annotations

import argparse
import bisect
import random
import shlex
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bidkv_ext.replay.trace import TraceError, TraceRequest, load_trace

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from run import CODE, CONV, MOON, write_section  # noqa: E402

# Output-so-far buckets: powers of two, since the residual's spread grows with k.
K_EDGES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
MIN_CELL = 30  # fewer training moments than this in a (p, k) cell: use the k bucket alone
TRAIN_MOMENTS = 200_000


@dataclass(frozen=True, slots=True)
class Moment:
    """A running request at one output position: what an online rule sees, and the truth."""

    prompt: int
    produced: int
    remaining: int  # true output tokens still to come, >= 1


Predictor = Callable[[Moment], float]  # higher = more remaining output expected


def moments(requests: Sequence[TraceRequest], count: int, rng: random.Random) -> list[Moment]:
    """``count`` running moments, requests weighted by output length, ``k`` uniform."""
    weights = [r.output_length for r in requests]
    chosen = rng.choices(requests, weights=weights, k=count)
    out = []
    for r in chosen:
        k = rng.randrange(r.output_length)
        out.append(Moment(r.input_length, k, r.output_length - k))
    return out


def _k_bucket(k: int) -> int:
    return bisect.bisect_right(K_EDGES, k)


def fit_output_so_far(train: Sequence[Moment]) -> Predictor:
    """Mean remaining output per bucket of output so far."""
    sums: dict[int, list[int]] = {}
    for m in train:
        sums.setdefault(_k_bucket(m.produced), []).append(m.remaining)
    overall = statistics.fmean(m.remaining for m in train)
    means = {b: statistics.fmean(v) for b, v in sums.items()}
    return lambda m: means.get(_k_bucket(m.produced), overall)


def decile_bin(train: Sequence[Moment]) -> Callable[[int], int]:
    """The prompt-length decile (edges from the training moments)."""
    prompts = sorted(m.prompt for m in train)
    edges = [prompts[len(prompts) * i // 10] for i in range(1, 10)]
    return lambda p: bisect.bisect_right(edges, p)


def power_of_two_bin(p: int) -> int:
    """The bin ``headroom.py``'s sampled lookahead draws similar prompts from."""
    return p.bit_length()


def fit_prompt_and_output(train: Sequence[Moment], prompt_bin: Callable[[int], int]
                          ) -> Predictor:
    """Mean remaining output per (prompt bin, output-so-far bucket)."""
    cells: dict[tuple[int, int], list[int]] = {}
    for m in train:
        cells.setdefault((prompt_bin(m.prompt), _k_bucket(m.produced)), []).append(m.remaining)
    means = {key: statistics.fmean(v) for key, v in cells.items() if len(v) >= MIN_CELL}
    fallback = fit_output_so_far(train)

    def predict(m: Moment) -> float:
        found = means.get((prompt_bin(m.prompt), _k_bucket(m.produced)))
        return fallback(m) if found is None else found

    return predict


def default_cap(max_model_len: int) -> Predictor:
    """Remaining ``max_tokens`` under vLLM's default cap, ``max_model_len - prompt``."""
    return lambda m: float(max_model_len - m.prompt - m.produced)


def concordance(predicted: Sequence[float], truth: Sequence[float], pairs: int,
                rng: random.Random) -> float:
    """C-index over ``pairs`` random pairs with different truths; prediction ties count 1/2.

    Returns NaN when no drawn pair has different truths.
    """
    n = len(truth)
    agree = 0.0
    counted = 0
    for _ in range(pairs):
        i, j = rng.randrange(n), rng.randrange(n)
        if truth[i] == truth[j]:
            continue
        counted += 1
        dp = predicted[i] - predicted[j]
        if dp == 0:
            agree += 0.5
        elif (dp > 0) == (truth[i] > truth[j]):
            agree += 1.0
    return agree / counted if counted else float("nan")


def soon_auc(chance: Sequence[float], finishes: Sequence[bool], pairs: int,
             rng: random.Random) -> float:
    """AUC: P(chance of a moment that finishes soon > one that does not); ties 1/2."""
    pos = [c for c, f in zip(chance, finishes, strict=True) if f]
    neg = [c for c, f in zip(chance, finishes, strict=True) if not f]
    if not pos or not neg:
        return float("nan")
    total = 0.0
    for _ in range(pairs):
        a, b = rng.choice(pos), rng.choice(neg)
        total += 1.0 if a > b else 0.5 if a == b else 0.0
    return total / pairs


def fit_soon_chance(train: Sequence[Moment], horizon: int,
                    key: Callable[[Moment], object]) -> Callable[[Moment], float]:
    """Share of training moments in the same ``key`` cell that finish within ``horizon``."""
    cells: dict[object, list[bool]] = {}
    for m in train:
        cells.setdefault(key(m), []).append(m.remaining <= horizon)
    base = statistics.fmean(m.remaining <= horizon for m in train)
    shares = {c: statistics.fmean(v) for c, v in cells.items() if len(v) >= MIN_CELL}
    return lambda m: shares.get(key(m), base)


@dataclass(frozen=True, slots=True)
class TraceScores:
    name: str
    requests: int
    rank_corr: float  # Spearman correlation of prompt and output length
    c_index: dict[str, float]
    soon: dict[str, float]
    soon_share: float


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for t in range(i, j + 1):
            ranks[order[t]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    return statistics.correlation(_ranks(xs), _ranks(ys))


def score_trace(name: str, requests: Sequence[TraceRequest], *, samples: int, horizon: int,
                max_model_len: int, seed: int) -> TraceScores:
    """Fit on the first half by arrival, score on the second half."""
    ordered = sorted(requests, key=lambda r: r.arrival)
    half = len(ordered) // 2
    rng = random.Random(seed)
    train = moments(ordered[:half], TRAIN_MOMENTS, rng)
    test = moments(ordered[half:], samples, rng)
    deciles = decile_bin(train)
    predictors: dict[str, Predictor] = {
        "output so far": fit_output_so_far(train),
        "prompt + output so far": fit_prompt_and_output(train, deciles),
        "prompt 2^n + output so far": fit_prompt_and_output(train, power_of_two_bin),
        "default cap": default_cap(max_model_len),
    }
    truth = [float(m.remaining) for m in test]
    c_index = {label: concordance([p(m) for m in test], truth, samples, rng)
               for label, p in predictors.items()}
    c_index["clairvoyant"] = concordance(truth, truth, samples, rng)
    chances = {
        "output so far": fit_soon_chance(train, horizon, lambda m: _k_bucket(m.produced)),
        "prompt + output so far": fit_soon_chance(
            train, horizon, lambda m: (deciles(m.prompt), _k_bucket(m.produced))),
    }
    finishes = [m.remaining <= horizon for m in test]
    soon = {label: soon_auc([c(m) for m in test], finishes, samples, rng)
            for label, c in chances.items()}
    return TraceScores(
        name=name,
        requests=len(requests),
        rank_corr=spearman([float(r.input_length) for r in requests],
                           [float(r.output_length) for r in requests]),
        c_index=c_index,
        soon=soon,
        soon_share=statistics.fmean(finishes),
    )


def table(scores: Sequence[TraceScores], horizon: int) -> str:
    lines = [
        "| trace | requests | Spearman(prompt, output) | C-index: output so far | "
        "C-index: prompt decile + output so far | C-index: prompt 2^n bin + output so far | "
        "C-index: default cap | C-index: clairvoyant | "
        f"finishing within {horizon} tokens | AUC: output so far | "
        "AUC: prompt decile + output so far |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in scores:
        lines.append(
            f"| {s.name} | {s.requests:,} | {s.rank_corr:.3f} | "
            f"{s.c_index['output so far']:.3f} | {s.c_index['prompt + output so far']:.3f} | "
            f"{s.c_index['prompt 2^n + output so far']:.3f} | "
            f"{s.c_index['default cap']:.3f} | {s.c_index['clairvoyant']:.3f} | "
            f"{s.soon_share:.1%} | {s.soon['output so far']:.3f} | "
            f"{s.soon['prompt + output so far']:.3f} |")
    return "\n".join(lines) + "\n"


MIN_REQUESTS = 4


def _given_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The options that differ from the parser's defaults, as a command line gives them."""
    given = []
    for name in ("samples", "horizon", "max_model_len", "seed", "traces"):
        if getattr(args, name) != parser.get_default(name):
            given += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return given


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--traces", type=Path,
                        default=ROOT.parents[1].parent / "shared" / "traces")
    parser.add_argument("--samples", type=int, default=100_000,
                        help="scored moments and pairs per trace (default 100,000)")
    parser.add_argument("--horizon", type=int, default=32,
                        help="'finishing soon' means within this many tokens (default 32)")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-readme", action="store_true",
                        help="print the table only; leave README.md as it is")
    args = parser.parse_args(argv)
    if args.samples < 2 or args.horizon < 1 or args.max_model_len < 1:
        parser.error("--samples must be >= 2, --horizon and --max-model-len >= 1")
    scores = []
    for name in (CONV, CODE, MOON):
        try:
            requests = load_trace(args.traces / name)
        except TraceError as exc:  # names the file and what was expected, in one line
            print(f"predictability: error: {exc}", file=sys.stderr)
            return 2
        if len(requests) < MIN_REQUESTS:
            # Fitted on the first half, scored on the second: each needs requests.
            print(f"predictability: error: {args.traces / name}: {len(requests)} usable "
                  f"request(s), expected at least {MIN_REQUESTS} (half to fit, half to "
                  "score)", file=sys.stderr)
            return 2
        scores.append(score_trace(name, requests, samples=args.samples,
                                  horizon=args.horizon, max_model_len=args.max_model_len,
                                  seed=args.seed))
    text = table(scores, args.horizon)
    print(text, end="")
    if not args.no_readme:
        command = shlex.join([".venv/bin/python", "benchmarks/replay/predictability.py",
                              *_given_options(parser, args)])
        write_section("predictability", f"`{command}` (seed {args.seed}, "
                      f"{args.samples:,} samples per trace, horizon {args.horizon} tokens, "
                      f"max_model_len {args.max_model_len:,}):\n\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
