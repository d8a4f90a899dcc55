"""Guards the per-arm procedure and the rollback of qualification.md §2 and §10, with real
processes: a stand-in for `vllm serve`, launched through the real `vllm-hust-ext run`,
that starts an "engine core" child and hands it the BIDKV_UTILITY_* variables only when
VLLM_ENGINE_EXTRA_ENV_PREFIXES allows them, as the reference engine did.

- §2 step 3: every arm runs the device snapshot command once after /health and records
  its bounded output; a command that is missing, fails or hangs is recorded and never
  aborts the run; `run --dry-run`'s plan names the command for every serve arm;
- §2 step 4: the candidate arm records the policy environment that the manager, the
  engine server and its child actually hold, read from /proc/<pid>/environ; an engine
  child without BIDKV_UTILITY_* (the reference then initialised disabled) is reported in
  the record, report.md and the run's output;
- §2 step 7: each arm's record names its own log file, which holds that arm's server only;
- §10: `python -m qualification rollback` prints the plan and changes nothing unless
  asked; `--forget` disables and forgets through the real manager; `--verify-log` accepts
  only a built-in (or absent) policy in the restarted engine's log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from qualification.cli import main
from qualification.procedure import (
    SNAPSHOT_LIMIT,
    policy_environment,
    snapshot_command,
    snapshot_device,
)
from qualification.profile import load_profile
from tests.serve_helpers import MANAGER, needs_manager, serve_profile, stand_in_script

needs_proc = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="no Linux /proc")
BUNDLE = "org.vllm-hust.bidkv"

STAND_IN = stand_in_script(
    about="""\
# A stand-in for `vllm serve` with an engine-core child. The child gets BIDKV_UTILITY_*
# only when VLLM_ENGINE_EXTRA_ENV_PREFIXES names the prefix; the policy is enabled only
# when the child has BIDKV_UTILITY_ENABLE=1. Appends "<server pid> <child pid> <enabled>"
# to FAKE_PIDS before serving.
""",
    setup="""\
import subprocess

allowed = [p for p in os.environ.get("VLLM_ENGINE_EXTRA_ENV_PREFIXES", "").split(",") if p]
child_env = {
    k: v for k, v in os.environ.items()
    if not k.startswith("BIDKV_UTILITY_") or any(k.startswith(p) for p in allowed)
}
WATCH = "import os, time\\np = os.getppid()\\nwhile os.getppid() == p:\\n    time.sleep(0.2)\\n"
child = subprocess.Popen([sys.executable, "-c", WATCH], env=child_env)
POLICY = child_env.get("BIDKV_UTILITY_ENABLE") == "1"
print(f"engine core child pid={child.pid} policy={POLICY}", flush=True)
with open(os.environ["FAKE_PIDS"], "a") as f:
    f.write(f"{os.getpid()} {child.pid} {POLICY}\\n")
lock = threading.Lock()
state = {"posts": 0}
""",
    handler="""\
    def do_GET(self):
        if self.path == "/health":
            return self._send(b"ok")
        with lock:
            calls = state["posts"] if POLICY else 0
        body = (
            "vllm:num_requests_running 0\\nvllm:num_requests_waiting 0\\n"
            f"vllm:num_preemptions_total {calls}\\n"
            f'vllm:preemption_policy_events_total{{event="calls"}} {calls}\\n'
            'vllm:preemption_policy_events_total{event="failures"} 0\\n'
            'vllm:preemption_policy_events_total{event="invalid_selections"} 0\\n'
            f"vllm:preemption_policy_enabled {int(POLICY)}\\n"
        )
        self._send(body.encode())

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with lock:
            state["posts"] += 1
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(req["max_tokens"]):
            self._chunk({"choices": [{"text": f" t{i}"}]})
            time.sleep(0.005)
        usage = {"prompt_tokens": len(req["prompt"].split()), "completion_tokens": 1}
        self._chunk({"choices": [], "usage": usage})
        self.wfile.write(b"data: [DONE]\\n\\n")
""",
)

SNAPSHOT = "print('index, memory.used [MiB]'); print('0, 1234 MiB')"


def _profile(tmp: Path, snapshot: list[str], candidate_env: str) -> Path:
    return serve_profile(
        tmp,
        "procedure",
        STAND_IN,
        server=f"""\
device_snapshot_command = {json.dumps(snapshot)}
environment = {{ FAKE_PIDS = "{tmp / 'pids'}" }}
candidate_environment = {candidate_env}
""",
        workload="""\
paragraph = "one two three. "
request_timeout_s = 20
""",
        cells="""\
name = "c"
paragraph_repeats = [2]
num_requests = 2
concurrency = 2
max_tokens = 8
""",
    )


def _run(tmp: Path, snapshot: list[str], candidate_env: str) -> tuple[int, dict[str, Any]]:
    out = tmp / "out"
    code = main(["run", str(_profile(tmp, snapshot, candidate_env)), "--out", str(out), "--quiet"])
    return code, json.loads((out / "record.json").read_text())


def _pids(tmp: Path) -> dict[bool, tuple[int, int]]:
    """policy enabled -> (server pid, child pid), one line per arm."""
    rows = [line.split() for line in (tmp / "pids").read_text().splitlines()]
    return {enabled == "True": (int(server), int(child)) for server, child, enabled in rows}


@needs_manager
@needs_proc
def test_each_arm_records_its_snapshot_and_the_candidate_its_engine_childs_environment(
    tmp_path: Path,
) -> None:
    """§2 steps 3, 4, 7: both arms record the snapshot's output; the candidate records
    the manager (depth 0), the engine server (1) and its real child (2), whose
    /proc/<pid>/environ carries the bundle's BIDKV_UTILITY_* variables and the allowlist;
    each arm's log is its own."""
    allow = '{ VLLM_ENGINE_EXTRA_ENV_PREFIXES = "BIDKV_UTILITY_" }'
    code, record = _run(tmp_path, [sys.executable, "-c", SNAPSHOT], allow)
    assert code == 0, record["gate"]
    (pair,) = record["cells"][0]["pairs"]
    pids = _pids(tmp_path)
    for arm in ("baseline", "candidate"):
        facts = pair[arm]["procedure"]
        snap = facts["device_snapshot"]
        assert (snap["status"], snap["exit_code"]) == ("ok", 0)
        assert "0, 1234 MiB" in snap["output"] and snap["command"][0] == sys.executable
        log = tmp_path / "out" / "cells" / "c" / "rep-0" / arm / facts["log"]["path"]
        assert facts["log"]["bytes"] == log.stat().st_size
        own, other = pids[arm == "candidate"][1], pids[arm != "candidate"][1]
        assert f"child pid={own} " in log.read_text()
        assert f"child pid={other} " not in log.read_text()
    assert "policy_environment" not in pair["baseline"]["procedure"]  # candidate only
    env = pair["candidate"]["procedure"]["policy_environment"]
    assert env["status"] == "carried", env
    by_depth = {p["depth"]: p for p in env["processes"]}
    server_pid, child_pid = pids[True]
    assert "vllm-hust-ext" in by_depth[0]["command"] and by_depth[0]["ppid"] == os.getpid()
    assert (by_depth[1]["pid"], by_depth[2]["pid"], by_depth[2]["ppid"]) == (
        server_pid, child_pid, server_pid
    )
    child_env = by_depth[2]["policy_environment"]
    assert child_env["BIDKV_UTILITY_ENABLE"] == "1"
    assert child_env["VLLM_ENGINE_EXTRA_ENV_PREFIXES"] == "BIDKV_UTILITY_"
    assert not any(k.startswith("FAKE") for k in child_env)  # only the policy's variables
    assert record["procedure_notes"] == []
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Per-arm procedure" in report and "| c | 0 | candidate | ok | carried |" in report


@needs_manager
@needs_proc
def test_a_child_without_the_policy_environment_and_a_missing_snapshot_tool_are_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without the allowlist the engine server holds BIDKV_UTILITY_* but its child does
    not: the record, report.md and the run's output say so, and the policy-enabled gate
    fails; a snapshot command not on the machine is
    recorded as missing and the arms still run to the end."""
    missing = str(tmp_path / "no-such-smi")
    code, record = _run(tmp_path, [missing], "{}")
    (cell,) = record["cells"]
    gates = {g["name"]: g["status"] for g in cell["gates"]}
    assert code == 1 and gates["policy-enabled-and-invoked"] == "fail"
    assert gates["no-failed-or-starved"] == "pass"  # both arms ran their workload
    (pair,) = cell["pairs"]
    for arm in ("baseline", "candidate"):
        snap = pair[arm]["procedure"]["device_snapshot"]
        assert snap["status"] == "missing" and "no-such-smi" in snap["detail"]
    env = pair["candidate"]["procedure"]["policy_environment"]
    assert env["status"] == "missing"
    by_depth = {p["depth"]: p for p in env["processes"]}
    assert by_depth[1]["policy_environment"]["BIDKV_UTILITY_ENABLE"] == "1"
    assert by_depth[2]["policy_environment"] == {}
    (note,) = record["procedure_notes"]
    assert note.startswith("c rep 0 candidate: no engine child process carries BIDKV_UTILITY_*")
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"- **policy environment missing**: {note}" in report
    assert f"policy environment missing: {note}" in capsys.readouterr().out


def test_a_failing_hanging_or_verbose_snapshot_command_is_recorded_never_raised() -> None:
    """§2 step 3 must not abort the run: a non-zero exit keeps its output and last stderr
    line, a hang is cut off, output beyond the bound is truncated."""
    failing = "import sys; print('partial'); sys.stderr.write('no devices\\n'); sys.exit(3)"
    snap = snapshot_device([sys.executable, "-c", failing])
    assert (snap.status, snap.exit_code, snap.output, snap.detail) == (
        "failed", 3, "partial\n", "no devices"
    )
    hung = snapshot_device([sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=0.5)
    assert hung.status == "timeout" and hung.exit_code is None
    big = snapshot_device([sys.executable, "-c", f"print('x' * {2 * SNAPSHOT_LIMIT})"])
    assert big.status == "ok" and big.truncated and len(big.output) == SNAPSHOT_LIMIT


def test_the_snapshot_command_defaults_per_lane_and_a_profile_overrides_it(
    tmp_path: Path,
) -> None:
    """nvidia-smi's memory query for cuda, `npu-smi info` for ascend, none elsewhere or
    when a profile sets []; a shipped profile uses its lane's default."""
    cuda = snapshot_command(None, "cuda")
    assert cuda[0] == "nvidia-smi" and "memory.used" in cuda[1] and "--format=csv" in cuda
    assert snapshot_command(None, "ascend") == ("npu-smi", "info")
    assert snapshot_command(None, "cpu") == () and snapshot_command([], "cuda") == ()
    assert snapshot_command(["x", "y"], "cuda") == ("x", "y")
    for name in ("cuda", "ascend-tp4"):
        server = load_profile(name).server
        assert server is not None and server.device_snapshot_command is None
    none = snapshot_device(())
    assert none.status == "none"


def test_the_dry_run_plan_names_each_serve_arms_snapshot_command() -> None:
    """``run --dry-run`` shows what step 3 will run after /health, per serve arm: the
    lane's default for both GPU profiles; replay arms have no server to snapshot."""
    from qualification.runner import launch_plan

    for name, program in (("cuda", "nvidia-smi"), ("ascend-tp4", "npu-smi")):
        arms = launch_plan(load_profile(name), repeats=1)["arms"]
        assert isinstance(arms, list) and arms
        assert {tuple(a["device_snapshot_command"]) for a in arms} == {
            snapshot_command(None, load_profile(name).accelerator)
        }
        assert arms[0]["device_snapshot_command"][0] == program
    replay = launch_plan(load_profile("cpu-replay"), repeats=1)["arms"]
    assert isinstance(replay, list) and all("device_snapshot_command" not in a for a in replay)


def test_the_policy_environment_is_unavailable_without_proc(tmp_path: Path) -> None:
    """Only Linux /proc is read: without the process's directory the fact is
    'unavailable', not an error."""
    env = policy_environment(os.getpid(), proc_root=tmp_path)
    assert env.status == "unavailable" and env.processes == ()


# --- §10 rollback ----------------------------------------------------------------------


def _state(config: Path) -> dict[str, Any]:
    return json.loads(config.read_text())["extensions"]  # type: ignore[no-any-return]


def test_rollback_prints_the_plan_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without flags: the §10 steps with their exact commands, no manager call."""
    config = tmp_path / "config.json"
    monkeypatch.setenv("VLLM_HUST_EXT_CONFIG", str(config))
    assert main(["rollback"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"1. disable the bundle: vllm-hust-ext extension disable {BUNDLE}"
    assert any("restart the engine without --preemption-policy" in line for line in out)
    assert any(line.endswith(f"extension forget {BUNDLE}") for line in out)
    assert any("pip uninstall vllm-hust-bidkv" in line for line in out)
    assert any("--verify-log" in line for line in out)
    assert not config.exists()


@needs_manager
def test_rollback_forget_disables_then_forgets_through_the_manager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """§10 step 2 on the operator's state: an enabled bundle is disabled, then forgotten
    (the manager refuses to forget an enabled one); a refusal exits 1 with its line."""
    config = tmp_path / "config.json"
    monkeypatch.setenv("VLLM_HUST_EXT_CONFIG", str(config))
    subprocess.run([MANAGER, "extension", "enable", BUNDLE], check=True, capture_output=True)
    assert _state(config)[BUNDLE]["enabled"] is True
    assert main(["rollback", "--forget"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"disabled {BUNDLE}", f"forgot {BUNDLE}"]
    assert BUNDLE not in _state(config)
    config.write_text("not json")
    assert main(["rollback", "--disable"]) == 1
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and said[0].startswith(f"extension disable {BUNDLE} failed (exit")


def test_rollback_verify_log_accepts_only_the_builtin_or_no_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """§10 step 4: `policy=builtin enabled=False` or no policy line passes; any line that
    still names a policy fails (exit 1); an unreadable log is bad input (exit 2, one line)
    and is checked before any manager step runs."""
    builtin = "INFO Preemption policy initialized: policy=builtin enabled=False\n"
    active = "INFO Preemption policy initialized: policy=bidkv_ext.selector.X enabled=True\n"
    cases = [(builtin * 2, 0), ("INFO engine up\n", 0), (builtin + active, 1)]
    for text, expected in cases:
        log = tmp_path / "engine.log"
        log.write_text(text)
        assert main(["rollback", "--verify-log", str(log)]) == expected
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "fallback verified: 2 policy line(s), all policy=builtin enabled=False"
    assert out[1].startswith("fallback verified: no 'Preemption policy initialized' line")
    assert out[2] == (
        "fallback NOT verified: 1 of 2 policy line(s) name a policy: "
        "policy=bidkv_ext.selector.X enabled=True"
    )
    config = tmp_path / "config.json"
    monkeypatch.setenv("VLLM_HUST_EXT_CONFIG", str(config))
    assert main(["rollback", "--forget", "--verify-log", str(tmp_path / "absent.log")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qualification: error: --verify-log ") and err.count("\n") == 1
    assert "Traceback" not in err and not config.exists()
