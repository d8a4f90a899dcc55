"""An option the caller gave without its value, followed by another option
(``--preemption-policy --port 8000``).

Guards manager-protocol.md §6.2 steps 4 and 5 ("a missing value → ``<option> requires a
value`` / ``<option> requires a JSON object``") as vLLM's argparse reads a command: an
argument starting with ``-`` is the next option, not the value, unless it is ``-`` alone,
a negative number or holds a space. The next option must also survive where the manager
removes an option with its value (the stock-vLLM adapter command it suggests).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hust_ext_manager.launch import merge_additional_config, merge_option, without_option

from tests.manager_helpers import fake_site, install_bundles, invoke

ROOT = Path(__file__).resolve().parents[1]
BASE: dict[str, Any] = json.loads(
    (ROOT / "manifests" / "bidkv" / "vllm-hust-extension-v0.2.json").read_text()
)


@pytest.mark.parametrize("following", ["--port", "--", "-tp"])
def test_an_option_followed_by_an_option_has_no_value(following: str) -> None:
    """The missing-value texts, not a conflict with a value nobody gave."""
    command = ["vllm", "serve", "m", "OPTION", following, "8000"]

    def given(option: str) -> list[str]:
        return [option if arg == "OPTION" else arg for arg in command]

    with pytest.raises(ValueError) as scalar:
        merge_option(given("--preemption-policy"), "--preemption-policy", "a.B", is_json=False)
    assert str(scalar.value) == "--preemption-policy requires a value"
    with pytest.raises(ValueError) as json_option:
        merge_option(given("--speculative-config"), "--speculative-config", {"n": 1},
                     is_json=True)
    assert str(json_option.value) == "--speculative-config requires a JSON object"
    with pytest.raises(ValueError) as additional:
        merge_additional_config(given("--additional-config"), {"k": 1})
    assert str(additional.value) == "--additional-config requires a JSON object"


@pytest.mark.parametrize("value", ["-", "-1", "-0.5", "-x y"])
def test_what_argparse_takes_as_a_value_stays_one(value: str) -> None:
    """``-`` alone, a negative number and an argument with a space are values to argparse:
    a different value is a conflict, as before."""
    with pytest.raises(ValueError) as refused:
        merge_option(["h", "--preemption-policy", value], "--preemption-policy", "a.B",
                     is_json=False)
    assert str(refused.value) == "extension activation conflicts with --preemption-policy"


def test_removing_an_option_without_a_value_keeps_the_next_option() -> None:
    command = ["vllm", "serve", "m", "--preemption-policy", "--port", "8000"]
    assert without_option(command, "--preemption-policy") == [
        "vllm", "serve", "m", "--port", "8000"
    ]


def test_the_suggested_adapter_command_keeps_the_callers_next_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The stock-vLLM refusal suggests the caller's command with the adapter: ``--port``
    after a value-less ``--preemption-policy`` stays, with its value."""
    site = fake_site(tmp_path, monkeypatch, ("VLLM_PLUGINS",))
    install_bundles(site, {"org.test.m": BASE}, name="fake-missing")
    state = {"org.test.m": {"enabled": True, "configuration": {"host_version": "0.33.0"}}}
    (tmp_path / "config.json").write_text(
        json.dumps({"schema_version": 2, "extensions": state})
    )
    code, _, err = invoke(
        ["run", "--dry-run", "--", "vllm", "serve", "m", "--preemption-policy", "--port",
         "8000"],
        capsys,
    )
    assert code == 2
    assert (
        "vllm-hust-ext run -- vllm serve m --port 8000 --scheduler-cls "
        "bidkv_ext.hosts.vllm.policy_scheduler" in err.splitlines()[-1]
    )
