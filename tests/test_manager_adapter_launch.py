"""``vllm-hust-ext run -- vllm serve ... --scheduler-cls <the stock-vLLM adapter>``.

Stock vLLM 0.33.0 has no ``--preemption-policy`` flag (the manager refuses a plain
``vllm serve`` there), but our adapter takes the policy from
``additional_config["preemption_policy"]``. Guarded: when the command names one of the
adapter's scheduler classes (any spelling vLLM accepts, the last occurrence counting), the
launch carries the policy in the ``--additional-config`` vLLM reads and no
``--preemption-policy`` flag, with the bundle's ``BIDKV_UTILITY_*`` environment; vLLM's own
parser and the adapter's own reading of that config find the bundle's policy; a caller's
different ``preemption_policy`` conflicts; another scheduler class is still refused, and
the refusal names the adapter command. Runs the real CLI on the real bidkv manifest and
the real installed vLLM (which lacks the contract file).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.manager_helpers import fake_site, invoke
from tests.manager_helpers import install_bundles as install

ROOT = Path(__file__).resolve().parents[1]
BIDKV = json.loads((ROOT / "manifests" / "bidkv" / "vllm-hust-extension-v0.2.json").read_text())
BUNDLE = "org.test.adapter"  # the real bidkv manifest under an id of its own
POLICY = "bidkv_ext.selector.BidkvPreemptionPolicy"
DECLARED = {"protocol_versions": {"vllm.preemption-policy": "1.0"}, "host_version": "0.33.0"}


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = fake_site(tmp_path, monkeypatch)
    install(site, {BUNDLE: BIDKV})
    (tmp_path / "config.json").write_text(json.dumps({"schema_version": 2, "extensions": {
        BUNDLE: {"enabled": True, "configuration": DECLARED}}}))
    return site


def _dry_run(command: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code, out, err = invoke(["run", "--dry-run", "--", *command], capsys)
    assert code == 0, err
    document: dict[str, Any] = json.loads(out)
    return document


@pytest.fixture(scope="module")
def vllm_parser() -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())


@pytest.mark.parametrize("scheduler", [
    ["--scheduler-cls", "bidkv_ext.hosts.vllm.policy_scheduler"],
    ["--scheduler_cls=bidkv_ext.hosts.vllm.PolicyAsyncScheduler"],
    ["--scheduler-cls", "x.Y", "--scheduler-cls", "bidkv_ext.hosts.vllm.scheduler.PolicyScheduler"],
])
def test_the_adapter_gets_the_policy_through_additional_config(
    site: Path, capsys: pytest.CaptureFixture[str], vllm_parser: Any, scheduler: list[str]
) -> None:
    from bidkv_ext.hosts.vllm.scheduler import _policy_spec

    launch = _dry_run(["vllm", "serve", "m", *scheduler, "--additional-config", '{"x": 1}'],
                      capsys)
    command = launch["command"]
    assert "--preemption-policy" not in command
    engine_args = vllm_parser.parse_args(command[3:])  # the engine options `vllm serve` parses
    assert engine_args.additional_config == {"x": 1, "preemption_policy": POLICY}
    assert _policy_spec(SimpleNamespace(additional_config=engine_args.additional_config),
                        None) == POLICY
    assert launch["environment"]["BIDKV_UTILITY_ENABLE"] == "1"


def test_a_callers_other_policy_in_additional_config_conflicts(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = invoke(["run", "--dry-run", "--", "vllm", "serve", "m", "--scheduler-cls",
                           "bidkv_ext.hosts.vllm.policy_scheduler", "--additional-config",
                           '{"preemption_policy": "other.Policy"}'], capsys)
    assert code == 2
    assert err.splitlines()[-1].endswith(
        "conflicts with additional_config keys: ['preemption_policy']")


def test_another_scheduler_class_is_still_refused_naming_the_adapter_command(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = invoke(["run", "--dry-run", "--", "vllm", "serve", "m", "--scheduler-cls",
                           "bidkv_ext.hosts.vllm.policy_scheduler", "--scheduler-cls",
                           "x.Y"], capsys)
    assert code == 2
    line = err.splitlines()[-1]
    assert "lacks the vllm.preemption-policy contract" in line
    assert line.endswith(
        "vllm-hust-ext run -- vllm serve m --scheduler-cls bidkv_ext.hosts.vllm.policy_scheduler"
        " --scheduler-cls x.Y --scheduler-cls bidkv_ext.hosts.vllm.policy_scheduler")


def test_a_non_serve_command_keeps_the_preemption_policy_flag(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only ``vllm serve`` goes through the adapter; a replay host (which implements the
    contract) still gets ``--preemption-policy``."""
    launch = _dry_run(["bidkv-replay", "--scheduler-cls",
                       "bidkv_ext.hosts.vllm.policy_scheduler"], capsys)
    assert launch["command"][-2:] == ["--preemption-policy", POLICY]
