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
    assert line.endswith(  # the other classes make way for the adapter's
        "vllm-hust-ext run -- vllm serve m --scheduler-cls bidkv_ext.hosts.vllm.policy_scheduler")


def test_a_non_serve_command_keeps_the_preemption_policy_flag(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only ``vllm serve`` goes through the adapter; a replay host (which implements the
    contract) still gets ``--preemption-policy``."""
    launch = _dry_run(["bidkv-replay", "--scheduler-cls",
                       "bidkv_ext.hosts.vllm.policy_scheduler"], capsys)
    assert launch["command"][-2:] == ["--preemption-policy", POLICY]


def test_a_typed_preemption_policy_is_refused_when_the_adapter_is_named(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stock vLLM has no --preemption-policy: passed through, vLLM would stop on it."""
    code, _, err = invoke(["run", "--dry-run", "--", "vllm", "serve", "m", "--scheduler-cls",
                           "bidkv_ext.hosts.vllm.policy_scheduler", "--preemption_policy", POLICY],
                          capsys)
    assert code == 2
    assert "stock vLLM has no --preemption-policy option; drop it" in err.splitlines()[-1]


def test_the_refusal_suggests_a_command_that_runs_and_says_to_declare_the_version_first(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], vllm_parser: Any
) -> None:
    """The suggested command drops the user's --preemption-policy and --scheduler-cls (an
    empty one too) so that vLLM can parse it, and, while the contract version is not
    declared, says to declare it first (the next refusal would be about that)."""
    (tmp_path / "config.json").write_text(json.dumps({"schema_version": 2, "extensions": {
        BUNDLE: {"enabled": True, "configuration": {}}}}))
    code, _, err = invoke(["run", "--dry-run", "--", "vllm", "serve", "m", "--preemption-policy",
                           POLICY, "--max-model-len", "64", "--scheduler-cls"], capsys)
    assert code == 2
    line = err.splitlines()[-1]
    suggested = line.split("through --additional-config: ")[1].split(" (first declare")[0]
    assert suggested == ("vllm-hust-ext run -- vllm serve m --max-model-len 64 "
                         "--scheduler-cls bidkv_ext.hosts.vllm.policy_scheduler")
    assert vllm_parser.parse_args(suggested.split()[6:]).scheduler_cls == \
        "bidkv_ext.hosts.vllm.policy_scheduler"
    assert line.endswith(f"extension configure {BUNDLE} --file FILE, FILE holding "
                         '{"protocol_versions": {"vllm.preemption-policy": "1.0"}})')


@pytest.mark.parametrize("abbreviated", [
    ["--scheduler-cl", "bidkv_ext.hosts.vllm.policy_scheduler"],
    ["--scheduler-cls", "bidkv_ext.hosts.vllm.policy_scheduler", "--additional-conf", "{}"],
])
def test_an_abbreviated_option_is_refused(
    site: Path, capsys: pytest.CaptureFixture[str], vllm_parser: Any, abbreviated: list[str]
) -> None:
    """vLLM's parser takes unique prefixes of option names: an abbreviation would be read
    as the option the manager merges without the manager seeing it (the policy left off,
    or another scheduler run with the policy's environment)."""
    name = abbreviated[-2]
    full = {"--scheduler-cl": "scheduler_cls", "--additional-conf": "additional_config"}[name]
    assert getattr(vllm_parser.parse_args(abbreviated), full) is not None  # vLLM reads it
    code, _, err = invoke(["run", "--dry-run", "--", "vllm", "serve", "m", *abbreviated], capsys)
    assert code == 2
    assert err.splitlines()[-1].startswith(f"vllm-hust-ext: error: {name} abbreviates --")


def test_a_config_file_that_sets_a_merged_option_is_refused(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], vllm_parser: Any
) -> None:
    """vLLM reads a ``--config`` YAML's options before the command line's, so the
    manager's --additional-config would replace the file's object without a word; a file
    that sets other options is fine."""
    overlapping = tmp_path / "serve.yaml"
    overlapping.write_text("additional_config:\n  bidkv: {enabled: false}\nport: 9\n")
    adapter = ["--scheduler-cls", "bidkv_ext.hosts.vllm.policy_scheduler"]
    code, _, err = invoke(["run", "--dry-run", "--", "vllm", "serve", "m", "--config",
                           str(overlapping), *adapter], capsys)
    assert code == 2
    assert err.splitlines()[-1] == (
        f"vllm-hust-ext: error: --config {overlapping} sets --additional-config, which the "
        "enabled extensions set too; vLLM reads the file before the command line, so one "
        "would replace the other: give --additional-config on the command line instead")
    other = tmp_path / "len.yaml"
    other.write_text("max-model-len: 64\n")
    launch = _dry_run(["vllm", "serve", "m", "--config", str(other), *adapter], capsys)
    parsed = vllm_parser.parse_args(launch["command"][3:])  # the options after the model
    assert parsed.max_model_len == 64
    assert parsed.additional_config == {"preemption_policy": POLICY}


def test_a_host_with_the_contract_refuses_the_adapter(
    site: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vLLM-HUST host takes --preemption-policy itself and the adapter only runs on stock
    vLLM 0.33.0. No vLLM-HUST host can be installed here, so only the manager's contract
    probe is faked (``host_has_preemption_contract``)."""
    from hust_ext_manager import provider

    monkeypatch.setattr(provider, "host_has_preemption_contract", lambda name: True)
    code, _, err = invoke(["run", "--dry-run", "--", "vllm", "serve", "m", "--scheduler-cls",
                           "bidkv_ext.hosts.vllm.policy_scheduler"], capsys)
    assert code == 2
    assert "has the vllm.preemption-policy contract and takes --preemption-policy itself; " \
        "drop --scheduler-cls bidkv_ext.hosts.vllm.policy_scheduler" in err.splitlines()[-1]
    launch = _dry_run(["vllm", "serve", "m"], capsys)
    assert launch["command"][-2:] == ["--preemption-policy", POLICY]


def test_every_option_the_provider_renders_is_spelled_out_not_an_abbreviation() -> None:
    """launch.py's list of rendered names (an option that prefixes another rendered one is
    not an abbreviation of it) covers every option the provider renders."""
    from hust_ext_manager import launch, provider

    rendered = {*provider.RENDERED_CONTRACTS.values(), *provider._LAUNCH_JSON_OPTIONS.values(),
                *provider._LAUNCH_FLAGS.values(), "--additional-config", "--scheduler-cls"}
    assert rendered <= launch._RENDERED_NAMES
