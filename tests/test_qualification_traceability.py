"""Guards the qualification.md clauses that the traceability audit found with code but no
test that would fail if the code broke (§3, §4, §6 gates 2/3/5/6, §7 rule order, §8, §9):

- §3 requests: every workload request goes out streaming with the profile's temperature
  (0), seed (7) and ``ignore_eos``, and the warm-up is a 16-token deterministic request;
  the client keeps at most the cell's concurrency in flight and sends no request before
  its arrival delay; the shipped GPU profiles default to Stage 2's three pairs and the
  CUDA lane keeps the deterministic request shape and the 1 s drain bound;
- §4 per arm, read by a real serve arm (`vllm-hust-ext run` and a local stand-in for
  `vllm serve`): output throughput is the completed requests' output tokens over the
  makespan; graph capture and the TP ranks seen come from the engine log through the
  Ascend lane's own patterns, and tracebacks are counted there; a request past its timeout
  is starved, not failed;
- §6: gate 3's drain waits for 0 running **and** 0 waiting; gates 2, 5 and 6 fail for the
  arm and repeat at fault only;
- §7: rule 2 (a failed gate) outranks rule 3 (a repeat without calls), and rule 3 ("check
  calls > 0 before comparing") outranks rules 4 and 5;
- §8: the ascending-mixed Stage 2 intervals reproduce from their per-repeat deltas, and
  the record and report.md list the candidate's calls per repeat;
- §1, §9: the record names the extension's commit, the GPU model and driver (the
  `nvidia-smi` query) and the KV budget.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from qualification.cli import main
from qualification.client import RequestSpec, Sampling, run_requests
from qualification.profile import PROFILE_DIR, load_profile
from qualification.report import write_markdown
from qualification.runner import build_record
from qualification.stats import summarize_deltas
from qualification.verdict import Pair, evaluate_cell
from tests.serve_helpers import needs_manager, serve_profile, stand_in_script
from tests.verdict_helpers import arm_result

RECOVERY = "BIDKV_MATRIX_CANCEL_RECOVERY_OK"
REPO = Path(__file__).resolve().parent.parent


# --- §7: the verdict rules' order -------------------------------------------------------


def _cell(candidate: list[tuple[float, float]], calls: list[int], **kw: object) -> str:
    pairs = [
        Pair("c", r, "baseline", arm_result("baseline", 100.0, 10.0),
             arm_result("candidate", thr, p95, calls=n, **kw))
        for r, ((thr, p95), n) in enumerate(zip(candidate, calls, strict=True))
    ]
    return evaluate_cell("c", pairs, cancel_bound_s=None, tensor_parallel_size=1).label


UP = [(105.0, 9.9), (106.0, 10.0), (107.0, 10.1)]  # beneficial with calls in every repeat
DOWN = [(74.06, 13.4), (74.99, 13.5), (75.0, 13.45)]  # §8 interactive: not-beneficial


def test_a_failed_gate_outranks_a_repeat_without_calls() -> None:
    """Rule 2 before rule 3: a starved request in the candidate arms and no policy call in
    repeat 1 is `gate-failed` (the cell fails), not `inconclusive`."""
    assert _cell(UP, [10, 10, 10]) == "beneficial"
    assert _cell(UP, [10, 0, 10]) == "inconclusive"
    assert _cell(UP, [10, 0, 10], starved=1, completed=3) == "gate-failed"


@pytest.mark.parametrize(("figures", "compared"), [(UP, "beneficial"),
                                                   (DOWN, "not-beneficial-in-tested-cell")])
def test_calls_are_checked_before_the_intervals_are_compared(
    figures: list[tuple[float, float]], compared: str
) -> None:
    """Rule 3 before rules 4 and 5 (§9 "check before comparing"): intervals that clear the
    `beneficial` or the `not-beneficial` bar do not count when repeat 2 made no call."""
    assert _cell(figures, [24, 24, 24]) == compared
    assert _cell(figures, [24, 24, 0]) == "inconclusive"


# --- §8: the reported Stage 2 intervals ---------------------------------------------------


def test_the_ascending_mixed_intervals_reproduce_from_their_deltas() -> None:
    """§8 ascending mixed: throughput deltas +0.33, +138.38, +0.12 give mean +46.28 %, CI
    [-151.88, +244.44]; P95 latency mean -20.12 %, CI [-105.92, +65.68] from -0.27, x, -0.09
    (x = 3 * -20.12 + 0.36 = -60.00, the repeat §8 leaves out)."""
    # §8 computed from unrounded deltas (as §5's example): the two-decimal deltas land
    # within 0.02 of the reported bounds.
    thr = summarize_deltas([0.33, 138.38, 0.12])
    assert (thr.mean, thr.low, thr.high) == pytest.approx((46.28, -151.88, 244.44), abs=0.03)
    lat = summarize_deltas([-0.27, -60.00, -0.09])
    assert (lat.mean, lat.low, lat.high) == pytest.approx((-20.12, -105.92, 65.68), abs=0.02)


def test_the_calls_per_repeat_are_in_the_record_and_the_report(tmp_path: Path) -> None:
    """§7 rule 3 / §8 ("calls per repeat 63, 0, 63"): the record's cell and report.md's
    verdict table list the candidate's calls in every repeat, in repeat order."""
    pairs = [
        Pair("ascending", r, "baseline", arm_result("baseline", 100.0, 10.0),
             arm_result("candidate", thr, p95, calls=n))
        for r, ((thr, p95), n) in enumerate(zip(UP, [63, 0, 63], strict=True))
    ]
    outcome = evaluate_cell("ascending", pairs, cancel_bound_s=None, tensor_parallel_size=1)
    assert outcome.as_dict()["calls_per_repeat"] == [63, 0, 63]
    record = build_record(load_profile("cuda"), [outcome], 3)
    write_markdown(tmp_path / "report.md", record, [outcome])
    row = next(line for line in (tmp_path / "report.md").read_text().splitlines()
               if line.startswith("| ascending | 3 |"))
    assert row.startswith("| ascending | 3 | [63, 0, 63] |") and "**inconclusive**" in row


# --- §9: what the record names ----------------------------------------------------------


def test_the_record_names_the_gpu_model_and_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """§9 "Record GPU model, driver": a CUDA record carries what `nvidia-smi` answers to a
    query for the GPU name and driver version (a stand-in `nvidia-smi` on PATH here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    asked = tmp_path / "asked.json"
    fake = bin_dir / "nvidia-smi"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        f"open({str(asked)!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
        "print('NVIDIA H200, 570.86.15, 143771 MiB')\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin")
    record = build_record(load_profile("cuda"), [], 3)
    accelerator = record["accelerator"]
    assert isinstance(accelerator, dict)
    assert accelerator["kind"] == "cuda"
    assert accelerator["devices"] == ["NVIDIA H200, 570.86.15, 143771 MiB"]
    (query,) = [a for a in json.loads(asked.read_text()) if a.startswith("--query-gpu=")]
    assert {"name", "driver_version"} <= set(query.removeprefix("--query-gpu=").split(","))


def test_the_record_names_the_extensions_commit(tmp_path: Path) -> None:
    """§1 "exact commits ... recorded per lane" (§8 names each BidKV commit): the record
    carries this checkout's commit and whether the tree had changes; report.md names it."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=False)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    record = build_record(load_profile("cuda"), [], 3)
    extension = record["extension"]
    assert isinstance(extension, dict)
    assert extension["commit"] == head.stdout.strip()
    assert isinstance(extension["dirty"], bool)
    record["gate"] = {"passed": False}
    write_markdown(tmp_path / "report.md", record, [])
    assert f"(commit {head.stdout.strip()})" in (tmp_path / "report.md").read_text()


def test_the_record_names_the_kv_budget(tmp_path: Path) -> None:
    """§9: the KV budget (`--kv-cache-memory-bytes` or `--num-gpu-blocks-override`) is
    recorded with the lane, whichever the profile sets."""
    for name, budget in (("cuda", 2 << 30), ("ascend-tp4", 1 << 30)):
        lane = build_record(load_profile(name), [], 3)["profile"]
        assert isinstance(lane, dict)
        assert (lane["kv_cache_memory_bytes"], lane["num_gpu_blocks_override"]) == (budget, None)
    text = (PROFILE_DIR / "cuda.toml").read_text()
    variant = tmp_path / "blocks.toml"
    variant.write_text(text.replace("kv_cache_memory_bytes = 2147483648",
                                    "num_gpu_blocks_override = 512"))
    lane = build_record(load_profile(str(variant)), [], 3)["profile"]
    assert isinstance(lane, dict)
    assert (lane["kv_cache_memory_bytes"], lane["num_gpu_blocks_override"]) == (None, 512)


# --- §3: the shipped GPU profiles ---------------------------------------------------------


@pytest.mark.parametrize("name", ["cuda", "ascend-tp4"])
def test_gpu_profiles_run_stage_two_with_the_deterministic_request_shape(name: str) -> None:
    """§3 Stage 2 (three pairs per cell) is the default; §3 and §9 ("same cells ... gates"):
    temperature 0, seed 7, ignore_eos, a 16-token warm-up, the exact recovery text and
    §6 gate 3's 1 s drain bound in both GPU lanes."""
    profile = load_profile(name)
    w = profile.workload
    assert profile.repeats == 3
    assert (w.temperature, w.seed, w.ignore_eos, w.warmup_max_tokens) == (0.0, 7, True, 16)
    assert (w.recovery_expected, w.cancel_drain_bound_s) == (RECOVERY, 1.0)


# --- §3: the client's concurrency and arrival delays ------------------------------------


class _HoldingServer(ThreadingHTTPServer):
    """Holds each completion until more than `limit` are in flight or `hold_s` passed, and
    records the most it ever saw in flight."""

    daemon_threads = True

    def __init__(self, limit: int, hold_s: float) -> None:
        super().__init__(("127.0.0.1", 0), _HoldingHandler)
        self.limit, self.hold_s = limit, hold_s
        self.cond = threading.Condition()
        self.in_flight = 0
        self.most = 0


class _HoldingHandler(BaseHTTPRequestHandler):
    server: _HoldingServer

    def do_POST(self) -> None:
        srv = self.server
        self.rfile.read(int(self.headers["Content-Length"]))
        with srv.cond:
            srv.in_flight += 1
            srv.most = max(srv.most, srv.in_flight)
            srv.cond.notify_all()
            srv.cond.wait_for(lambda: srv.in_flight > srv.limit, timeout=srv.hold_s)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b'data: {"choices": [{"text": " x"}]}\n\n')
        self.wfile.flush()
        with srv.cond:  # before [DONE]: the client cannot start the next one earlier
            srv.in_flight -= 1
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def holding_server() -> Iterator[_HoldingServer]:
    server = _HoldingServer(limit=2, hold_s=1.0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _send(server: _HoldingServer, specs: list[RequestSpec], concurrency: int) -> list[float]:
    url = f"http://127.0.0.1:{server.server_address[1]}"
    sampling = Sampling("m", 0.0, 7, True)
    results, _ = asyncio.run(
        run_requests(url, sampling, specs, concurrency=concurrency, timeout_s=30.0)
    )
    assert all(r.ok for r in results), [r.error for r in results]
    return [r.sent_at for r in results]


def test_the_client_keeps_at_most_the_cells_concurrency_in_flight(
    holding_server: _HoldingServer,
) -> None:
    """§3 "Concurrency": five requests arriving at once with concurrency 2 never put a
    third in flight (the server holds two for a second, waiting for a third)."""
    specs = [RequestSpec(i, f"p{i}", 1) for i in range(5)]
    _send(holding_server, specs, concurrency=2)
    assert holding_server.most == 2


def test_no_request_is_sent_before_its_arrival_delay(holding_server: _HoldingServer) -> None:
    """§3 "Arrival delays": a request goes out no earlier than its delay after the cell
    starts (a lower bound only; the clock's resolution allowed)."""
    delays = [0.0, 0.3, 0.6]
    specs = [RequestSpec(i, f"p{i}", 1, delay) for i, delay in enumerate(delays)]
    sent = _send(holding_server, specs, concurrency=3)
    assert all(at >= delay - 1e-3 for at, delay in zip(sent, delays, strict=True)), sent


# --- §3, §4, §6 through a real serve arm -------------------------------------------------

STAND_IN = stand_in_script(
    about="""\
# A stand-in for `vllm serve` that logs like a TP-4 graph-mode engine. FAKE_FAULTY=1 (the
# candidate) logs no graph capture, only TP ranks 0-2 and a traceback, and stalls request 1
# past the client's timeout. /metrics reports one waiting request on its 2nd and 3rd
# scrapes (the drain), and each POST is written to FAKE_POSTS with the scrape count.
""",
    setup="""\
POSTS = os.environ["FAKE_POSTS"]
FAULTY = os.environ.get("FAKE_FAULTY") == "1"
STALL_S = float(os.environ["FAKE_STALL_S"])
lock = threading.Lock()
state = {"running": 0, "scrapes": 0, "posts": 0}

ranks = ["(Worker rank=0) ready", "(Worker tp_rank=1) ready", "(Worker TP rank 2) ready",
         "(Worker rank=3) ready"]
print("\\n".join(ranks[:3] if FAULTY else ranks), flush=True)
if FAULTY:
    print('Traceback (most recent call last):\\n  File "w.py", line 1\\nValueError: x',
          file=sys.stderr, flush=True)
else:
    print("INFO Graph capturing finished in 2 secs", flush=True)
""",
    handler=f"""\
    def do_GET(self):
        if self.path == "/health":
            return self._send(b"ok")
        with lock:
            state["scrapes"] += 1
            waiting = 1 if state["scrapes"] in (2, 3) else 0
            body = (
                f"vllm:num_requests_running {{state['running']}}\\n"
                f"vllm:num_requests_waiting {{waiting}}\\n"
                f'vllm:preemption_policy_events_total{{{{event="calls"}}}} {{state["posts"]}}\\n'
                'vllm:preemption_policy_events_total{{event="failures"}} 0\\n'
                'vllm:preemption_policy_events_total{{event="invalid_selections"}} 0\\n'
                "vllm:preemption_policy_enabled 1\\n"
            )
        self._send(body.encode())

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with lock:
            state["posts"] += 1
            with open(POSTS, "a") as f:
                f.write(json.dumps({{"scrapes": state["scrapes"], **req}}) + "\\n")
        if FAULTY and req["prompt"].startswith("Request 0-1."):
            time.sleep(STALL_S)  # the client gives up first: a starved request
            return
        with lock:
            state["running"] += 1
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            if "{RECOVERY}" in req["prompt"]:
                texts = ["{RECOVERY}"]
            else:
                texts = [f" t{{i}}" for i in range(req["max_tokens"])]
            for text in texts:
                self._chunk({{"choices": [{{"text": text}}]}})
                time.sleep(0.01)
            usage = {{"prompt_tokens": 3, "completion_tokens": len(texts)}}
            self._chunk({{"choices": [], "usage": usage}})
            self.wfile.write(b"data: [DONE]\\n\\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client cancelled the stream
        finally:
            with lock:
                state["running"] -= 1
""",
)

TIMEOUT_S = 3.0
MAX_TOKENS = 60  # 10 ms a token: every stream outlasts the 0.3 s cancel


def _tp4_profile(tmp: Path) -> Path:
    """A TP-4 graph-mode cancel cell with the Ascend lane's log patterns."""
    ascend = load_profile("ascend-tp4").server
    assert ascend is not None and ascend.tp_rank_pattern and ascend.graph_capture_pattern
    return serve_profile(
        tmp,
        "tp4",
        STAND_IN,
        accelerator="ascend",
        top="tensor_parallel_size = 4\n",
        graph_mode="FULL_DECODE_ONLY",
        server=f"""\
device_snapshot_command = []
graph_capture_pattern = "{ascend.graph_capture_pattern}"
tp_rank_pattern = '{ascend.tp_rank_pattern}'
environment = {{ FAKE_POSTS = "{tmp / 'baseline.jsonl'}", FAKE_STALL_S = "{TIMEOUT_S + 1}" }}
candidate_environment = {{ FAKE_POSTS = "{tmp / 'candidate.jsonl'}", FAKE_FAULTY = "1" }}
""",
        workload=f"""\
paragraph = "one two three. "
seed = 7
temperature = 0.0
ignore_eos = true
warmup_max_tokens = 16
request_timeout_s = {TIMEOUT_S}
cancel_drain_bound_s = 5.0
recovery_expected = "{RECOVERY}"
""",
        cells=f"""\
name = "burst"
paragraph_repeats = [2, 3]
num_requests = 4
concurrency = 4
max_tokens = {MAX_TOKENS}
cancel_after_s = 0.3
""",
    )


@needs_manager
def test_a_serve_arm_reads_the_spec_figures_and_gates_the_arm_at_fault(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One pair through `python -m qualification run`: the baseline logs graph capture and
    TP ranks 0-3; the candidate logs ranks 0-2, no capture and a traceback, and stalls a
    request past its timeout. §3 request shape, §4 throughput and log facts, §6 gates 2,
    3, 5, 6 as the module docstring says."""
    out = tmp_path / "out"
    assert main(["run", str(_tp4_profile(tmp_path)), "--out", str(out), "--quiet"]) == 1
    assert "Traceback" not in capsys.readouterr().err
    record = json.loads((out / "record.json").read_text())
    (cell,) = record["cells"]
    (pair,) = cell["pairs"]
    base, cand = pair["baseline"], pair["candidate"]

    for arm in ("baseline", "candidate"):
        posts = [json.loads(line) for line in (tmp_path / f"{arm}.jsonl").read_text().splitlines()]
        warmup, *workload, recovery = posts
        # §2 step 5 / §3: a deterministic 16-token warm-up, then streaming forced-length
        # requests at temperature 0 and seed 7.
        assert (warmup["max_tokens"], warmup["temperature"], warmup["seed"]) == (16, 0.0, 7)
        # Requests 1 and 3 run to completion (0 and 2 are cancelled, maybe before sending).
        assert {"Request 0-1.", "Request 0-3."} <= {r["prompt"][:12] for r in workload}
        for req in workload:
            assert (req["temperature"], req["seed"], req["ignore_eos"], req["stream"],
                    req["max_tokens"]) == (0.0, 7, True, True, MAX_TOKENS), req
        # §6 gate 3: two scrapes reported a waiting request; the drain went on to the
        # fourth scrape (0 running, 0 waiting) before the recovery request.
        assert recovery["prompt"].endswith(RECOVERY) and recovery["scrapes"] >= 4

    # §4 output throughput: completed requests' output tokens over the makespan.
    assert base["completed"] == 2 and base["output_tokens"] == 2 * MAX_TOKENS
    assert base["throughput"] == pytest.approx(
        base["output_tokens"] / base["extra"]["makespan_s"], rel=1e-12
    )
    # §4 log facts with the Ascend lane's patterns.
    assert (base["graph_captured"], base["tp_ranks"], base["tracebacks"]) == (
        True, [0, 1, 2, 3], 0)
    assert (cand["graph_captured"], cand["tp_ranks"], cand["tracebacks"]) == (
        False, [0, 1, 2], 1)
    # A request past its timeout is starved, not failed (§6 gate 2).
    assert (cand["requests"], cand["completed"], cand["failed"], cand["starved"]) == (
        2, 1, 0, 1)

    gates = {g["name"]: g for g in cell["gates"]}
    failed = {name for name, g in gates.items() if g["status"] == "fail"}
    assert failed == {"no-failed-or-starved", "graph-capture-and-tp-ranks", "zero-tracebacks"}
    for name in failed:
        assert gates[name]["detail"].startswith("repeat 0 candidate: "), gates[name]
        assert "baseline" not in gates[name]["detail"]
    assert gates["cancellation-drains"]["status"] == "pass"
    assert cell["verdict"] == "inconclusive"  # one pair: rule 1 comes first
