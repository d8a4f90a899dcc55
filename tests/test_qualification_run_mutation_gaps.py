"""Guards the qualification behaviour a second hand-run mutation audit found unguarded (a
mutant of client, serve, runner, replay or cli that the qualification suite let pass).
The streaming client's and fetch_text's cases are in tests/test_qualification_stream_client.py,
beside the stub server they share.
Each test names the rule it holds, from qualification.md (the shared spec),
qualification/README.md or the module's own docstring:

- the serve arm (``qualification/serve.py``, real stand-in servers launched through the
  real ``vllm-hust-ext run``): ``served_model_name``, ``max_num_seqs`` and ``extra_args``
  reach ``vllm serve`` and requests name the served model; one response without usage
  makes the client's prompt tokens unknown, and the recovery request's count among them;
  a server that exits before /health is named so with its status and its log's last line;
  only HTTP 200 from /health is ready; the recovery answer is compared stripped (§6 gate
  4); a stop past stop_timeout_s escalates through the manager (second SIGTERM) so no
  engine outlives the run; counters and the enabled flag come from /metrics before the
  manager's evidence before the engine log, the policy name from the evidence first; a
  failed request (the warm-up included) leaves no output hash;
- the runner: the dry run's ``dry_run_configuration`` overrides the profile's
  ``configuration`` for the manager's rendering;
- replay: each arm's seed, window offset, repeat, cell and arm arguments (profile.py's
  ReplaySpec placeholders); a negative integer past float's range is -inf; a report nested
  exactly 64 deep is read; a count of 0 is a count; reference arms are not the policy arm
  and uncompleted requests are failed ones; a replay that writes no report did not run,
  even where an earlier run's report is left in a reused --out; after a non-zero exit a
  malformed report fails the arm, not the run;
- the command line: an ``--extension-id`` with a line break is bad input (exit 2, one
  line). (Its second case, a second SIGTERM during the arm's server stop, is a case of
  tests/test_qualification_serve_edges.py's second-signal test.)
"""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from qualification.cli import main
from qualification.client import RequestResult
from qualification.errors import QualificationError
from qualification.manager import ManagerSession
from qualification.profile import PROFILE_DIR, Profile, load_profile
from qualification.replay import MAX_REPORT_DEPTH, arm_from_report, read_report
from qualification.runner import launch_plan
from qualification.serve import ServeArm, client_prompt_tokens, serve_command
from tests.serve_helpers import needs_manager, serve_profile, stand_in_script
from tests.test_qualification_cpu_replay import GOOD_REPORT, _fake_replay_profile
from tests.test_qualification_plans import _plan
from tests.test_qualification_serve_faults import FAULT_ENGINE, _engines, _survivors
from tests.test_qualification_serve_faults import _profile as _faults_profile
from tests.test_qualification_serve_faults import _run as _faults_run

# ---------------------------------------------------------------- the serve arm


def _cuda_variant(tmp_path: Path, server_lines: str) -> Profile:
    """The bundled cuda profile with more ``[server]`` keys."""
    text = (PROFILE_DIR / "cuda.toml").read_text()
    variant = tmp_path / "variant.toml"
    variant.write_text(text.replace("[server]\n", f"[server]\n{server_lines}", 1))
    return load_profile(str(variant))


def test_the_served_name_max_num_seqs_and_extra_args_reach_vllm_serve(tmp_path: Path) -> None:
    """serve.serve_command is "the ``vllm serve`` argv for both arms": a profile's
    ``served_model_name`` is passed as ``--served-model-name`` and is the model every
    request names (the server answers only to it), ``max_num_seqs`` as
    ``--max-num-seqs``, and ``extra_args`` come last, after ``vllm serve MODEL``. Kills
    dropping ``--served-model-name``, dropping ``--max-num-seqs``, ``extra_args`` put
    before the command, and the requests' model taken from ``model`` alone."""
    profile = _cuda_variant(
        tmp_path, 'served_model_name = "llama"\nmax_num_seqs = 6\nextra_args = ["--x", "1"]\n'
    )
    argv = serve_command(profile)
    assert argv[:3] == ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"]
    assert argv[argv.index("--served-model-name") + 1] == "llama"
    assert argv[argv.index("--max-num-seqs") + 1] == "6"
    assert argv[-2:] == ["--x", "1"]
    session = ManagerSession(profile.manager, tmp_path / "manager", {})
    assert ServeArm(profile, session, tmp_path / "engine.log").sampling.model == "llama"


def test_one_response_without_usage_makes_the_client_prompt_tokens_unknown() -> None:
    """serve.client_prompt_tokens: "None when any response carried no usage (a cancelled
    or failed stream), since a partial sum would be wrong" (README: then ``null``). Kills
    ``any`` -> ``all`` (the partial sum 5 was recorded)."""

    def result(prompt_tokens: int | None) -> RequestResult:
        return RequestResult(0, True, 200, 0.0, 0.1, 0.2, 1, "x", prompt_tokens=prompt_tokens)

    assert client_prompt_tokens([result(5), result(None)]) is None
    assert client_prompt_tokens([result(5), result(2)]) == 7


def _engine(behaviour: str) -> str:
    """A stand-in ``vllm serve`` that exits at once (``exits``) or whose /health answers
    503 for ever (``unhealthy``)."""
    return stand_in_script(
        about=f"# A stand-in for `vllm serve` that is never ready: {behaviour}.\n",
        setup=(
            'print("engine: loading", flush=True)\n'
            'print("engine: cannot allocate the KV cache", flush=True)\nsys.exit(3)\n'
            if behaviour == "exits" else ""
        ),
        handler="""\
    def do_GET(self):
        self.send_response(503)
        self.end_headers()
""",
    )


def _never_ready(tmp_path: Path, behaviour: str) -> tuple[int, dict[str, Any]]:
    profile = serve_profile(
        tmp_path, behaviour, _engine(behaviour), server="", ready_timeout_s=3,
        workload='paragraph = "one two. "\n', cells='name = "c"\nparagraph_repeats = [1]\n',
    )
    out = tmp_path / "out"
    code = main(["run", str(profile), "--out", str(out), "--quiet"])
    (pair,) = json.loads((out / "record.json").read_text())["cells"][0]["pairs"]
    return code, pair


@needs_manager
def test_a_server_that_exits_before_health_is_named_so(tmp_path: Path) -> None:
    """README: a server that never gets healthy fails that arm with a one-line reason; one
    that exited says so, with its status and the log's last line (not its first), rather
    than "did not become healthy". Kills ``proc.poll() is not None`` -> ``is None`` in
    ServeArm.run and the log's first line taken for its last (``[:1]``)."""
    code, pair = _never_ready(tmp_path, "exits")
    assert code == 1
    for arm in ("baseline", "candidate"):
        error = pair[arm]["error"]
        assert pair[arm]["started"] is False
        assert error.startswith("server exited with status 3 before /health: "), error
        assert error.endswith("engine: cannot allocate the KV cache"), error


@needs_manager
def test_a_health_answer_other_than_200_is_not_ready(tmp_path: Path) -> None:
    """qualification.md §2 step 3 "wait for health": only HTTP 200 from /health is a ready
    server; a 503 for the whole ready timeout fails the arm as not started. Kills
    ``status == 200`` -> any status (the arm then ran its workload against the 503s)."""
    code, pair = _never_ready(tmp_path, "unhealthy")
    assert code == 1
    for arm in ("baseline", "candidate"):
        assert pair[arm]["started"] is False
        assert pair[arm]["error"].startswith("server did not become healthy within 3s")


RECOVERY = "BIDKV_MATRIX_CANCEL_RECOVERY_OK"
PADDED_RECOVERY = stand_in_script(
    about="# A stand-in for `vllm serve` whose recovery answer has whitespace around it.\n",
    setup="",
    handler=f"""\
    def do_GET(self):
        if self.path == "/health":
            return self._send(b"ok")
        self._send(b"vllm:num_requests_running 0\\nvllm:num_requests_waiting 0\\n")

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if "{RECOVERY}" in req["prompt"]:
            texts = [" ", "{RECOVERY}", "\\n"]
        else:
            texts = [f" t{{i}}" for i in range(req["max_tokens"])]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for text in texts:
            self._chunk({{"choices": [{{"text": text}}]}})
        self._chunk({{"choices": [], "usage": {{"prompt_tokens": 1, "completion_tokens": 1}}}})
        self.wfile.write(b"data: [DONE]\\n\\n")
""",
)


@needs_manager
def test_the_recovery_answer_is_compared_without_surrounding_whitespace(tmp_path: Path) -> None:
    """qualification.md §6 gate 4 "the recovery request returns the exact expected text":
    the text, as a model answers it, may come with a leading space and a trailing newline
    around it. Kills comparing ``answer.text`` unstripped (the gate then failed). The
    recovery request's prompt tokens count among the client's (README: "summed over the
    cell's requests and the recovery request"; here 1 each): kills leaving it out."""
    profile = serve_profile(
        tmp_path, "recovery", PADDED_RECOVERY, server="",
        workload=f'paragraph = "one two. "\nrecovery_expected = "{RECOVERY}"\n',
        cells='name = "c"\nparagraph_repeats = [1]\nmax_tokens = 2\ncancel_after_s = 30\n',
    )
    out = tmp_path / "out"
    main(["run", str(profile), "--out", str(out), "--quiet"])
    record = json.loads((out / "record.json").read_text())
    (cell,) = record["cells"]
    (pair,) = cell["pairs"]
    for arm in ("baseline", "candidate"):
        assert pair[arm]["recovery_ok"] is True and pair[arm]["extra"]["cancelled"] == 0
        assert pair[arm]["extra"]["client_prompt_tokens"] == 2
    gates = {g["name"]: g["status"] for g in cell["gates"]}
    assert gates["recovers-after-restart"] == "pass"


@needs_manager
def test_a_stop_past_its_timeout_escalates_through_the_manager(tmp_path: Path) -> None:
    """serve.ServeArm._stop: "the manager forwards the first SIGTERM to the engine's group
    and escalates to SIGKILL on a second one; killing the manager itself is the last
    resort". An engine that ignores SIGTERM under a manager whose own grace (60 s) outlasts
    the arm's stop_timeout_s (5 s) is killed by that second SIGTERM, and nothing outlives
    the run. Kills stopping with one SIGTERM and then SIGKILL to the manager (the engine,
    in its own session, was left running)."""
    (tmp_path / "pids").mkdir()
    profile = serve_profile(
        tmp_path, "stop", FAULT_ENGINE, shutdown_grace_seconds=60,
        server=f'environment = {{ FAKE_PID_DIR = "{tmp_path / "pids"}", '
        'FAKE_FAULT = "ignore-sigterm" }\n',
        workload="", cells='name = "c"\nparagraph_repeats = [1]\nmax_tokens = 2\n',
    )
    try:
        main(["run", str(profile), "--out", str(tmp_path / "out"), "--quiet"])
        left = _survivors(tmp_path, within_s=2.0)
    finally:
        for pid in _survivors(tmp_path, within_s=0.0):
            os.kill(pid, signal.SIGKILL)
    assert len(_engines(tmp_path)) == 2
    assert not left, "an engine or its manager outlived the run"


THREE_SOURCES = stand_in_script(
    about="""\
# A stand-in for `vllm serve` that reports the policy three ways at once: /metrics (calls
# = requests served, enabled gauge 1), the manager's evidence file next to its state file
# (calls 99, enabled false, policy "from-evidence") and its log (policy "from-log",
# enabled False).
""",
    setup="""\
state_dir = os.path.dirname(os.environ["VLLM_HUST_EXT_CONFIG"])
with open(os.path.join(state_dir, "runtime-evidence.jsonl"), "a") as f:
    f.write(json.dumps({"calls": 99, "enabled": False, "policy_name": "from-evidence"}) + "\\n")
print("Preemption policy initialized: policy=from-log enabled=False", flush=True)
lock = threading.Lock()
posts = [0]
""",
    handler="""\
    def do_GET(self):
        if self.path == "/health":
            return self._send(b"ok")
        with lock:
            calls = posts[0]
        self._send(
            f'vllm:preemption_policy_events_total{{event="calls"}} {calls}\\n'
            'vllm:preemption_policy_events_total{event="failures"} 0\\n'
            'vllm:preemption_policy_events_total{event="invalid_selections"} 0\\n'
            "vllm:preemption_policy_enabled 1\\n".encode()
        )

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with lock:
            posts[0] += 1
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(req["max_tokens"]):
            self._chunk({"choices": [{"text": f" t{i}"}]})
        self.wfile.write(b"data: [DONE]\\n\\n")
""",
)


@needs_manager
def test_policy_facts_come_from_metrics_then_evidence_then_the_log(tmp_path: Path) -> None:
    """README: "Policy counters come from vllm:preemption_policy_events deltas, else the
    manager's runtime-evidence.jsonl, else the engine log's ``Preemption policy
    initialized`` line (enabled flag only)". With all three present, the counters and the
    enabled flag are the /metrics ones (2 calls: the cell's two requests between the
    scrapes; the gauge says enabled) and the policy name the evidence's. Kills preferring
    the evidence's counters, reading the enabled flag log-first, and naming the policy
    from the log."""
    profile = serve_profile(
        tmp_path, "sources", THREE_SOURCES, server="", workload='paragraph = "one two. "\n',
        cells='name = "c"\nparagraph_repeats = [1, 2]\nmax_tokens = 2\nconcurrency = 2\n',
    )
    out = tmp_path / "out"
    main(["run", str(profile), "--out", str(out), "--quiet"])
    (pair,) = json.loads((out / "record.json").read_text())["cells"][0]["pairs"]
    for arm in ("baseline", "candidate"):
        result = pair[arm]
        assert result["error"] is None, result["error"]
        assert result["counters"]["calls"] == 2, result["counters"]
        assert result["policy_enabled"] is True
        assert result["policy_name"] == "from-evidence"


@needs_manager
def test_failed_requests_leave_no_output_hashes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """qualification.md §6 gate 1 compares the warm-up answers' hashes, and the long
    hashes are those of the completed requests: an arm whose server answers every request
    with HTTP 500 has no short hash (an empty failed answer must not hash equal to
    another) and no long hashes. Kills hashing a failed warm-up and hashing every request,
    failed ones included."""
    record: dict[str, Any] = _faults_run(tmp_path, _faults_profile(tmp_path, "http-500"), capsys)
    (pair,) = record["cells"][0]["pairs"]
    base, cand = pair["baseline"], pair["candidate"]
    assert len(base["short_hash"]) == 16 and len(base["long_hashes"]) == 2
    assert cand["short_hash"] is None and cand["long_hashes"] == []


# ---------------------------------------------------------------- runner


@needs_manager
def test_the_dry_run_declares_its_host_facts_over_the_profiles_configuration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """runner.render_with_manager renders the first arms "with ... declared host facts
    from ``[manager] dry_run_configuration``": where the profile's own ``configuration``
    names the same fact (a host version outside the bundle's range), the dry run's
    declaration is the one the manager sees, so the candidate is rendered, not refused.
    Kills merging the two the other way round (``configuration`` last)."""
    text = (PROFILE_DIR / "ascend-tp4.toml").read_text()
    text = text.replace("configuration = {}", 'configuration = { host_version = "0.1.0" }', 1)
    text = text.replace('command = ["vllm", "serve"]',
                        'command = ["python", "-m", "vllm.entrypoints.cli.main", "serve"]', 1)
    variant = tmp_path / "declared.toml"
    variant.write_text(text)
    plan: dict[str, Any] = _plan(str(variant), capsys, repeats=1)
    candidate = plan["manager_dry_run"]["candidate"]
    assert "refused" not in candidate, candidate
    assert candidate["command"][-2:] == [
        "--preemption-policy", "bidkv_ext.selector.BidkvPreemptionPolicy"]


# ---------------------------------------------------------------- replay


def test_each_replay_arm_gets_its_repeats_seed_window_and_arm_arguments(tmp_path: Path) -> None:
    """profile.ReplaySpec: placeholders {seed} {repeat} {offset} {out} {cell}, "``offset``
    = repeat x ``slice_stride`` so repeats are distinct samples"; the seed is ``base_seed``
    + repeat; the arguments are the profile's, then the cell's ``replay_args``, then the
    arm's own (the baseline's ``--policies builtin``). Kills a seed, offset or repeat that
    ignores the repeat, the baseline and candidate arguments swapped, and the cell's
    arguments dropped."""
    text = (PROFILE_DIR / "cpu-replay.toml").read_text()
    text = text.replace("base_seed = 0", "base_seed = 5", 1)
    text = text.replace('"--no-progress",', '"--no-progress", "--tag", "{repeat}/{cell}",', 1)
    text = text.replace("[[cells]]\n", '[[cells]]\nreplay_args = ["--cell-arg"]\n', 1)
    variant = tmp_path / "replay.toml"
    variant.write_text(text)
    profile = load_profile(str(variant))
    cell = profile.cells[0].name
    plan: dict[str, Any] = launch_plan(profile, repeats=2)
    commands = {(a["repetition"], a["arm"]): a["command"] for a in plan["arms"]}
    for rep in (0, 1):
        for arm, own in (("baseline", ["--policies", "builtin"]), ("candidate", [])):
            out = f"<out>/cells/{cell}/rep-{rep}/{arm}/replay"
            assert commands[(rep, arm)] == [
                "bidkv-replay", "--start", str(30 * rep), "--duration", "30",
                "--num-gpu-blocks", "120", "--seed", str(5 + rep), "--output-dir", out,
                "--no-plots", "--no-progress", "--tag", f"{rep}/{cell}", "--cell-arg", *own,
            ]


def _report_arm(**fields: object) -> dict[str, object]:
    return {
        "label": "x", "requests": 2, "completed": 2, "output_tokens": 8,
        "throughput_output_tok_s": 10.0, "ttft_s": {"p50": 0.1, "p95": 0.2},
        "e2e_s": {"p50": 1.0, "p95": 2.0}, **fields,
    }


def test_a_negative_integer_past_floats_range_is_minus_infinity() -> None:
    """replay._number: "an integer past float's range: infinite, as json reads 1e400", with
    its sign (-1e400 reads as -inf). Kills returning +inf whatever the sign."""
    doc = {"arms": [_report_arm(preemptions=-(10**400), recompute_tax=10**400)]}
    result = arm_from_report("baseline", doc, [], 0.0)
    assert result.preemptions == -math.inf and result.extra["recompute_tax"] == math.inf


def test_a_report_nested_exactly_64_deep_is_read(tmp_path: Path) -> None:
    """replay.read_report: a report is refused only when "nested at most 64 deep" does not
    hold; a value nested exactly 64 deep is still a report. Kills ``> MAX_REPORT_DEPTH``
    -> ``>=``."""
    assert MAX_REPORT_DEPTH == 64

    def nested(depth: int) -> str:  # the object itself is level 1
        return '{"arms": [], "deep": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"

    path = tmp_path / "report.json"
    path.write_text(nested(64))
    assert read_report(path)["arms"] == []
    path.write_text(nested(65))
    with pytest.raises(QualificationError, match="nested too deeply"):
        read_report(path)


def test_a_replay_arm_that_completed_nothing_is_read_as_such() -> None:
    """replay._count: a count is "a non-negative finite number", so 0 is one: an arm that
    completed nothing (figures null: no samples) is read, with every request failed,
    rather than refused as a malformed report. Kills ``0 <= value`` -> ``0 < value``."""
    entry = _report_arm(completed=0, output_tokens=0, throughput_output_tok_s=0.0,
                        ttft_s={"p50": None, "p95": None}, e2e_s={"p50": None, "p95": None})
    result = arm_from_report("candidate", {"arms": [entry]}, [], 0.0)
    assert (result.requests, result.completed, result.failed, result.output_tokens) == (2, 0, 2, 0)
    assert math.isnan(result.latency_p95)


def test_the_one_policy_arm_is_read_beside_reference_arms_with_its_failures() -> None:
    """replay.arm_from_report reads "the single policy arm a qualification replay runs":
    reference arms (``"reference": true``) beside it are not policy arms; its requests
    that did not complete are failed ones. Kills counting reference arms (the report was
    refused) and a failed count of 0."""
    reference = _report_arm(label="oracle", reference=True, throughput_output_tok_s=99.0)
    doc = {"arms": [reference, _report_arm(requests=3)]}
    result = arm_from_report("candidate", doc, [], 0.0)
    assert result.throughput == 10.0 and result.extra["label"] == "x"
    assert (result.requests, result.completed, result.failed) == (3, 2, 1)


def _replay_run(profile: Path, out: Path) -> tuple[int, dict[str, Any]]:
    code = main(["run", str(profile), "--out", str(out), "--repeats", "1", "--quiet"])
    (pair,) = json.loads((out / "record.json").read_text())["cells"][0]["pairs"]
    return code, pair


@needs_manager
def test_a_replay_that_writes_no_report_did_not_run_even_in_a_reused_out(
    tmp_path: Path,
) -> None:
    """replay.run_replay_arm: "a report left by an earlier run in a reused --out must not
    pass for this one's"; README: a replay that fails (here: exits 0 without its report)
    fails that arm with a one-line reason, and the run still writes record.json and exits
    1. Kills dropping the stale report's removal (the earlier figures passed again) and
    reading a missing report after exit 0 (exit 2, no record)."""
    profile = _fake_replay_profile(tmp_path, GOOD_REPORT)
    out = tmp_path / "out"
    _, first = _replay_run(profile, out)
    assert first["baseline"]["started"] is True and first["baseline"]["throughput"] == 10.0
    script = tmp_path / "fake-replay.sh"
    script.write_text("#!/bin/sh\necho 'replay: nothing to do'\nexit 0\n")
    code, pair = _replay_run(profile, out)
    assert code == 1
    for arm in ("baseline", "candidate"):
        assert pair[arm]["started"] is False
        assert pair[arm]["error"] == "bidkv-replay exit 0: replay: nothing to do"


@needs_manager
def test_a_failed_replays_malformed_report_is_no_evidence(tmp_path: Path) -> None:
    """replay.run_replay_arm: after a non-zero exit, "a failed run's report is no evidence;
    its exit line says why": a malformed report then fails the arm with the exit line
    (exit 1, record written), not the whole run as bad input. Kills re-raising the
    report's error (exit 2)."""
    profile = _fake_replay_profile(tmp_path, "{bad")
    script = tmp_path / "fake-replay.sh"
    script.write_text(script.read_text() + "echo 'replay: out of memory' >&2\nexit 1\n")
    code, pair = _replay_run(profile, tmp_path / "out")
    assert code == 1
    for arm in ("baseline", "candidate"):
        assert pair[arm]["started"] is False
        assert pair[arm]["error"] == "bidkv-replay exit 1: replay: out of memory"


# ---------------------------------------------------------------- cli


def test_an_extension_id_with_a_line_break_is_bad_input(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """cli docstring: exit 2 for bad input, one line on stderr; ``rollback --extension-id``
    must be a printable bundle id, so one holding a line break is refused before any plan
    line is printed. Kills dropping the ``isprintable`` check (the plan was printed for
    it, exit 0)."""
    assert main(["rollback", "--extension-id", "org.x\nid"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "qualification: error: --extension-id 'org.x\\nid' is invalid: expected a bundle id\n"
    )

