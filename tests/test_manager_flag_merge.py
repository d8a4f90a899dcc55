"""``run``'s boolean flag (``launch_options.scheduler_reserve_output_budget``) against the
caller's own spelling of it.

Guards the rendering rule of manager-protocol.md §6.2 step 5 and ``launch.py``: the
caller's arguments are never changed, an equal value is accepted and a different one is a
conflict. vLLM's boolean options also take a ``--no-`` form (its ``--config`` loader writes
one for a ``false`` value), and the last one given wins, so an appended flag after the
caller's ``--no-<flag>`` would silently turn on what the caller turned off.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hust_ext_manager.launch import merge_flag

from tests.manager_helpers import fake_site, install_bundles, invoke

ROOT = Path(__file__).resolve().parents[1]
BASE: dict[str, Any] = json.loads(
    (ROOT / "manifests" / "bidkv" / "vllm-hust-extension-v0.2.json").read_text()
)
BUNDLE = "org.test.flag"
FLAG = "--scheduler-reserve-output-budget"
CONFIGURATION = {
    "host_version": "0.33.0",
    "protocol_versions": {"vllm.preemption-policy": "1.0"},
    "launch_options": {"scheduler_reserve_output_budget": True},
}


@pytest.mark.parametrize(
    "negative",
    ["--no-scheduler-reserve-output-budget", "--no_scheduler_reserve_output_budget"],
)
def test_the_callers_no_form_of_a_flag_is_a_conflict(negative: str) -> None:
    """``--no-<flag>`` (either dash spelling) is the caller's different value: refused,
    never overridden by appending ``<flag>`` after it."""
    with pytest.raises(ValueError) as refused:
        merge_flag(["vllm", "serve", "m", negative], FLAG)
    assert str(refused.value) == (
        "extension activation conflicts with --no-scheduler-reserve-output-budget"
    )


def test_the_callers_underscore_spelling_of_the_flag_is_the_flag() -> None:
    """``--scheduler_reserve_output_budget`` is the same option as vLLM reads it: kept,
    not given a second time."""
    given = ["vllm", "serve", "m", "--scheduler_reserve_output_budget"]
    assert merge_flag(given, FLAG) == given


def test_run_refuses_to_override_the_callers_no_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the CLI: a configured ``true`` against the caller's ``--no-`` form is one
    error line naming the option (exit 2), not a command with both."""
    site = fake_site(tmp_path, monkeypatch, ("VLLM_PLUGINS",))
    install_bundles(site, {BUNDLE: BASE}, name="fake-flag")
    state = {BUNDLE: {"enabled": True, "configuration": CONFIGURATION}}
    (tmp_path / "config.json").write_text(
        json.dumps({"schema_version": 2, "extensions": state})
    )
    code, out, err = invoke(
        ["run", "--dry-run", "--", "h", "--no-scheduler-reserve-output-budget"], capsys
    )
    assert (code, out) == (2, "")
    assert err.splitlines()[-1] == (
        "vllm-hust-ext: error: extension activation conflicts with "
        "--no-scheduler-reserve-output-budget"
    )


@pytest.mark.parametrize("key", ["no-scheduler-reserve-output-budget",
                                 "no_scheduler_reserve_output_budget"])
def test_run_refuses_a_config_file_that_sets_the_no_form(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    key: str,
) -> None:
    """A ``--config`` YAML key ``no-<flag>: true`` is vLLM's ``--no-<flag>``, read before the
    command line, where the rendered flag would reverse it: refused, naming it."""
    site = fake_site(tmp_path, monkeypatch, ("VLLM_PLUGINS",))
    install_bundles(site, {BUNDLE: BASE}, name="fake-flag")
    state = {BUNDLE: {"enabled": True, "configuration": CONFIGURATION}}
    (tmp_path / "config.json").write_text(
        json.dumps({"schema_version": 2, "extensions": state})
    )
    config = tmp_path / "serve.yaml"
    config.write_text(f"{key}: true\n")
    code, out, err = invoke(["run", "--dry-run", "--", "h", "--config", str(config)], capsys)
    assert (code, out) == (2, "")
    assert err.splitlines()[-1].startswith(
        f"vllm-hust-ext: error: --config {config} sets --no-scheduler-reserve-output-budget, "
        "which the enabled extensions set too"
    )
