"""Manifest 0.2 and state-file behaviour a mutation audit of ``manifest.py`` and
``state.py`` found unguarded: each test pins one promise of manager-protocol.md that a
small change to the code (a value dropped from an enum, a loosened pattern, a skipped
check, a changed default) broke without any other test failing.

- §1.2: every listed ``kind``, ``lifecycle_owner``, ``runtime.type``, carrier ``type`` and
  module ``status`` is accepted;
- §1.3: every listed execution plane, isolation and permission is accepted;
- §1.2/§1.3: the identifier regex ``^[a-z0-9][a-z0-9.-]*$`` accepts one character and
  refuses a leading dot or hyphen (extension id, host provider, component id);
- §1.3: ``implementation_ref`` needs its ``:`` and may name ``Object.attr``;
- §1.1/§1.2: a required key left out is named in ``missing=[...]`` (top level, component,
  service), never a crash;
- §1.1: a non-string where a non-empty string is required gets ``must be a non-empty
  string``; free strings (protocol name, service id/protocol, entry point group) are
  checked too;
- §1.2: a ``python_module`` carrier has exactly ``module``, ``object``, ``status``, each a
  string; other carriers keep their attributes;
- §1.2: ``optional`` defaults to false and must be a JSON boolean, not a number;
- §1.2: activation keys are each optional; an entry point's group must be non-empty;
- §1.2/§1.3: a 0.2 manifest is experimental; duplicate ids are refused however many;
  component arrays keep the manifest's order;
- §1.1: only ``"1.0"`` selects the legacy parser, and the legacy rules check
  ``bundle_id``, ``bundle_version``, ``host_api_range`` and missing fields, and keep
  ``activation``;
- the parsed models are frozen;
- §2: a manifest path that is a directory is refused as not a regular file;
- §3: a schema 1 file without ``enabled`` and a schema 2 file without ``extensions`` are
  empty state; a non-UTF-8 state file is refused;
- §3: writes are ``indent=2`` JSON with sorted keys and a trailing newline, entries always
  hold ``enabled`` and ``configuration``, and missing parent directories are created;
- the parsed state is frozen: changes go through ``with_entry``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pydantic
import pytest
from hust_ext_manager.manifest import ManifestError, parse_manifest
from hust_ext_manager.state import (
    ExtensionState,
    State,
    load_state,
    parse_state,
    write_state,
)

from tests.manager_helpers import fake_site, install_bundles, invoke

ROOT = Path(__file__).resolve().parents[1]
BASE: dict[str, Any] = json.loads(
    (ROOT / "manifests" / "bidkv" / "vllm-hust-extension-v0.2.json").read_text()
)
GOOD = "org.test.good"


def _replaced(original: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``original`` with keys replaced (``None`` removes the key)."""
    result = copy.deepcopy(original)
    for key, value in changes.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = value
    return result


def _document(**changes: Any) -> dict[str, Any]:
    """The BidKV manifest with top-level keys replaced (``None`` removes the key)."""
    return _replaced(BASE, changes)


def _component(**changes: Any) -> dict[str, Any]:
    """The BidKV manifest's first component with keys replaced (``None`` removes it)."""
    return _replaced(BASE["components"][0], changes)


def _refusal(document: object) -> str:
    with pytest.raises(ManifestError) as raised:
        parse_manifest(document)
    return str(raised.value)


_SERVICE: dict[str, Any] = {
    "service_id": "store",
    "protocol": "http",
    "version_range": None,
    "endpoint_config": "health_url",
}


# --- §1.2/§1.3: every listed enum value is accepted --------------------------------------

_ENUM_CASES: list[tuple[str, str]] = [
    *[("kind", v) for v in ("in_process_plugin", "scheduler_policy", "kv_connector",
                            "kv_service_adapter", "control_plane_extension", "runtime_bridge")],
    *[("lifecycle_owner", v) for v in ("vllm", "host", "external_operator", "kubernetes",
                                       "user")],
    *[("runtime.type", v) for v in ("python", "external_service", "oci", "kubernetes",
                                    "composite")],
    *[("carrier", v) for v in ("host_builtin", "python_entry_point", "external_service",
                               "oci_image", "helm_values", "kubernetes_manifest", "crd",
                               "controller")],
    *[("status", v) for v in ("active", "import_only", "legacy_unregistered")],
    *[("plane", v) for v in ("api", "scheduler", "worker", "native", "device", "bridge")],
    *[("isolation", v) for v in ("trusted_in_process", "process_isolated",
                                 "sandboxed_process")],
    *[("permission", v) for v in ("device_access", "filesystem_read", "filesystem_write",
                                  "ipc", "network_egress", "shared_memory", "subprocess")],
]


def _with_enum(field: str, value: str) -> dict[str, Any]:
    document = _document()
    if field in ("kind", "lifecycle_owner"):
        document[field] = value
    elif field == "runtime.type":
        document["runtime"]["type"] = value
    elif field == "carrier":
        document["implementation"].append({"type": value, "name": "x"})
    elif field == "status":
        document["implementation"].append(
            {"type": "python_module", "module": "m", "object": "O", "status": value}
        )
    elif field == "plane":
        document["components"][0]["execution_planes"] = [value]
    elif field == "isolation":
        document["components"][0]["isolation"] = value
    else:
        document["components"][0]["permissions"] = [value]
    return document


@pytest.mark.parametrize(("field", "value"), _ENUM_CASES, ids=[v for _, v in _ENUM_CASES])
def test_every_listed_enum_value_is_accepted(field: str, value: str) -> None:
    """§1.2/§1.3: each value the protocol lists for an enum field parses."""
    parsed = parse_manifest(_with_enum(field, value))
    assert parsed.extension_id == BASE["extension_id"]


# --- identifiers and references ----------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "ok"),
    [
        ("extension_id", "a", True),
        ("extension_id", "7", True),
        ("extension_id", "-org.test", False),
        ("extension_id", ".org.test", False),
        ("host.provider", "v", True),
        ("host.provider", "-vllm", False),
        ("component_id", "c", True),
        ("component_id", ".victim", False),
    ],
)
def test_the_identifier_regex_is_anchored_at_its_first_character(
    field: str, value: str, ok: bool
) -> None:
    """§1.2: ``^[a-z0-9][a-z0-9.-]*$``: one character is enough, a dot or hyphen may not lead."""
    document = _document()
    if field == "host.provider":
        document["host"]["provider"] = value
    elif field == "component_id":
        document["components"][0]["component_id"] = value
    else:
        document[field] = value
    if ok:
        parse_manifest(document)
    else:
        location = "components[0].component_id" if field == "component_id" else field
        assert _refusal(document) == f"{location} is invalid"


@pytest.mark.parametrize(
    ("reference", "ok"),
    [
        ("bidkv_ext.selector.BidkvPreemptionPolicy", False),
        ("selector", False),
        ("bidkv_ext.selector:BidkvPreemptionPolicy.create", True),
    ],
    ids=["dotted-without-colon", "bare-name", "object-attribute"],
)
def test_an_implementation_ref_needs_its_colon_and_may_name_an_attribute(
    reference: str, ok: bool
) -> None:
    """§1.3: ``module.path:Object[.attr]``: the colon is required, ``Object.attr`` allowed."""
    document = _document(components=[_component(implementation_ref=reference)])
    if ok:
        assert parse_manifest(document).components[0].implementation_ref == reference
    else:
        assert _refusal(document) == "components[0].implementation_ref is invalid"


# --- required keys and string fields -----------------------------------------------------

_TOP_REQUIRED = ["extension_id", "extension_version", "kind", "host", "runtime",
                 "lifecycle_owner", "protocols", "implementation", "requires_services"]


@pytest.mark.parametrize("key", _TOP_REQUIRED)
def test_a_missing_top_level_key_is_named(key: str) -> None:
    """§1.1: each required top-level key left out gives ``unknown=[] missing=[key]``."""
    document = _document()
    del document[key]
    assert _refusal(document) == f"experimental manifest has unknown=[] missing=['{key}']"


@pytest.mark.parametrize(
    "key", ["component_id", "contracts", "execution_planes", "isolation", "implementation_ref"]
)
def test_a_missing_component_key_is_named(key: str) -> None:
    """§1.3: a component without a required key gives ``components[i] has ... missing``."""
    document = _document(components=[_component(**{key: None})])
    assert _refusal(document) == f"components[0] has unknown=[] missing=['{key}']"


@pytest.mark.parametrize("key", ["service_id", "protocol", "version_range", "endpoint_config"])
def test_a_missing_service_key_is_named(key: str) -> None:
    """§1.2: a service without a required key gives ``requires_services[i] has ... missing``."""
    service = {k: v for k, v in _SERVICE.items() if k != key}
    document = _document(requires_services=[service])
    assert _refusal(document) == f"requires_services[0] has unknown=[] missing=['{key}']"


@pytest.mark.parametrize(
    ("section", "key", "value", "location"),
    [
        ("", "extension_id", 7, "extension_id"),
        ("", "kind", 1, "kind"),
        ("protocols", "name", " ", "protocols[0].name"),
        ("requires_services", "service_id", " ", "requires_services[0].service_id"),
        ("requires_services", "protocol", "\t", "requires_services[0].protocol"),
        ("entry_points", "group", " ", "activation.entry_points[0].group"),
    ],
)
def test_every_required_string_must_be_a_non_empty_string(
    section: str, key: str, value: object, location: str
) -> None:
    """§1.1: a value that is not a ``str`` with non-blank ``strip()`` gets
    ``<location> must be a non-empty string``, also for the free-text fields."""
    document = _document()
    if section == "":
        document[key] = value
    elif section == "protocols":
        document["protocols"][0][key] = value
    elif section == "requires_services":
        document["requires_services"] = [{**_SERVICE, key: value}]
    else:
        document["activation"]["entry_points"] = [{"group": "g", "name": "n", key: value}]
    assert _refusal(document) == f"{location} must be a non-empty string"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([1], "components[0].contracts must be an array of strings"),
        ("vllm.preemption-policy.v1", "components[0].contracts must be an array of strings"),
        (["vllm.a", "vllm.b", "vllm.a", "vllm.b"],
         "components[0].contracts must not contain duplicates"),
        (["vllm.preemption-policy.v1", "torch.x"], "components[0].contracts is invalid"),
    ],
    ids=["non-string-item", "string-not-array", "two-duplicates", "one-foreign-contract"],
)
def test_contracts_are_an_array_of_unique_vllm_strings(value: object, message: str) -> None:
    """§1.3: ``contracts`` is an array of unique strings, *each* starting with ``vllm.``."""
    document = _document(components=[_component(contracts=value)])
    assert _refusal(document) == message


def test_component_arrays_keep_the_manifests_order() -> None:
    """§1.3/§1.4: contracts, planes and permissions are kept as written (the native
    manifest copies them), not re-sorted."""
    component = _component(
        contracts=["vllm.preemption-policy.v1", "vllm.a"],
        execution_planes=["worker", "api"],
        permissions=["subprocess", "ipc"],
    )
    (parsed,) = parse_manifest(_document(components=[component])).components
    assert parsed.contracts == ("vllm.preemption-policy.v1", "vllm.a")
    assert parsed.execution_planes == ("worker", "api")
    assert parsed.permissions == ("subprocess", "ipc")


def test_component_ids_must_be_unique_however_many_repeat() -> None:
    """§1.3: two pairs of duplicate component ids are refused too."""
    components = [_component(component_id=i) for i in ("a", "b", "a", "b")]
    assert _refusal(_document(components=components)) == "component_id values must be unique"


@pytest.mark.parametrize(
    ("carrier", "message"),
    [
        ({"type": "python_module", "module": "m", "object": "O", "status": "active",
          "extra": 1}, "implementation[0] python_module requires module, object, and status"),
        ({"type": "python_module", "module": True, "object": "O", "status": "active"},
         "implementation[0].module is invalid"),
        ({"type": "python_module", "module": "m", "object": True, "status": "active"},
         "implementation[0].object is invalid"),
    ],
    ids=["extra-attribute", "boolean-module", "boolean-object"],
)
def test_a_python_module_carrier_has_exactly_three_string_attributes(
    carrier: dict[str, Any], message: str
) -> None:
    """§1.2: ``python_module`` must have exactly ``module``, ``object`` and ``status``."""
    assert _refusal(_document(implementation=[carrier])) == message


def test_other_carriers_keep_their_free_attributes() -> None:
    """§1.2: a non-module carrier accepts free attributes and keeps them."""
    carrier = {"type": "python_entry_point", "name": "n", "group": "g"}
    parsed = parse_manifest(_document(implementation=[carrier]))
    assert parsed.implementation[0].type == "python_entry_point"
    assert parsed.implementation[0].attribute("group") == "g"
    assert parsed.implementation[0].attribute("name") == "n"
    assert parsed.activation_blocker is None


def test_an_entry_point_carrier_with_a_status_attribute_is_no_module() -> None:
    """§1.4: only ``python_module`` carriers can be descriptor-only; an entry-point carrier
    with a free ``status`` attribute still leaves the bundle activatable."""
    carrier = {"type": "python_entry_point", "group": "g", "name": "n", "status": "import_only"}
    assert parse_manifest(_document(implementation=[carrier])).activation_blocker is None


# --- services, activation, flags ---------------------------------------------------------


@pytest.mark.parametrize(("given", "expected"), [({}, False), ({"optional": True}, True)])
def test_a_service_is_required_unless_it_says_optional(
    given: dict[str, Any], expected: bool
) -> None:
    """§1.2: ``optional`` defaults to false."""
    parsed = parse_manifest(_document(requires_services=[{**_SERVICE, **given}]))
    assert parsed.requires_services[0].optional is expected


@pytest.mark.parametrize("value", [1, 0])
def test_a_numeric_optional_is_no_boolean(value: int) -> None:
    """§1.2: ``optional`` must be a JSON boolean; ``1``/``0`` are refused."""
    document = _document(requires_services=[{**_SERVICE, "optional": value}])
    assert _refusal(document) == "requires_services[0].optional must be boolean"


@pytest.mark.parametrize(
    "activation",
    [{}, {"entry_points": []}, {"environment": {"A": "1"}}, {"additional_config": {"k": 1}}],
    ids=["empty", "entry-points-only", "environment-only", "additional-config-only"],
)
def test_each_activation_key_is_optional(activation: dict[str, Any]) -> None:
    """§1.2: ``entry_points``, ``environment`` and ``additional_config`` may each be left out."""
    parsed = parse_manifest(_document(activation=activation))
    assert parsed.environment == activation.get("environment", {})
    assert parsed.additional_config == activation.get("additional_config", {})
    assert parsed.activation.entry_points == ()


def test_a_zero_point_two_manifest_is_experimental() -> None:
    """§1.1: a ``0.2-experimental`` manifest parses as experimental, with its schema version."""
    parsed = parse_manifest(_document())
    assert parsed.experimental is True
    assert parsed.schema_version == "0.2-experimental"


def test_the_parsed_manifest_is_frozen() -> None:
    """The parsed models are immutable: a caller cannot change a validated manifest."""
    parsed = parse_manifest(_document())
    with pytest.raises(pydantic.ValidationError):
        parsed.extension_id = "other"  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        parsed.host.version_range = ">=0"  # type: ignore[misc]


# --- legacy Bundle v1 --------------------------------------------------------------------


_LEGACY: dict[str, Any] = {
    "schema_version": "1.0",
    "bundle_id": "org.test.legacy",
    "bundle_version": "2.0",
    "host_api_range": ">=1,<2",
    "components": BASE["components"],
}


def _legacy(**changes: Any) -> dict[str, Any]:
    """A legacy (schema 1.0) manifest with keys replaced (``None`` removes the key)."""
    return _replaced(_LEGACY, changes)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"bundle_id": "Org.Bad"},
            "bundle_id must use lowercase letters, digits, dots, or hyphens",
        ),
        ({"bundle_version": "two"}, "bundle_version is not a valid version"),
        ({"host_api_range": "~~1"}, "host_api_range is not a valid version range"),
        ({"host_api_range": None}, "manifest is missing fields: ['host_api_range']"),
        ({"components": None, "bundle_version": None},
         "manifest is missing fields: ['bundle_version', 'components']"),
        ({"host_api_range": ">=1.5,<2"}, "bundle requires host API >=1.5,<2, host provides 1.0"),
    ],
    ids=["bundle-id", "bundle-version", "api-range-syntax", "missing-api-range",
         "missing-two", "api-range-excludes-1.0"],
)
def test_the_legacy_rules_check_each_field(changes: dict[str, Any], message: str) -> None:
    """§1.1: ``"1.0"`` goes to the legacy rules, which check id, version, host API range
    (against the fixed host API 1.0) and required fields."""
    assert _refusal(_legacy(**changes)) == message


def test_a_legacy_manifest_keeps_its_activation() -> None:
    """§1.1: a legacy manifest's optional ``activation`` is validated and kept."""
    activation = {"environment": {"B": "2", "A": "1"}, "additional_config": {"k": 1}}
    parsed = parse_manifest(_legacy(activation=activation))
    assert parsed.experimental is False
    assert parsed.environment == {"A": "1", "B": "2"}
    assert parsed.additional_config == {"k": 1}
    assert _refusal(_legacy(activation={"other": 1})) == (
        "activation contains unknown fields: ['other']"
    )


@pytest.mark.parametrize("version", ["1", 1.0, "0.2", None])
def test_only_the_exact_schema_strings_dispatch(version: object) -> None:
    """§1.1: only ``"1.0"`` and ``"0.2-experimental"`` are schema versions."""
    assert _refusal(_legacy(schema_version=version)) == "unsupported schema_version"


# --- manifest file -----------------------------------------------------------------------


def test_a_manifest_path_that_is_a_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """§2: the manifest must be a regular non-symlink file; a directory is not one."""
    site = fake_site(tmp_path, monkeypatch)
    install_bundles(site, {GOOD: BASE})
    (manifest,) = site.glob("*/b0/vllm-hust-extension-v0.2.json")
    manifest.unlink()
    manifest.mkdir()
    code, _, err = invoke(["extension", "validate", GOOD], capsys)
    assert code == 2
    assert err.splitlines()[-1] == (
        f"vllm-hust-ext: error: {GOOD!r} manifest is invalid: "
        "manifest must be a regular non-symlink file"
    )


# --- state file --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "document",
    [{"schema_version": 1}, {"schema_version": 2}],
    ids=["schema-1-without-enabled", "schema-2-without-extensions"],
)
def test_a_state_document_without_its_collection_is_empty(document: dict[str, Any]) -> None:
    """§3: a state file without ``enabled`` (schema 1) or ``extensions`` (schema 2) is empty."""
    assert parse_state(document).extensions == {}


@pytest.mark.parametrize(
    "payload",
    [b'{"schema_version": 2, "extensions": {"\xff": {}}}', b'\xef\xbb\xbf{"schema_version": 2}'],
    ids=["latin-1-byte", "bom"],
)
def test_a_state_file_that_is_not_plain_utf8_json_is_refused(
    tmp_path: Path, payload: bytes
) -> None:
    """§3: a state file that is not UTF-8 JSON is refused (not repaired, not read as empty),
    even when its bytes would decode to a valid document with replacement characters."""
    path = tmp_path / "config.json"
    path.write_bytes(payload)
    with pytest.raises(ValueError, match=r"^vllm-hust-ext config .* is not"):
        load_state(path)


def test_the_state_file_is_indented_sorted_and_ends_with_a_newline(tmp_path: Path) -> None:
    """§3: writes are JSON with ``indent=2``, sorted keys (nested ones too) and a trailing
    newline; every entry holds ``enabled`` and ``configuration``; missing parent
    directories are created."""
    path = tmp_path / "new" / "dir" / "config.json"
    state = State(
        extensions={
            "org.test.b": ExtensionState(enabled=False),
            "org.test.a": ExtensionState(
                enabled=True, configuration={"z": 1, "a": {"y": 2, "b": 3}}
            ),
        }
    )
    write_state(state, path)
    document = {
        "schema_version": 2,
        "extensions": {
            "org.test.a": {"enabled": True, "configuration": {"z": 1, "a": {"y": 2, "b": 3}}},
            "org.test.b": {"enabled": False, "configuration": {}},
        },
    }
    assert path.read_text(encoding="utf-8") == json.dumps(document, indent=2, sort_keys=True) + "\n"


def test_the_parsed_state_is_frozen() -> None:
    """The state model is immutable: changes go through ``with_entry``."""
    state = parse_state({"schema_version": 2, "extensions": {"x": {"enabled": True}}})
    with pytest.raises(pydantic.ValidationError):
        state.extensions["x"].enabled = False  # type: ignore[misc]
    changed = state.with_entry("x", None)
    assert "x" in state.extensions and "x" not in changed.extensions
