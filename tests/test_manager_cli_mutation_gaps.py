"""Behaviour a mutation audit of the manager's command line and vLLM Host Provider
(``hust_ext_manager.cli`` and ``hust_ext_manager.provider``) found unguarded.

Each test pins one promise of manager-protocol.md or of the module it exercises, which a
small change to the code broke without any other test failing:

- §5.2 step 3: a ``null`` in ``protocol_versions`` declares the version unknown (the
  protocol is unavailable, the bundle unverified), unlike a number, which is refused;
- §5.2 step 5: only a qualification whose ``status`` is ``"passed"`` counts; any other
  status (not just ``"failed"``) leaves the result unknown;
- a required service whose endpoint key holds an empty string is "not configured", as an
  absent key is (no probe of an empty URL);
- a bundle check that raises an exception without a message is reported by the
  exception's type name, never as an empty reason;
- §6.1: only activation entry points in vLLM's plugin groups become ``vllm_plugins``
  (and so ``VLLM_PLUGINS``); one in another group renders nothing;
- §6.1: ``vllm_plugins``, ``vllm_flags`` and ``vllm_options`` appear in a plan only when
  non-empty;
- §4: ``render``'s ``vllm-launch.json`` is the plan exactly as ``extension plan`` prints
  it (``indent=2``, sorted keys), byte for byte;
- §9 (per key): a conflict names the bundle that claimed the option first, even when a
  second bundle agreed with it;
- §6.3: one bundle declaring a plugin name in both vLLM plugin groups is no conflict with
  itself (only two bundles declaring one name are refused);
- a bundle whose own ``additional_config`` sets ``preemption_policy`` to another policy
  than the one ``run`` hands the stock-vLLM adapter is refused, never overridden;
- §6.3: the launched child's environment is the caller's *overridden* by the bundles'
  activation environment (a caller's variable of the same name does not win).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.manager_helpers import install_bundles, invoke
from tests.test_manager_status import (
    BASE,
    DECLARED,
    PROFILE,
    _check_module,
    _install_with_service,
    _other,
    _with,
    set_state,
    site,
    status,
)

__all__ = ["site"]  # the fixture, imported for the tests below

BUNDLE = "org.test.p"


def _plan(capsys: pytest.CaptureFixture[str]) -> tuple[str, dict[str, Any]]:
    code, out, err = invoke(["extension", "plan", BUNDLE], capsys)
    assert code == 0, err
    document: dict[str, Any] = json.loads(out)
    return out, document


# --- the provider's check -------------------------------------------------------------


def test_a_null_protocol_version_declares_it_unknown(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§5.2 step 3: ``protocol_versions: {name: null}`` is the operator saying the version
    is unknown: the protocol is unavailable and the bundle unverified (degraded), not an
    incompatible configuration. Kills the mutant that refuses every non-string value,
    ``null`` included, as a slip."""
    install_bundles(site, {BUNDLE: BASE})
    configuration = {**DECLARED, "protocol_versions": {"vllm.preemption-policy": None}}
    set_state(tmp_path, {BUNDLE: {"enabled": True, "configuration": configuration}})
    shown = status(BUNDLE, capsys)
    assert shown["states"] == ["installed", "discovered", "configured", "enabled", "degraded"]
    assert "protocol vllm.preemption-policy version is unavailable" in shown["evidence"]
    assert not any("must be a version string" in line for line in shown["evidence"])


def test_only_a_passed_qualification_counts(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§5.2 step 5: a runtime qualification whose ``status`` is not ``"passed"`` (here
    ``"inconclusive"``, every profile key matching) leaves the result unknown, so ``run``
    refuses the trusted in-process bundle as unverified. Kills the mutant that discounts
    only ``"failed"``."""
    document = _with(
        BASE, activation__additional_config={"_manager_runtime_qualification": PROFILE}
    )
    install_bundles(site, {BUNDLE: document})
    observed = {"status": "inconclusive", **PROFILE}
    configuration = {**DECLARED, "runtime_qualification": observed}
    set_state(tmp_path, {BUNDLE: {"enabled": True, "configuration": configuration}})
    shown = status(BUNDLE, capsys)
    assert "compatible" not in shown["states"] and "degraded" in shown["states"]
    assert any("required runtime qualification is unavailable" in line
               for line in shown["evidence"])
    code, _, err = invoke(["run", "--dry-run", "--", "true"], capsys)
    assert code == 2
    assert f"refusing to launch unverified trusted in-process extension '{BUNDLE}'" in err


# --- services and bundle checks -------------------------------------------------------


def test_an_empty_service_endpoint_is_not_configured(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A required service whose endpoint key holds ``""`` is reported as not configured,
    exactly as an absent key, and leaves the bundle unreachable. Kills the mutant that
    treats only a non-string as unconfigured (and probes the empty URL)."""
    _install_with_service(site)
    configuration = {**DECLARED, "health_url": ""}
    set_state(tmp_path, {BUNDLE: {"enabled": True, "configuration": configuration}})
    shown = status(BUNDLE, capsys)
    assert "service kv endpoint health_url is not configured" in shown["evidence"]
    assert "reachable" not in shown["states"] and "degraded" in shown["states"]


def test_a_check_raising_without_a_message_is_named_by_its_type(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bundle check raising an exception with no message is one failed line naming the
    exception's type (``_one_line``: "its type name when it has no message"), in status
    and in ``run``'s refusal. Kills the mutant that drops the type-name fallback and
    reports an empty reason."""
    _check_module(site, "raise LookupError()", "fakecheck_mutation_gaps_silent")
    install_bundles(site, {BUNDLE: BASE},
                    checks={BUNDLE: "fakecheck_mutation_gaps_silent:check"})
    set_state(tmp_path, {BUNDLE: {"enabled": True, "configuration": DECLARED}})
    shown = status(BUNDLE, capsys)
    assert "bundle check failed: LookupError" in shown["evidence"]
    code, _, err = invoke(["run", "--dry-run", "--", "true"], capsys)
    assert code == 2
    assert err.rstrip().endswith(f"refusing to launch '{BUNDLE}': bundle check failed: LookupError")


# --- plan and render ------------------------------------------------------------------


def test_an_entry_point_outside_the_plugin_groups_is_no_vllm_plugin(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§6.1/§6.3: only activation entry points in ``vllm.general_plugins`` or
    ``vllm.platform_plugins`` are vLLM plugins; one in another group gives no
    ``vllm_plugins`` and no ``VLLM_PLUGINS``. Kills the mutant that takes every activation
    entry point as a plugin."""
    document = _with(
        BASE, activation__entry_points=[{"group": "example.hooks", "name": "unpublished"}]
    )
    install_bundles(site, {BUNDLE: document})
    set_state(tmp_path, {BUNDLE: {"enabled": True, "configuration": DECLARED}})
    _, plan = _plan(capsys)
    assert "vllm_plugins" not in plan["generated_config"]
    code, out, err = invoke(["extension", "env"], capsys)
    assert code == 0, err
    assert "VLLM_PLUGINS" not in json.loads(out)


def test_optional_plan_parts_appear_only_when_non_empty(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§6.1: ``vllm_plugins``, ``vllm_flags`` and ``vllm_options`` are in
    ``generated_config`` only when applicable: a bundle with no plugin entry point, no
    rendered contract and a launch flag set to ``false`` has none of them. Kills each of
    the three mutants that always add its key (as an empty list or object)."""
    install_bundles(site, {BUNDLE: _with(BASE, components=[])})
    configuration = {**DECLARED, "launch_options": {"scheduler_reserve_output_budget": False}}
    set_state(tmp_path, {BUNDLE: {"enabled": False, "configuration": configuration}})
    _, plan = _plan(capsys)
    assert set(plan["generated_config"]) == {
        "environment",
        "additional_config",
        "user_config",
        "vllm_json_options",
        "native_extension_manifest",
    }


def test_the_rendered_launch_artifact_is_the_plan_as_printed(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§4: ``render``'s ``vllm-launch.json`` is the plan, written as ``extension plan``
    prints it (``indent=2``, sorted keys) plus a final newline: the same bytes, not only
    the same JSON value. Kills the mutant that writes artifacts unsorted."""
    install_bundles(site, {BUNDLE: BASE})
    set_state(tmp_path, {BUNDLE: {"enabled": False, "configuration": DECLARED}})
    printed, _ = _plan(capsys)
    code, out, err = invoke(["extension", "render", BUNDLE], capsys)
    assert code == 0, err
    (launch,) = [a for a in json.loads(out) if a["name"] == "vllm-launch.json"]
    assert launch["content"] == printed


# --- conflicts and the launch ---------------------------------------------------------


def test_a_conflict_names_the_bundle_that_claimed_the_option_first(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§9, per key: the first bundle to set an option owns it; a second that agrees takes
    nothing over, so a third that disagrees is refused naming the first and the third.
    Kills the mutant whose agreeing claim replaces the owner (naming the second)."""
    bundles = ("org.test.a", "org.test.b", "org.test.c")
    install_bundles(site, dict.fromkeys(bundles, _other({})))
    values = ({"n": 1}, {"n": 1}, {"n": 2})
    set_state(tmp_path, {
        bundle: {"enabled": True, "configuration": {
            "host_version": "0.33.0", "launch_options": {"speculative_config": value}}}
        for bundle, value in zip(bundles, values, strict=True)
    })
    code, _, err = invoke(["extension", "env"], capsys)
    assert code == 2
    assert err.splitlines()[-1] == (
        "vllm-hust-ext: error: extensions 'org.test.a' and 'org.test.c' conflict on "
        "--speculative-config"
    )


def test_a_bundle_declaring_one_plugin_in_both_groups_is_no_conflict(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§6.3: two *bundles* declaring one plugin name are refused, but one bundle that
    declares a name as both a general and a platform plugin conflicts with nobody: the name
    appears once in ``VLLM_PLUGINS``. Kills the mutant that refuses any repeated name."""
    declares = [{"group": "vllm.general_plugins", "name": "kvp"},
                {"group": "vllm.platform_plugins", "name": "kvp"}]
    install_bundles(site, {BUNDLE: _with(_other({}), activation__entry_points=declares)},
                    plugins={"kvp": "fakestatus.kvp_plugin"})
    points = next(site.glob("*.dist-info")) / "entry_points.txt"
    points.write_text(points.read_text()
                      + "[vllm.platform_plugins]\nkvp = fakestatus.kvp_plugin:register\n")
    set_state(tmp_path, {BUNDLE: {"enabled": True, "configuration": {"host_version": "0.33.0"}}})
    code, out, err = invoke(["extension", "env"], capsys)
    assert code == 0, err
    assert json.loads(out)["VLLM_PLUGINS"] == "ascend,kvp"


def test_a_bundles_other_adapter_policy_is_refused_not_overridden(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the stock-vLLM adapter ``run`` hands the policy over in
    ``additional_config["preemption_policy"]``; an enabled bundle whose own
    ``additional_config`` names another policy there is refused with one line naming the
    key, not silently overridden. Kills the mutant that drops this comparison."""
    document = _with(BASE, activation__additional_config={"preemption_policy": "other.Policy"})
    install_bundles(site, {BUNDLE: document})
    set_state(tmp_path, {BUNDLE: {"enabled": True, "configuration": DECLARED}})
    code, out, err = invoke(["run", "--dry-run", "--", "vllm", "serve", "m", "--scheduler-cls",
                             "bidkv_ext.hosts.vllm.policy_scheduler"], capsys)
    assert (code, out) == (2, "")
    assert err.splitlines()[-1].startswith(
        "vllm-hust-ext: error: an enabled bundle's additional_config key 'preemption_policy' "
        "disagrees with the policy the stock-vLLM adapter is given"
    )


def test_the_activation_environment_overrides_the_callers(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """§6.3: child environment = caller environment + activation + evidence + native
    manifest variables, later ones winning: a variable the caller set and an enabled
    bundle declares reaches the real child with the bundle's value. Kills the mutant that
    lets the caller's value win."""
    monkeypatch.delenv("VLLM_HUST_EXT_EVIDENCE_PATH")  # run owns it (the fixture sets it)
    monkeypatch.setenv("ZZ_MUTATION_GAP", "caller")
    install_bundles(site, {BUNDLE: _other({"ZZ_MUTATION_GAP": "bundle"})})
    set_state(tmp_path, {BUNDLE: {"enabled": True, "configuration": {"host_version": "0.33.0"}}})
    seen = tmp_path / "seen.txt"
    child = "import os, sys; open(sys.argv[1], 'w').write(os.environ['ZZ_MUTATION_GAP'])"
    code, _, err = invoke(["run", "--", sys.executable, "-c", child, str(seen)], capsys)
    assert code == 0, err
    assert seen.read_text() == "bundle"
