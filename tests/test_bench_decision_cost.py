"""``benchmarks/decision_cost.py`` measures what evaluation.md section 6 asks for.

Guarded behaviour:

* every row of one candidate count is warmed up, then timed side by side with the
  yardstick (each round times every row, in rotating order), so that the published ratio
  is measured in one run on one machine state rather than minutes apart;
* the report has vLLM's FCFS ``pop`` beside the PRIORITY scan, every strategy, and the
  per-call p50 / p99 against the section's budget;
* the default sizes cover the anchor (1,024) and the section's curve up to 2,048;
* the host-path rows run the stock-vLLM adapter's real per-call code on real vLLM
  ``Request`` objects and hand the policy exactly the candidates the policy-only rows use,
  so both tables time the same candidate set.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import decision_cost

from bidkv_ext.contract import CandidateFacts, PreemptionContext
from bidkv_ext.controller import PolicyController


def test_rows_are_warmed_up_then_timed_side_by_side() -> None:
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("yard", "a", "b")}
    result = decision_cost.best_us(fns, repeat=3, number=1)
    assert set(result) == {"yard", "a", "b"}
    assert all(v >= 0.0 for v in result.values())
    warm_up, rounds = calls[:3], calls[3:]
    assert warm_up == ["yard", "a", "b"]
    # Each round times every row once, starting one row further along each round.
    assert rounds == ["yard", "a", "b", "a", "b", "yard", "b", "yard", "a"]


def test_per_call_quantiles_interleave_and_count_samples() -> None:
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("x", "y")}
    result = decision_cost.per_call_us(fns, samples=5, chunk=2)
    assert calls == ["x", "x", "y", "y", "x", "x", "y", "y", "x", "y"]
    for p50, p99 in result.values():
        assert 0.0 <= p50 <= p99


def test_quantile_interpolates_linearly() -> None:
    assert decision_cost._quantile([1000, 2000, 3000, 4000], 0.5) == 2.5
    assert decision_cost._quantile([1000, 2000], 0.99) == pytest.approx(1.99)


def test_default_sizes_cover_the_anchor_and_the_spec_curve() -> None:
    sizes = decision_cost.build_parser().parse_args([]).sizes
    assert decision_cost.BUDGET_N in sizes
    assert max(sizes) >= 2048 and 64 in sizes


@pytest.mark.parametrize("sizes", ["9999999999999", "8,,64", "0"])
def test_sizes_beyond_any_engine_or_malformed_are_refused(
    sizes: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A size far beyond any engine's running list used to start building a context that
    never finished; it is an argparse error, as a malformed list is."""
    with pytest.raises(SystemExit) as exited:
        decision_cost.build_parser().parse_args(["--sizes", sizes])
    assert exited.value.code == 2
    assert "expected comma-separated whole numbers from 1 to 65,536" in capsys.readouterr().err


def test_report_has_both_anchors_every_strategy_and_the_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    decision_cost.main(["--sizes", "8,48", "--repeat", "1", "--samples", "3", "--no-host"])
    out = capsys.readouterr().out
    for kind in ("decoding", "prefilling"):
        assert f"Requester {kind}: the policy's part" in out
    rows = [line.split(" | ")[0].lstrip("| ") for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| row")]
    for name in (decision_cost.FCFS, decision_cost.YARDSTICK, *decision_cost.STRATEGIES,
                 decision_cost.TAIL, decision_cost.FACTS):
        assert rows.count(name) >= 2, name
    assert "p50 <= 20, p99 <= 100" in out
    assert "| N=8 p50 / p99 µs | N=48 p50 / p99 µs |" in out
    assert "host" not in out  # --no-host skips the vLLM table


class _Recorder:
    """A contract policy that records the context it is handed and picks candidate 0."""

    def __init__(self) -> None:
        self.seen: list[PreemptionContext] = []

    def select_victim(self, context: PreemptionContext) -> str | None:
        self.seen.append(context)
        return context.candidates[0].request_id


@pytest.mark.parametrize("kind", ["decoding", "prefilling"])
def test_host_path_hands_the_policy_the_same_candidates(kind: str) -> None:
    context = decision_cost.make_context(64, random.Random(3), kind)
    requests = decision_cost.host_requests(context)
    recorder = _Recorder()
    victim = decision_cost.host_call(requests, context, PolicyController(recorder))()
    assert recorder.seen[0] == context
    assert victim is requests[0]
    # The yardstick on real Requests picks the same victim as on the candidates.
    assert (decision_cost.priority_scan(requests).request_id
            == decision_cost.priority_scan(context.candidates).request_id)


def test_host_path_bidkv_chooses_as_the_policy_only_rows() -> None:
    context = decision_cost.make_context(256, random.Random(5), "prefilling")
    requests = decision_cost.host_requests(context)
    expected = decision_cost.controller_for("bidkv").select_victim(context)
    controller = decision_cost.controller_for("bidkv", use_host_facts=False)
    victim = decision_cost.host_call(requests, context, controller)()
    assert victim.request_id == expected
    assert controller.stats.selections == 1


@pytest.mark.parametrize("at", [0, 31, 62])
def test_the_tail_row_moves_only_the_requester(at: int) -> None:
    """The worst-case row times the same candidates with the requester moved (swapped with
    the one at ``at``) and the built-in victim still the tail; the facts row gives every
    candidate its own blocks, as the adapter reports unshared, uncached ones."""
    context = decision_cost.make_context(64, random.Random(5), "prefilling")
    moved = decision_cost.with_requester_at(context, at)
    assert sorted(moved.candidates, key=str) == sorted(context.candidates, key=str)
    assert moved.candidates[at].request_id == context.requesting_request_id
    assert moved.requesting_request_id == context.requesting_request_id
    assert moved.builtin_victim_id == moved.candidates[-1].request_id
    facts = decision_cost.block_facts(context)
    for c in context.candidates:
        blocks = -(-c.num_computed_tokens // 16)
        assert facts.facts[c.request_id] == CandidateFacts(blocks, 0, blocks)


def test_the_host_facts_row_times_the_adapters_facts_on_a_real_block_pool() -> None:
    """The host-facts row times the adapter's real ``_host_facts``: facts for every running
    request of a real scheduler, the shared prefix seen as shared blocks."""
    rows = decision_cost.facts_rows(12)
    facts = rows[decision_cost.FACTS_ROW]()
    assert len(facts.facts) == 12  # type: ignore[attr-defined]
    assert all(f.total_blocks == decision_cost.FACTS_BLOCKS  # type: ignore[attr-defined]
               for f in facts.facts.values())  # type: ignore[attr-defined]
    assert any(f.exclusive_blocks < f.total_blocks  # type: ignore[attr-defined]
               for f in facts.facts.values())  # type: ignore[attr-defined]


def test_the_readme_command_runs_in_a_shell_without_vllm_settings(tmp_path: Path) -> None:
    """benchmarks/README.md runs ``python benchmarks/decision_cost.py`` as it is. Without
    ``VLLM_TARGET_DEVICE`` in the environment the host rows imported vLLM first, so vLLM
    settled on no platform and the host-facts table's engine failed ("Failed to infer
    device type") after every other table had printed. A real subprocess, so vLLM's
    platform is settled afresh."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    environment = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    done = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "decision_cost.py"), "--sizes", "8",
         "--repeat", "1", "--samples", "3"],
        env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"| {decision_cost.FACTS_ROW} |" in done.stdout
