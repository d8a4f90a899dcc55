"""Guards a serve arm (GPU profiles) end to end against a real local HTTP server launched
through the real `vllm-hust-ext run`: an engine that dies mid-arm is a failed arm with its
reason in the record (the run finishes, writes record.json and exits 1, keeping the arms
already run), and the recomputed-prompt-token figure is the local-compute delta minus the
prompt tokens the server reported (None when a response carried no usage). The policy
facts an arm reads (qualification.md §4) are guarded too: Prometheus counter deltas summed
over label sets and the enabled gauge (1 is enabled), the manager evidence's largest
counters with torn lines skipped and the last enabled flag, and the engine log's last
initialisation line (the built-in victim never counts as an enabled policy), and the TP
ranks the log names (decimal captures only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qualification.cli import main
from qualification.evidence import (
    counters_from_evidence,
    counters_from_metrics,
    enabled_from_log,
    parse_prometheus,
    tp_ranks_from_log,
)
from qualification.profile import load_profile
from tests.serve_helpers import needs_manager, serve_profile, stand_in_script

RECOMPUTE = 7
FAKE_ENGINE = stand_in_script(
    about="# A stand-in for `vllm serve`: /health, /metrics and streaming /v1/completions.\n",
    setup="""\
DIE_ON_METRICS = int(os.environ.get("FAKE_DIE_ON_METRICS", "0"))
NO_USAGE = os.environ.get("FAKE_NO_USAGE") == "1"
lock = threading.Lock()
state = {"local": 0, "scrapes": 0}
""",
    handler=f"""\
    def do_GET(self):
        if self.path == "/health":
            return self._send(b"ok")
        with lock:
            state["scrapes"] += 1
            if state["scrapes"] == DIE_ON_METRICS:
                os._exit(3)  # the engine dies mid-arm
            body = (
                'vllm:prompt_tokens_by_source_total{{source="local_compute"}} '
                f'{{state["local"]}}\\nvllm:num_requests_running 0\\n'
                "vllm:num_requests_waiting 0\\n"
            )
        self._send(body.encode())

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt_tokens = len(req["prompt"].split())
        with lock:
            # Every prompt is computed once plus {RECOMPUTE} tokens again (a preemption).
            state["local"] += prompt_tokens + {RECOMPUTE}
        chunks = [{{"choices": [{{"text": f" t{{i}}"}}]}} for i in range(req["max_tokens"])]
        if not NO_USAGE:
            usage = {{"prompt_tokens": prompt_tokens, "completion_tokens": req["max_tokens"]}}
            chunks.append({{"choices": [], "usage": usage}})
        lines = [f"data: {{json.dumps(c)}}\\n\\n" for c in chunks] + ["data: [DONE]\\n\\n"]
        self._send("".join(lines).encode(), "text/event-stream")
""",
)

PARAGRAPH = "one two three four five. "


def _profile(tmp: Path, candidate_env: dict[str, str]) -> Path:
    env = ", ".join(f'{k} = "{v}"' for k, v in candidate_env.items())
    return serve_profile(
        tmp,
        "fake-serve",
        FAKE_ENGINE,
        server=f"candidate_environment = {{ {env} }}\n",
        workload=f"""\
paragraph = "{PARAGRAPH}"
request_timeout_s = 20
""",
        cells="""\
name = "c"
paragraph_repeats = [2, 3]
max_tokens = 4
concurrency = 2
""",
    )


def _run(tmp: Path, candidate_env: dict[str, str]) -> tuple[int, dict[str, object]]:
    out = tmp / "out"
    code = main(["run", str(_profile(tmp, candidate_env)), "--out", str(out), "--quiet"])
    return code, json.loads((out / "record.json").read_text())


@needs_manager
@pytest.mark.parametrize(
    ("scrape", "stage", "completed"),
    [(1, "before the workload", 0), (2, "after the workload", 2)],
)
def test_engine_dying_mid_arm_is_a_failed_arm_in_the_record(
    tmp_path: Path,
    scrape: int,
    stage: str,
    completed: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The candidate's engine exits on its n-th /metrics scrape. The run must not escape
    with aiohttp's ClientConnectorError: the arm fails with a one-line reason, the record
    is written with the baseline's finished figures, and the exit status is the gate's."""
    code, record = _run(tmp_path, {"FAKE_DIE_ON_METRICS": str(scrape)})
    assert code == 1
    assert "Traceback" not in capsys.readouterr().err
    (pair,) = record["cells"][0]["pairs"]  # type: ignore[index]
    base, cand = pair["baseline"], pair["candidate"]
    assert base["completed"] == 2 and base["error"] is None and base["throughput"] > 0
    assert cand["started"] is True and cand["completed"] == completed
    assert cand["error"].startswith(f"engine stopped answering /metrics {stage}: ")
    assert cand["error"].endswith("(server exited with status 3)")
    assert "\n" not in cand["error"]
    assert any(
        f.startswith("c: no-failed-or-starved: repeat 0 candidate") and stage in f
        for f in record["gate"]["failures"]  # type: ignore[index]
    )


@needs_manager
def test_recomputed_prompt_tokens_subtracts_the_clients_prompt_tokens(tmp_path: Path) -> None:
    """qualification.md §4: recomputed = local_compute delta - the prompt tokens the server
    reported in each stream's usage chunk; with any response lacking usage (the candidate
    here) the figure is unavailable (None), never the raw delta under that name."""
    _, record = _run(tmp_path, {"FAKE_NO_USAGE": "1"})
    (pair,) = record["cells"][0]["pairs"]  # type: ignore[index]
    words = len(PARAGRAPH.split())
    # Request r-i: "Request 0-i." (2 words) + the paragraph repeated 2 and 3 times.
    prompts = [2 + 2 * words, 2 + 3 * words]
    base, cand = pair["baseline"]["extra"], pair["candidate"]["extra"]
    assert base["client_prompt_tokens"] == sum(prompts)
    assert base["prompt_tokens_local_compute"] == sum(prompts) + 2 * RECOMPUTE
    assert base["recomputed_prompt_tokens"] == 2 * RECOMPUTE
    assert cand["prompt_tokens_local_compute"] == sum(prompts) + 2 * RECOMPUTE
    assert cand["client_prompt_tokens"] is None and cand["recomputed_prompt_tokens"] is None


def _events(calls: int, selections: int, enabled: int) -> str:
    return (
        "# HELP vllm:preemption_policy_events Policy events.\n"
        "# TYPE vllm:preemption_policy_events counter\n"
        f'vllm:preemption_policy_events_total{{engine="0",event="calls"}} {calls}\n'
        f'vllm:preemption_policy_events_total{{engine="1",event="calls"}} {calls}\n'
        f'vllm:preemption_policy_events_total{{engine="0",event="selections"}} {selections}\n'
        f"vllm:preemption_policy_enabled {enabled}\n"
    )


def test_policy_counters_and_enabled_gauge_from_metrics() -> None:
    """Deltas per event summed over engines; an event with no series in a family that is
    there has counted nothing (a label set exists only once used); the enabled gauge reads
    1 as enabled."""
    before = parse_prometheus(_events(2, 1, 1))
    counters, enabled = counters_from_metrics(before, parse_prometheus(_events(7, 3, 1)))
    assert counters == {"calls": 10, "selections": 2, "abstentions": 0, "failures": 0,
                        "invalid_selections": 0}
    assert enabled is True
    _, enabled = counters_from_metrics(before, parse_prometheus(_events(7, 3, 0)))
    assert enabled is False


@pytest.mark.parametrize(("gauges", "enabled"), [
    (['{engine="0"} 1', '{engine="1"} 1'], True),
    (['{engine="0"} 0', '{engine="1"} 1'], False),  # one engine of two: not enabled
    ([" 2"], False),  # the gauge is 0 or 1; 2 is no "= 1"
    ([], None),  # no gauge: unknown
])
def test_the_enabled_gauge_must_read_1_on_every_engine(
    gauges: list[str], enabled: bool | None
) -> None:
    """qualification.md section 6 gate 8: "Policy enabled (gauge = 1)". The gauge's series
    were summed and read as enabled from 1 up, so a data-parallel run with the policy
    enabled on one engine of two, or a gauge of 2, passed the gate."""
    text = "".join(f"vllm:preemption_policy_enabled{g}\n" for g in gauges)
    assert counters_from_metrics([], parse_prometheus(text))[1] is enabled


def test_policy_counters_from_the_managers_evidence(tmp_path: Path) -> None:
    """The largest counters seen (a later event may carry a smaller snapshot), the last
    enabled flag and policy name; a torn line does not hide the others."""
    lines = [
        {"event": "effective", "stats": {"calls": 5, "selections": 2, "enabled": True,
                                         "policy_name": "bidkv"}},
        {"event": "effective", "stats": {"calls": 3, "selections": 1, "enabled": False}},
    ]
    path = tmp_path / "runtime-evidence.jsonl"
    path.write_text(json.dumps(lines[0]) + "\n" + '{"stats": {"calls": 9' + "\n"
                    + json.dumps(lines[1]) + "\n")
    assert counters_from_evidence(path) == ({"calls": 5, "selections": 2}, False, "bidkv")


def test_policy_enabled_from_the_engine_log() -> None:
    line = "INFO Preemption policy initialized: policy={} enabled={}\n"
    restarted = line.format("builtin", "True") + line.format("bidkv_ext.selector.P", "True")
    assert enabled_from_log(restarted) == (True, "bidkv_ext.selector.P")  # the last line
    assert enabled_from_log(line.format("builtin", "True")) == (False, "builtin")
    assert enabled_from_log("no such line") == (None, None)


def test_tp_ranks_are_the_decimal_captures_of_the_pattern() -> None:
    """qualification.md §6 gate 5 compares the TP ranks each arm's log names. A loose
    pattern may capture words: only a decimal capture is a rank, in any script ``int``
    reads (``٢`` is 2), and ``²`` (a digit ``int`` refuses) is none rather than a crash
    of the arm. Each rank once, ascending."""
    log = "\n".join(f"worker rank={r} ready" for r in ("3", "0", "x", "-1", "²", "٢", "3"))
    assert tp_ranks_from_log(log, r"rank=(\S+)") == (0, 2, 3)
    ascend = load_profile("ascend-tp4").server
    assert ascend is not None and ascend.tp_rank_pattern
    assert tp_ranks_from_log("(W TP rank 1) (W tp_rank=0)", ascend.tp_rank_pattern) == (0, 1)
    assert tp_ranks_from_log("no ranks here", ascend.tp_rank_pattern) == ()
