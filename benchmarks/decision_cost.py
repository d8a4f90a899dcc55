"""Decision cost: microseconds per ``select_victim`` through the controller, per strategy.

evaluation.md section 6 sets the method. The anchor is vLLM's own PRIORITY victim scan
(``max`` over the running requests with key ``(priority, arrival_time)``), timed in the same
run on the same candidates; the ratio to it is the portable figure (absolute microseconds
vary 2-4x across CPUs). vLLM's FCFS victim (``running.pop()``) is reported beside it.

Method: every timed function is warmed up (one untimed batch), then all the rows of one
candidate count are timed side by side: each of ``--repeat`` rounds times every row once
(200 calls), starting one row further along each round, and a row's figure is its best
round. Noise on a shared machine then hits the yardstick and the rows alike.

Three tables per requester kind:

* the policy's part: ``PolicyController.select_victim`` on a context built beforehand, the
  requester at a random position; bidkv again with the requester last but one (finding it
  by id costs most there) and with host facts (what the stock-vLLM adapter passes by
  default; a vLLM-HUST host passes none);
* the host's whole call (not with ``--no-host``): the stock-vLLM adapter's per-call path
  (``PolicySchedulerMixin._bidkv_select_victim``) on real vLLM ``Request`` objects with the
  same values: built-in choice, the contract's snapshot of the running list, controller,
  policy. BidKV runs there without host facts, as on a vLLM-HUST host (on the stock-vLLM
  adapter its default also walks every running request's blocks, not timed here);
* per-call p50 / p99 (``--samples`` single calls each, interleaved) against the budget of
  section 6: p50 <= 20 us and p99 <= 100 us per call at N = 1024;
* (not with ``--no-host``) the adapter's host facts, which it computes for a policy that
  asks (bidkv by default), on a real scheduler whose N running requests hold 100 blocks
  each.

Prints tables; asserts nothing.

    python benchmarks/decision_cost.py [--sizes 8,64,256,1024,2048] [--repeat 5]
                                       [--samples 1000] [--no-host]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import time
import timeit
from collections.abc import Callable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from bidkv_ext.config import BidKVConfig
from bidkv_ext.contract import (
    CandidateFacts,
    PreemptionCandidate,
    PreemptionContext,
    PreemptionContextFacts,
    candidate_index,
)
from bidkv_ext.controller import PolicyController
from bidkv_ext.selector import BidkvPreemptionPolicy

STRATEGIES = ["builtin", "lifo", "priority", "largest-first", "least-computed-first", "random",
              "shortest-remaining", "cost-aware", "sglang", "bidkv"]
NUMBER = 200  # calls per timed batch
FCFS = "vLLM FCFS pop (+ append back)"
YARDSTICK = "vLLM priority scan (yardstick)"
BUDGET_N = 1024
BUDGET_P50_US = 20.0
BUDGET_P99_US = 100.0

Timed = Callable[[], object]


def make_context(n: int, rng: random.Random, requester: str = "decoding",
                 at: int | None = None) -> PreemptionContext:
    """``n`` candidates; the requester at position ``at`` (default: a random one)."""
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
    i = rng.randrange(n) if at is None else at
    c = cands[i]
    if requester == "decoding":
        c = PreemptionCandidate(c.request_id, 0, c.arrival_time, c.num_prompt_tokens,
                                max(c.num_output_tokens, 1),
                                c.num_prompt_tokens + max(c.num_output_tokens, 1), 0, 2048)
    else:
        c = PreemptionCandidate(c.request_id, 0, c.arrival_time, 4000, 0, 1000, 0, 2048)
    cands[i] = c
    return PreemptionContext(tuple(cands), "fcfs", c.request_id, 0.98, 123.0, cands[-1].request_id)


def priority_scan(running: Sequence[Any]) -> Any:
    """vLLM's PRIORITY victim: the least urgent, then the latest arrival."""
    return max(running, key=lambda r: (r.priority, r.arrival_time))


def fcfs_pop(running: Sequence[Any]) -> Timed:
    """vLLM's FCFS victim, ``running.pop()``, on a copy; the append restores the list."""
    tail = list(running)
    return lambda: tail.append(tail.pop())


def best_us(fns: Mapping[str, Timed], repeat: int, number: int = NUMBER) -> dict[str, float]:
    """Best microseconds per call of every function, timed side by side (module doc)."""
    names = list(fns)
    for name in names:
        timeit.timeit(fns[name], number=number)  # warm-up, untimed
    best = dict.fromkeys(names, math.inf)
    for round_ in range(repeat):
        for k in range(len(names)):
            name = names[(round_ + k) % len(names)]
            best[name] = min(best[name], timeit.timeit(fns[name], number=number))
    return {name: best[name] / number * 1e6 for name in names}


def per_call_us(fns: Mapping[str, Timed], samples: int,
                chunk: int = 50) -> dict[str, tuple[float, float]]:
    """(p50, p99) microseconds of single calls, ``samples`` per function, interleaved in
    chunks so that every function sees the same machine (warm them up first)."""
    clock = time.perf_counter_ns
    names = list(fns)
    times: dict[str, list[int]] = {name: [] for name in names}
    while len(times[names[0]]) < samples:
        for name in names:
            fn, out = fns[name], times[name]
            for _ in range(min(chunk, samples - len(out))):
                start = clock()
                fn()
                out.append(clock() - start)
    return {name: (_quantile(times[name], 0.50), _quantile(times[name], 0.99))
            for name in names}


def _quantile(values: list[int], q: float) -> float:
    """Linear-interpolated quantile of nanosecond samples, in microseconds."""
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return (ordered[low] + (ordered[high] - ordered[low]) * (at - low)) / 1e3


def controller_for(strategy: str, **settings: Any) -> PolicyController:
    # Default settings; the repeated context never trips the liveness guard because no
    # victim is actually preempted between calls.
    config = BidKVConfig(enabled=True, strategy=strategy, **settings)
    return PolicyController(BidkvPreemptionPolicy(config))


TAIL = "bidkv, requester last but one"
FACTS = "bidkv, with the adapter's block facts"


def with_requester_at(context: PreemptionContext, at: int) -> PreemptionContext:
    """``context`` with the requester moved to position ``at``: the same candidates, the
    requester swapped with the one there (the built-in victim stays the tail)."""
    cands = list(context.candidates)
    i = candidate_index(cands, context.requesting_request_id)
    cands[i], cands[at] = cands[at], cands[i]
    return dataclasses.replace(context, candidates=tuple(cands),
                               builtin_victim_id=cands[-1].request_id)


def block_facts(context: PreemptionContext, block_size: int = 16) -> PreemptionContextFacts:
    """Host facts as the stock-vLLM adapter reports them for unshared, uncached blocks:
    every candidate's blocks are its own (``ceil(computed / block_size)``)."""
    facts = {}
    for c in context.candidates:
        blocks = -(-c.num_computed_tokens // block_size)
        facts[c.request_id] = CandidateFacts(blocks, 0, blocks)
    return PreemptionContextFacts(block_size, 0, facts)


def policy_rows(context: PreemptionContext) -> dict[str, Timed]:
    """The anchors and every strategy's controller call, on one context; bidkv also with
    the requester where finding it costs most, and with host facts."""
    running = context.candidates
    rows: dict[str, Timed] = {
        FCFS: fcfs_pop(running),
        YARDSTICK: lambda: priority_scan(running),
    }
    for name in STRATEGIES:
        controller = controller_for(name)
        rows[name] = lambda c=controller: c.select_victim(context)
    # The requester is found by a scan that checks the tail (the built-in victim) first,
    # then stops at the match: last but one is its longest.
    tail = with_requester_at(context, max(len(running) - 2, 0))
    controller = controller_for("bidkv")
    rows[TAIL] = lambda: controller.select_victim(tail)
    facts = block_facts(context)
    with_facts = controller_for("bidkv")
    rows[FACTS] = lambda: with_facts.select_victim(context, facts)
    return rows


def host_requests(context: PreemptionContext) -> list[Any]:
    """Real vLLM ``Request`` objects carrying the context's candidate values, in order."""
    # The first vLLM import of the run: the offline host sets VLLM_TARGET_DEVICE=cpu (when
    # unset) before vLLM settles its platform, which the host-facts table's engine needs.
    import bidkv_ext.hosts.vllm.offline  # noqa: F401

    # isort: split
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    requests = []
    for c in context.candidates:
        params = SamplingParams(ignore_eos=True, max_tokens=c.max_tokens)
        request = Request(c.request_id, [1] * c.num_prompt_tokens, params, None,
                          arrival_time=c.arrival_time, priority=c.priority)
        if c.num_output_tokens:
            request.append_output_token_ids([1] * c.num_output_tokens)
        request.num_computed_tokens = c.num_computed_tokens
        request.num_preemptions = c.num_preemptions
        requests.append(request)
    return requests


def host_call(requests: list[Any], context: PreemptionContext,
              controller: PolicyController) -> Timed:
    """One call of the adapter's per-decision path, on a stand-in for the scheduler that
    holds only what that path reads (running, policy, controller, KV usage, requests)."""
    from vllm.v1.core.sched.request_queue import SchedulingPolicy

    from bidkv_ext.hosts.vllm.scheduler import PolicySchedulerMixin

    by_id = {r.request_id: r for r in requests}
    host = SimpleNamespace(
        running=requests, policy=SchedulingPolicy.FCFS, controller=controller,
        kv_cache_manager=SimpleNamespace(usage=context.kv_cache_usage), requests=by_id,
    )
    requester = by_id[context.requesting_request_id]
    select = PolicySchedulerMixin._bidkv_select_victim
    return lambda: select(host, requester, context.now, 1)  # type: ignore[arg-type]


HOST_YARDSTICK = "vLLM priority scan on Requests (yardstick)"
HOST_ROWS = ("host, no policy", "host + builtin (abstains)",
             "host + bidkv{use_host_facts=false}")


def host_rows(context: PreemptionContext) -> dict[str, Timed]:
    requests = host_requests(context)
    return {
        HOST_YARDSTICK: lambda: priority_scan(requests),
        HOST_ROWS[0]: host_call(requests, context, PolicyController(None)),
        HOST_ROWS[1]: host_call(requests, context, controller_for("builtin")),
        HOST_ROWS[2]: host_call(requests, context,
                                controller_for("bidkv", use_host_facts=False)),
    }


FACTS_BLOCKS = 100  # blocks per running request in the host-facts table (1,600 tokens)
FACTS_ROW = "host facts (every block of every running request)"


def facts_rows(n: int) -> dict[str, Timed]:
    """The stock-vLLM adapter's host facts (``_host_facts``, what it computes for a policy
    that asks, bidkv by default) on a real scheduler and block pool holding ``n`` running
    requests of FACTS_BLOCKS blocks each."""
    from bidkv_ext.hosts.vllm import offline

    tokens = FACTS_BLOCKS * 16
    vllm_config, kv_cache_config = offline.build_vllm_config(
        num_gpu_blocks=n * (FACTS_BLOCKS + 2) + 2, max_num_seqs=n,
        max_num_batched_tokens=n * tokens, max_model_len=2 * tokens)
    scheduler: Any = offline.build_scheduler(
        vllm_config, kv_cache_config, preemption_policy="bidkv_ext.selector.BidkvPreemptionPolicy")
    for i in range(n):  # a shared 32-token prefix among every 7th, as prefix caching finds
        scheduler.add_request(offline.make_request(
            str(i), [1 + i % 7] * 32 + [i + 10] * (tokens - 32), max_tokens=64,
            arrival_time=float(i)))
    out = scheduler.schedule()
    scheduler.update_from_output(out, offline.runner_output_for(out, scheduler))
    requester = scheduler.running[n // 2]
    return {
        HOST_YARDSTICK: lambda: priority_scan(scheduler.running),
        FACTS_ROW: lambda: scheduler._host_facts(requester, 1),
    }


def _positive(text: str) -> int:
    """A whole number >= 1 (a context needs a requester; timeit needs a repeat)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


# More running requests than any engine schedules (vLLM's max_num_seqs is in the
# hundreds); beyond it building the contexts alone would exhaust memory.
MAX_SIZE = 65_536


def _sizes(text: str) -> list[int]:
    """Comma-separated candidate counts, each from 1 to MAX_SIZE, such as 8,64,256."""
    try:
        sizes = [_positive(part.strip()) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        sizes = []
    if not sizes or max(sizes) > MAX_SIZE:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated whole numbers from 1 to {MAX_SIZE:,} such as "
            f"8,64,256, got {text!r}")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=_sizes, default=[8, 64, 256, 1024, 2048],
                        help="comma-separated candidate counts (default 8,64,256,1024,2048)")
    parser.add_argument("--repeat", type=_positive, default=5,
                        help="timed rounds per row; a row's figure is its best (default 5)")
    parser.add_argument("--samples", type=_positive, default=1000,
                        help="single calls per row for p50/p99 (default 1000)")
    parser.add_argument("--no-host", action="store_true",
                        help="skip the host-path table (it imports vLLM)")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sizes: list[int] = args.sizes
    rng = random.Random(7)
    for kind in ("decoding", "prefilling"):
        contexts = {n: make_context(n, rng, kind) for n in sizes}
        print(f"\nRequester {kind}: the policy's part (controller call)\n")
        policy = {n: policy_rows(contexts[n]) for n in sizes}
        table({n: best_us(policy[n], args.repeat) for n in sizes}, sizes, YARDSTICK)
        host = {} if args.no_host else {n: host_rows(contexts[n]) for n in sizes}
        if host:
            print(f"\nRequester {kind}: the host's whole call (stock-vLLM adapter, real "
                  "Requests)\n")
            table({n: best_us(host[n], args.repeat) for n in sizes}, sizes, HOST_YARDSTICK)
        print(f"\nRequester {kind}: single calls, p50 / p99 µs (budget at N={BUDGET_N}: "
              f"p50 <= {BUDGET_P50_US:g}, p99 <= {BUDGET_P99_US:g})\n")
        percentiles = {}
        for n in sizes:
            rows = {YARDSTICK: policy[n][YARDSTICK], "bidkv": policy[n]["bidkv"],
                    TAIL: policy[n][TAIL]}
            if host:
                rows[HOST_ROWS[2]] = host[n][HOST_ROWS[2]]
            percentiles[n] = per_call_us(rows, args.samples)
        quantile_table(percentiles, sizes)
    if not args.no_host:
        print(f"\nHost facts (stock-vLLM adapter, real block pool, {FACTS_BLOCKS} blocks per "
              "request)\n")
        # One scheduler at a time: all of them alive at once (200,000 blocks at 2,048)
        # slowed every row down.
        table({n: best_us(facts_rows(n), args.repeat, number=5) for n in sizes}, sizes,
              HOST_YARDSTICK)


def table(results: Mapping[int, Mapping[str, float]], sizes: list[int], yardstick: str) -> None:
    print("| row | " + " | ".join(f"N={n} µs (x yardstick)" for n in sizes) + " |")
    print("|" + "---|" * (len(sizes) + 1))
    for name in results[sizes[0]]:
        cells = " | ".join(
            f"{results[n][name]:.1f} ({results[n][name] / results[n][yardstick]:.2f}x)"
            for n in sizes
        )
        print(f"| {name} | {cells} |")


def quantile_table(results: Mapping[int, Mapping[str, tuple[float, float]]],
                   sizes: list[int]) -> None:
    print("| row | " + " | ".join(f"N={n} p50 / p99 µs" for n in sizes) + " |")
    print("|" + "---|" * (len(sizes) + 1))
    for name in results[sizes[0]]:
        cells = " | ".join(f"{results[n][name][0]:.1f} / {results[n][name][1]:.1f}"
                           for n in sizes)
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
