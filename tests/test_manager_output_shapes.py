"""Exact output shapes of the ``vllm-hust-ext`` verbs (manager-protocol.md §4, §6).

Guards what a script reading the official manager's output relies on: ``inspect`` prints
exactly the spec's key set as ``indent=2`` JSON with sorted keys, and ``validate`` prints
the same bytes; ``plan`` is ``indent=2`` sorted JSON whose one action is a non-mutating
``configure_launch`` (a descriptor-only bundle: one ``inspect_only`` action with
``enabled: false`` and the blocker as the only warning); ``status`` and its alias ``check``
print the same object with the keys in the order ``extension_id, provider, states,
evidence`` (not sorted); ``render`` is an array of ``name``/``media_type``/``content``
objects; ``env`` is sorted ``indent=2`` JSON that always carries
``VLLMHUST_EXT_ENABLED_BUNDLES`` (empty when nothing is enabled); ``list`` prints
``<id> <extension_version> enabled|disabled`` sorted by id; ``run --dry-run`` prints
``command``, ``environment``, ``native_extension_manifests`` in that order; ``run`` with no
command runs ``vllm`` and strips exactly one leading ``--``; ``--shutdown-grace-seconds``
defaults to 10; ``enable`` makes no host-version check.

Bundles are registered through a throw-away ``*.dist-info`` directory on ``sys.path``;
the CLI runs in-process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hust_ext_manager.cli import build_parser

from tests.manager_helpers import fake_site, install_bundles, invoke

ROOT = Path(__file__).resolve().parents[1]
BASE: dict[str, Any] = json.loads(
    (ROOT / "manifests" / "bidkv" / "vllm-hust-extension-v0.2.json").read_text()
)
BUNDLE = "org.test.shapes"
OTHER = "org.test.other"
DECLARED = {"host_version": "0.33.0", "protocol_versions": {"vllm.preemption-policy": "1.0"}}
INSPECT_KEYS = {
    "bundle_id",
    "bundle_version",
    "distribution",
    "distribution_version",
    "enabled",
    "kind",
    "host",
    "runtime",
    "lifecycle_owner",
    "protocols",
    "implementation",
    "requires_services",
    "requires_extensions",
    "resource_claims",
    "activation_ready",
    "activation_blocker",
    "experimental",
    "components",
    "activation",
    "manifest_path",
}


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return fake_site(tmp_path, monkeypatch, ("VLLM_HUST_EXT_EVIDENCE_PATH", "VLLM_PLUGINS"))


def install(site: Path, documents: dict[str, dict[str, Any]]) -> None:
    """One fake installed distribution (version 9.9) registering each manifest under its id."""
    install_bundles(site, documents, name="fake-shapes", version="9.9")


def set_state(tmp_path: Path, extensions: dict[str, Any]) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"schema_version": 2, "extensions": extensions})
    )


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code, out, err = invoke(argv, capsys)
    assert code == 0, err
    return out


def sorted_json(out: str) -> Any:
    """The document, after checking the text is exactly ``indent=2`` JSON with sorted keys."""
    document = json.loads(out)
    assert out == json.dumps(document, indent=2, sort_keys=True) + "\n"
    return document


def descriptor_only() -> dict[str, Any]:
    carrier = {**BASE["implementation"][0], "status": "import_only"}
    return {**BASE, "implementation": [carrier]}


def test_inspect_prints_the_spec_keys_sorted_and_validate_prints_the_same(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    install(site, {BUNDLE: BASE})
    out = run_cli(["extension", "inspect", BUNDLE], capsys)
    shown = sorted_json(out)
    assert set(shown) == INSPECT_KEYS
    assert (shown["bundle_version"], shown["distribution_version"]) == ("0.1.0", "9.9")
    assert (shown["requires_extensions"], shown["resource_claims"]) == ([], [])
    assert run_cli(["extension", "validate", BUNDLE], capsys) == out


def test_plan_is_sorted_json_with_one_non_mutating_configure_launch(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    install(site, {BUNDLE: BASE})
    set_state(tmp_path, {BUNDLE: {"enabled": True, "configuration": DECLARED}})
    plan = sorted_json(run_cli(["extension", "plan", BUNDLE], capsys))
    assert list(plan) == ["actions", "extension_id", "generated_config", "provider", "warnings"]
    assert (plan["extension_id"], plan["provider"]) == (BUNDLE, "vllm")
    assert plan["actions"] == [
        {
            "operation": "configure_launch",
            "target": "vllm",
            "lifecycle_owner": "vllm",
            "mutating": False,
            "details": {"enabled": True},
        }
    ]
    assert {"environment", "additional_config", "user_config", "vllm_json_options"} <= set(
        plan["generated_config"]
    )
    assert plan["generated_config"]["user_config"] == DECLARED


def test_a_descriptor_only_bundle_plans_one_inspect_only_action(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    install(site, {BUNDLE: descriptor_only()})
    blocker = json.loads(run_cli(["extension", "inspect", BUNDLE], capsys))["activation_blocker"]
    assert "descriptor-only" in blocker
    plan = sorted_json(run_cli(["extension", "plan", BUNDLE], capsys))
    assert plan["actions"] == [
        {
            "operation": "inspect_only",
            "target": "vllm",
            "lifecycle_owner": "vllm",
            "mutating": False,
            "details": {"enabled": False},
        }
    ]
    assert plan["warnings"] == [blocker]


def test_status_and_check_print_the_same_object_in_the_spec_key_order(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    install(site, {BUNDLE: BASE})
    set_state(tmp_path, {BUNDLE: {"enabled": True, "configuration": DECLARED}})
    out = run_cli(["extension", "status", BUNDLE], capsys)
    shown = json.loads(out)
    assert out == json.dumps(shown, indent=2) + "\n"
    assert list(shown) == ["extension_id", "provider", "states", "evidence"]
    assert (shown["extension_id"], shown["provider"]) == (BUNDLE, "vllm")
    assert shown["states"] == ["installed", "discovered", "compatible", "configured", "enabled"]
    assert run_cli(["extension", "check", BUNDLE], capsys) == out


def test_render_is_an_array_of_named_artifacts(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    install(site, {BUNDLE: BASE})
    set_state(tmp_path, {BUNDLE: {"enabled": False, "configuration": DECLARED}})
    rendered = json.loads(run_cli(["extension", "render", BUNDLE], capsys))
    assert [sorted(a) for a in rendered] == [["content", "media_type", "name"]] * 2
    assert [a["name"] for a in rendered] == ["vllm-extension-manifest.json", "vllm-launch.json"]
    native = json.loads(rendered[0]["content"])
    assert (native["schema_version"], native["bundle_id"]) == ("1.0", BUNDLE)
    plan = json.loads(run_cli(["extension", "plan", BUNDLE], capsys))
    assert json.loads(rendered[1]["content"]) == plan


def test_env_is_sorted_json_and_always_names_the_enabled_bundles(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # OTHER sorts first by id but sets a variable that sorts last.
    other = {**BASE, "activation": {**BASE["activation"], "environment": {"ZZ_OTHER": "1"}}}
    install(site, {OTHER: other, BUNDLE: BASE})
    assert sorted_json(run_cli(["extension", "env"], capsys)) == {
        "VLLMHUST_EXT_ENABLED_BUNDLES": ""
    }
    entry = {"enabled": True, "configuration": DECLARED}
    set_state(tmp_path, {OTHER: entry, BUNDLE: entry})
    environment = sorted_json(run_cli(["extension", "env"], capsys))
    assert environment == {
        **BASE["activation"]["environment"],
        "ZZ_OTHER": "1",
        "VLLMHUST_EXT_ENABLED_BUNDLES": f"{OTHER},{BUNDLE}",
    }


def test_list_prints_id_version_and_flag_sorted_by_id(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    install(site, {OTHER: {**BASE, "extension_version": "2.0"}, BUNDLE: BASE})
    set_state(tmp_path, {OTHER: {"enabled": True, "configuration": {}}})
    # The project's own bundles are installed too: only the test ids are looked at.
    lines = run_cli(["extension", "list"], capsys).splitlines()
    ours = [line for line in lines if line.startswith("org.test.")]
    assert ours == [f"{OTHER} 2.0 enabled", f"{BUNDLE} 0.1.0 disabled"]
    assert lines == sorted(lines)
    documents = sorted_json(run_cli(["extension", "list", "--json"], capsys))
    shown = [(d["bundle_id"], d["enabled"]) for d in documents if d["bundle_id"] in (OTHER, BUNDLE)]
    assert shown == [(OTHER, True), (BUNDLE, False)]


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        ([], ["vllm"]),
        (["--", "x"], ["x"]),
        (["x", "--dry-run"], ["x", "--dry-run"]),
        (["--", "--", "x"], ["--", "x"]),
        (["--", "x", "--", "y"], ["x", "--", "y"]),
    ],
)
def test_dry_run_document_and_command_parsing(
    site: Path, capsys: pytest.CaptureFixture[str], argv: list[str], command: list[str]
) -> None:
    """§6.2 step 3 and §6.4: default ``vllm``; one leading ``--`` is stripped, no more."""
    out = run_cli(["run", "--dry-run", *argv], capsys)
    shown = json.loads(out)
    assert out == json.dumps(shown, indent=2) + "\n"
    assert list(shown) == ["command", "environment", "native_extension_manifests"]
    assert shown["command"] == command


def test_the_grace_period_defaults_to_ten_seconds() -> None:
    assert build_parser().parse_args(["run"]).shutdown_grace_seconds == 10


def test_enable_makes_no_host_version_check(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§4: ``enable`` is strict discovery and the activation blocker only; an incompatible
    host is left to ``status`` and ``run``."""
    install(site, {BUNDLE: BASE})
    set_state(tmp_path, {BUNDLE: {"enabled": False, "configuration": {"host_version": "9.0"}}})
    assert run_cli(["extension", "enable", BUNDLE], capsys) == f"enabled {BUNDLE}\n"
    shown = json.loads(run_cli(["extension", "status", BUNDLE], capsys))
    assert shown["states"] == ["installed", "discovered", "incompatible", "enabled"]
