"""The whole chain ``vllm-hust-ext run -- bidkv-replay ...`` with the BidKV bundle.

The manager renders ``--preemption-policy bidkv_ext.selector.BidkvPreemptionPolicy`` and the
``BIDKV_UTILITY_*`` environment; the replay's host loads the policy through the controller
(``from_vllm_config``) and the controller counters in the report are non-zero under KV
pressure. The replay provides the contract itself, so the operator declares the protocol
version with ``extension configure`` first. Skips only when a console script is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HAVE_VLLM

BUNDLE = "org.vllm-hust.bidkv"
POLICY = "bidkv_ext.selector.BidkvPreemptionPolicy"
BIN = Path(sys.executable).parent


def _script(name: str) -> str:
    found = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if found is None:
        pytest.skip(f"console script {name} is not installed")
    return found


@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (real-scheduler tier)")
def test_manager_run_renders_and_replays_with_counters(tmp_path: Path) -> None:
    manager = _script("vllm-hust-ext")
    replay = _script("bidkv-replay")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BIDKV_", "VLLM_ECPA_"))}
    env["VLLM_HUST_EXT_CONFIG"] = str(tmp_path / "state.json")
    env["PATH"] = f"{Path(replay).parent}{os.pathsep}{env.get('PATH', '')}"

    def cli(*args: str) -> str:
        done = subprocess.run([manager, *args], env=env, capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
        assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-2000:])
        return done.stdout

    cli("extension", "enable", BUNDLE)
    declared = tmp_path / "declared.json"
    declared.write_text(json.dumps({"protocol_versions": {"vllm.preemption-policy": "1.0"}}))
    cli("extension", "configure", BUNDLE, "--file", str(declared))
    args = ["bidkv-replay", "--max-requests", "60", "--num-gpu-blocks", "300", "--no-plots",
            "--no-progress", "--output-dir", str(tmp_path / "out")]
    plan = json.loads(cli("run", "--dry-run", "--", *args))
    assert plan["command"][-2:] == ["--preemption-policy", POLICY]
    assert plan["environment"]["BIDKV_UTILITY_ENABLE"] == "1"

    cli("run", "--", *args)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    (arm,) = report["arms"]
    assert arm["label"] == POLICY and arm["kind"] == "host"
    counters = arm["controller"]
    assert counters["policy_name"] == POLICY and counters["enabled"] is True
    assert counters["calls"] > 0 and counters["selections"] > 0
    assert counters["calls"] == arm["preemptions"]
    assert arm["conservation"]["all_completed_once"]
