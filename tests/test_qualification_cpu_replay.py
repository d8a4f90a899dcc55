"""Guards the CPU qualification gate end to end: `python -m qualification run cpu-replay`
launches every arm as a fresh `vllm-hust-ext run -- bidkv-replay ...` process (private
manager state, bundle disabled for the baseline and enabled for the candidate), and
produces a record, a Markdown report, a PNG plot and a verdict; the record is accepted by
the release check's record rule. With the arms injected (no process launched), `run_profile`
runs each pair in the alternating order, gates every cell with the profile's TP size and,
only where the cell cancels, the workload's drain bound, and the record's gate summary and
the report name the failing cells; blocked cells appear in record and report; a record
that cannot be written leaves neither a temporary file nor a changed record behind."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from qualification import RECORD_SCHEMA
from qualification.cli import main
from qualification.errors import QualificationError
from qualification.manager import Arm, ManagerSession
from qualification.profile import PROFILE_DIR, CellSpec, load_profile
from qualification.release import check_release
from qualification.replay import arm_from_report, read_report
from qualification.report import write_json_atomic, write_markdown
from qualification.runner import arm_order, build_record, run_profile
from qualification.verdict import COUNTER_NAMES, ArmResult

REPO = Path(__file__).resolve().parent.parent
VERDICTS = {"beneficial", "neutral", "not-beneficial-in-tested-cell", "inconclusive"}


def _installed(name: str) -> bool:
    return shutil.which(name) is not None or (Path(sys.executable).parent / name).is_file()


needs_replay = pytest.mark.skipif(
    not (_installed("bidkv-replay") and _installed("vllm-hust-ext")),
    reason="bidkv-replay and vllm-hust-ext must be installed",
)
needs_manager = pytest.mark.skipif(
    not _installed("vllm-hust-ext"), reason="vllm-hust-ext must be installed"
)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cpu-replay")
    assert main(["run", "cpu-replay", "--out", str(out), "--quiet"]) == 0
    return out


@needs_replay
def test_record_report_plot_and_verdict(run_dir: Path) -> None:
    record = json.loads((run_dir / "record.json").read_text())
    assert record["schema"] == RECORD_SCHEMA
    assert record["gate"] == {"passed": True, "failures": [], "failed_cells": []}
    assert record["host"]["version"].startswith("0.33.")
    assert record["profile"]["name"] == "cpu-replay"
    (cell,) = record["cells"]
    assert cell["verdict"] in VERDICTS
    assert record["verdicts"] == {cell["cell"]: cell["verdict"]}
    assert len(cell["pairs"]) == 3
    assert [p["first"] for p in cell["pairs"]] == ["baseline", "candidate", "baseline"]
    report = (run_dir / "report.md").read_text()
    assert f"**{cell['verdict']}**" in report and "PASSED" in report
    assert (run_dir / "deltas.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_replay
def test_arms_differ_only_by_the_bundle(run_dir: Path) -> None:
    record = json.loads((run_dir / "record.json").read_text())
    pairs = record["cells"][0]["pairs"]
    for pair in pairs:
        base, cand = pair["baseline"], pair["candidate"]
        # Candidate: the manager rendered the bundle's policy, which the host loaded.
        assert cand["extra"]["label"] == "bidkv_ext.selector.BidkvPreemptionPolicy"
        assert cand["policy_enabled"] is True and cand["invoked"] is True
        assert cand["counters"]["failures"] == 0 == cand["counters"]["invalid_selections"]
        # Its decision counts (qualification.md §4) came through, and agree with the
        # controller's counters.
        decisions = cand["extra"]["policy_decisions"]
        assert decisions["selections"] == cand["counters"]["selections"] > 0
        assert decisions["strategy_abstentions"] + decisions["barrier_decisions"] \
            == cand["counters"]["abstentions"]
        assert decisions["useful_blocks"] >= decisions["selections"]
        # Baseline: the built-in victim, never overridden.
        assert base["extra"]["label"] == "builtin"
        assert base["counters"]["selections"] == 0
        assert base["requests"] == base["completed"] and cand["requests"] == cand["completed"]
    # Repeats replay different windows, so they are distinct samples.
    assert (
        len(
            {p["baseline"]["requests"] for p in pairs}
            | {p["baseline"]["throughput"] for p in pairs}
        )
        > 1
    )
    cand_dir = run_dir / "cells" / pairs[0]["cell"] / "rep-0" / "candidate" / "manager"
    state = json.loads((cand_dir / "config.json").read_text())
    assert state["extensions"]["org.vllm-hust.bidkv"]["enabled"] is True
    base_dir = cand_dir.parent.parent / "baseline" / "manager"
    state = json.loads((base_dir / "config.json").read_text())
    assert state["extensions"]["org.vllm-hust.bidkv"]["enabled"] is False


@needs_replay
def test_release_check_refuses_the_ci_record_as_a_release(run_dir: Path) -> None:
    """The record is well formed and passing, but a CPU replay gates CI, not a release."""
    result = check_release(REPO, [run_dir])
    assert any(
        "a CPU replay record is the CI gate, not a release qualification" in p
        for p in result.problems
    ), result.problems


def _fake_replay_profile(tmp: Path, report_text: str) -> Path:
    """cpu-replay, but each arm is a script that writes `report_text` as report.json."""
    (tmp / "canned.json").write_text(report_text)
    script = tmp / "fake-replay.sh"
    script.write_text(
        "#!/bin/sh\n"
        'out=""\n'
        'while [ $# -gt 0 ]; do [ "$1" = --output-dir ] && out="$2"; shift; done\n'
        f'mkdir -p "$out" && cp {tmp / "canned.json"} "$out/report.json"\n'
    )
    script.chmod(0o755)
    text = (REPO / "qualification" / "profiles" / "cpu-replay.toml").read_text()
    profile = tmp / "fake.toml"
    profile.write_text(text.replace('command = ["bidkv-replay"]', f'command = ["{script}"]'))
    return profile


ARM = '"label": "x", "completed": 1, "output_tokens": 1'


@needs_manager
@pytest.mark.parametrize(
    ("report", "message"),
    [
        ("{bad", "cannot be read as JSON"),
        ("[1, 2]", "expected a JSON object, got an array"),
        ('{"arms": [{"label": "x"}]}', "expected 'requests'"),
        (f'{{"arms": [{{{ARM}, "requests": NaN}}]}}', "got nan"),
    ],
)
def test_malformed_report_fails_its_arm_in_one_line_and_keeps_the_run(
    tmp_path: Path, report: str, message: str
) -> None:
    """A bad replay report.json fails that arm with one line naming the file (not a
    traceback from json.loads, dict access on a list or int(nan)). It used to end the
    whole run with exit 2 and no record.json, losing the arms already run, where the README
    says an arm that goes wrong mid-run fails that arm and the run goes on (exit 1)."""
    profile = _fake_replay_profile(tmp_path, report)
    out = tmp_path / "out"
    assert main(["run", str(profile), "--out", str(out), "--repeats", "1", "--quiet"]) == 1
    pair = _pair(out)
    for arm in (pair["baseline"], pair["candidate"]):
        error = str(arm["error"])
        assert arm["started"] is False
        assert error.startswith("bidkv-replay exit 0 but its report is unusable: "
                                "bidkv-replay report ") and message in error, error
        assert str(out / "cells") in error and "report.json" in error and "\n" not in error


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-1", "true", '"3"'])
def test_report_counts_must_be_finite_numbers(tmp_path: Path, value: str) -> None:
    # `requests` feeds int(); NaN/inf/strings/booleans must name the file, not crash.
    path = tmp_path / "report.json"
    path.write_text(f'{{"arms": [{{{ARM}, "requests": {value}}}]}}')
    with pytest.raises(QualificationError, match=r"report\.json: arm 'x': expected 'requests'"):
        arm_from_report("baseline", read_report(path), [], 0.0, str(path))


@pytest.mark.parametrize(
    ("text", "message"),
    [('{"arms": 1' + "0" * 5000 + "}", "value has 5001 digits"), ("[" * 100_000, "too deeply")],
)
def test_hostile_report_is_named(tmp_path: Path, text: str, message: str) -> None:
    # A huge integer (plain ValueError) or deep nesting (RecursionError) names the report.
    path = tmp_path / "report.json"
    path.write_text(text)
    with pytest.raises(QualificationError, match=f"report {path}: cannot be read as JSON") as info:
        read_report(path)
    assert message in str(info.value) and "\n" not in str(info.value)


GOOD_REPORT = json.dumps(
    {
        "arms": [
            {
                "label": "x",
                "requests": 2,
                "completed": 2,
                "output_tokens": 8,
                "throughput_output_tok_s": 10.0,
                "ttft_s": {"p50": 0.1, "p95": 0.2},
                "e2e_s": {"p50": 1.0, "p95": 2.0},
            }
        ]
    }
)


def _pair(out: Path) -> dict[str, dict[str, object]]:
    record = json.loads((out / "record.json").read_text())
    (pair,) = record["cells"][0]["pairs"]
    return pair  # type: ignore[no-any-return]


def _gate(out: Path, name: str) -> dict[str, str]:
    record = json.loads((out / "record.json").read_text())
    return next(g for g in record["cells"][0]["gates"] if g["name"] == name)  # type: ignore[no-any-return]


@needs_manager
def test_replay_failing_after_its_report_is_not_a_server_that_never_came_up(
    tmp_path: Path,
) -> None:
    """A replay that writes its report and then exits 1 for a conservation violation ran:
    its figures are kept and the arm fails with the replay's own line, instead of being
    recorded as an arm that never started ("server did not come up")."""
    profile = _fake_replay_profile(tmp_path, GOOD_REPORT)
    script = tmp_path / "fake-replay.sh"
    script.write_text(
        script.read_text() + 'echo "bidkv-replay: error: conservation violated for x" >&2\nexit 1\n'
    )
    out = tmp_path / "out"
    assert main(["run", str(profile), "--out", str(out), "--repeats", "1", "--quiet"]) == 1
    pair = _pair(out)
    for arm in (pair["baseline"], pair["candidate"]):
        assert arm["started"] is True and arm["throughput"] == 10.0
        assert arm["error"] == (
            "bidkv-replay exit 1 after writing its report: "
            "bidkv-replay: error: conservation violated for x"
        )
    assert _gate(out, "recovers-after-restart")["status"] == "pass"
    failed = _gate(out, "no-failed-or-starved")
    assert failed["status"] == "fail" and "conservation violated for x" in failed["detail"]


@needs_manager
def test_failing_manager_verb_fails_the_arm_and_keeps_the_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`vllm-hust-ext extension enable` failing for the candidate arm fails that arm with
    the verb's one line; the run still writes record.json with the baseline arm already
    run and exits 1 (a gate failed), instead of aborting with exit 2 and no record."""
    profile = _fake_replay_profile(tmp_path, GOOD_REPORT)
    real = shutil.which("vllm-hust-ext") or str(Path(sys.executable).parent / "vllm-hust-ext")
    wrapper = tmp_path / "manager.sh"
    wrapper.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = extension ] && [ "$2" = enable ]; then\n'
        "  echo \"vllm-hust-ext: error: bundle 'org.vllm-hust.bidkv' is not installed\" >&2\n"
        "  exit 3\n"
        "fi\n"
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    profile.write_text(
        profile.read_text().replace("[manager]\n", f'[manager]\ncommand = ["{wrapper}"]\n', 1)
    )
    out = tmp_path / "out"
    assert main(["run", str(profile), "--out", str(out), "--repeats", "1"]) == 1
    assert "Traceback" not in capsys.readouterr().err
    pair = _pair(out)
    assert pair["baseline"]["started"] is True and pair["baseline"]["throughput"] == 10.0
    verb = (
        f"{wrapper} extension enable org.vllm-hust.bidkv failed (exit 3): "
        "vllm-hust-ext: error: bundle 'org.vllm-hust.bidkv' is not installed"
    )
    assert pair["candidate"]["started"] is False and pair["candidate"]["error"] == verb
    gate = _gate(out, "recovers-after-restart")
    assert gate["detail"] == f"repeat 0 candidate: arm did not run ({verb})"


@needs_manager
def test_a_run_started_inside_a_managed_process_still_launches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manager refuses a launch whose caller already set its evidence variables
    (manager-protocol §6.3); each arm drops them, so a qualification run started from a
    managed process (or a shell that inherited them) still runs every arm, and each arm
    keeps its private manager state even when the caller names another state file."""
    profile = _fake_replay_profile(tmp_path, GOOD_REPORT)
    for name in ("VLLM_ECPA_LAUNCH_ID", "VLLM_HUST_EXT_EVIDENCE_PATH", "VLLM_EXTENSION_BUNDLES"):
        monkeypatch.setenv(name, "inherited")
    callers = tmp_path / "callers-config.json"
    monkeypatch.setenv("VLLM_HUST_EXT_CONFIG", str(callers))
    out = tmp_path / "out"
    main(["run", str(profile), "--out", str(out), "--repeats", "1", "--quiet"])
    pair = _pair(out)
    for arm in (pair["baseline"], pair["candidate"]):
        assert arm["started"] is True and arm["error"] is None and arm["throughput"] == 10.0
    assert not callers.exists()
    for arm, enabled in (("baseline", False), ("candidate", True)):
        state = out / "cells" / pair["cell"] / "rep-0" / arm / "manager" / "config.json"
        extensions = json.loads(state.read_text())["extensions"]
        assert extensions["org.vllm-hust.bidkv"]["enabled"] is enabled


def _online_arm(report: Path) -> dict[str, object]:
    """The one non-reference arm of a replay report.json."""
    doc = json.loads(report.read_text())
    (entry,) = [a for a in doc["arms"] if not a.get("reference")]
    return entry  # type: ignore[no-any-return]


@needs_replay
def test_recorded_latency_is_the_replays_end_to_end_figure(run_dir: Path) -> None:
    """Every recorded arm of the real CPU run takes its P95 latency (the verdict's latency,
    qualification.md §4/§7) from the replay's end-to-end percentiles (`e2e_s`) and its TTFT
    from `ttft_s`, never one for the other; the two differ in the real reports."""
    record = json.loads((run_dir / "record.json").read_text())
    for pair in record["cells"][0]["pairs"]:
        for arm in ("baseline", "candidate"):
            rep = run_dir / "cells" / pair["cell"] / f"rep-{pair['repetition']}" / arm
            entry = _online_arm(rep / "replay" / "report.json")
            e2e, ttft = entry["e2e_s"], entry["ttft_s"]
            assert e2e["p95"] != ttft["p95"]  # otherwise the check below proves nothing
            recorded = pair[arm]
            assert recorded["latency_p95"] == e2e["p95"]
            assert recorded["latency_p50"] == e2e["p50"]
            assert recorded["ttft_p95"] == ttft["p95"]
            assert recorded["ttft_p50"] == ttft["p50"]


def test_arm_figures_map_each_report_percentile() -> None:
    """arm_from_report reads latency_p50/p95 from `e2e_s` (end-to-end latency, §4) and
    ttft_p50/p95 (and extra ttft_p99) from `ttft_s`; all five figures differ, so a swapped
    or misread key is caught."""
    doc = {
        "arms": [
            {
                "label": "x",
                "requests": 3,
                "completed": 3,
                "output_tokens": 9,
                "throughput_output_tok_s": 12.5,
                "ttft_s": {"p50": 0.11, "p95": 0.23, "p99": 0.37},
                "e2e_s": {"p50": 1.7, "p95": 2.9, "p99": 3.3},
            }
        ]
    }
    arm = arm_from_report("candidate", doc, [], 0.0, "report.json")
    assert arm.latency_p95 == 2.9
    assert arm.latency_p50 == 1.7
    assert arm.ttft_p95 == 0.23
    assert arm.ttft_p50 == 0.11
    assert arm.extra["ttft_p99"] == 0.37
    assert arm.throughput == 12.5


def test_arm_records_the_policys_decision_counts() -> None:
    """qualification.md §4's policy log-tag counts and sum of r come from the replay's
    ``policy_decisions`` (recorded, not gated): copied as counted, None where the report
    has none (an older replay or another policy); a count that is no non-negative integer
    is left out, as the controller counters are."""
    entry: dict[str, object] = {
        "label": "x", "requests": 3, "completed": 3, "output_tokens": 9,
        "throughput_output_tok_s": 12.5, "ttft_s": {"p50": 0.1, "p95": 0.2},
        "e2e_s": {"p50": 1.0, "p95": 2.0},
    }
    counts = {"selections": 7, "cascade_selections": 1, "liveness_reselections": 2,
              "strategy_abstentions": 0, "barrier_decisions": 3, "liveness_epochs": 3,
              "useful_blocks": 11}
    arm = arm_from_report("candidate", {"arms": [{**entry, "policy_decisions": counts}]}, [],
                          0.0, "report.json")
    assert arm.extra["policy_decisions"] == counts
    other = {**counts, "useful_blocks": None, "selections": -1, "barrier_decisions": True,
             "liveness_epochs": 2.0, "unknown": 4}
    arm = arm_from_report("candidate", {"arms": [{**entry, "policy_decisions": other}]}, [],
                          0.0, "report.json")
    assert arm.extra["policy_decisions"] == {
        "cascade_selections": 1, "liveness_reselections": 2, "strategy_abstentions": 0,
        "useful_blocks": None}
    for absent in ({}, {"policy_decisions": None}, {"policy_decisions": [1, 2]}):
        arm = arm_from_report("candidate", {"arms": [{**entry, **absent}]}, [], 0.0, "r.json")
        assert arm.extra["policy_decisions"] is None


def _controller(**changes: object) -> dict[str, object]:
    """An arm's controller counters, zero unless given."""
    counters = dict.fromkeys(
        ("calls", "selections", "abstentions", "failures", "invalid_selections"), 0)
    return {**counters, **changes}


def _replay_arm_report(*, throughput: float, ttft_p95: float, e2e_p95: float, **kw: object) -> str:
    entry: dict[str, object] = {
        "label": "x",
        "requests": 4,
        "completed": 4,
        "output_tokens": 16,
        "throughput_output_tok_s": throughput,
        "ttft_s": {"p50": ttft_p95 / 2, "p95": ttft_p95},
        "e2e_s": {"p50": e2e_p95 / 2, "p95": e2e_p95},
        **kw,
    }
    return json.dumps({"arms": [entry]})


@needs_manager
def test_verdict_uses_end_to_end_p95_not_ttft(tmp_path: Path) -> None:
    """Through `qualification run`: the candidate's end-to-end P95 equals the baseline's
    while its P95 TTFT is +50 %, with throughput +10 % in every repeat. The record keeps
    each figure under its own name, the cell's P95-latency delta is the end-to-end one
    (0 %) and the verdict is `beneficial`; reading TTFT as the P95 latency would make it
    `not-beneficial-in-tested-cell`."""
    profile = _fake_replay_profile(tmp_path, "{}")
    (tmp_path / "baseline.json").write_text(
        _replay_arm_report(
            throughput=10.0,
            ttft_p95=0.2,
            e2e_p95=2.0,
            controller=_controller(enabled=False),
        )
    )
    (tmp_path / "candidate.json").write_text(
        _replay_arm_report(
            throughput=11.0,
            ttft_p95=0.3,
            e2e_p95=2.0,
            controller=_controller(enabled=True, policy_name="p", calls=5, selections=2,
                                   abstentions=3),
        )
    )
    # The baseline arm is the one run with `--policies builtin`.
    script = tmp_path / "fake-replay.sh"
    script.write_text(
        "#!/bin/sh\n"
        f"src={tmp_path / 'candidate.json'}\n"
        'out=""\n'
        "while [ $# -gt 0 ]; do\n"
        '  [ "$1" = --output-dir ] && out="$2"\n'
        f'  [ "$1" = builtin ] && src={tmp_path / "baseline.json"}\n'
        "  shift\n"
        "done\n"
        'mkdir -p "$out" && cp "$src" "$out/report.json"\n'
    )
    out = tmp_path / "out"
    assert main(["run", str(profile), "--out", str(out), "--quiet"]) == 0
    record = json.loads((out / "record.json").read_text())
    (cell,) = record["cells"]
    assert len(cell["pairs"]) == 3
    for pair in cell["pairs"]:
        assert pair["baseline"]["latency_p95"] == 2.0 == pair["candidate"]["latency_p95"]
        assert pair["baseline"]["ttft_p95"] == 0.2 and pair["candidate"]["ttft_p95"] == 0.3
        assert pair["deltas_pct"]["latency_p95"] == pytest.approx(0.0, abs=1e-9)
        assert pair["deltas_pct"]["ttft_p95"] == pytest.approx(50.0)
    assert cell["deltas"]["latency_p95"]["ci_high"] == pytest.approx(0.0, abs=1e-9)
    assert cell["verdict"] == "beneficial", cell["reason"]


def test_run_profile_gates_each_cell_in_alternating_order(tmp_path: Path) -> None:
    """ascend-tp4 (TP 4, a 1 s drain bound) with injected arms that all take 2 s to drain:
    only the cell that cancels is held to the bound; the arms of "mixed-length" saw TP
    ranks 0-2 of 4. Exactly those two cells fail, in the record and in the report."""
    profile = load_profile("ascend-tp4")
    ran: list[tuple[str, int, Arm]] = []

    def runner(arm: Arm, cell: CellSpec, repetition: int, arm_dir: Path,
               session: ManagerSession) -> ArmResult:
        ran.append((cell.name, repetition, arm))
        counters = dict.fromkeys(COUNTER_NAMES, 0)
        if arm == "candidate":
            counters.update(calls=4, selections=1, abstentions=3)
        ranks = (0, 1, 2) if cell.name == "mixed-length" else (0, 1, 2, 3)
        return ArmResult(
            arm=arm, throughput=100.0, ttft_p50=0.1, ttft_p95=0.2, latency_p50=1.0,
            latency_p95=2.0, requests=8, completed=8, counters=counters,
            policy_enabled=arm == "candidate", short_hash="h", drain_s=2.0,
            recovery_ok=True, tracebacks=0, graph_captured=True, tp_ranks=ranks,
        )

    result = run_profile(profile, tmp_path / "out", repeats=2, arm_runner=runner)
    cells = [c.name for c in profile.cells]
    assert ran == [(c, r, arm) for i, c in enumerate(cells) for r in range(2)
                   for arm in arm_order(i, r)]
    for i, outcome in enumerate(result.outcomes):
        assert [p.first for p in outcome.pairs] == [arm_order(i, r)[0] for r in range(2)]
        gates = {g.name: g.status for g in outcome.gates}
        cancels = outcome.cell == "burst-cancel-recovery"
        assert gates["cancellation-drains"] == ("fail" if cancels else "n/a")
        assert gates["graph-capture-and-tp-ranks"] == (
            "fail" if outcome.cell == "mixed-length" else "pass")
    gate = result.record["gate"]
    assert isinstance(gate, dict) and gate["passed"] is False and not result.passed
    assert gate["failed_cells"] == ["burst-cancel-recovery", "mixed-length"]
    report = result.report_path.read_text()
    assert report.startswith("# Qualification: ascend-tp4 (FAILED)")
    assert "- cancellation-drains: **fail** — repeat 0 baseline: drain 2.0s > bound 1.0s" in report


def test_blocked_cells_are_recorded_and_reported(tmp_path: Path) -> None:
    """qualification.md §3: declared-but-unrun cells are reported as `blocked`."""
    text = (PROFILE_DIR / "cpu-replay.toml").read_text()
    variant = tmp_path / "blocked.toml"
    blocked = 'blocked_cells = ["liveness-0"]\n\n[manager]\n'
    variant.write_text(text.replace("[manager]\n", blocked, 1))
    record = build_record(load_profile(str(variant)), [], 3)
    assert record["blocked_cells"] == ["liveness-0"]
    record["gate"] = {"passed": False}
    write_markdown(tmp_path / "report.md", record, [])
    assert "| liveness-0 | 0 | - | - | - | - | blocked |" in (tmp_path / "report.md").read_text()


def test_a_record_that_cannot_be_written_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "record.json"
    path.write_text('{"old": true}\n')
    with pytest.raises(TypeError):
        write_json_atomic(path, {"figure": object()})  # not JSON: json.dump fails midway
    assert path.read_text() == '{"old": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]
