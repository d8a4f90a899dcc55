"""``bidkv-replay`` through the real vLLM 0.33.0 scheduler (skips only without vLLM).

Guards: conservation (every request completes exactly once with exactly its trace output
length, no KV block leaks, every victim back once per preemption) under real preemption
for several arms; byte-identical ``report.json`` for the same seed; metrics taken from the
scheduler's real events equal hand-computed values on a 5-request trace (idle KV
included); with prefix caching off every position is executed once plus exactly the
recomputed ones; the headline ratios (recompute tax, preemptions per 1k, victims per
pressure step) follow from those counts; the clairvoyant arm is marked a reference.
Also: the step-time model's inputs (prompt chunks are prefill, a decode is charged its
context); a step that only preempted keeps the clock (no jump, no "cannot make progress")
and progress counts one update per completed request; one run's outputs (terminal table
and outputs line, exactly three files with ``--no-plots`` in a directory made with its
parents, arms in command-line order, timing.json's wall seconds and speed, report.md's
table and header facts, the trace record, the progress bar's total); the table's cells
(ms/s, each percentile from its own field, counters, "-" for a missing speed or TPOT);
the TTFT CDF is fed each request's TTFT.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.conftest import HAVE_VLLM

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (real-scheduler tier)")

from bidkv_ext.replay.cli import main  # noqa: E402
from bidkv_ext.replay.trace import load_trace  # noqa: E402

PRESSURE = ["--max-requests", "60", "--num-gpu-blocks", "300", "--no-plots", "--no-progress"]


def _replay(tmp_path: Path, name: str, *args: str) -> dict[str, Any]:
    out = tmp_path / name
    assert main([*args, "--output-dir", str(out)]) == 0
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report


@pytest.fixture(scope="module")
def pressured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("pressure")
    return _replay(tmp, "a", *PRESSURE, "--no-prefix-caching",
                   "--policies", "builtin,least-computed-first,bidkv,clairvoyant")


def test_conservation_under_preemption(pressured: dict[str, Any]) -> None:
    assert pressured["trace"]["requests"] == 60
    for arm in pressured["arms"]:
        c = arm["conservation"]
        assert arm["completed"] == 60
        assert c["all_completed_once"] and c["exact_output_lengths"], arm["label"]
        assert c["free_blocks_end"] == c["usable_blocks"] == 299
        assert arm["preemptions"] > 0
        assert arm["controller"]["calls"] == arm["preemptions"]
        # Each preemption is answered by exactly one return, at least one step later.
        assert arm["victim_returns"] == arm["preemptions"], arm["label"]
        assert arm["steps_to_return_mean"] >= 1.0


def test_every_position_executed_once_plus_recompute(pressured: dict[str, Any]) -> None:
    from bidkv_ext.replay.cli import SAMPLE_TRACE

    rows = load_trace(SAMPLE_TRACE)[:60]
    positions = sum(r.input_length + r.output_length - 1 for r in rows)
    for arm in pressured["arms"]:
        # Without prefix caching nothing is skipped: computed = each position once + redo,
        # and the upper bound (computed tokens at preemption) is exact.
        assert arm["computed_tokens"] == positions + arm["recomputed_tokens"], arm["label"]
        assert arm["recompute_upper_bound_tokens"] == arm["recomputed_tokens"]
        assert arm["output_tokens"] == sum(r.output_length for r in rows)


def test_headline_ratios_follow_the_counts(pressured: dict[str, Any]) -> None:
    """evaluation.md section 1 on every pressured arm: recompute tax = recomputed / computed
    tokens (both pinned by the test above), preemptions per 1k = 1000 x preemptions /
    completed requests, recomputed tokens per preemption, and at least one victim per
    pressure step (no more victims than preemptions)."""
    for arm in pressured["arms"]:
        assert arm["recomputed_tokens"] > 0, arm["label"]
        assert arm["recompute_tax"] == pytest.approx(
            arm["recomputed_tokens"] / arm["computed_tokens"]), arm["label"]
        assert arm["preemptions_per_1k"] == pytest.approx(1000 * arm["preemptions"] / 60)
        assert arm["recomputed_tokens_per_preemption"] == pytest.approx(
            arm["recomputed_tokens"] / arm["preemptions"])
        assert 1.0 <= arm["victims_per_pressure_step"] <= arm["preemptions"]
        assert 1 <= arm["max_preemptions_one_request"] <= arm["preemptions"]


def test_arms_are_labelled_and_counted(pressured: dict[str, Any]) -> None:
    arms = {a["label"]: a for a in pressured["arms"]}
    assert arms["builtin"]["controller"]["abstentions"] == arms["builtin"]["controller"]["calls"]
    assert arms["least-computed-first"]["controller"]["selections"] > 0
    assert arms["bidkv"]["controller"]["policy_name"] == "bidkv_ext.selector.BidkvPreemptionPolicy"
    reference = arms["clairvoyant (reference)"]
    assert reference["reference"] is True and reference["kind"] == "reference"
    assert not arms["bidkv"]["reference"]


def test_report_states_the_policy_versions(pressured: dict[str, Any]) -> None:
    """evaluation.md §5.6: every claim states policy versions. The report carries this
    package's version and, per selector arm, the BidKV settings it ran with (so a report
    made under another default cannot pass for a current one); other policies have none."""
    from bidkv_ext import __version__

    assert pressured["host"]["bidkv_ext_version"] == __version__
    arms = {a["label"]: a for a in pressured["arms"]}
    bidkv = arms["bidkv"]["policy_config"]
    assert bidkv["strategy"] == "bidkv" and bidkv["enabled"] is True
    assert bidkv["liveness_preemptions"] == 8 and bidkv["prefix_caching"] is False
    assert arms["least-computed-first"]["policy_config"]["strategy"] == "least-computed-first"
    assert arms["clairvoyant (reference)"]["policy_config"] is None


def test_report_carries_the_selectors_decision_counts(
    pressured: dict[str, Any], tmp_path: Path
) -> None:
    """Each selector arm's decision counts (BidkvPreemptionPolicy.decision_stats) agree with
    its controller's counters: every call named a victim, was left to the strategy's
    abstention or was a barrier. bidkv sums its r (at least one block per victim named);
    other strategies score no r; the reference arm is no selector. A tight liveness budget
    shows the guard's decisions in the counts."""
    arms = {a["label"]: a for a in pressured["arms"]}
    tight = _replay(tmp_path, "tight", *PRESSURE, "--num-gpu-blocks", "150",
                    "--no-prefix-caching",
                    "--policies", "bidkv{liveness_preemptions=1}")["arms"][0]
    for arm in (arms["builtin"], arms["least-computed-first"], arms["bidkv"], tight):
        d, c = arm["policy_decisions"], arm["controller"]
        assert d["selections"] == c["selections"], arm["label"]
        assert d["strategy_abstentions"] + d["barrier_decisions"] == c["abstentions"]
        assert d["liveness_epochs"] == d["barrier_decisions"]
    assert arms["builtin"]["policy_decisions"]["strategy_abstentions"] > 0
    assert arms["least-computed-first"]["policy_decisions"]["useful_blocks"] is None
    bidkv = arms["bidkv"]["policy_decisions"]
    assert bidkv["useful_blocks"] >= bidkv["selections"] > 0
    assert tight["policy_decisions"]["liveness_reselections"] > 0
    assert arms["clairvoyant (reference)"]["policy_decisions"] is None


def test_same_seed_gives_byte_identical_json(tmp_path: Path) -> None:
    args = [*PRESSURE, "--policies", "random,bidkv", "--seed", "7"]
    for name in ("one", "two"):
        _replay(tmp_path, name, *args)
    first = (tmp_path / "one" / "report.json").read_bytes()
    assert first == (tmp_path / "two" / "report.json").read_bytes()
    assert json.loads(first)["arms"][0]["preemptions"] > 0


FIVE = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2023-11-16 18:00:00.0000000,10,1\n"
    "2023-11-16 18:00:00.0000000,10,2\n"
    "2023-11-16 18:00:00.0000000,10,3\n"
    "2023-11-16 18:00:00.0000000,10,4\n"
    "2023-11-16 18:00:02.5000000,10,2\n"
)


def test_five_requests_match_hand_computed_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bidkv_ext.replay import report as report_module

    plotted: list[Any] = []
    write_plots = report_module.write_plots

    def recording(out: Path, runs: Any, arms: Any) -> None:
        plotted.append(runs)
        write_plots(out, runs, arms)

    monkeypatch.setattr(report_module, "write_plots", recording)
    trace = tmp_path / "five.csv"
    trace.write_text(FIVE)
    model = tmp_path / "unit.json"
    model.write_text(json.dumps({"name": "unit", "a": 1.0, "b": 0, "c": 0, "d": 0}))
    report = _replay(tmp_path, "out", "--trace", str(trace), "--step-model", str(model),
                     "--num-gpu-blocks", "64", "--policies", "builtin", "--no-progress")
    (arm,) = report["arms"]
    # One simulated second per step. Step 1 prefills requests 0-3 (first tokens at t=1;
    # request 0 done). Steps 2-3 decode; request 4 arrives at 2.5 and is prefilled in step 4
    # (t=3->4) beside request 3's last decode; step 5 decodes request 4 (done at t=5).
    assert arm["steps"] == 5
    assert arm["completed"] == 5 and arm["output_tokens"] == 12
    assert arm["makespan_s"] == 5.0
    assert arm["throughput_output_tok_s"] == pytest.approx(12 / 5)
    assert arm["throughput_req_s"] == pytest.approx(1.0)
    assert arm["computed_tokens"] == 50 + 7 and arm["recomputed_tokens"] == 0
    assert arm["preemptions"] == 0 and arm["preemptions_per_1k"] == 0
    assert arm["victim_returns"] == 0 and arm["steps_to_return_mean"] == 0
    # Idle KV after each step's scheduling: 63 usable blocks, one per running request
    # (<= 14 tokens each); steps hold 4, 3, 2, 2 (requests 3 and 4) and 1 block.
    assert arm["kv_free_blocks_mean"] == pytest.approx((59 + 60 + 61 + 61 + 62) / 5)
    ttft, tpot, e2e = arm["ttft_s"], arm["tpot_s"], arm["e2e_s"]
    # TTFT = [1, 1, 1, 1, 1.5]; E2E = [1, 2, 3, 4, 2.5]; every TPOT is 1 s.
    assert ttft == pytest.approx({"p50": 1.0, "p95": 1.4, "p99": 1.48, "mean": 1.1})
    assert e2e == pytest.approx({"p50": 2.5, "p95": 3.8, "p99": 3.96, "mean": 2.5})
    assert tpot == pytest.approx({"p50": 1.0, "p95": 1.0, "p99": 1.0, "mean": 1.0})
    # SLO TTFT <= 2 s holds for all, TPOT <= 100 ms only for the one-token request.
    assert arm["slo_attainment"] == pytest.approx(0.2)
    # Goodput: that one request over the 5 s makespan; nothing preempted or recomputed.
    assert arm["goodput_req_s"] == pytest.approx(1 / 5)
    assert arm["recompute_tax"] == 0 and arm["max_preemptions_one_request"] == 0
    assert arm["victims_per_pressure_step"] == 0
    # The TTFT CDF plots each request's TTFT.
    assert plotted == [[("builtin", pytest.approx([1.0, 1.0, 1.0, 1.0, 1.5]))]]
    assert (tmp_path / "out" / "ttft_cdf.png").stat().st_size > 0
    assert (tmp_path / "out" / "bars.png").stat().st_size > 0
    assert "| builtin |" in (tmp_path / "out" / "report.md").read_text()


class _Progress:
    def __init__(self) -> None:
        self.updates: list[int] = []

    def update(self, n: int = 1) -> None:
        self.updates.append(n)


def _run_arm(requests: tuple[Any, ...], arm: Any, step_model: Any, progress: Any = None,
             **settings: Any) -> Any:
    from bidkv_ext.replay.engine import ReplaySettings, run_arm

    return run_arm(requests, arm, ReplaySettings(enable_prefix_caching=False, **settings),
                   step_model, progress=progress)


def test_step_time_charges_prefill_chunks_and_decode_context() -> None:
    """The step-time model's inputs (steptime.py): a prompt chunk that emits nothing and a
    last prompt chunk of one position are prefill tokens; a decode is a request scheduled
    for one position after having produced output, with its context length (positions
    attended to, the new one included)."""
    from bidkv_ext.replay.arms import named_arm
    from bidkv_ext.replay.steptime import StepTimeModel
    from bidkv_ext.replay.trace import TraceRequest

    model = StepTimeModel("probe", a=1.0, b=0.01, c=0.1, d=0.001)
    # A 17-token prompt under a 16-token budget: chunk of 16 (t = 1.16), chunk of 1 that
    # emits the first token (t = 2.17), then decodes over 18 and 19 positions.
    run = _run_arm((TraceRequest(0, 0.0, 17, 3),), named_arm("builtin", 0), model,
                   num_gpu_blocks=8, max_num_seqs=16, max_num_batched_tokens=16)
    (outcome,) = run.outcomes
    assert run.steps == 4 and run.computed_tokens == 19
    assert outcome.first_token == pytest.approx(2 * 1.0 + 17 * 0.01)
    assert outcome.finish == pytest.approx(4 * 1.0 + 17 * 0.01 + 2 * 0.1 + (18 + 19) * 0.001)


class _SelfVictim:
    """Preempts the request that asked for blocks, whatever else is running."""

    def select_victim(self, context: Any) -> str | None:
        return str(context.requesting_request_id)


def test_a_step_that_only_preempts_keeps_the_clock() -> None:
    """A step that schedules nothing because its only decision was a preemption (the first
    running request preempts itself; vLLM admits nothing in a step that preempted) is not
    "nothing can be scheduled": the next step runs at the same time, with no clock jump
    and no "cannot make progress" error, also when it happens again later in the replay."""
    from bidkv_ext.replay.arms import Arm
    from bidkv_ext.replay.steptime import StepTimeModel
    from bidkv_ext.replay.trace import TraceRequest

    # Two identical groups, at t=0 and t=20, on 3 usable blocks: a 16-token prompt (one
    # full block) and two 4-token prompts take all three. In each group's second step the
    # first request needs a second block and preempts itself; the others then decode for
    # 7 steps (done at +8 s) and it returns for its last two tokens (done at +10 s).
    shape = ((16, 3), (4, 8), (4, 8))
    requests = tuple(TraceRequest(3 * g + j, 20.0 * g, inp, out)
                     for g in range(2) for j, (inp, out) in enumerate(shape))
    arm = Arm("self-victim", "class", lambda _lengths: _SelfVictim())
    progress = _Progress()
    run = _run_arm(requests, arm, StepTimeModel("unit", a=1.0, b=0.0, c=0.0, d=0.0),
                   num_gpu_blocks=4, progress=progress)
    assert progress.updates == [1] * 6  # one per completed request
    assert run.steps == 22 and run.preemption_events == 2 and run.pressure_steps == 2
    assert [(o.first_token, o.finish, o.preemptions) for o in run.outcomes] == [
        (1.0, 10.0, 1), (1.0, 8.0, 0), (1.0, 8.0, 0),
        (21.0, 30.0, 1), (21.0, 28.0, 0), (21.0, 28.0, 0)]
    assert run.returns == 2 and run.return_steps == 2 * (10 - 2)


# Mooncake rows (milliseconds); the last executes 100 + 14 - 1 = 113 positions (its last
# output token is never fed back) = 8 blocks of 16, one position more than 7 usable blocks
# hold, and is removed before the replay.
MOONCAKE = "".join(
    json.dumps({"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": [i]})
    + "\n" for i, (ts, inp, out) in enumerate([(0, 16, 1), (0, 16, 2), (1000, 16, 3),
                                                (2000, 100, 14)]))


class _Bar:
    """Stands in for tqdm: records the total, the arm labels and the updates."""

    made: ClassVar[list[_Bar]] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs, self.labels, self.updates = kwargs, [], []
        _Bar.made.append(self)

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def set_postfix_str(self, label: str) -> None:
        self.labels.append(label)

    def update(self, n: int = 1) -> None:
        self.updates.append(n)


def test_outputs_of_a_run_in_arm_order_without_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What one run writes: the terminal table (header, rule, one row per arm) and the
    outputs line on stdout; with ``--no-plots`` exactly report.json, timing.json and
    report.md (no PNG, no probe or temporary file) in a directory created with its parents;
    arms in command-line order everywhere;
    timing.json holds per arm the wall seconds and the simulated seconds per wall second
    (makespan / wall), and report.md's table shows that speed; the trace record (format,
    rows, rows in the window, requests removed for the KV pool) and the run's settings;
    the progress bar counts one unit per request and arm."""
    trace = tmp_path / "four.jsonl"
    trace.write_text(MOONCAKE)
    out = tmp_path / "new" / "out"  # created with its parents
    import tqdm

    _Bar.made = []
    monkeypatch.setattr(tqdm, "tqdm", _Bar)
    assert main(["--trace", str(trace), "--num-gpu-blocks", "8", "--no-prefix-caching",
                 "--policies", "least-computed-first,builtin", "--seed", "3", "--no-plots",
                 "--no-progress", "--output-dir", str(out)]) == 0
    stdout = capsys.readouterr().out.splitlines()
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md", "timing.json"]
    report = json.loads((out / "report.json").read_text())
    labels = ["least-computed-first", "builtin"]
    assert [a["label"] for a in report["arms"]] == labels
    # The progress bar: one unit per request and arm, one update per completed request.
    (bar,) = _Bar.made
    assert bar.kwargs["total"] == 6 and bar.kwargs["disable"] is True
    assert bar.labels == labels and bar.updates == [1] * 6
    assert report["seed"] == 3 and report["settings"]["enable_prefix_caching"] is False
    assert {k: report["trace"][k] for k in ("format", "rows", "rows_in_window", "requests",
                                            "filtered_kv_capacity", "attribution")} == {
        "format": "mooncake", "rows": 4, "rows_in_window": 4, "requests": 3,
        "filtered_kv_capacity": 1, "attribution": None}

    timing = json.loads((out / "timing.json").read_text())
    assert sorted(timing) == ["simulated_seconds_per_wall_second", "wall_seconds"]
    walls, speeds = timing["wall_seconds"], timing["simulated_seconds_per_wall_second"]
    assert list(walls) == list(speeds) == sorted(labels)  # sort_keys
    for arm in report["arms"]:
        wall = walls[arm["label"]]
        assert 0 < wall < 60
        assert speeds[arm["label"]] == pytest.approx(arm["makespan_s"] / wall)

    start = next(i for i, line in enumerate(stdout) if line.startswith("policy "))
    header, rule, *rows = stdout[start:start + 4]
    assert set(rule.replace(" ", "")) == {"-"} and len(rule) == len(header)
    assert [row.split()[0] for row in rows] == labels
    assert rows[1].split()[-1] == f"{speeds['builtin']:.1f}"
    assert stdout[start + 4] == (f"outputs: {out}/ (report.json, timing.json, report.md)")

    markdown = (out / "report.md").read_text()
    md_rows = [line for line in markdown.splitlines() if line.startswith("| ")][1:3]
    assert [row.split(" | ")[0] for row in md_rows] == ["| " + label for label in labels]
    assert md_rows[1].endswith(f" | {speeds['builtin']:.1f} |")
    assert "prefix caching off, seed 3." in markdown
    assert f"sha256 `{report['trace']['sha256'][:16]}…`" in markdown
    assert "Trace attribution" not in markdown


def test_terminal_table_cells() -> None:
    """The table's cells on a hand-built run: latencies under a second in ms, from a second
    on in s with two decimals; TTFT P50/P95/P99, TPOT P99 and E2E P99 each from its own
    percentile; controller counters as calls/selections/abstentions; a missing speed is
    "-", and no TPOT sample (one-token outputs only) is "-" too."""
    from bidkv_ext.replay.engine import ArmRun, RequestOutcome
    from bidkv_ext.replay.metrics import arm_metrics
    from bidkv_ext.replay.report import format_table, markdown_table

    def arm(label: str, *outcomes: tuple[float, float, int]) -> dict[str, object]:
        return arm_metrics(ArmRun(
            label=label, kind="builtin",
            outcomes=tuple(RequestOutcome(str(i), 0.0, first, finish, tokens, tokens, 0, 1)
                           for i, (first, finish, tokens) in enumerate(outcomes)),
            steps=3, computed_tokens=10, recomputed_tokens=1, recompute_upper_bound=2,
            preemption_events=1, pressure_steps=1,
            controller={"calls": 5, "selections": 3, "abstentions": 2},
            free_blocks_end=9, usable_blocks=9, wall_seconds=0.0))

    # TTFT [0.5, 1, 2], TPOT [0.2, 0.6], E2E [0.7, 1.6, 2].
    hand = arm("hand", (0.5, 0.7, 2), (1.0, 1.6, 2), (2.0, 2.0, 1))
    ones = arm("ones", (0.25, 0.25, 1))
    table = format_table([hand, ones], {"hand": 12.34})
    _, rule, row, other = (line.split() for line in table.splitlines())
    assert set("".join(rule)) == {"-"}
    assert row == ["hand", "3", "2", "1.00s", "1.90s", "1.98s", "596ms", "1.99s", "10.00%",
                   "20.00%", "333.3", "0", "0.50", "5/3/2", "12.3"]
    assert other[:8] == ["ones", "1", "4", "250ms", "250ms", "250ms", "-", "250ms"]
    assert other[-1] == "-"
    markdown = markdown_table([hand, ones], {"hand": 12.34}).splitlines()
    assert markdown[1] == "|" + "|".join(["---"] * 15) + "|"
    assert markdown[2] == "| " + " | ".join(row) + " |"
