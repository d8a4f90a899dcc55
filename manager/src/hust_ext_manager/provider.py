"""The vLLM Host Provider: compatibility check, launch plan and rendered artifacts.

Host facts come from package metadata only (vLLM is never imported): the host version is
``importlib.metadata.version(host.name)`` and the ``vllm.preemption-policy`` protocol is
"1.0" only when the installed host distribution ships
``vllm/v1/core/sched/preemption.py`` (vLLM-HUST): listed in its RECORD or, for an editable
or source-tree install, present in its source tree. The operator's ``configure`` file may
declare ``host_version`` / ``host_api_version`` / ``protocol_versions`` instead.
"""

from __future__ import annotations

import http.client
import importlib.metadata
import inspect
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from hust_ext_manager.discovery import (
    CHECK_GROUP,
    PLUGIN_GROUPS,
    SHUTDOWN_GROUP,
    DiscoveryError,
    InstalledBundle,
    file_exists,
    source_roots,
)
from hust_ext_manager.jsonio import same_json
from hust_ext_manager.manifest import RESERVED_QUALIFICATION_KEY, Manifest
from hust_ext_manager.metadata_scan import metadata_field

__all__ = [
    "CONTRACT_FILE",
    "RENDERED_CONTRACTS",
    "RENDERED_OPTIONS",
    "CheckResult",
    "bundle_checks",
    "bundle_shutdown",
    "check",
    "host_has_preemption_contract",
    "native_manifest",
    "plan",
    "render",
    "service_health",
]

PREEMPTION_PROTOCOL = "vllm.preemption-policy"
CONTRACT_FILE = "vllm/v1/core/sched/preemption.py"
RENDERED_CONTRACTS = {
    "vllm.preemption-policy.v1": "--preemption-policy",
    "vllm.batch-admission-policy.v1": "--batch-admission-policy",
    "vllm.worker-class.v1": "--worker-cls",
}
_LAUNCH_JSON_OPTIONS = {
    "batch_admission_policy_config": "--batch-admission-policy-config",
    "speculative_config": "--speculative-config",
}
_LAUNCH_FLAGS = {"scheduler_reserve_output_budget": "--scheduler-reserve-output-budget"}
# Every vLLM option a plan may render (scalar, JSON or flag).
RENDERED_OPTIONS = frozenset(
    {*RENDERED_CONTRACTS.values(), *_LAUNCH_JSON_OPTIONS.values(), *_LAUNCH_FLAGS.values()}
)
_POLICY_WARNING = (
    "in-process scheduler activation requires explicit host and protocol compatibility "
    "evidence; run refuses unverified policies"
)


@dataclass(frozen=True, slots=True)
class CheckResult:
    """``compatible`` is True, False, or None (unknown)."""

    compatible: bool | None
    configured: bool
    degraded: bool
    evidence: tuple[str, ...]


# --- host facts ---------------------------------------------------------------------


def _host_distribution(name: str) -> importlib.metadata.Distribution | None:
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def host_has_preemption_contract(host_name: str = "vllm") -> bool:
    """True when the installed host ships the ``vllm.preemption-policy`` module: its RECORD
    lists it or, for an editable or source-tree install (whose RECORD lists no package
    files), the module is in its source tree. Nothing is imported."""
    dist = _host_distribution(host_name)
    if dist is None:
        return False
    try:
        files = dist.files or ()
    except (OSError, ValueError, TypeError) as error:  # importlib raises all three
        raise ValueError(
            f"host distribution {host_name!r} RECORD cannot be read, so whether it ships "
            f"{CONTRACT_FILE} is unknown: reinstall {host_name}"
        ) from error
    if any(str(f) == CONTRACT_FILE for f in files):
        return True
    try:
        roots = source_roots(dist)
    except DiscoveryError:
        # An invalid direct_url.json names no source tree: the contract is not detected,
        # and an operator's declared protocol_versions still decides (manager-protocol.md
        # §8), as on any host without it.
        return False
    return any(file_exists(root / CONTRACT_FILE) for root in roots)


def _installed_version(host_name: str) -> str | None:
    """The installed host distribution's version; None when it is not installed or its
    METADATA has no Version field."""
    dist = _host_distribution(host_name)
    if dist is None:
        return None
    try:
        version = metadata_field(dist.metadata, "Version")
    except (OSError, ValueError) as error:  # undecodable METADATA (UnicodeDecodeError)
        raise ValueError(
            f"host distribution {host_name!r} METADATA cannot be read, so its version is "
            f"unknown: reinstall {host_name}"
        ) from error
    return version or None


def _detected_protocols(host_name: str) -> dict[str, str]:
    return {PREEMPTION_PROTOCOL: "1.0"} if host_has_preemption_contract(host_name) else {}


# Operators whose pre-release version lets a range match pre-releases (packaging 24's rule;
# an exclusive ``<``/``>``/``!=`` naming one does not).
_PRERELEASE_OPERATORS = frozenset({"==", ">=", "<=", "~=", "==="})


def _names_prerelease(specifiers: SpecifierSet) -> bool:
    """Whether the range itself names a pre-release (``>=0.28.1rc1.dev319`` does)."""
    for specifier in specifiers:
        if specifier.operator not in _PRERELEASE_OPERATORS:
            continue
        text = specifier.version
        if specifier.operator == "==":
            text = text.removesuffix(".*")
        try:
            if Version(text).is_prerelease:
                return True
        except InvalidVersion:  # an arbitrary ``===`` string names no version
            continue
    return False


def _in_range(version: str, spec: str) -> bool:
    """``version`` in the PEP 440 range; pre-releases match only when the range names one.

    The pre-release rule is spelled out rather than left to ``Version(v) in
    SpecifierSet(r)``: newer packaging releases (26.x) accept ``1.1rc1`` in ``>=1,<2``
    there, while packaging 24 (the official manager's floor) and the protocol do not.
    """
    try:
        specifiers = SpecifierSet(spec)
        return specifiers.contains(Version(version), prereleases=_names_prerelease(specifiers))
    except (InvalidVersion, InvalidSpecifier):
        return False  # an unparsable version counts as outside


# --- configuration ------------------------------------------------------------------


def _optional_string(configuration: Mapping[str, Any], key: str) -> str | None:
    value = configuration.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{key} must be a non-empty string")
    return value


def _environment(manifest: Manifest, configuration: Mapping[str, Any]) -> dict[str, str]:
    overrides = configuration.get("environment", {})
    if not isinstance(overrides, dict):
        raise ValueError("environment must be an object")
    declared = manifest.environment
    undeclared = sorted(set(overrides) - set(declared))
    if undeclared:
        raise ValueError(f"environment overrides must be declared by the manifest: {undeclared}")
    if not all(isinstance(v, str) for v in overrides.values()):
        raise ValueError("environment override values must be strings")
    environment = {**declared, **overrides}
    _exportable(environment)
    return environment


def _exportable(environment: Mapping[str, str]) -> None:
    """Refuse what no process environment can hold, before ``run`` gets as far as exec.

    Manifest 0.2 allows any string, but a name that is empty or holds '=' or NUL, or a
    value holding NUL, would fail the launch with an error naming no variable.
    """
    for name, value in environment.items():
        if not name or "=" in name or "\0" in name:
            raise ValueError(
                f"environment variable name {name!r} cannot be exported: expected a "
                "non-empty name without '=' or NUL"
            )
        if "\0" in value:
            raise ValueError(
                f"environment variable {name!r} cannot be exported: its value holds a NUL "
                "character"
            )


def _launch_options(configuration: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    options = configuration.get("launch_options", {})
    if not isinstance(options, dict):
        raise ValueError("launch_options must be an object")
    unsupported = sorted(set(options) - set(_LAUNCH_JSON_OPTIONS) - set(_LAUNCH_FLAGS))
    if unsupported:
        raise ValueError(f"unsupported vLLM launch_options: {unsupported}")
    json_options: dict[str, Any] = {}
    flags: list[str] = []
    for key, value in sorted(options.items()):
        if key in _LAUNCH_FLAGS:
            if not isinstance(value, bool):
                raise ValueError(f"launch_options.{key} must be a boolean")
            if value:
                flags.append(_LAUNCH_FLAGS[key])
        else:
            if not isinstance(value, dict):
                raise ValueError(f"launch_options.{key} must be an object")
            json_options[_LAUNCH_JSON_OPTIONS[key]] = value
    return json_options, flags


# --- check --------------------------------------------------------------------------


def _host_step(manifest: Manifest, configuration: Mapping[str, Any]) -> tuple[bool | None, str]:
    host = manifest.host
    version = _optional_string(configuration, "host_version")
    if version is None:
        version = _installed_version(host.name)
    if version is None:
        return None, "host version is unavailable; compatibility is unverified"
    if not _in_range(version, host.version_range):
        return False, f"host version {version} is outside {host.version_range}"
    return True, f"host version {version} satisfies the declared range"


def _api_step(manifest: Manifest, configuration: Mapping[str, Any]) -> tuple[bool | None, str]:
    api_range = manifest.host.api_range
    assert api_range is not None
    version = _optional_string(configuration, "host_api_version") or "1.0"
    if not _in_range(version, api_range):
        return False, f"host API {version} is outside {api_range}"
    return True, f"host API {version} satisfies the declared range"


def _protocol_steps(
    manifest: Manifest, configuration: Mapping[str, Any]
) -> list[tuple[bool | None, str]]:
    declared = configuration.get("protocol_versions", {})
    if not isinstance(declared, dict):
        raise ValueError("protocol_versions must be an object")
    for name, value in declared.items():
        # A number (1.0 for "1.0") is a slip, not a statement that the version is unknown:
        # reading it as unavailable would send the user after a detection problem.
        if value is not None and not isinstance(value, str):
            raise ValueError(
                f"protocol_versions.{name} must be a version string, got {json.dumps(value)}"
            )
    versions = {**_detected_protocols(manifest.host.name), **declared}
    steps: list[tuple[bool | None, str]] = []
    for protocol in manifest.protocols:
        version = versions.get(protocol.name)
        if not isinstance(version, str) or not version:
            steps.append((None, f"protocol {protocol.name} version is unavailable"))
        elif protocol.version_range is not None and not _in_range(version, protocol.version_range):
            steps.append(
                (False, f"protocol {protocol.name} {version} is outside {protocol.version_range}")
            )
        else:
            steps.append((True, f"protocol {protocol.name} {version} satisfies the declared range"))
    return steps


def _qualification_step(
    manifest: Manifest, configuration: Mapping[str, Any]
) -> tuple[bool | None, str] | None:
    config = manifest.additional_config
    if RESERVED_QUALIFICATION_KEY not in config:
        return None
    profile = config[RESERVED_QUALIFICATION_KEY]
    if not isinstance(profile, dict):
        return False, "manifest runtime qualification profile is invalid"
    observed = configuration.get("runtime_qualification")
    if not isinstance(observed, dict) or observed.get("status") != "passed":
        return None, (
            "matching source contracts are insufficient; required runtime qualification "
            "is unavailable"
        )
    mismatch = {
        k: (v, observed.get(k)) for k, v in profile.items() if not same_json(observed.get(k), v)
    }
    if mismatch:
        return False, f"runtime qualification profile mismatch: {mismatch}"
    return True, "required runtime qualification profile passed"


def check(manifest: Manifest, configuration: Mapping[str, Any]) -> CheckResult:
    """The provider check (spec §5.2); raises ValueError on a bad user configuration."""
    _environment(manifest, configuration)
    _launch_options(configuration)
    host_ok, host_text = _host_step(manifest, configuration)
    if host_ok is False:
        return _finish(manifest, False, [host_text])
    steps: list[tuple[bool | None, str]] = [(host_ok, host_text)]
    if manifest.host.api_range is not None:
        steps.append(_api_step(manifest, configuration))
    steps.extend(_protocol_steps(manifest, configuration))
    results = [ok for ok, _ in steps]
    result: bool | None = False if False in results else (None if None in results else True)
    evidence = [text for _, text in steps]
    if result is True:
        qualification = _qualification_step(manifest, configuration)
        if qualification is not None:
            result = qualification[0]
            evidence.append(qualification[1])
    return _finish(manifest, result, evidence)


def _finish(manifest: Manifest, result: bool | None, evidence: list[str]) -> CheckResult:
    blocker = manifest.activation_blocker
    if blocker is not None:
        return CheckResult(result, False, True, (*evidence, blocker))
    return CheckResult(
        result,
        result is not False,
        result is None,
        (*evidence, "vLLM launch configuration can be rendered"),
    )


# --- services and bundle checks -----------------------------------------------------


def service_health(
    manifest: Manifest, configuration: Mapping[str, Any]
) -> tuple[bool, bool, list[str], list[str]]:
    """Probe each required service's endpoint.

    Returns (reachable, healthy, evidence lines, ids of unhealthy required services).
    """
    reachable = healthy = True
    evidence: list[str] = []
    unhealthy: list[str] = []
    for service in manifest.requires_services:
        url = configuration.get(service.endpoint_config)
        ok = False
        if not isinstance(url, str) or not url:
            evidence.append(
                f"service {service.service_id} endpoint {service.endpoint_config} is not configured"
            )
            reachable = False
        else:
            answered, ok, finding = _probe(url)
            reachable = reachable and answered
            evidence.append(f"service {service.service_id} at {url} is {finding}")
        healthy = healthy and ok
        if not ok and not service.optional:
            unhealthy.append(service.service_id)
    return reachable, healthy, evidence, unhealthy


def _probe(url: str) -> tuple[bool, bool, str]:
    """(reachable, healthy, finding) for one health endpoint: an HTTP(S) GET, 2 s.

    A server that answers with an error status, or with something that is not HTTP (the
    port of a service's own protocol), is reachable but unhealthy; an endpoint that is not
    an http(s) URL, or not a valid one, has no health to read, so it counts as unreachable.
    """
    try:
        scheme = urllib.parse.urlsplit(url).scheme.lower()
    except ValueError as error:  # e.g. an unclosed IPv6 bracket: "http://[::1"
        return False, False, f"unreachable: the endpoint is not a valid URL ({error})"
    if scheme not in ("http", "https"):
        return False, False, "unreachable: the endpoint must be an http:// or https:// URL"
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            status = response.status
    except urllib.error.HTTPError as error:  # an answer, with a non-2xx status
        return True, False, f"unhealthy: HTTP {error.code}"
    except http.client.InvalidURL as error:  # refused before any request was sent
        return False, False, f"unreachable: the endpoint is not a valid URL ({error})"
    except (OSError, ValueError) as error:  # URLError is an OSError
        return False, False, f"unreachable: {error}"
    except http.client.HTTPException as error:  # not an OSError: BadStatusLine and kin
        reason = _one_line(error)
        return True, False, f"unhealthy: not an HTTP answer ({type(error).__name__}: {reason})"
    if 200 <= status < 300:
        return True, True, "healthy"
    return True, False, f"unhealthy: HTTP {status}"


def _one_line(error: Exception) -> str:
    """A bundle hook's exception as one line (its type name when it has no message)."""
    return " ".join(str(error).split()) or type(error).__name__


def _takes_context(function: Any) -> bool:
    try:
        return "context" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # builtins and C callables may have no signature
        return False


def _own_hooks(group: str, bundle: InstalledBundle) -> list[importlib.metadata.EntryPoint]:
    """The bundle's hooks in ``group``: registered under its id by its own distribution, so
    that no other installed distribution can veto its launch or run code in its name."""
    own = canonicalize_name(bundle.distribution)
    return [e for e in importlib.metadata.entry_points(group=group, name=bundle.bundle_id)
            if e.dist is not None and _canonical_name(e.dist) == own]


def _canonical_name(dist: importlib.metadata.Distribution) -> str | None:
    """``dist``'s normalized name; ``None`` when its METADATA gives none (or cannot be
    read). Discovery refuses such a distribution as a bundle's own, so its hooks are never
    the bundle's."""
    try:
        name = metadata_field(dist.metadata, "Name")
    except (OSError, ValueError):  # undecodable
        return None
    return canonicalize_name(name) if name else None


def bundle_checks(
    bundle: InstalledBundle,
    configuration: Mapping[str, Any],
    context: Mapping[str, Any] | None = None,
) -> list[tuple[bool, str]]:
    """Run the bundle's own check from ``vllm_hust_ext.bundle_checks`` (loaded only here).

    A check is called as ``check(manifest, configuration)``. One that declares a ``context``
    parameter also gets ``context=`` a dict with ``enabled_bundles`` (the raw manifests of
    the *other* enabled bundles, by id) and ``command`` (the launch command for ``run``,
    ``None`` for ``status``/``check``), so it can refuse a launch another bundle or an
    option would break.
    """
    results: list[tuple[bool, str]] = []
    for registration in _own_hooks(CHECK_GROUP, bundle):
        try:
            function = registration.load()
            extra = {"context": dict(context)} if context and _takes_context(function) else {}
            for ok, line in function(dict(bundle.raw), dict(configuration), **extra):
                results.append((bool(ok), str(line)))
        except Exception as error:  # a broken check is a failed check, never a crash
            results.append((False, f"bundle check failed: {_one_line(error)}"))
    return results


def bundle_shutdown(bundle: InstalledBundle, configuration: Mapping[str, Any]) -> list[str]:
    """Run the bundle's ``vllm_hust_ext.bundle_shutdown`` hook after a launch ended.

    The hook gets ``(manifest, configuration)`` once the launch has ended (after the
    manager's clean-up of the process group, or a command that could not start) and returns
    report lines (what it cleaned up, what it left and why). It can never change
    ``run``'s exit status: a raising hook is one more line.
    """
    lines: list[str] = []
    for registration in _own_hooks(SHUTDOWN_GROUP, bundle):
        try:
            function = registration.load()
            lines.extend(str(line) for line in function(dict(bundle.raw), dict(configuration)))
        except Exception as error:
            lines.append(f"bundle shutdown hook failed: {_one_line(error)}")
    return lines


# --- plan and render ----------------------------------------------------------------


def rendered_options(manifest: Manifest) -> dict[str, str]:
    """Scalar vLLM options from components whose contract has a renderer."""
    options: dict[str, str] = {}
    for contract, option in RENDERED_CONTRACTS.items():
        refs = [c.implementation_ref for c in manifest.components if contract in c.contracts]
        if len(refs) > 1:
            raise ValueError(f"exactly one {contract} component is required")
        if refs:
            options[option] = refs[0].replace(":", ".")
    return options


def native_manifest(manifest: Manifest) -> dict[str, Any] | None:
    """The host-native Bundle v1 document, present when ``host.api_range`` is declared."""
    if manifest.host.api_range is None:
        return None
    return {
        "schema_version": "1.0",
        "bundle_id": manifest.extension_id,
        "bundle_version": manifest.extension_version,
        "host_api_range": manifest.host.api_range,
        "components": [
            {
                "component_id": c.component_id,
                "contracts": list(c.contracts),
                "execution_planes": list(c.execution_planes),
                "isolation": c.isolation,
                "implementation_ref": c.implementation_ref,
                "permissions": list(c.permissions),
            }
            for c in manifest.components
        ],
    }


def plugin_names(manifest: Manifest) -> list[str]:
    return [e.name for e in manifest.activation.entry_points if e.group in PLUGIN_GROUPS]


def plan(
    bundle: InstalledBundle, configuration: Mapping[str, Any], *, enabled: bool
) -> dict[str, Any]:
    """The provider plan: one non-mutating action, the generated launch config, warnings.

    A bundle that cannot activate gets an ``inspect_only`` plan that says why.
    """
    manifest = bundle.manifest
    blocker = manifest.activation_blocker
    if blocker is not None:
        return _plan_document(manifest, "inspect_only", False, {}, [blocker])
    generated = _generated_config(manifest, configuration)
    warnings = []
    if manifest.kind == "scheduler_policy" and manifest.protocols:
        warnings.append(_POLICY_WARNING)
    result = _plan_document(manifest, "configure_launch", enabled, generated, warnings)
    if any(action["mutating"] for action in result["actions"]):
        raise ValueError("provider plan contains a forbidden implicit mutation")
    return result


def _plan_document(
    manifest: Manifest,
    operation: str,
    enabled: bool,
    generated: dict[str, Any],
    warnings: list[str],
) -> dict[str, Any]:
    return {
        "extension_id": manifest.extension_id,
        "provider": "vllm",
        "actions": [
            {
                "operation": operation,
                "target": "vllm",
                "lifecycle_owner": manifest.lifecycle_owner,
                "mutating": False,
                "details": {"enabled": enabled},
            }
        ],
        "generated_config": generated,
        "warnings": warnings,
    }


def _generated_config(manifest: Manifest, configuration: Mapping[str, Any]) -> dict[str, Any]:
    """What ``run`` applies to the launch; optional parts appear only when non-empty."""
    json_options, flags = _launch_options(configuration)
    additional = {
        k: v for k, v in manifest.additional_config.items() if k != RESERVED_QUALIFICATION_KEY
    }
    generated: dict[str, Any] = {
        "environment": _environment(manifest, configuration),
        "additional_config": additional,
        "user_config": dict(configuration),
        "vllm_json_options": json_options,
    }
    plugins = plugin_names(manifest)
    if plugins:
        generated["vllm_plugins"] = plugins
    if flags:
        generated["vllm_flags"] = flags
    options = rendered_options(manifest)
    if options:
        generated["vllm_options"] = options
    native = native_manifest(manifest)
    if native is not None:
        generated["native_extension_manifest"] = native
    return generated


def render(plan_document: Mapping[str, Any]) -> list[dict[str, str]]:
    generated = plan_document.get("generated_config", {})
    if plan_document["actions"][0]["operation"] == "inspect_only":
        return [_artifact("inspection-plan.json", plan_document)]
    artifacts = []
    native = generated.get("native_extension_manifest")
    if native is not None:
        artifacts.append(_artifact("vllm-extension-manifest.json", native))
    artifacts.append(_artifact("vllm-launch.json", plan_document))
    return artifacts


def _artifact(name: str, content: object) -> dict[str, str]:
    return {
        "name": name,
        "media_type": "application/json",
        "content": json.dumps(content, indent=2, sort_keys=True) + "\n",
    }
