"""Serving metrics of one arm, as defined in evaluation.md section 1.

* TTFT = first output token time - arrival; TPOT = (last - first) / (outputs - 1) for
  requests with at least two output tokens; E2E = last token time - arrival.
* Percentiles P50/P95/P99 with linear interpolation (numpy's default); mean TTFT too.
* Throughput = output tokens / makespan (first arrival -> last completion); also req/s.
* Recompute tax = recomputed tokens / all computed tokens (exact, from the step loop);
  the upper bound uses the victims' ``num_computed_tokens`` at preemption time instead.
* Preemptions per 1k = 1000 * preemption events / completed requests.
* Elastic capacity (only with a capacity schedule): the arm's ``capacity`` summary from
  :class:`~bidkv_ext.replay.capacity.ElasticPool` (time in shrink, overcommit, reserve).
* Goodput at SLO: completed requests with TTFT <= 2 s and TPOT <= 100 ms per makespan
  second (the TPOT bound is vacuous for one-token outputs), and the attainment fraction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from bidkv_ext.replay.engine import ArmRun, RequestOutcome

__all__ = ["SLO_TPOT_S", "SLO_TTFT_S", "arm_metrics", "percentiles"]

SLO_TTFT_S = 2.0
SLO_TPOT_S = 0.1


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """P50/P95/P99 (linear) and mean; ``None`` when there are no values."""
    if not values:
        return {"p50": None, "p95": None, "p99": None, "mean": None}
    arr = np.asarray(values, dtype=np.float64)
    p50, p95, p99 = np.percentile(arr, [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99), "mean": float(arr.mean())}


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def _latencies(done: Sequence[RequestOutcome]) -> tuple[list[float], list[float], list[float]]:
    ttft = [o.first_token - o.arrival for o in done]
    e2e = [o.finish - o.arrival for o in done]
    tpot = [t for o in done if (t := _tpot(o)) is not None]
    return ttft, tpot, e2e


def _tpot(o: RequestOutcome) -> float | None:
    """Seconds per output token after the first; ``None`` below two output tokens."""
    if o.output_tokens < 2:
        return None
    return (o.finish - o.first_token) / (o.output_tokens - 1)


def arm_metrics(run: ArmRun) -> dict[str, object]:
    """Everything the reports show for one arm (no wall-clock fields: see ``timing``)."""
    done = [o for o in run.outcomes if not math.isnan(o.finish)]
    ttft, tpot, e2e = _latencies(done)
    output_tokens = sum(o.output_tokens for o in done)
    start = min((o.arrival for o in run.outcomes), default=0.0)
    end = max((o.finish for o in done), default=start)
    makespan = end - start
    good = sum(1 for o in done if _meets_slo(o))
    metrics: dict[str, object] = {
        "label": run.label,
        "kind": run.kind,
        "reference": run.kind == "reference",
        "requests": len(run.outcomes),
        "completed": len(done),
        "output_tokens": output_tokens,
        "makespan_s": makespan,
        "steps": run.steps,
        "throughput_output_tok_s": _ratio(output_tokens, makespan),
        "throughput_req_s": _ratio(len(done), makespan),
        "ttft_s": percentiles(ttft),
        "tpot_s": percentiles(tpot),
        "e2e_s": percentiles(e2e),
        "computed_tokens": run.computed_tokens,
        "recomputed_tokens": run.recomputed_tokens,
        "recompute_tax": _ratio(run.recomputed_tokens, run.computed_tokens),
        "recompute_upper_bound_tokens": run.recompute_upper_bound,
        "recompute_tax_upper_bound": _ratio(run.recompute_upper_bound, run.computed_tokens),
        "preemptions": run.preemption_events,
        "preemptions_per_1k": _ratio(1000.0 * run.preemption_events, len(done)),
        "recomputed_tokens_per_preemption": _ratio(run.recomputed_tokens, run.preemption_events),
        "victims_per_pressure_step": _ratio(run.preemption_events, run.pressure_steps),
        # KV no request held, averaged over scheduler steps (vLLM's free count: a waiting
        # victim's cached blocks are in it until something evicts them).
        "kv_free_blocks_mean": _ratio(run.free_block_steps, run.steps),
        # Every victim comes back once per preemption (it must finish): returns == preemptions.
        "victim_returns": run.returns,
        "steps_to_return_mean": _ratio(run.return_steps, run.returns),
        "max_preemptions_one_request": max((o.preemptions for o in run.outcomes), default=0),
        "goodput_req_s": _ratio(good, makespan),
        "slo_attainment": _ratio(good, len(done)),
        "controller": dict(run.controller),
        "policy_config": dict(run.policy_config) if run.policy_config is not None else None,
        # Why the selector answered as it did: its decision counts (None for other policies).
        "policy_decisions": (
            dict(run.policy_decisions) if run.policy_decisions is not None else None
        ),
        "conservation": _conservation(run),
    }
    if run.capacity is not None:
        metrics["capacity"] = dict(run.capacity)
    return metrics


def _meets_slo(o: RequestOutcome) -> bool:
    """A completed request within the TTFT SLO and, past its first token, the TPOT SLO."""
    tpot = _tpot(o)
    return o.first_token - o.arrival <= SLO_TTFT_S and (tpot is None or tpot <= SLO_TPOT_S)


def _conservation(run: ArmRun) -> dict[str, object]:
    """Conservation checks: each request completed once, at its exact length; free blocks."""
    return {
        "all_completed_once": all(o.completions == 1 for o in run.outcomes),
        "exact_output_lengths": all(o.output_tokens == o.expected_output for o in run.outcomes),
        "free_blocks_end": run.free_blocks_end,
        "usable_blocks": run.usable_blocks,
    }
