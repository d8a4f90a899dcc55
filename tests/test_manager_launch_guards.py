"""``run`` clean-up and refusals, the one-line error contract, and provider check rules.

Guards: a real ``run`` removes its native-manifest temp directory and runs the bundles'
shutdown hooks even when the launch itself fails; a preset ``VLLM_EXTENSION_MANIFESTS`` or
``VLLM_EXTENSION_BUNDLES`` is refused; an unexpected exception is one ``internal error``
line, never a traceback; undeclared environment overrides are incompatible; a failed
check step makes the bundle incompatible even when another step is unverified (spec §5.2
rule 4); a false boolean launch option renders no flag. Also: each of §4's configuration
errors is ``incompatible`` with its own text; an out-of-range host is the only check
evidence; overrides and JSON launch options reach the launch; the plan's enabled flag,
policy warning and native manifest follow the manifest and state; a real launch binds
strict evidence with a stable plan id and a fresh launch id. A ``--config`` file that
is a FIFO or directory, or not a UTF-8 YAML mapping, is one line naming it.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hust_ext_manager import cli

from tests.manager_helpers import fake_site, install_bundles, invoke, within

ROOT = Path(__file__).resolve().parents[1]
BASE: dict[str, Any] = json.loads(
    (ROOT / "manifests" / "bidkv" / "vllm-hust-extension-v0.2.json").read_text()
)
DECLARED = {"protocol_versions": {"vllm.preemption-policy": "1.0"}, "host_version": "0.33.0"}
BUNDLE = "org.test.p"


def install(site: Path, shutdown: str | None = None) -> None:
    """A fake installed distribution registering BASE as ``org.test.p`` (optional hook)."""
    hooks = {BUNDLE: shutdown} if shutdown else None
    install_bundles(site, {BUNDLE: BASE}, name="fake-guards", shutdown=hooks)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # A real launch owns these variables.
    unset = ("VLLM_HUST_EXT_EVIDENCE_PATH", "VLLM_EXTENSION_MANIFESTS", "VLLM_EXTENSION_BUNDLES")
    return fake_site(tmp_path, monkeypatch, unset)


def enable(tmp_path: Path, configuration: dict[str, Any]) -> None:
    entry = {"enabled": True, "configuration": configuration}
    (tmp_path / "config.json").write_text(
        json.dumps({"schema_version": 2, "extensions": {BUNDLE: entry}})
    )


def status(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code, out, err = invoke(["extension", "status", BUNDLE], capsys)
    assert code == 0, err
    result: dict[str, Any] = json.loads(out)
    return result


# --- run: clean-up ----------------------------------------------------------------------


def test_a_real_run_removes_its_native_manifest_directory(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``vllm-hust-ext-*`` temp directory holding the native manifests exists while the
    child runs and is gone once ``run`` returns."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    seen = tmp_path / "seen"
    install(site)
    enable(tmp_path, DECLARED)
    script = f'test -f "$VLLM_EXTENSION_MANIFESTS" && echo "$VLLM_EXTENSION_MANIFESTS" > {seen}'
    code, _, err = invoke(["run", "--", "sh", "-c", script], capsys)
    assert code == 0, err
    manifest = Path(seen.read_text().strip())
    assert manifest.parent.parent == temp and manifest.parent.name.startswith("vllm-hust-ext-")
    assert [p.name for p in temp.iterdir() if p.name.startswith("vllm-hust-ext-")] == []


def test_shutdown_hooks_run_even_when_the_launch_fails(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A command that cannot be started is one error line, and the bundle's shutdown hook
    still runs and reports (the hooks run in ``finally``, not only after a normal exit)."""
    (site / "fakeguards_hook.py").write_text(
        "def on_shutdown(manifest, configuration):\n    return ['cleaned up']\n"
    )
    install(site, shutdown="fakeguards_hook:on_shutdown")
    enable(tmp_path, DECLARED)
    code, _, err = invoke(["run", "--", "/nonexistent/command"], capsys)
    assert code == 2
    assert f"vllm-hust-ext: {BUNDLE}: cleaned up" in err.splitlines()
    assert err.splitlines()[-1].startswith("vllm-hust-ext: error: ")
    assert "No such file or directory" in err.splitlines()[-1]


def test_a_real_launch_binds_fresh_evidence_variables(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§6.3, real launches only: the child gets the manager's sink, strict evidence, a plan
    id that is the same for the same bundles (a sha256 digest) and a new launch id each
    launch, and the evidence path next to the state file."""
    install(site)
    enable(tmp_path, DECLARED)
    names = [
        "VLLM_ECPA_EVIDENCE_SINK",
        "VLLM_ECPA_EVIDENCE_STRICT",
        "VLLM_ECPA_PLAN_ID",
        "VLLM_ECPA_LAUNCH_ID",
        "VLLM_HUST_EXT_EVIDENCE_PATH",
    ]
    launches = []
    for index in range(2):
        seen = tmp_path / f"seen{index}"
        code = (
            f"import json, os; json.dump({{n: os.environ.get(n) for n in {names!r}}}, "
            f"open({str(seen)!r}, 'w'))"
        )
        result, _, err = invoke(["run", "--", sys.executable, "-c", code], capsys)
        assert result == 0, err
        launches.append(json.loads(seen.read_text()))
    first, second = launches
    assert first["VLLM_ECPA_EVIDENCE_SINK"] == "hust_ext_manager.runtime_evidence:record_event"
    assert first["VLLM_ECPA_EVIDENCE_STRICT"] == "1"
    assert re.fullmatch(r"[0-9a-f]{64}", first["VLLM_ECPA_PLAN_ID"])
    assert second["VLLM_ECPA_PLAN_ID"] == first["VLLM_ECPA_PLAN_ID"]
    assert second["VLLM_ECPA_LAUNCH_ID"] != first["VLLM_ECPA_LAUNCH_ID"]
    assert first["VLLM_HUST_EXT_EVIDENCE_PATH"] == str(tmp_path / "runtime-evidence.jsonl")


# --- run: refusals and the error contract ---------------------------------------------


@pytest.mark.parametrize("variable", ["VLLM_EXTENSION_MANIFESTS", "VLLM_EXTENSION_BUNDLES"])
def test_a_preset_native_manifest_variable_is_refused(
    site: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
) -> None:
    """With a native-manifest bundle enabled, the manager owns both native variables: a
    preset one is refused with exit 2 and nothing is launched."""
    install(site)
    enable(tmp_path, DECLARED)
    monkeypatch.setenv(variable, "mine")
    marker = tmp_path / "launched"
    code, _, err = invoke(["run", "--", "touch", str(marker)], capsys)
    assert code == 2
    assert err.splitlines()[-1] == (
        "vllm-hust-ext: error: vllm-hust-ext owns VLLM_EXTENSION_MANIFESTS and "
        "VLLM_EXTENSION_BUNDLES while launching enabled vLLM extensions"
    )
    assert not marker.exists()


def test_an_unexpected_exception_is_one_internal_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any exception, not only OSError/ValueError, ends as exit 2 and one error line."""
    monkeypatch.setenv("VLLM_HUST_EXT_CONFIG", str(tmp_path / "config.json"))

    def broken_discover(*args: object, **kwargs: object) -> object:
        raise RuntimeError("discovery exploded\nsecond line")

    monkeypatch.setattr(cli, "discover", broken_discover)
    code, out, err = invoke(["extension", "env"], capsys)
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == (
        "vllm-hust-ext: error: internal error: RuntimeError: discovery exploded second line"
    )
    assert "Traceback" not in err


def _serve_with_config(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """``run --dry-run -- vllm serve m --config PATH`` refused: its one error line."""
    with within(10):
        code, out, err = invoke(
            ["run", "--dry-run", "--", "vllm", "serve", "m", "--config", str(path)], capsys)
    assert code == 2 and out == "" and "Traceback" not in err, err
    return err.splitlines()[-1]


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_config_file_that_is_not_a_regular_file_is_refused_at_once(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """``--config`` names a file vLLM reads, so ``run`` reads it even with no bundle
    enabled; a FIFO there (which a plain open() waits on forever) or a directory is
    refused at once, in one line naming it, and the FIFO is left as it was."""
    path = tmp_path / "serve.yaml"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    assert _serve_with_config(path, capsys) == (
        f"vllm-hust-ext: error: --config {path} is not a regular file: expected a regular "
        "file holding a UTF-8 YAML mapping of options")
    assert stat.S_ISFIFO(path.stat().st_mode) if kind == "fifo" else path.is_dir()


@pytest.mark.parametrize(("data", "problem"), [
    (b"\xff\xfe: 1\n", "is not UTF-8 (byte 0)"),
    (b"[" * 5000 + b"]" * 5000, "is nested too deeply"),
    (b"port: 2020-13-45\n", "is not valid YAML (month must be in 1..12)"),
    (b"port: " + b"9" * 5000 + b"\n", "is not valid YAML (Exceeds the limit (4300 digits)"),
    (b"port: [1\n", "is not valid YAML (expected ',' or ']', but got '<stream end>' at line 2"),
    (b"- port\n", "is not a mapping of options"),
    # PyYAML's own constructors: a dict lookup (KeyError) and a failed regex match
    # (AttributeError), not YAMLErrors; they ended in "internal error".
    (b"enforce-eager: !!bool maybe\n", "is not valid YAML (a tagged value its tag cannot"),
    (b"seed: !!timestamp soon\n", "is not valid YAML (a tagged value its tag cannot"),
], ids=["not-utf8", "deep", "bad-date", "long-integer", "syntax", "list", "tagged-bool",
        "tagged-timestamp"])
def test_a_config_file_that_is_not_a_yaml_mapping_is_one_line_naming_it(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], data: bytes, problem: str
) -> None:
    """Whatever a ``--config`` file holds, a failure to read it as a UTF-8 YAML mapping is
    one line naming the file, what is wrong and what was expected: not a bare decoder
    message, nor an "internal error" for nesting or for a scalar YAML constructs with
    Python's own int() or date()."""
    path = tmp_path / "serve.yaml"
    path.write_bytes(data)
    line = _serve_with_config(path, capsys)
    assert line.startswith(f"vllm-hust-ext: error: --config {path} {problem}"), line
    assert line.endswith("expected a UTF-8 YAML mapping of options"), line


# --- provider check rules ---------------------------------------------------------------


def test_an_undeclared_environment_override_is_incompatible(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``configuration.environment`` may only override variables the manifest declares."""
    install(site)
    enable(tmp_path, {**DECLARED, "environment": {"X": "1"}})
    shown = status(capsys)
    # As for any bad user configuration (test_bad_user_configuration_is_incompatible).
    assert shown["states"] == ["installed", "discovered", "incompatible"]
    assert shown["evidence"] == ["environment overrides must be declared by the manifest: ['X']"]


def test_a_failed_step_beats_an_unverified_one(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Spec §5.2 rule 4: host API out of range (failed) plus an unavailable protocol
    (unverified) is incompatible, not degraded."""
    install(site)
    enable(
        tmp_path,
        {
            "host_version": "0.33.0",
            "host_api_version": "2.0",
            "protocol_versions": {"vllm.preemption-policy": ""},
        },
    )
    shown = status(capsys)
    assert "incompatible" in shown["states"] and "degraded" not in shown["states"]
    assert "host API 2.0 is outside >=1,<2" in shown["evidence"]
    assert "protocol vllm.preemption-policy version is unavailable" in shown["evidence"]


@pytest.mark.parametrize(
    ("configuration", "error"),
    [
        ({"environment": ["x"]}, "environment must be an object"),
        (
            {"environment": {"BIDKV_UTILITY_ENABLE": 1}},
            "environment override values must be strings",
        ),
        ({"launch_options": []}, "launch_options must be an object"),
        (
            {"launch_options": {"speculative_config": "ngram"}},
            "launch_options.speculative_config must be an object",
        ),
        (
            {"launch_options": {"scheduler_reserve_output_budget": "yes"}},
            "launch_options.scheduler_reserve_output_budget must be a boolean",
        ),
        ({"protocol_versions": ["1.0"]}, "protocol_versions must be an object"),
        (
            {"protocol_versions": {"vllm.preemption-policy": 1.0}},
            "protocol_versions.vllm.preemption-policy must be a version string, got 1.0",
        ),
        ({"host_version": ""}, "host_version must be a non-empty string"),
        ({"host_api_version": 2}, "host_api_version must be a non-empty string"),
    ],
)
def test_each_bad_user_configuration_is_incompatible_with_its_own_error(
    site: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    configuration: dict[str, Any],
    error: str,
) -> None:
    """§4's configuration errors: each is a provider ``ValueError``, so status is
    ``installed, discovered, incompatible`` with the error as the only evidence (§5.1), and
    ``run`` refuses the bundle as incompatible with that text."""
    install(site)
    enable(tmp_path, {**DECLARED, **configuration})
    shown = status(capsys)
    assert shown["states"] == ["installed", "discovered", "incompatible"]
    assert shown["evidence"] == [error]
    code, _, err = invoke(["run", "--dry-run", "--", "h"], capsys)
    assert code == 2
    assert err.splitlines()[-1] == (
        f"vllm-hust-ext: error: refusing to launch incompatible extension {BUNDLE!r}: {error}"
    )


@pytest.mark.parametrize("version", ["0.40.0", "not-a-version"])
def test_a_host_outside_the_range_is_the_only_check_evidence(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], version: str
) -> None:
    """§5.2 step 1: a host version outside the range (an unparsable one counts as outside)
    makes the bundle incompatible and is returned alone: no API or protocol step follows."""
    install(site)
    enable(tmp_path, {**DECLARED, "host_version": version})
    shown = status(capsys)
    assert shown["states"] == ["installed", "discovered", "incompatible", "enabled"]
    assert shown["evidence"] == [
        f"host version {version} is outside >=0.28.1rc1.dev319,<0.34",
        "vLLM launch configuration can be rendered",
    ]


def test_configured_overrides_and_launch_options_reach_the_launch(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§4: an ``environment`` override of a declared variable replaces the manifest's value;
    the two JSON ``launch_options`` render as their vLLM options (compact JSON)."""
    install(site)
    enable(
        tmp_path,
        {
            **DECLARED,
            "environment": {"BIDKV_UTILITY_STRATEGY": "fcfs"},
            "launch_options": {
                "speculative_config": {"n": 1},
                "batch_admission_policy_config": {"a": 2},
            },
        },
    )
    code, out, err = invoke(["run", "--dry-run", "--", "h"], capsys)
    assert code == 0, err
    shown = json.loads(out)
    assert shown["environment"]["BIDKV_UTILITY_STRATEGY"] == "fcfs"
    assert shown["environment"]["BIDKV_UTILITY_ENABLE"] == "1"
    assert shown["command"] == [
        "h",
        "--batch-admission-policy-config",
        '{"a":2}',
        "--speculative-config",
        '{"n":1}',
        "--preemption-policy",
        "bidkv_ext.selector.BidkvPreemptionPolicy",
    ]


WARNING = (
    "in-process scheduler activation requires explicit host and protocol compatibility "
    "evidence; run refuses unverified policies"
)


@pytest.mark.parametrize("enabled", [False, True])
def test_the_plan_records_the_enabled_flag_and_the_policy_warning(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], enabled: bool
) -> None:
    """§6.1: the single ``configure_launch`` action carries ``details.enabled`` from the
    state file, and a ``scheduler_policy`` with protocols carries the policy warning."""
    install(site)
    entry = {"enabled": enabled, "configuration": DECLARED}
    (tmp_path / "config.json").write_text(
        json.dumps({"schema_version": 2, "extensions": {BUNDLE: entry}})
    )
    code, out, err = invoke(["extension", "plan", BUNDLE], capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert [(a["operation"], a["details"]) for a in plan["actions"]] == [
        ("configure_launch", {"enabled": enabled})
    ]
    assert plan["warnings"] == [WARNING]


def _install_document(site: Path, document: dict[str, Any]) -> None:
    install(site)
    (site / "fakeguards" / "b0" / "vllm-hust-extension-v0.2.json").write_text(
        json.dumps({**document, "extension_id": BUNDLE})
    )


def test_without_protocols_or_api_range_there_is_no_warning_and_no_native_manifest(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The warning needs protocols (§6.1), and the native manifest needs ``host.api_range``
    (§1.4): without them the plan has neither, ``render`` gives only ``vllm-launch.json``
    and ``run`` writes no native manifest."""
    document = json.loads(json.dumps(BASE))
    document["protocols"] = []
    del document["host"]["api_range"]
    _install_document(site, document)
    enable(tmp_path, {"host_version": "0.33.0"})
    code, out, err = invoke(["extension", "plan", BUNDLE], capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["warnings"] == []
    assert "native_extension_manifest" not in plan["generated_config"]
    code, out, _ = invoke(["extension", "render", BUNDLE], capsys)
    assert [a["name"] for a in json.loads(out)] == ["vllm-launch.json"]
    code, out, err = invoke(["run", "--dry-run", "--", "h"], capsys)
    assert code == 0, err
    assert json.loads(out)["native_extension_manifests"] == {}


@pytest.mark.parametrize("value", [False, True])
def test_a_boolean_launch_option_renders_its_flag_only_when_true(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], value: bool
) -> None:
    """``launch_options.scheduler_reserve_output_budget: false`` renders no flag."""
    install(site)
    enable(tmp_path, {**DECLARED, "launch_options": {"scheduler_reserve_output_budget": value}})
    code, out, err = invoke(["extension", "plan", BUNDLE], capsys)
    assert code == 0, err
    flags = json.loads(out)["generated_config"].get("vllm_flags", [])
    assert ("--scheduler-reserve-output-budget" in flags) is value
