"""Guards the qualification method clause by clause (qualification.md §1-§3, §5, §8):

- the GPU profiles' lanes (§1): the Ascend lane runs Qwen3.8-27B with TP 4 on NPUs 0-3,
  FULL_DECODE_ONLY graphs captured at 1/2/4/8, a 1 GiB KV budget, and a max_model_len
  that fits that budget (vLLM refuses to start when one max_model_len sequence does not
  fit the KV cache); its prompts are the sizes §8 reports (700 paragraphs ~ 12,425
  tokens, the interactive pattern ~ 49,700); the CUDA lane's max_model_len fits its 2 GiB;
- the cells (§3): each cell's pattern, delays, concurrency, output length and the cancel
  burst (half the streams at 0 s, half at 2 s; every other stream from the first cancelled
  at 12 s), the same in both GPU lanes;
- one serve arm end to end (§2, §6 gate 4) through the real `vllm-hust-ext run` and a
  local stand-in for `vllm serve`: the warm-up comes after /health and before the first
  /metrics scrape, the workload between the two scrapes, the drain and the recovery
  request after the cancellations; the recovery request honours the end-of-sequence token
  so an engine that answers the exact text passes the exact-recovery gate;
- every reported figure gets a paired delta and interval (§5 "and any other reported
  metric", §8's P95 TPOT and Jain deltas), computed by hand here, and report.md carries
  the per-cell calls / selections / abstentions and preemption totals of §8;
- a cell declared but not run is `blocked` in the record's verdicts too (§3).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import pytest

from qualification.cli import main
from qualification.client import RequestResult
from qualification.errors import QualificationError
from qualification.figures import serve_figures
from qualification.profile import PROFILE_DIR, CellSpec, load_profile
from qualification.report import write_markdown
from qualification.runner import build_record
from qualification.serve import build_requests, serve_command
from qualification.verdict import COUNTER_NAMES, ArmResult, Pair, evaluate_cell
from tests.serve_helpers import needs_manager, serve_profile, stand_in_script

GIB = 1 << 30
# qualification.md §1: the Ascend lane's 1 GiB KV budget holds ~55,050 tokens.
ASCEND_TOKENS_PER_GIB = 55_050
# Llama-3.1-8B: 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes = 128 KiB a token.
LLAMA_8B_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2
# qualification.md §8: 4 concurrent prompts of 12,425 tokens (homogeneous-long, 700
# paragraphs) and a 49,700-prompt-token heterogeneous run (the interactive pattern).
REFERENCE_TOKENS_PER_PARAGRAPH = 12_425 / 700

# qualification.md §3, per cell: (pattern, delays, concurrency, max_tokens, requests,
# cancel_after_s). The CUDA lane scales the patterns down and keeps everything else.
SPEC_CELLS = {
    "homogeneous-long": ([700], [0.0], 4, 2048, 4, None),
    "homogeneous-ultralong": ([1500], [0.0], 4, 2048, 4, None),
    "mixed-length": ([1500, 600, 1200, 900], [0.0], 4, 2048, 4, None),
    "mixed-length-ascending-trigger": ([400, 650, 850, 1100], [0.0], 4, 2048, 4, None),
    "interactive-batch": (
        [12, 620, 20, 900, 30, 500, 16, 700], [0, 0, 1, 1, 2, 2, 4, 4], 8, 1024, 8, None,
    ),
    "burst-cancel-recovery": (
        [900, 700, 500, 380], [0, 0, 0, 0, 2, 2, 2, 2], 8, 2048, 8, 12.0,
    ),
}


def _word_pieces(text: str) -> int:
    """Words and punctuation marks: a BPE tokenizer gives an English word at least one
    token, so this is a close lower estimate of the paragraph's tokens."""
    return len(re.findall(r"\w+|[^\w\s]", text))


def test_the_ascend_lane_is_the_spec_lane() -> None:
    """§1: model, TP 4 on NPUs 0-3, FULL_DECODE_ONLY captured at 1/2/4/8, 1 GiB KV, both
    lane cores in the host range; the candidate passes BIDKV_UTILITY_* to the engine core."""
    profile = load_profile("ascend-tp4")
    server = profile.server
    assert server is not None
    assert profile.model == "Qwen3.8-27B" and profile.tensor_parallel_size == 4
    assert server.environment == {"ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3"}
    assert server.candidate_environment == {"VLLM_ENGINE_EXTRA_ENV_PREFIXES": "BIDKV_UTILITY_"}
    argv = serve_command(profile)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"
    graph = json.loads(argv[argv.index("--compilation-config") + 1])
    assert graph == {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8]}
    assert "--enforce-eager" not in argv
    assert server.kv_cache_memory_bytes == GIB
    from packaging.specifiers import SpecifierSet

    lane = SpecifierSet(profile.host_version_range)
    assert {"0.28.1rc1.dev319", "0.28.1rc1.dev391"} <= set(lane.filter(
        ["0.28.1rc1.dev319", "0.28.1rc1.dev391"], prereleases=True))
    w = profile.workload
    assert (w.temperature, w.seed, w.ignore_eos, w.warmup_max_tokens) == (0.0, 7, True, 16)
    assert w.cancel_drain_bound_s == 1.0


@pytest.mark.parametrize("name", ["ascend-tp4", "cuda"])
def test_max_model_len_fits_the_kv_budget_and_the_longest_request(name: str) -> None:
    """vLLM refuses to start when one max_model_len sequence needs more KV cache than the
    budget holds; the longest prompt plus its forced outputs must still fit max_model_len
    (with 15 % headroom over the word-piece estimate of its tokens)."""
    profile = load_profile(name)
    server = profile.server
    assert server is not None and server.kv_cache_memory_bytes is not None
    assert server.max_model_len is not None
    if name == "ascend-tp4":
        capacity = server.kv_cache_memory_bytes / GIB * ASCEND_TOKENS_PER_GIB
    else:
        capacity = server.kv_cache_memory_bytes / LLAMA_8B_BYTES_PER_TOKEN
    assert server.max_model_len <= capacity
    per_paragraph = _word_pieces(profile.workload.paragraph)
    for cell in profile.cells:
        for spec in build_requests(profile, cell, 0):
            prompt = _word_pieces(spec.prompt)
            assert prompt * 1.15 + cell.max_tokens <= server.max_model_len, (cell.name, prompt)
    assert per_paragraph > 0


def test_the_ascend_prompts_are_the_sizes_the_spec_reports() -> None:
    """§8: 700 paragraphs made 12,425-token prompts and the interactive pattern (2,798
    paragraphs) 49,700 prompt tokens: ~17.75 tokens a paragraph. A paragraph twice as long
    would press the 1 GiB budget far harder than the reference cells did."""
    profile = load_profile("ascend-tp4")
    pieces = _word_pieces(profile.workload.paragraph)
    assert 0.8 * REFERENCE_TOKENS_PER_PARAGRAPH <= pieces <= 1.1 * REFERENCE_TOKENS_PER_PARAGRAPH
    interactive = next(c for c in profile.cells if c.name == "interactive-batch")
    assert sum(interactive.paragraph_repeats) * REFERENCE_TOKENS_PER_PARAGRAPH == (
        pytest.approx(49_700, rel=0.01)
    )


@pytest.mark.parametrize("name", ["ascend-tp4", "cuda"])
def test_cells_are_the_spec_cells(name: str) -> None:
    """§3 cell by cell; the CUDA lane (§9 "same cells") keeps every shape but the pattern,
    which it scales down to fit its budget, keeping its order of lengths."""
    profile = load_profile(name)
    assert [c.name for c in profile.cells] == list(SPEC_CELLS)
    for cell in profile.cells:
        pattern, delays, concurrency, max_tokens, count, cancel = SPEC_CELLS[cell.name]
        specs = build_requests(profile, cell, 0)
        assert len(specs) == count, cell.name
        assert [s.delay_s for s in specs] == [delays[i % len(delays)] for i in range(count)]
        assert (cell.concurrency, cell.max_tokens, cell.cancel_after_s) == (
            concurrency, max_tokens, cancel
        )
        if name == "ascend-tp4":
            assert list(cell.paragraph_repeats) == pattern
        else:
            got = list(cell.paragraph_repeats)
            assert len(got) == len(pattern)
            pairs = [(i, j) for i in range(len(got)) for j in range(len(got))]
            assert all(got[i] <= got[j] for i, j in pairs if pattern[i] < pattern[j]), cell.name


def test_the_cancel_burst_cancels_every_other_stream_from_the_first() -> None:
    """§3 burst-cancel-recovery: half the streams at 0 s, half at 2 s, every other stream
    cancelled at 12 s -- the first, third, ... as the reference workload cancelled them
    (its pattern's 900- and 500-paragraph requests), the others run to completion."""
    profile = load_profile("ascend-tp4")
    cell = next(c for c in profile.cells if c.name == "burst-cancel-recovery")
    specs = build_requests(profile, cell, 0)
    assert [s.cancel_at_s for s in specs] == [12.0, None] * 4
    cancelled = [s.prompt.count(profile.workload.paragraph) for s in specs if s.cancel_at_s]
    assert cancelled == [900, 500, 900, 500]


# --- one serve arm end to end -------------------------------------------------------

RECOVERY = "BIDKV_MATRIX_CANCEL_RECOVERY_OK"
STAND_IN = stand_in_script(
    about="""\
# A stand-in for `vllm serve`: logs what it is asked, in order, to FAKE_EVENTS; streams a
# token every 20 ms; answers the recovery prompt with its text and then its end-of-sequence
# (so ignore_eos makes it go on, as a real engine would); counts policy calls when
# FAKE_POLICY is set.
""",
    setup="""\
EVENTS = os.environ["FAKE_EVENTS"]
POLICY = os.environ.get("FAKE_POLICY") == "1"
lock = threading.Lock()
state = {"running": 0, "posts": 0, "local": 0}


def event(text):
    with lock, open(EVENTS, "a") as f:
        f.write(text + "\\n")
""",
    handler=f"""\
    def do_GET(self):
        event("GET " + self.path)
        if self.path == "/health":
            return self._send(b"ok")
        with lock:
            body = (
                f"vllm:num_requests_running {{state['running']}}\\n"
                "vllm:num_requests_waiting 0\\n"
                f"vllm:num_preemptions_total {{state['posts']}}\\n"
                f'vllm:prompt_tokens_by_source_total{{{{source="local_compute"}}}} '
                f"{{state['local']}}\\n"
            )
            if POLICY:
                body += (
                    f'vllm:preemption_policy_events_total{{{{event="calls"}}}} '
                    f"{{state['posts']}}\\n"
                    'vllm:preemption_policy_events_total{{event="failures"}} 0\\n'
                    'vllm:preemption_policy_events_total{{event="invalid_selections"}} 0\\n'
                    "vllm:preemption_policy_enabled 1\\n"
                )
        self._send(body.encode())

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        event(f"POST max_tokens={{req['max_tokens']}} ignore_eos={{req['ignore_eos']}} "
              f"prompt={{req['prompt'][:24]!r}}")
        prompt_tokens = len(req["prompt"].split())
        with lock:
            state["running"] += 1
            state["posts"] += 1
            state["local"] += prompt_tokens
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            if "{RECOVERY}" in req["prompt"]:
                texts = ["{RECOVERY}"]
                if req["ignore_eos"]:
                    texts += [f" t{{i}}" for i in range(req["max_tokens"] - 1)]
            else:
                texts = [f" t{{i}}" for i in range(req["max_tokens"])]
            for text in texts:
                self._chunk({{"choices": [{{"text": text}}]}})
                time.sleep(0.02)
            usage = {{"prompt_tokens": prompt_tokens, "completion_tokens": len(texts)}}
            self._chunk({{"choices": [], "usage": usage}})
            self.wfile.write(b"data: [DONE]\\n\\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client cancelled the stream
        finally:
            with lock:
                state["running"] -= 1
""",
)


def _cancel_profile(tmp: Path) -> Path:
    return serve_profile(
        tmp,
        "cancel",
        STAND_IN,
        top='blocked_cells = ["liveness-0"]\n',
        server=f"""\
environment = {{ FAKE_EVENTS = "{tmp / 'events-'}" }}
candidate_environment = {{ FAKE_POLICY = "1" }}
""",
        workload=f"""\
paragraph = "one two three. "
request_timeout_s = 20
cancel_drain_bound_s = 2.0
recovery_expected = "{RECOVERY}"
""",
        cells="""\
name = "burst"
paragraph_repeats = [2, 3]
delays_s = [0, 0, 0.2, 0.2]
num_requests = 4
concurrency = 4
max_tokens = 40
cancel_after_s = 0.4
""",
    )


def _collapsed(lines: list[str]) -> list[str]:
    """The stand-in's events with repeated /health polls and drain scrapes collapsed."""
    out: list[str] = []
    for line in lines:
        if not out or line != out[-1] or not line.startswith("GET"):
            out.append(line)
    return out


@needs_manager
def test_a_cancel_cell_arm_runs_the_procedure_in_order_and_recovers_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """§2 steps 3, 5, 6 in order per arm, then the drain and the recovery request (§3); the
    recovery request does not ignore the end-of-sequence token, so the exact answer passes
    §6 gate 4, and with every gate passing the run exits 0 (one pair: inconclusive)."""
    profile = _cancel_profile(tmp_path)
    # Both arms' servers append to one events file; the arms run one after the other.
    out = tmp_path / "out"
    code = main(["run", str(profile), "--out", str(out), "--quiet"])
    record = json.loads((out / "record.json").read_text())
    (cell,) = record["cells"]
    gates = {g["name"]: g for g in cell["gates"]}
    assert gates["recovers-after-restart"]["status"] == "pass", gates["recovers-after-restart"]
    assert gates["cancellation-drains"]["status"] == "pass", gates["cancellation-drains"]
    assert code == 0, record["gate"]
    assert "Traceback" not in capsys.readouterr().err
    (pair,) = cell["pairs"]
    for arm in ("baseline", "candidate"):
        result = pair[arm]
        assert result["recovery_ok"] is True
        assert result["requests"] == 2 and result["completed"] == 2  # 2 of 4 cancelled
        assert result["extra"]["cancelled"] == 2
    events = _collapsed((tmp_path / "events-").read_text().splitlines())
    # Two arms, one after the other: split at each arm's first /health.
    starts = [i for i, e in enumerate(events) if e == "GET /health"]
    assert len(starts) == 2
    for begin, end in zip(starts, [*starts[1:], len(events)], strict=True):
        arm = events[begin:end]
        assert arm[1].startswith("POST max_tokens=16 ignore_eos=True prompt='Answer with")
        assert arm[2] == "GET /metrics"  # the first scrape, after the warm-up
        workload = arm[3:7]
        assert all(e.startswith("POST max_tokens=40 ignore_eos=True") for e in workload)
        assert arm[7] == "GET /metrics"  # the drain
        assert arm[8].startswith("POST max_tokens=16 ignore_eos=False prompt='Reply with")
        assert arm[9:] == ["GET /metrics"]  # the second scrape, last
    assert record["verdicts"] == {"burst": "inconclusive", "liveness-0": "blocked"}


# --- paired deltas of every reported figure ----------------------------------------------


def _arm(arm: str, scale: float, jain: float, tpot95: float) -> ArmResult:
    counters = dict.fromkeys(COUNTER_NAMES, 0)
    if arm == "candidate":
        counters.update(calls=24, selections=2, abstentions=22)
    return ArmResult(
        arm=arm,  # type: ignore[arg-type]
        throughput=100.0 * scale, ttft_p50=1.0, ttft_p95=2.0, latency_p50=10.0,
        latency_p95=20.0 / scale, requests=8, completed=8, counters=counters,
        policy_enabled=arm == "candidate", preemptions=5.0 if arm == "baseline" else 7.0,
        short_hash="h", recovery_ok=None, tracebacks=0,
        extra={"tpot_p95": tpot95, "jain_fairness": jain, "goodput_rps": 0.5 * scale,
               "label": "not a number"},
    )


def test_every_reported_figure_gets_a_paired_delta_and_interval(tmp_path: Path) -> None:
    """§5: Δ = (candidate / baseline - 1) x 100 % per pair, matched by repetition, and
    mean ± t(0.975, n-1)·s/√n over the pairs -- for the extra figures too (§8 reports P95
    TPOT and Jain deltas); a figure no arm reports has no delta."""
    tpots = [(0.100, 0.099), (0.100, 0.101), (0.100, 0.0995)]
    jains = [(0.90, 0.88), (0.92, 0.92), (0.95, 0.93)]
    pairs = [
        Pair("c", r, "baseline", _arm("baseline", 1.0, jb, tb), _arm("candidate", 1.0, jc, tc))
        for r, ((tb, tc), (jb, jc)) in enumerate(zip(tpots, jains, strict=True))
    ]
    outcome = evaluate_cell("c", pairs, cancel_bound_s=None, tensor_parallel_size=1)
    expected_tpot = [(c / b - 1) * 100 for b, c in tpots]  # -1, +1, -0.5
    mean = statistics.fmean(expected_tpot)
    half = 4.303 * statistics.stdev(expected_tpot) / math.sqrt(3)
    tpot = outcome.deltas["tpot_p95"]
    assert list(tpot.deltas) == pytest.approx(expected_tpot)
    assert (tpot.mean, tpot.low, tpot.high) == pytest.approx(
        (mean, mean - half, mean + half), abs=5e-4
    )
    jain = outcome.deltas["jain_fairness"]
    assert list(jain.deltas) == pytest.approx([(c / b - 1) * 100 for b, c in jains])
    assert outcome.deltas["goodput_rps"].mean == pytest.approx(0.0)
    assert "label" not in outcome.deltas and "tpot_p99" not in outcome.deltas
    assert pairs[0].as_dict()["deltas_pct"]["tpot_p95"] == pytest.approx(-1.0)  # type: ignore[index]
    # The verdict still reads throughput and P95 latency only.
    assert outcome.label == "neutral"
    profile = load_profile(str(PROFILE_DIR / "cuda.toml"))
    record = build_record(profile, [outcome], 3)
    write_markdown(tmp_path / "report.md", record, [outcome])
    report = (tmp_path / "report.md").read_text()
    # §8's per-cell line: calls / selections / abstentions, and preemptions per arm.
    assert "| c | 72 / 6 / 66 | 0 / 0 | 15 / 21 |" in report
    assert f"| c | tpot_p95 | 3 | {mean:+.2f} | [{mean - half:+.2f}, {mean + half:+.2f}] |" in (
        report
    )


def test_serve_figures_feed_the_deltas_under_the_names_they_are_reported() -> None:
    """The serve arm's extra figures are the ones the deltas read."""
    from qualification.verdict import EXTRA_DELTA_METRICS

    result = RequestResult(0, True, 200, 0.0, 1.0, 11.0, 101, "x")
    figures = serve_figures([result], makespan_s=11.0)
    serve_extra = {k for k in figures if k not in ("ttft_p50", "ttft_p95", "e2e_p50", "e2e_p95")}
    assert serve_extra <= set(EXTRA_DELTA_METRICS)


def test_a_blocked_cell_that_also_runs_is_refused(tmp_path: Path) -> None:
    """A cell both run and declared blocked would get two verdicts."""
    text = (PROFILE_DIR / "cpu-replay.toml").read_text()
    variant = tmp_path / "both.toml"
    variant.write_text(text.replace("[manager]\n", 'blocked_cells = ["azure-conv-30s"]\n\n'
                                    "[manager]\n", 1))
    with pytest.raises(QualificationError, match="blocked_cells must be unique"):
        load_profile(str(variant))


def test_cell_spec_defaults_count_one_request_per_pattern_entry() -> None:
    """§3 "pattern cycled": without num_requests a cell sends one request per pattern
    entry (or per delay, whichever is longer)."""
    profile = load_profile("ascend-tp4")
    cell = CellSpec(name="x", paragraph_repeats=(1, 2, 3), delays_s=(0.0, 1.0))
    assert [s.prompt.count(profile.workload.paragraph) for s in
            build_requests(profile, cell, 0)] == [1, 2, 3]
