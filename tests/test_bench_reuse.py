"""``run.py``/``headroom.py --reuse`` reads a saved report only when it stands for the
replay asked for now: the same arms, and every BidKV arm recorded with exactly the settings
this code resolves for it. A report made under an earlier default (the liveness threshold
was 4) or without recorded settings is replayed, never mixed into the medians.

``run.py slices`` turns per-slice reports into issue 8's figures; these are pinned here on
small hand-built arms whose expected figures are worked out in the comments: per-slice
ratios paired by slice against the better (lesser) of the peers on that slice, medians
(not means) over slices, the seeded bootstrap interval, the share of the best peer's gap
to the clairvoyant reference closed, evaluation.md's oracle-gap capture against builtin,
and every goal's threshold and its boundary (a figure exactly at its goal meets it)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "replay"))

import run  # noqa: E402

from bidkv_ext.config import BidKVConfig  # noqa: E402

ARGV = ["--trace", "t.csv", "--duration", "300", "--num-gpu-blocks", "600", "--start", "0",
        "--policies", "builtin,bidkv,bidkv{liveness_preemptions=4}"]


def _config(**overrides: object) -> dict[str, object]:
    # With the engine's facts, as the replay records them: block size, prefix caching and
    # the prefill chunk (the replay's default token budget, 8192).
    return BidKVConfig.from_sources({"bidkv": {"seed": 0, **overrides}}, {},
                                    block_size=16, prefix_caching=True,
                                    prefill_chunk_tokens=8192).model_dump()


def _arms(bidkv_liveness: int | None) -> list[dict[str, object]]:
    bidkv = None if bidkv_liveness is None else _config(
        enabled=True, strategy="bidkv", liveness_preemptions=bidkv_liveness)
    return [
        {"label": "builtin", "policy_config": _config(enabled=True, strategy="builtin",
                                                      liveness_preemptions=0)},
        {"label": "bidkv", "policy_config": bidkv},
        {"label": "bidkv{liveness_preemptions=4}",
         "policy_config": _config(enabled=True, strategy="bidkv", liveness_preemptions=4)},
    ]


@pytest.fixture(autouse=True)
def _no_bidkv_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The expected settings are resolved over the environment, as the replay does.
    for name in [n for n in os.environ if n.startswith("BIDKV_UTILITY_")]:
        monkeypatch.delenv(name)


TRACE_TEXT = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n"


def _argv(tmp_path: Path) -> list[str]:
    trace = tmp_path / "t.csv"
    if not trace.exists():
        trace.write_text(TRACE_TEXT)
    return [str(trace) if a == "t.csv" else a for a in ARGV]


def _saved(tmp_path: Path, arms: list[dict[str, object]], *,
           made_with: list[str] | None = None) -> Path:
    """A report as replay_arms leaves it: report.json (the arms, the trace's sha256) and
    the argv it was made with beside it."""
    argv = _argv(tmp_path)
    path = tmp_path / "report.json"
    sha = hashlib.sha256((tmp_path / "t.csv").read_bytes()).hexdigest()
    path.write_text(json.dumps({"trace": {"sha256": sha}, "arms": arms}))
    (tmp_path / run.ARGV_FILE).write_text(json.dumps(argv if made_with is None else made_with))
    return path


def test_a_current_report_is_reused(tmp_path: Path) -> None:
    assert run.stale_reason(_saved(tmp_path, _arms(8)), _argv(tmp_path)) is None


def test_a_report_made_with_other_options_or_another_trace_is_replayed(tmp_path: Path) -> None:
    """Every knob of the cell is in its argv: a report made with other blocks (or without
    the argv recorded, as before 2026-12-03) is replayed; so is one made from a trace whose
    content has changed since."""
    argv = _argv(tmp_path)
    other = [("700" if a == "600" else a) for a in argv]
    assert run.stale_reason(_saved(tmp_path, _arms(8), made_with=other), argv) == (
        "made with other (or unrecorded) options")
    report = _saved(tmp_path, _arms(8))
    (tmp_path / run.ARGV_FILE).unlink()
    assert run.stale_reason(report, argv) == "made with other (or unrecorded) options"
    # A damaged record (here nested past the JSON decoder's recursion limit) is no record.
    (tmp_path / run.ARGV_FILE).write_text("[" * 100_000)
    assert run.stale_reason(report, argv) == "made with other (or unrecorded) options"
    report = _saved(tmp_path, _arms(8))
    (tmp_path / "t.csv").write_text(TRACE_TEXT + "2023-11-16 18:15:47.00,10,5\n")
    run._sha256.cache_clear()
    assert run.stale_reason(report, argv) == "made from another version of the trace"


def test_a_report_the_replay_just_made_is_reused(tmp_path: Path) -> None:
    """End to end: what replay_arms writes (a real bidkv-replay run) is what a later
    ``--reuse`` accepts. The check rebuilt each BidKV arm's settings without the engine's
    token budget, so it judged every current report stale and silently replayed it."""
    argv = ["--trace", str(REPO / "src" / "bidkv_ext" / "replay" / "data" /
                           "azure_conv_sample.csv"),
            "--max-requests", "20", "--num-gpu-blocks", "400",
            "--policies", "builtin,bidkv"]
    out = tmp_path / "slice"
    run.replay_arms(argv, out, "the sample")
    assert run.stale_reason(out / "report.json", argv) is None


@pytest.mark.parametrize(
    ("arms", "why"),
    [
        (_arms(4), "bidkv was made with other (or unrecorded) settings"),  # the old default
        (_arms(None), "bidkv was made with other (or unrecorded) settings"),  # not recorded
        (_arms(8)[:2], "arms"),  # an arm missing
    ],
    ids=["old-default", "unrecorded", "missing-arm"],
)
def test_a_stale_report_is_replayed(tmp_path: Path, arms: list[dict[str, object]],
                                    why: str) -> None:
    reason = run.stale_reason(_saved(tmp_path, arms), _argv(tmp_path))
    assert reason is not None and why in reason


# --- run.py slices: the figures and goal checks -------------------------------------------

PC = run.Cell("c-pc", "t.csv", ("--duration", "300"))
NOPC = run.Cell("c-nopc", "t.csv", ("--duration", "300", "--no-prefix-caching"))


def _arm(label: str, tax: float, p95: float = 10.0, tps: float = 1000.0, p99: float = 100.0,
         worst: int = 0) -> dict[str, object]:
    return {"label": label, "recompute_tax": tax, "ttft_s": {"p95": p95, "p99": p99},
            "throughput_output_tok_s": tps, "max_preemptions_one_request": worst}


def _slice(*arms: dict[str, object]) -> dict[str, dict[str, object]]:
    return {str(a["label"]): a for a in arms}


def test_ratio_of_and_metric_of() -> None:
    assert run.ratio_of(0.0, 0.0) == 1.0  # both recomputed nothing: a tie
    assert run.ratio_of(0.125, 0.0) == float("inf")
    assert run.ratio_of(0.125, 0.5) == 0.25
    arm = _arm("x", 0.125, p95=2.0, tps=500.0, p99=3.0)
    assert [run.metric_of(arm, k) for k in ("tax", "p95", "p99", "throughput_output_tok_s")] \
        == [0.125, 2.0, 3.0, 500.0]


def test_paired_ratios_pair_by_slice_against_the_least_peer() -> None:
    runs = [_slice(_arm("builtin", 0.25), _arm("least-computed-first", 0.5), _arm("bidkv", 0.125)),
            _slice(_arm("builtin", 0.75), _arm("least-computed-first", 0.375),
                   _arm("bidkv", 0.375)),
            _slice(_arm("builtin", 1.0), _arm("least-computed-first", 0.75), _arm("bidkv", 0.5))]
    # slice 0: 0.125 / min(0.25, 0.5) = 0.5; slice 1: 0.375 / 0.375 = 1; slice 2: 0.5 / 0.75
    assert run.paired_ratios(runs, "tax", "bidkv", "builtin", "least-computed-first") \
        == pytest.approx([0.5, 1.0, 2 / 3])
    # one peer: slice by slice 0.125 / 0.25, 0.375 / 0.75, 0.5 / 1.0
    assert run.paired_ratios(runs, "tax", "bidkv", "builtin") == pytest.approx([0.5] * 3)


def test_bootstrap_interval_is_the_2_5_and_97_5_percentiles_of_resampled_medians() -> None:
    # A resample of 9 has median 1 when >= 5 of its draws are a 1 (p = 2/9 each):
    # C(9,5)(2/9)^5(7/9)^4 + C(9,6)(2/9)^6(7/9)^3 + ... ~= 0.025 + 0.0048 + 0.0006 ~= 0.030,
    # and likewise median 7 (~3 % of the 10,000 seeded resamples each). So the 2.5th and
    # 97.5th percentiles are 1 and 7; the 5th and 95th would be 2 and 6, and percentiles of
    # resampled means would lie strictly inside (1, 7).
    assert run._bootstrap_median([1, 1, 2, 3, 4, 5, 6, 7, 7]) == (1.0, 7.0)


def _row_runs() -> list[dict[str, dict[str, object]]]:
    return [
        _slice(_arm("builtin", 0.2, p95=10.0, worst=1), _arm("least-computed-first", 0.4, p95=8.0),
               _arm("bidkv", 0.1, p95=4.0, tps=990.0, worst=3)),
        _slice(_arm("builtin", 0.6, p95=20.0), _arm("least-computed-first", 0.3, p95=10.0),
               _arm("bidkv", 0.3, p95=10.0, tps=1000.0, worst=1)),
        _slice(_arm("builtin", 0.8, p95=30.0), _arm("least-computed-first", 1.0, p95=40.0),
               _arm("bidkv", 0.4, p95=8.0, tps=1200.0, worst=2)),
    ]


def test_slice_rows_show_medians_and_paired_ratio_columns() -> None:
    rows = run._slice_rows(PC, _row_runs())
    # builtin: median tax of 0.2, 0.6, 0.8 is 0.6; P95 10, 20, 30 -> 20; worst slice 1
    assert rows[0] == "| c-pc | builtin | 60.00% | 20.00 | 1000 | 1 | - | - | - |"
    # bidkv: median tax of 0.1, 0.3, 0.4 = 30 % (the mean would be 26.67 %); P95 of 4, 10, 8
    # -> 8; tok/s of 990, 1000, 1200 -> 1000; worst 3 (max over slices). Per slice
    # tax / LCF = 0.25, 1.0, 0.4 -> median 0.4 (mean 0.55); tax / builtin = 0.5 on every
    # slice; P95 / LCF = 0.5, 1.0, 0.2 -> 0.5. With 3 slices a resample's median is the
    # least value with p = 7/27 > 2.5 % (and the greatest likewise): the interval is
    # [min, max].
    assert rows[2] == ("| c-pc | bidkv | 30.00% | 8.00 | 1000 | 3 | 0.400 [0.250, 1.000] | "
                       "0.500 [0.500, 0.500] | 0.500 [0.200, 1.000] |")


def test_slice_goals_at_their_boundaries_are_met() -> None:
    # Every slice: bidkv's tax and P95 equal the best peer's (LCF's tax, builtin's P95):
    # ratios 1.0; the reference recomputes as much as the best peer: no slice has a gap to
    # close (n/a, not a yes or a no); throughput 990 / 1000 = 0.99. Capture vs builtin:
    # (0.5 - 0.25) / (0.5 - 0.25) = 1.
    one = _slice(_arm("builtin", 0.5, p95=8.0), _arm("least-computed-first", 0.25, p95=16.0),
                 _arm("bidkv", 0.25, p95=8.0, tps=990.0), _arm(run.ORACLE, 0.25))
    assert run._slice_goals(PC, [one] * 3) == (
        "- `c-pc`: tax / best peer 1.000 (goal <= 1.0): yes; "
        "P95 TTFT / best peer 1.000 (goal <= 1.0): yes; "
        "gap to clairvoyant closed n/a (the reference recomputes no less than the best "
        "peer in any slice); "
        "throughput / builtin 0.990 (goal >= 0.99): yes; "
        "oracle-gap capture vs builtin (evaluation.md) 1.00 over 3 of 3 slices")


def test_slice_goals_with_prefix_caching_pair_each_slice_with_its_best_peer() -> None:
    b, lcf, o = "builtin", "least-computed-first", run.ORACLE
    s0 = _slice(_arm(b, 0.5, p95=8.0), _arm(lcf, 0.75, p95=16.0, tps=500.0),
                _arm("bidkv", 0.375, p95=8.0), _arm(o, 0.25))
    runs = [
        s0,
        _slice(_arm(b, 1.0, p95=16.0), _arm(lcf, 0.5, p95=8.0, tps=500.0),
               _arm("bidkv", 0.375, p95=6.0, tps=980.0), _arm(o, 0.25)),
        _slice(_arm(b, 0.25, p95=10.0), _arm(lcf, 0.5, p95=20.0, tps=500.0),
               _arm("bidkv", 0.0625, p95=5.0, tps=990.0), _arm(o, 0.375)),
        s0,
    ]
    # tax / min(builtin, LCF) per slice: 0.375/0.5, 0.375/0.5, 0.0625/0.25, 0.375/0.5
    #   = 0.75, 0.75, 0.25, 0.75 -> median 0.75 (mean 0.625)
    # P95 / min: 8/8, 6/8, 5/10, 8/8 = 1, 0.75, 0.5, 1 -> median 0.875 (p99 is 100 everywhere)
    # gap closed = (best - bidkv) / (best - clairvoyant): (0.5-0.375)/(0.5-0.25) = 0.5,
    #   (0.5-0.375)/(0.5-0.25) = 0.5, slice 2 has no gap (0.375 > 0.25): left out; 0.5 ->
    #   median of 3 = 0.5, exactly the goal
    # throughput / builtin: 1, 0.98, 0.99, 1 -> 0.995 (against LCF it would be ~1.99)
    # capture vs builtin = (builtin - bidkv) / (builtin - clairvoyant): 0.125/0.25 = 0.5,
    #   0.625/0.75 = 0.833, none on slice 2 (no gap), 0.5 -> median of 3 = 0.5 (mean 0.61)
    assert run._slice_goals(PC, runs) == (
        "- `c-pc`: tax / best peer 0.750 (goal <= 1.0): yes; "
        "P95 TTFT / best peer 0.875 (goal <= 1.0): yes; "
        "gap to clairvoyant closed 0.50 over 3 of 4 slices (goal >= 0.5): yes; "
        "throughput / builtin 0.995 (goal >= 0.99): yes; "
        "oracle-gap capture vs builtin (evaluation.md) 0.50 over 3 of 4 slices")


def test_slices_without_a_gap_do_not_count_towards_closing_it() -> None:
    """Six slices where the reference is no better than the best peer (bidkv ties it) and
    four where it is better and bidkv closes none of the gap: 0.00 over 4 of 10, NO. The
    old median counted each gapless slice as 1.0 and printed "1.00: yes"."""
    b, lcf, o = "builtin", "least-computed-first", run.ORACLE
    tie = _slice(_arm(b, 0.5), _arm(lcf, 0.5), _arm("bidkv", 0.5), _arm(o, 0.5))
    gap = _slice(_arm(b, 0.5), _arm(lcf, 0.5), _arm("bidkv", 0.5), _arm(o, 0.25))
    assert run._gap_goal([tie] * 6 + [gap] * 4) == (
        "gap to clairvoyant closed 0.00 over 4 of 10 slices (goal >= 0.5): NO")


@pytest.mark.parametrize(("oracle_tax", "bidkv_tax", "mark"), [
    (0.5, 0.5, "n/a"),     # the reference recomputes as much as the best peer: no gap
    (0.625, 0.5, "n/a"),   # ... or more (the README's conv-pc-moderate window)
    (0.25, 0.375, "yes"),  # half of the gap 0.5 -> 0.25 closed
    (0.25, 0.4375, "NO"),  # a quarter of it
])
def test_the_comparison_suite_marks_a_gapless_window_not_applicable(
    oracle_tax: float, bidkv_tax: float, mark: str
) -> None:
    """``run.py comparison``'s goal line said "closes half the gap to clairvoyant: yes"
    whenever the reference recomputed no less than the best peer and bidkv matched the best
    peer: there was no gap, so nothing was closed. It says "n/a" there now, as the slices
    suite's median already leaves such slices out."""
    b, lcf = "builtin", "least-computed-first"
    arms = _slice(_arm(b, 0.5), _arm(lcf, 0.75), _arm("bidkv", bidkv_tax),
                  _arm(run.ORACLE, oracle_tax))
    line = run._goals(PC, arms, prefix_caching=True)
    assert f"closes half the gap to clairvoyant: {mark};" in line, line


def test_slice_headline_takes_the_better_peer_per_metric_and_direction() -> None:
    """evaluation.md's other headline metrics: per slice bidkv over the better of builtin
    and LCF on that metric, the lower for latencies and preemptions, the higher for
    goodput (the least would call a goodput loss a tie with the worse peer)."""
    b, lcf = "builtin", "least-computed-first"

    def arm(label: str, p99: float, tpot: float, goodput: float, preemptions: int
            ) -> dict[str, object]:
        return {**_arm(label, 0.1, p99=p99), "tpot_s": {"p99": tpot},
                "goodput_req_s": goodput, "preemptions": preemptions}

    runs = [_slice(arm(b, 8.0, 0.02, 2.0, 10), arm(lcf, 4.0, 0.04, 1.0, 20),
                   arm("bidkv", 4.0, 0.03, 1.5, 25))] * 3
    assert run._slice_headline(PC, runs) == (
        "- `c-pc`: P99 TTFT 1.000 [1.000, 1.000]; P99 TPOT 1.500 [1.500, 1.500]; "
        "goodput 0.750 [0.750, 0.750]; preemptions 2.500 [2.500, 2.500]")


def test_slice_goals_without_prefix_caching() -> None:
    b, lcf = "builtin", "least-computed-first"
    runs = [
        _slice(_arm(b, 1.0, p95=4.0), _arm(lcf, 0.5, p95=8.0),
               _arm("bidkv", 0.4375, p95=6.0, tps=985.0)),
        _slice(_arm(b, 0.75, p95=4.0), _arm(lcf, 0.5, p95=8.0),
               _arm("bidkv", 0.4375, p95=6.0, tps=985.0)),
        _slice(_arm(b, 0.5, p95=4.0), _arm(lcf, 0.25, p95=8.0),
               _arm("bidkv", 0.265625, p95=6.0, tps=985.0)),
    ]
    # tax / LCF: 0.875, 0.875, 1.0625 -> 0.875 (> 0.85); tax / builtin: 0.4375, 0.583,
    # 0.53125 -> 0.53125 (> 0.5); P95 / LCF 6/8 = 0.75 (against builtin 1.5); throughput
    # 985 / 1000 = 0.985 (< 0.99)
    assert run._slice_goals(NOPC, runs) == (
        "- `c-nopc`: tax / LCF 0.875 (goal <= 0.85): NO; "
        "tax / builtin 0.531 (goal <= 0.5): NO; "
        "P95 TTFT / LCF 0.750 (goal <= 1.0): yes; "
        "throughput / builtin 0.985 (goal >= 0.99): NO")


def test_single_window_goals_at_their_boundaries_are_met() -> None:
    # bidkv's tax = LCF's 0.25, P95 = builtin's 8, throughput 990 = 0.99 x 1000. Without
    # the clairvoyant arm there is no gap line at all (as in _slice_goals).
    arms = _slice(_arm("builtin", 0.5, p95=8.0), _arm("least-computed-first", 0.25, p95=16.0),
                  _arm("bidkv", 0.25, p95=8.0, tps=990.0))
    assert run._goals(PC, arms, True) == (
        "- `c-pc`: tax <= best peer: yes; P95 TTFT <= best peer: yes; "
        "throughput >= 0.99x builtin: yes")
    # With it, at 0.125: half the gap is at 0.25 - 0.0625 = 0.1875; bidkv at exactly that.
    arms = _slice(*arms.values(), _arm(run.ORACLE, 0.125))
    arms["bidkv"]["recompute_tax"] = 0.1875
    assert run._goals(PC, arms, True) == (
        "- `c-pc`: tax <= best peer: yes; P95 TTFT <= best peer: yes; "
        "closes half the gap to clairvoyant: yes; throughput >= 0.99x builtin: yes")


def test_single_window_goals_missed() -> None:
    b, lcf = "builtin", "least-computed-first"
    # best peer tax 0.25 (LCF), reference 0.125: half the gap is at 0.25 - 0.0625 = 0.1875;
    # bidkv's 0.21875 is below the best peer but short of that. P95 12 > builtin's 8 (the
    # better peer); 980 < 0.99 x 1000.
    arms = _slice(_arm(b, 0.5, p95=8.0), _arm(lcf, 0.25, p95=16.0),
                  _arm("bidkv", 0.21875, p95=12.0, tps=980.0), _arm(run.ORACLE, 0.125))
    assert run._goals(PC, arms, True) == (
        "- `c-pc`: tax <= best peer: yes; P95 TTFT <= best peer: NO; "
        "closes half the gap to clairvoyant: NO; throughput >= 0.99x builtin: NO")
    # without prefix caching: 0.21875 > 0.85 x 0.25 = 0.2125 and > 0.5 x 0.40625 = 0.203125;
    # P95 12 <= LCF's 16 (builtin's 8 is not the peer here)
    arms = _slice(_arm(b, 0.40625, p95=8.0), _arm(lcf, 0.25, p95=16.0),
                  _arm("bidkv", 0.21875, p95=12.0, tps=980.0))
    assert run._goals(NOPC, arms, False) == (
        "- `c-nopc`: tax <= 0.85x LCF: NO; tax <= 0.5x builtin: NO; P95 TTFT <= LCF: yes; "
        "throughput >= 0.99x builtin: NO")


def test_capture_against_builtin() -> None:
    arms = _slice(_arm("builtin", 0.5, p95=5.0, p99=20.0), _arm("bidkv", 0.3125, p95=5.0, p99=14.0))
    ref = _arm(run.ORACLE, 0.25, p95=5.0, p99=8.0)
    # (builtin - bidkv) / (builtin - ref): tax 0.1875 / 0.25 = 0.75; P99 6 / 12 = 0.5
    assert run.capture(arms, ref, "tax") == 0.75
    assert run.capture(arms, ref, "p99") == 0.5
    assert run.capture(arms, _arm("x", 0.5), "tax") is None  # ref no better: nothing to capture
    arms[run.ORACLE] = ref
    # floor: tax (0.5 - 0.3125) / (0.5 - 0.125) = 0.5; its P99 equals builtin's: n/a
    floor = _arm("no pressure", 0.125, p95=5.0, p99=20.0)
    assert run._captures(arms, floor) == (
        "oracle-gap capture tax 0.75; recovered tax 0.50; "
        "oracle-gap capture P99 TTFT 0.50; recovered P99 TTFT n/a")


def test_a_rollout_horizon_width_or_sample_count_of_its_own_names_its_own_reports() -> None:
    """``headroom.py --reuse`` finds reports by their folder tag: a rollout with another
    horizon, width or number of sampled futures must not be tagged (and its README section
    named) as the standard one, or reports made at one horizon would be re-rendered as
    another's. None of the three is in the replay's argv (the workers read them from the
    environment), so the tag is all --reuse can tell them by."""
    import headroom

    def variant(**kw: object) -> str:
        args = dict(suite="rollout", objective="tax", samples=0, known=0.0,
                    horizon=headroom.STANDARD_HORIZON, width=headroom.STANDARD_WIDTH)
        args.update(kw)
        return headroom._variant(SimpleNamespace(**args))

    assert variant() == ""
    assert variant(horizon=5.0) == "-horizon5"
    assert variant(width=1) == "-width1"
    assert variant(horizon=5.0, width=1, samples=2) == "-sampled-horizon5-width1"
    assert variant(samples=headroom.STANDARD_SAMPLES) == "-sampled"  # the README's sections
    assert variant(samples=4) == "-sampled4"
    assert variant(suite="pc", horizon=5.0) == ""  # only the rollout suites read them


@pytest.mark.parametrize(("argv", "says"), [
    (["slices", "--cells", "code-heavy,typo"], "--cells: typo not among slices's cells"),
    (["slices", "--cells", "code-heavy"], "--cells runs part of the suite: add --no-write"),
    (["comparison", "--reuse", "--no-write"],
     "--reuse applies to slices only; comparison always replays"),
    (["slices", "--traces", "/nonexistent", "--no-write"],
     "--traces /nonexistent: no azure_llm_2023_code.csv, azure_llm_2023_conv.csv, "
     "mooncake_fast25_conversation.jsonl; expected the shared traces folder"),
])
def test_run_refuses_bad_options_before_any_replay(argv: list[str], says: str) -> None:
    """``run.py --cells`` used to drop unknown names without a word and then replace the
    README's whole section with the cells that were left; ``--reuse`` outside ``slices``
    was ignored (a full run started); a traces folder missing a trace failed only after
    every other replay of the suite had run."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "replay" / "run.py"), *argv],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1].startswith(f"run.py: error: {says}")
