"""Decision cost: microseconds per ``select_victim`` through the controller, per strategy.

The yardstick, measured in the same run, is vLLM's own PRIORITY victim scan: ``max`` over the
running requests with key ``(priority, arrival_time)``. The ratio to it is the portable
figure (absolute microseconds vary 2-4x across CPUs). Prints a table; asserts nothing.

    python benchmarks/decision_cost.py [--sizes 8,64,256,1024] [--repeat 5]
"""

from __future__ import annotations

import argparse
import random
import timeit
from collections.abc import Callable

from bidkv_ext.config import BidKVConfig
from bidkv_ext.contract import PreemptionCandidate, PreemptionContext
from bidkv_ext.controller import PolicyController
from bidkv_ext.selector import BidkvPreemptionPolicy

STRATEGIES = ["builtin", "lifo", "priority", "largest-first", "least-computed-first", "random",
              "shortest-remaining", "cost-aware", "sglang", "bidkv"]


def make_context(n: int, rng: random.Random, requester: str = "decoding") -> PreemptionContext:
    cands = []
    for i in range(n):
        prompt = rng.randint(50, 4000)
        out = rng.randint(0, 600)
        computed = prompt + out - (0 if rng.random() < 0.8 else rng.randint(0, prompt))
        cands.append(PreemptionCandidate(
            f"req-{i}", 0, 1.7e9 + i * 0.01, prompt, out, max(computed, 0),
            1 if rng.random() < 0.05 else 0, 2048,
        ))
    # The requester: a decoding request (needs one block; the common case), or one in the
    # middle of a long prefill (needs a whole chunk of blocks).
    i = rng.randrange(n)
    c = cands[i]
    if requester == "decoding":
        c = PreemptionCandidate(c.request_id, 0, c.arrival_time, c.num_prompt_tokens,
                                max(c.num_output_tokens, 1),
                                c.num_prompt_tokens + max(c.num_output_tokens, 1), 0, 2048)
    else:
        c = PreemptionCandidate(c.request_id, 0, c.arrival_time, 4000, 0, 1000, 0, 2048)
    cands[i] = c
    return PreemptionContext(tuple(cands), "fcfs", c.request_id, 0.98, 123.0, cands[-1].request_id)


def best_us(fn: Callable[[], object], repeat: int) -> float:
    number = 200
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def _positive(text: str) -> int:
    """A whole number >= 1 (a context needs a requester; timeit needs a repeat)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _sizes(text: str) -> list[int]:
    """Comma-separated candidate counts, each >= 1, such as 8,64,256."""
    try:
        return [_positive(part.strip()) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated whole numbers >= 1 such as 8,64,256, got {text!r}"
        ) from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=_sizes, default=[8, 64, 256, 1024],
                        help="comma-separated candidate counts (default 8,64,256,1024)")
    parser.add_argument("--repeat", type=_positive, default=5)
    args = parser.parse_args()
    sizes: list[int] = args.sizes
    rng = random.Random(7)
    for kind in ("decoding", "prefilling"):
        print(f"\nRequester {kind}:\n")
        contexts = {n: make_context(n, rng, kind) for n in sizes}
        table(contexts, sizes, args.repeat)


def table(contexts: dict[int, PreemptionContext], sizes: list[int], repeat: int) -> None:
    rows: dict[str, list[float]] = {}
    yard = []
    for n in sizes:
        running = contexts[n].candidates
        yard.append(best_us(lambda r=running: max(r, key=lambda c: (c.priority, c.arrival_time)),
                            repeat))
    for name in STRATEGIES:
        # Default settings; the repeated context never trips the liveness guard because no
        # victim is actually preempted between calls.
        config = BidKVConfig(enabled=True, strategy=name)
        rows[name] = []
        for n in sizes:
            controller = PolicyController(BidkvPreemptionPolicy(config))
            context = contexts[n]
            rows[name].append(best_us(lambda c=controller, x=context: c.select_victim(x),
                                      repeat))
    header = "| strategy | " + " | ".join(f"N={n} µs (x yardstick)" for n in sizes) + " |"
    print(header)
    print("|" + "---|" * (len(sizes) + 1))
    print("| vLLM priority scan (yardstick) | "
          + " | ".join(f"{y:.1f} (1.00x)" for y in yard) + " |")
    for name, values in rows.items():
        cells = " | ".join(f"{v:.1f} ({v / y:.2f}x)" for v, y in zip(values, yard, strict=True))
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
