"""Guards the qualification behaviour a hand-run mutation audit found unguarded (a mutant
of stats, verdict, figures, profile, release, report, procedure or rollback that the
qualification suite let pass; its release-check cases are in
tests/test_qualification_release.py). Each test names the rule it holds, from qualification.md,
qualification/README.md or the module's own docstring:

- an empty cell and a NaN delta give NaN intervals (no ZeroDivisionError, no infinite
  bounds); a cell without pairs never passes its gates;
- the gates: a started arm with an error, or fewer completions than requests, fails
  "no failed or starved"; a cancel-cell arm without a drain measurement fails the drain
  gate; TP ranks outside 0..tp-1 do not stand in for missing ones; an unknown enabled
  flag is not "enabled";
- an ``extra`` figure reported by only one arm still gets a (NaN) delta; a boolean is not
  a figure; a negative integer past float's range is -inf;
- a zero-latency request does not break the serve figures;
- profiles: repeats 1 to 1000, directory names without ``..`` or ``\\``, environment names
  not starting with a digit, ports up to 65535, and the spec's workload defaults;
- report.md: the gate summary, the verdict row's columns and CI order, n/a for NaN, the
  procedure section and its notes, exact counter totals (a counter past float's range
  used to crash the report with OverflowError), the short hash and the model;
- procedure: the 64 KiB snapshot bound, a non-zero exit with its last stderr line, a
  ``comm`` holding ``)``, what counts as carrying the policy environment, the bounded
  process tree and values, and the arm-relative log path;
- rollback: only ``policy=builtin enabled=False`` lines verify the fallback.
"""

from __future__ import annotations

import json
import math
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from qualification.client import RequestResult
from qualification.errors import QualificationError
from qualification.evidence import counters_from_evidence
from qualification.figures import serve_figures
from qualification.procedure import (
    SNAPSHOT_LIMIT,
    log_facts,
    policy_environment,
    snapshot_device,
)
from qualification.profile import PROFILE_DIR, Profile, load_profile
from qualification.report import gate_summary, procedure_notes, write_markdown
from qualification.rollback import verify_fallback
from qualification.stats import summarize_deltas
from qualification.verdict import ArmResult, CellOutcome, Pair, evaluate_cell
from tests.verdict_helpers import arm_result

REPO = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------- verdict helpers


def _pairs(n: int = 3, base: Mapping[str, Any] | None = None,
           cand: Mapping[str, Any] | None = None) -> list[Pair]:
    return [
        Pair("cell", r, "baseline", arm_result("baseline", **(base or {})),
             arm_result("candidate", **(cand or {})))
        for r in range(n)
    ]


def _gate(pairs: list[Pair], name: str, *, bound: float | None = None, tp: int = 1) -> str:
    outcome = evaluate_cell("cell", pairs, cancel_bound_s=bound, tensor_parallel_size=tp)
    return next(g.status for g in outcome.gates if g.name == name)


# ---------------------------------------------------------------- stats and verdict


def test_a_cell_without_pairs_is_inconclusive_with_nan_intervals_and_fails_its_gates() -> None:
    """qualification.md §7 rule 1 (fewer than 3 pairs) for a cell whose pairs never ran:
    classified, not a ZeroDivisionError from an empty mean, and never 'gates passed'
    (the report lists it as failed)."""
    outcome = evaluate_cell("cell", [], cancel_bound_s=None, tensor_parallel_size=1)
    assert outcome.label == "inconclusive"
    assert not outcome.gates_passed
    thr = outcome.deltas["throughput"]
    assert thr.n == 0 and math.isnan(thr.mean) and math.isnan(thr.low)
    summary = gate_summary([outcome])
    assert summary["passed"] is False
    assert summary["failed_cells"] == ["cell"]
    assert summary["failures"] == ["cell: no pairs ran"]


@pytest.mark.parametrize("deltas", [[math.nan], [1.0, math.nan, 2.0]])
def test_a_nan_delta_leaves_the_whole_interval_undefined(deltas: list[float]) -> None:
    """stats.summarize_deltas: a pair without a ratio (zero baseline) makes mean and both
    bounds NaN, never an 'unbounded' [-inf, +inf] interval that reads as computed."""
    s = summarize_deltas(deltas)
    assert s.n == len(deltas)
    assert all(math.isnan(v) for v in (s.mean, s.low, s.high, s.half_width))


def test_fewer_completions_than_requests_fail_the_failed_or_starved_gate() -> None:
    """§6 gate 2: a request that never completed is failed or starved even when the arm
    counted neither."""
    assert _gate(_pairs(cand={"completed": 3}), "no-failed-or-starved") == "fail"


def test_a_started_arm_with_an_error_fails_the_failed_or_starved_gate() -> None:
    """README: a replay that exits non-zero, even after writing its report, fails that
    arm; its figures may look complete, so the error alone must fail the gate."""
    pairs = _pairs(base={"error": "bidkv-replay exited 1"})
    assert _gate(pairs, "no-failed-or-starved") == "fail"


def test_a_cancel_cell_arm_without_a_drain_measurement_fails_the_drain_gate() -> None:
    """§6 gate 3 holds in every repeat, both arms: an arm that never showed the engine
    drained (no measurement) does not pass."""
    assert _gate(_pairs(), "cancellation-drains", bound=1.0) == "fail"
    assert _gate(_pairs(base={"drain_s": 0.5}, cand={"drain_s": 0.5}),
                 "cancellation-drains", bound=1.0) == "pass"
    assert _gate(_pairs(base={"drain_s": 0.5}), "cancellation-drains", bound=1.0) == "fail"


def test_a_rank_outside_the_tp_group_does_not_stand_in_for_a_missing_one() -> None:
    """§6 gate 5: TP ranks 0..tp-1 must all be seen; ranks 1..4 under TP 4 miss rank 0."""
    seen = {"graph_captured": True, "tp_ranks": (1, 2, 3, 4)}
    assert _gate(_pairs(base=seen, cand=seen), "graph-capture-and-tp-ranks", tp=4) == "fail"
    full = {"graph_captured": True, "tp_ranks": (0, 1, 2, 3)}
    assert _gate(_pairs(base=full, cand=full), "graph-capture-and-tp-ranks", tp=4) == "pass"


def test_an_unknown_enabled_flag_is_not_an_enabled_policy() -> None:
    """§6 gate 8: the policy enabled (gauge = 1) in the candidate; no gauge, evidence or
    log line saying so (None) fails like False does."""
    assert _gate(_pairs(cand={"policy_enabled": None}), "policy-enabled-and-invoked") == "fail"


def test_an_extra_figure_reported_by_one_arm_still_gets_a_delta() -> None:
    """verdict.Pair.metrics: every EXTRA_DELTA_METRICS figure *either* arm reports gets a
    delta (NaN when the other arm lacks it), so the record shows it was not comparable."""
    pairs = _pairs(cand={"extra": {"recompute_tax": 0.2}})
    assert "recompute_tax" in pairs[0].metrics()
    assert math.isnan(pairs[0].delta("recompute_tax"))
    outcome = evaluate_cell("cell", pairs, cancel_bound_s=None, tensor_parallel_size=1)
    assert math.isnan(outcome.deltas["recompute_tax"].mean)


def test_a_boolean_is_not_a_figure_and_a_huge_negative_integer_is_minus_infinity() -> None:
    """verdict.Pair.delta: NaN when an arm does not report the figure as a number (a JSON
    true is not 1.0); an integer past float's range keeps its sign."""
    flags = _pairs(base={"extra": {"goodput_rps": True}}, cand={"extra": {"goodput_rps": True}})
    assert math.isnan(flags[0].delta("goodput_rps"))
    huge = _pairs(base={"extra": {"recompute_tax": 5.0}},
                  cand={"extra": {"recompute_tax": -(10**400)}})
    assert huge[0].delta("recompute_tax") == -math.inf


def test_a_zero_latency_request_does_not_break_the_serve_figures() -> None:
    """figures.serve_figures: NaN where a figure has no data, never an error; a request
    whose latency reads 0 s has no output rate to weigh in Jain fairness."""
    results = [
        RequestResult(0, True, 200, 0.0, 0.0, 0.0, 1, "x"),
        RequestResult(1, True, 200, 0.0, 1.0, 2.0, 11, "x"),
        RequestResult(2, True, 200, 0.0, 1.0, 2.0, 11, "x"),
    ]
    figures = serve_figures(results, makespan_s=10.0)
    assert figures["jain_fairness"] == pytest.approx(1.0)
    assert figures["goodput_rps"] == pytest.approx(0.3)


# ---------------------------------------------------------------- profiles


def _replay_profile() -> dict[str, Any]:
    return tomllib.loads((PROFILE_DIR / "cpu-replay.toml").read_text(encoding="utf-8"))


def test_repeats_range_from_1_to_1000() -> None:
    """README: ``--repeats N`` (pairs per cell, 1 to 1000); a profile's repeats alike."""
    assert Profile.model_validate({**_replay_profile(), "repeats": 1000}).repeats == 1000
    with pytest.raises(ValidationError, match="repeats"):
        Profile.model_validate({**_replay_profile(), "repeats": 1001})


@pytest.mark.parametrize("name", ["..", "a\\b"])
def test_a_cell_name_must_be_one_directory_name(name: str) -> None:
    """README: a profile's and each cell's name is a directory name: printable, without
    '/' or '\\', and not '.' or '..'."""
    data = _replay_profile()
    data["cells"] = [{**data["cells"][0], "name": name}]
    with pytest.raises(ValidationError, match="one directory name"):
        Profile.model_validate(data)


def test_an_environment_name_starting_with_a_digit_is_refused() -> None:
    """profile._environment: letters, digits and '_', not starting with a digit."""
    data = _replay_profile()
    data["replay"] = {**data["replay"], "environment": {"1BIDKV": "x"}}
    with pytest.raises(ValidationError, match="not starting with a digit"):
        Profile.model_validate(data)


def test_a_port_above_65535_is_refused(tmp_path: Path) -> None:
    """A TCP port is at most 65535; the profile fails on load, before any server starts."""
    text = (PROFILE_DIR / "cuda.toml").read_text(encoding="utf-8")
    path = tmp_path / "p.toml"
    path.write_text(text.replace("port = 8000", "port = 65536"), encoding="utf-8")
    with pytest.raises(QualificationError, match=r"server\.port"):
        load_profile(str(path))
    path.write_text(text.replace("port = 8000", "port = 65535"), encoding="utf-8")
    assert load_profile(str(path)).server is not None


def test_an_unspecified_workload_gets_the_spec_defaults(tmp_path: Path) -> None:
    """qualification.md §1, §3, §7: a profile of one's own that leaves them out runs
    temperature 0, seed 7, ignore_eos, a 16-token warm-up, 2,048 output tokens at
    concurrency 4, FULL_DECODE_ONLY graphs captured at 1/2/4/8, and 3 pairs per cell."""
    path = tmp_path / "mine.toml"
    path.write_text(
        'name = "mine"\nkind = "serve"\naccelerator = "cuda"\nmodel = "m"\n'
        'host_version_range = ">=0.28"\n[server]\n[[cells]]\nname = "c"\n'
        "paragraph_repeats = [1]\n",
        encoding="utf-8",
    )
    profile = load_profile(str(path))
    w, cell, server = profile.workload, profile.cells[0], profile.server
    assert server is not None
    assert (w.temperature, w.seed, w.ignore_eos, w.warmup_max_tokens) == (0.0, 7, True, 16)
    assert (cell.max_tokens, cell.concurrency) == (2048, 4)
    assert (server.graph_mode, server.cudagraph_capture_sizes) == ("FULL_DECODE_ONLY",
                                                                  (1, 2, 4, 8))
    assert profile.repeats == 3


# ---------------------------------------------------------------- report


def _record(outcomes: list[CellOutcome], blocked: list[str] | None = None) -> dict[str, object]:
    return {
        "profile": {"name": "lane", "host_version_range": ">=0.33", "accelerator": "cuda",
                    "model": "org/The-Model", "tensor_parallel_size": 1,
                    "execution_mode": "graph"},
        "host": {"version": "0.33.0", "commit": None},
        "extension": {"id": "org.vllm-hust.bidkv", "version": "1.2.3", "commit": None},
        "gate": gate_summary(outcomes),
        "created_at": "2026-10-01T00:00:00+00:00",
        "blocked_cells": blocked or [],
    }


def _report(tmp_path: Path, outcomes: list[CellOutcome]) -> str:
    path = tmp_path / "report.md"
    write_markdown(path, _record(outcomes), outcomes)
    return path.read_text(encoding="utf-8")


def _row(text: str, cell: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"| {cell} | "))


def test_the_gate_summary_names_only_failing_cells_and_never_passes_empty() -> None:
    """A run passes only with at least one cell and no gate failure; ``failed_cells``
    lists the cells whose gates failed and no other."""
    good = evaluate_cell("good", _pairs(), cancel_bound_s=None, tensor_parallel_size=1)
    bad = evaluate_cell("bad", _pairs(cand={"tracebacks": 2}, base={"tracebacks": 0}),
                        cancel_bound_s=None, tensor_parallel_size=1)
    assert gate_summary([])["passed"] is False
    summary = gate_summary([good, bad])
    assert summary["passed"] is False
    assert summary["failed_cells"] == ["bad"]
    assert gate_summary([good]) == {"passed": True, "failures": [], "failed_cells": []}


def test_the_verdict_row_shows_throughput_then_p95_latency_with_ordered_intervals(
    tmp_path: Path,
) -> None:
    """report.md's verdict table (qualification.md §8): the throughput and the P95
    *latency* deltas, each as mean [low, high], the gate status and the verdict; the
    header names the lane's model."""
    pairs = [
        Pair("cell", r, "baseline", arm_result("baseline"),
             arm_result("candidate", throughput=thr, p95=p95, ttft_p95=0.5))
        for r, (thr, p95) in enumerate([(110.0, 9.0), (112.0, 9.5), (115.0, 9.2)])
    ]
    outcome = evaluate_cell("cell", pairs, cancel_bound_s=None, tensor_parallel_size=1)
    failing = evaluate_cell("broken", _pairs(cand={"tracebacks": 1}, base={"tracebacks": 0}),
                            cancel_bound_s=None, tensor_parallel_size=1)
    text = _report(tmp_path, [outcome, failing])
    thr, lat = outcome.deltas["throughput"], outcome.deltas["latency_p95"]
    assert thr.low < thr.high and lat.low < lat.high
    row = _row(text, "cell")
    assert (f"| {thr.mean:+.2f} [{thr.low:+.2f}, {thr.high:+.2f}] "
            f"| {lat.mean:+.2f} [{lat.low:+.2f}, {lat.high:+.2f}] | pass | **beneficial** |"
            ) in row
    assert _row(text, "broken").endswith("| FAIL | **gate-failed** |")
    assert "model `org/The-Model`" in text


def test_a_delta_without_a_value_reads_n_a(tmp_path: Path) -> None:
    """report._fmt: a NaN figure (a zero baseline) is written ``n/a``, not ``nan``."""
    outcome = evaluate_cell("cell", _pairs(base={"throughput": 0.0}),
                            cancel_bound_s=None, tensor_parallel_size=1)
    row = _row(_report(tmp_path, [outcome]), "cell")
    assert "n/a [n/a, n/a]" in row and "nan" not in row


def test_the_raw_table_shows_each_arm_short_hash(tmp_path: Path) -> None:
    """report.md's raw figures name each arm's short-output hash (the §6 gate 1 input)."""
    pairs = _pairs(base={"short_hash": "h-base"}, cand={"short_hash": "h-base"})
    text = _report(tmp_path, [evaluate_cell("cell", pairs, cancel_bound_s=None,
                                            tensor_parallel_size=1)])
    raw = text.split("## Raw figures per repeat")[1]
    assert raw.count("| h-base |") == 6


def test_the_procedure_section_names_a_candidate_without_its_environment(
    tmp_path: Path,
) -> None:
    """README "Procedure facts": report.md's "Per-arm procedure" section appears when any
    arm recorded its procedure (an arm that never started records none), and the notes
    name the candidate arm whose engine children lacked ``BIDKV_UTILITY_*``."""
    env = {"policy_environment": {"status": "missing", "detail": "no engine child carries it"}}
    pairs = _pairs(cand={"procedure": env})
    pairs[0] = Pair("cell", 0, "baseline", arm_result("baseline"),
                    ArmResult.not_started("candidate", "never healthy", wall_s=1.0, command=()))
    outcome = evaluate_cell("cell", pairs, cancel_bound_s=None, tensor_parallel_size=1)
    notes = procedure_notes([outcome])
    assert notes == ["cell rep 1 candidate: no engine child carries it",
                     "cell rep 2 candidate: no engine child carries it"]
    text = _report(tmp_path, [outcome])
    assert "## Per-arm procedure" in text
    assert "- **policy environment missing**: cell rep 1 candidate:" in text


def test_counter_totals_are_exact_and_n_a_when_a_repeat_has_none(tmp_path: Path) -> None:
    """§8's per-cell counter line: sums over the repeats, ``n/a`` when any repeat did not
    report its counters (never the sum of the others)."""
    pairs = _pairs(cand={"counters": {"calls": 1_234_567, "selections": 1, "abstentions": 0,
                                      "failures": 0, "invalid_selections": 0}})
    text = _report(tmp_path / "a", [evaluate_cell("cell", pairs, cancel_bound_s=None,
                                                  tensor_parallel_size=1)])
    assert "| cell | 3703701 / 3 / 0 | 0 / 0 |" in text
    pairs[1] = Pair("cell", 1, "baseline", arm_result("baseline"),
                    arm_result("candidate", counters=None))
    text = _report(tmp_path / "b", [evaluate_cell("cell", pairs, cancel_bound_s=None,
                                                  tensor_parallel_size=1)])
    assert "| cell | n/a / n/a / n/a | n/a / n/a |" in text


def test_a_counter_past_float_range_does_not_crash_the_report(tmp_path: Path) -> None:
    """Bug: a runtime-evidence line holding a policy counter past float's range (a JSON
    integer of 400 digits) reached report.md's counter totals, where ``math.isfinite``
    raised OverflowError: the run ended in a traceback after record.json, with no
    report.md. The total is now the exact integer."""
    evidence = tmp_path / "runtime-evidence.jsonl"
    huge = 10**400
    evidence.write_text(json.dumps({"controller": {
        "calls": huge, "selections": 0, "abstentions": huge, "failures": 0,
        "invalid_selections": 0, "enabled": True}}) + "\n")
    counters, enabled, _ = counters_from_evidence(evidence)
    assert counters is not None and counters["calls"] == huge and enabled is True
    pairs = _pairs(cand={"counters": counters})
    outcome = evaluate_cell("cell", pairs, cancel_bound_s=None, tensor_parallel_size=1)
    text = _report(tmp_path, [outcome])
    assert f"| cell | {3 * huge} / 0 / {3 * huge} | 0 / 0 |" in text


# ---------------------------------------------------------------- procedure


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_the_device_snapshot_keeps_at_most_64_kib() -> None:
    """README: the snapshot's stdout is kept up to 64 KiB: exactly 64 KiB is whole and
    not marked truncated; one byte more is cut to 64 KiB and marked."""
    whole = snapshot_device(_python(f"import sys; sys.stdout.write('x' * {SNAPSHOT_LIMIT})"))
    assert SNAPSHOT_LIMIT == 64 * 1024
    assert (whole.status, whole.truncated, len(whole.output)) == ("ok", False, SNAPSHOT_LIMIT)
    cut = snapshot_device(_python(f"import sys; sys.stdout.write('x' * {SNAPSHOT_LIMIT + 1})"))
    assert (cut.status, cut.truncated, len(cut.output)) == ("ok", True, SNAPSHOT_LIMIT)


def test_a_failing_snapshot_records_its_exit_and_last_stderr_line() -> None:
    """README: a non-zero exit is recorded as ``failed``, with its last stderr line."""
    shot = snapshot_device(_python(
        "import sys; sys.stderr.write('first line\\nthe last line\\n'); sys.exit(1)"))
    assert (shot.status, shot.exit_code, shot.detail) == ("failed", 1, "the last line")


# policy_environment reads /proc only on Linux (elsewhere it reports "unavailable").
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def _proc(root: Path, pid: int, ppid: int, env: list[str], comm: str = "python") -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1\n")
    (d / "cmdline").write_bytes(f"{comm}\0--flag\0".encode())
    (d / "environ").write_bytes(b"".join(e.encode() + b"\0" for e in ["PATH=/bin", *env]))


def _engine_tree(tmp_path: Path, child_env: list[str], comm: str = "EngineCore") -> Path:
    root = tmp_path / "proc"
    _proc(root, 100, 1, ["BIDKV_UTILITY_ENABLE=1"], comm="vllm-hust-ext")
    _proc(root, 101, 100, ["BIDKV_UTILITY_ENABLE=1"], comm="vllm")
    _proc(root, 102, 101, child_env, comm=comm)
    return root


@linux_only
def test_an_engine_child_named_with_a_parenthesis_is_found(tmp_path: Path) -> None:
    """procedure._parent_of: ``comm`` in /proc/<pid>/stat may hold ')'; the parent pid is
    read after the last one, so such an engine core is still the server's child."""
    root = _engine_tree(tmp_path, ["BIDKV_UTILITY_ENABLE=1"], comm="Engine) core")
    env = policy_environment(100, root)
    assert env.status == "carried", env.detail
    assert [p.pid for p in env.processes if p.depth == 2] == [102]


@linux_only
@pytest.mark.parametrize(
    "child_env",
    [["VLLM_ENGINE_EXTRA_ENV_PREFIXES=BIDKV_UTILITY_"], ["BIDKV_UTILITY_ENABLE"]],
    ids=["allowlist-only", "no-equals-sign"],
)
def test_only_a_bidkv_utility_variable_carries_the_policy_environment(
    tmp_path: Path, child_env: list[str]
) -> None:
    """§2 step 4: ``carried`` means an engine child holds a ``BIDKV_UTILITY_*`` variable;
    the allowlist alone, or an environ entry without '=' (no variable getenv would see),
    is ``missing``."""
    env = policy_environment(100, _engine_tree(tmp_path, child_env))
    assert env.status == "missing", env.detail


@linux_only
def test_the_process_tree_and_its_values_are_bounded(tmp_path: Path) -> None:
    """procedure: a tree bigger than 256 processes is not an engine, so the record stops
    there, breadth first in pid order; a long variable value is cut, keeping the record
    small."""
    root = _engine_tree(tmp_path, ["BIDKV_UTILITY_X=" + "v" * 5000])
    for pid in range(1000, 1300):
        _proc(root, pid, 101, [])
    env = policy_environment(100, root)
    assert len(env.processes) == 256
    children = [p.pid for p in env.processes if p.depth == 2]
    assert children == [102, *range(1000, 1253)]
    value = env.processes[2].policy_environment["BIDKV_UTILITY_X"]
    assert 0 < len(value) < 1000


def test_the_log_slice_is_named_relative_to_thearm_result(tmp_path: Path) -> None:
    """§2 step 7: the record names the arm's own log, relative to the arm's directory,
    with its size (None when the file is gone)."""
    log = tmp_path / "engine.log"
    log.write_text("hello\n")
    assert log_facts(log, tmp_path) == {"path": "engine.log", "bytes": 6}
    assert log_facts(tmp_path / "gone.log", tmp_path) == {"path": "gone.log", "bytes": None}


# ---------------------------------------------------------------- rollback


@pytest.mark.parametrize(
    ("line", "verified"),
    [
        ("policy=builtin enabled=False", True),
        ("policy=bidkv.BidKVPolicy enabled=False", False),
        ("policy=builtin enabled=True", False),
    ],
)
def test_only_builtin_disabled_lines_verify_the_fallback(line: str, verified: bool) -> None:
    """qualification.md §10 step 4: the restarted engine logs ``policy=builtin
    enabled=False`` (or no policy line); a line naming another policy, even disabled, or
    an enabled one, does not verify the rollback."""
    log = f"INFO Preemption policy initialized: {line}\n"
    assert verify_fallback(log).verified is verified
