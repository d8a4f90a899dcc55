"""Manifest 0.2 validation by the compatible ``vllm-hust-ext`` manager.

Guards: every malformed manifest (each protocol rule broken once, plus discovery-level
faults) is refused by ``extension validate`` with exit 2 and a one-line message that names
the offending field; the JSON Schema in ``manifests/schema/`` agrees with the rules, is
shipped identically inside the manager package, and accepts our bundle manifest; our
BidKV manifest satisfies the official manager's published rules (manager-protocol.md
§1-§2), so the bundle also works with the official manager unchanged. Also: the optional
and nullable fields are accepted, activation pairs print sorted by key, the activation
blocker needs *every* Python carrier descriptor-only, legacy Bundle v1 manifests go to the
legacy rules, only a local editable ``direct_url.json`` is searched, strict discovery keeps
the requested order, and ``list`` reports duplicates and nameless distributions. The
first failure in §1.1's validation order wins, and no verb (up to ``run --dry-run``)
imports the bundle's manifest package, its implementation module or the host.

Bundles are registered through a throw-away ``*.dist-info`` directory on ``sys.path``, the
same metadata an installed wheel provides, and the CLI runs in-process (fast).
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hust_ext_manager import manifest as manifest_module
from hust_ext_manager import metadata_scan
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.manager_helpers import invoke

ROOT = Path(__file__).resolve().parents[1]
BIDKV_MANIFEST = ROOT / "manifests" / "bidkv" / "vllm-hust-extension-v0.2.json"
SCHEMA = ROOT / "manifests" / "schema" / "vllm-hust-extension-v0.2.schema.json"
PACKAGED_SCHEMA = (
    ROOT
    / "manager"
    / "src"
    / "hust_ext_manager"
    / "schema"
    / "vllm-hust-extension-v0.2.schema.json"
)
TEST_ID = "org.test.bad"


def write_dist(
    root: Path,
    name: str,
    registrations: dict[str, str],
    files: dict[str, bytes],
    *,
    version: str = "1.0",
) -> None:
    """A minimal installed distribution: METADATA, entry_points.txt and a RECORD."""
    # Wheel convention: the dist-info directory uses the underscore-normalised name.
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = ["[vllm_hust.extension_bundles]"] + [f"{k} = {v}" for k, v in registrations.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    (info / "RECORD").write_text("".join(f"{path},,\n" for path in files))
    for relative, data in files.items():
        target = root / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def base_manifest() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(BIDKV_MANIFEST.read_text())
    document["extension_id"] = TEST_ID
    return document


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VLLM_HUST_EXT_CONFIG", str(tmp_path / "state" / "config.json"))
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    return site


def _set(path: str, value: object) -> Callable[[dict[str, Any]], Any]:
    """Mutation: set a dotted/indexed path (``a.b[0].c``) to ``value``."""

    def mutate(document: dict[str, Any]) -> Any:
        keys = [int(k) if k.isdigit() else k for k in re.findall(r"[^.\[\]]+", path)]
        target: Any = document
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
        return document

    return mutate


def _drop(path: str, key: str) -> Callable[[dict[str, Any]], Any]:
    def mutate(document: dict[str, Any]) -> Any:
        target: Any = document
        for part in [int(k) if k.isdigit() else k for k in re.findall(r"[^.\[\]]+", path)]:
            target = target[part]
        del target[key]
        return document

    return mutate


def _dup_component(document: dict[str, Any]) -> Any:
    document["components"].append(copy.deepcopy(document["components"][0]))
    return document


def _replace(value: object) -> Callable[[dict[str, Any]], Any]:
    return lambda _document: value


_SERVICE = {"service_id": "s", "protocol": "http", "version_range": None}

# (case id, mutation, expected message fragment, schema also rejects it)
MALFORMED: list[tuple[str, Callable[[dict[str, Any]], Any], str, bool]] = [
    ("not-an-object", _replace([1, 2]), "manifest must be an object with string keys", True),
    ("schema-0.3", _set("schema_version", "0.3-experimental"), "unsupported schema_version", True),
    (
        "unknown-name",
        _set("name", "x"),
        "experimental manifest has unknown=['name'] missing=[]",
        True,
    ),
    ("unknown-0.3-key", _set("requires_extensions", []), "unknown=['requires_extensions']", True),
    ("missing-host", _drop("", "host"), "missing=['host']", True),
    ("bad-id", _set("extension_id", "Org.Bad"), "extension_id is invalid", True),
    ("blank-id", _set("extension_id", "  "), "extension_id must be a non-empty string", True),
    (
        "bad-version",
        _set("extension_version", "one"),
        "extension_version is not a valid version",
        False,
    ),
    ("bad-kind", _set("kind", "policy"), "kind contains unsupported values: ['policy']", True),
    (
        "bad-owner",
        _set("lifecycle_owner", "root"),
        "lifecycle_owner contains unsupported values",
        True,
    ),
    ("host-extra", _set("host.port", 1), "host has unknown=['port'] missing=[]", True),
    ("host-provider", _set("host.provider", "VLLM"), "host.provider is invalid", True),
    ("host-name", _set("host.name", " "), "host.name must be a non-empty string", True),
    (
        "host-range",
        _set("host.version_range", "~~1"),
        "host.version_range is not a valid version range",
        False,
    ),
    (
        "host-api-range",
        _set("host.api_range", "one"),
        "host.api_range is not a valid version range",
        False,
    ),
    (
        "runtime-keys",
        _drop("runtime", "isolation"),
        "runtime requires type, process_scope, and isolation",
        True,
    ),
    (
        "runtime-type",
        _set("runtime.type", "wasm"),
        "runtime.type contains unsupported values",
        True,
    ),
    ("protocols-type", _set("protocols", {}), "protocols must be an array", True),
    (
        "protocol-keys",
        _set("protocols[0].extra", 1),
        "protocols[0] requires name and version_range",
        True,
    ),
    (
        "protocol-range",
        _set("protocols[0].version_range", "=>1"),
        "protocols[0].version_range is not a valid version range",
        False,
    ),
    (
        "implementation-empty",
        _set("implementation", []),
        "implementation must be a non-empty array",
        True,
    ),
    (
        "carrier-type",
        _set("implementation[0].type", "wheel"),
        "implementation[0].type contains unsupported values",
        True,
    ),
    (
        "carrier-bare",
        _set("implementation", [{"type": "host_builtin"}]),
        "implementation[0] has no carrier attributes",
        True,
    ),
    (
        "module-keys",
        _drop("implementation[0]", "status"),
        "implementation[0] python_module requires module, object, and status",
        True,
    ),
    (
        "module-name",
        _set("implementation[0].module", "1bad"),
        "implementation[0].module is invalid",
        True,
    ),
    (
        "module-object",
        _set("implementation[0].object", "a.b"),
        "implementation[0].object is invalid",
        True,
    ),
    (
        "module-status",
        _set("implementation[0].status", "enabled"),
        "implementation[0].status is unsupported",
        True,
    ),
    (
        "module-status-unhashable",
        _set("implementation[0].status", ["active"]),
        "implementation[0].status is unsupported",
        True,
    ),
    ("services-type", _set("requires_services", {}), "requires_services must be an array", True),
    (
        "service-keys",
        _set("requires_services", [_SERVICE]),
        "requires_services[0] has unknown=[] missing=['endpoint_config']",
        True,
    ),
    (
        "service-optional",
        _set("requires_services", [{**_SERVICE, "endpoint_config": "url", "optional": "yes"}]),
        "requires_services[0].optional must be boolean",
        True,
    ),
    ("components-type", _set("components", {"a": 1}), "components must be a non-empty array", True),
    (
        "component-keys",
        _set("components[0].extra", 1),
        "components[0] has unknown=['extra'] missing=[]",
        True,
    ),
    (
        "component-id",
        _set("components[0].component_id", "Bad_ID"),
        "components[0].component_id is invalid",
        True,
    ),
    (
        "contract-prefix",
        _set("components[0].contracts", ["torch.policy.v1"]),
        "components[0].contracts is invalid",
        True,
    ),
    (
        "contract-prefix-without-dot",
        _set("components[0].contracts", ["vllmx.policy.v1"]),
        "components[0].contracts is invalid",
        True,
    ),
    (
        "contract-dupes",
        _set("components[0].contracts", ["vllm.a", "vllm.a"]),
        "components[0].contracts must not contain duplicates",
        True,
    ),
    (
        "contract-empty",
        _set("components[0].contracts", []),
        "components[0].contracts is invalid",
        True,
    ),
    (
        "planes",
        _set("components[0].execution_planes", ["gpu"]),
        "components[0].execution_planes contains unsupported values: ['gpu']",
        True,
    ),
    (
        "isolation",
        _set("components[0].isolation", "none"),
        "components[0].isolation contains unsupported values",
        True,
    ),
    (
        "implementation-ref",
        _set("components[0].implementation_ref", "a.b.C"),
        "components[0].implementation_ref is invalid",
        True,
    ),
    (
        "permissions",
        _set("components[0].permissions", ["root"]),
        "components[0].permissions contains unsupported values",
        True,
    ),
    ("component-dupes", _dup_component, "component_id values must be unique", False),
    # A falsy activation is no shortcut to "no activation": only an absent key is.
    ("activation-false", _set("activation", False), "activation must be an object with string keys",
     True),
    (
        "activation-keys",
        _set("activation.launch_options", {}),
        "activation contains unknown fields: ['launch_options']",
        True,
    ),
    (
        "entry-point-keys",
        _set("activation.entry_points", [{"group": "vllm.general_plugins"}]),
        "activation.entry_points[0] requires group and name",
        True,
    ),
    (
        "env-value",
        _set("activation.environment.BIDKV_UTILITY_ENABLE", 1),
        "activation.environment values must be strings",
        True,
    ),
    (
        "additional-config",
        _set("activation.additional_config", [1]),
        "activation.additional_config must be an object with string keys",
        True,
    ),
    # Only some ranges may be null; the identifier regex has no underscore; key sets are
    # exact (nothing extra) for entry points and runtime; every service string is checked.
    (
        "host-range-null",
        _set("host.version_range", None),
        "host.version_range must be a non-empty string",
        True,
    ),
    ("underscore-id", _set("extension_id", "org.test_bad"), "extension_id is invalid", True),
    (
        "entry-point-extra",
        _set("activation.entry_points", [{"group": "g", "name": "n", "value": "m:f"}]),
        "activation.entry_points[0] requires group and name",
        True,
    ),
    (
        "runtime-extra",
        _set("runtime.entry", "x"),
        "runtime requires type, process_scope, and isolation",
        True,
    ),
    (
        "service-endpoint",
        _set("requires_services", [{**_SERVICE, "endpoint_config": " "}]),
        "requires_services[0].endpoint_config must be a non-empty string",
        True,
    ),
]


@pytest.mark.parametrize(
    ("mutate", "message"), [(m, t) for _, m, t, _ in MALFORMED], ids=[c[0] for c in MALFORMED]
)
def test_malformed_manifest_is_refused_naming_the_field(
    isolated: Path,
    capsys: pytest.CaptureFixture[str],
    mutate: Callable[[dict[str, Any]], Any],
    message: str,
) -> None:
    document = mutate(base_manifest())
    files = {"fakepkg/m/vllm-hust-extension-v0.2.json": json.dumps(document).encode()}
    write_dist(isolated, "fake-bundle", {TEST_ID: "fakepkg.m"}, files)
    code, out, err = invoke(["extension", "validate", TEST_ID], capsys)
    assert code == 2
    assert out == ""
    last = err.strip().splitlines()[-1]
    assert last == f"vllm-hust-ext: error: {TEST_ID!r} manifest is invalid: {message}" or (
        last.startswith("vllm-hust-ext: error: ") and message in last
    ), last
    assert "Traceback" not in err


def test_at_least_thirty_malformed_cases() -> None:
    assert len(MALFORMED) >= 30


# §1.1 validation order, first failure wins: each field broken in its own way.
VALIDATION_ORDER: list[tuple[str, Callable[[dict[str, Any]], Any], str]] = [
    ("keys", _set("name", "x"), "experimental manifest has unknown=['name'] missing=[]"),
    ("extension_id", _set("extension_id", "Bad"), "extension_id is invalid"),
    (
        "extension_version",
        _set("extension_version", "v?"),
        "extension_version is not a valid version",
    ),
    ("kind", _set("kind", "policy"), "kind contains unsupported values: ['policy']"),
    (
        "lifecycle_owner",
        _set("lifecycle_owner", "me"),
        "lifecycle_owner contains unsupported values: ['me']",
    ),
    (
        "components",
        _set("components[0].component_id", "Bad"),
        "components[0].component_id is invalid",
    ),
    ("activation", _set("activation.name", "x"), "activation contains unknown fields: ['name']"),
    ("host", _set("host.provider", "Bad"), "host.provider is invalid"),
    ("runtime", _set("runtime.extra", "x"), "runtime requires type, process_scope, and isolation"),
    ("protocols", _set("protocols", {}), "protocols must be an array"),
    ("implementation", _set("implementation", []), "implementation must be a non-empty array"),
    ("requires_services", _set("requires_services", {}), "requires_services must be an array"),
]


@pytest.mark.parametrize(
    "index", range(len(VALIDATION_ORDER)), ids=[c[0] for c in VALIDATION_ORDER]
)
def test_the_first_failure_in_validation_order_wins(
    isolated: Path, capsys: pytest.CaptureFixture[str], index: int
) -> None:
    """§1.1: with this field and every later one broken, this field's error is reported."""
    document = base_manifest()
    for _, mutate, _ in VALIDATION_ORDER[index:]:
        document = mutate(document)
    files = {"fakepkg/m/vllm-hust-extension-v0.2.json": json.dumps(document).encode()}
    write_dist(isolated, "fake-bundle", {TEST_ID: "fakepkg.m"}, files)
    code, _, err = invoke(["extension", "validate", TEST_ID], capsys)
    assert code == 2
    expected = VALIDATION_ORDER[index][2]
    assert err.strip().splitlines()[-1] == (
        f"vllm-hust-ext: error: {TEST_ID!r} manifest is invalid: {expected}"
    )


@pytest.mark.parametrize(
    ("mutate", "rejected"), [(m, s) for _, m, _, s in MALFORMED], ids=[c[0] for c in MALFORMED]
)
def test_schema_agrees_with_the_rules(
    mutate: Callable[[dict[str, Any]], Any], rejected: bool
) -> None:
    """The JSON Schema rejects every structural fault; version syntax is left to the rules."""
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    assert validator.is_valid(mutate(base_manifest())) is not rejected


def test_schema_is_valid_2020_12_and_shipped_identically() -> None:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert PACKAGED_SCHEMA.read_bytes() == SCHEMA.read_bytes()
    assert manifest_module.manifest_schema() == schema


# --- discovery-level faults -----------------------------------------------------------


def _good() -> bytes:
    return json.dumps(base_manifest()).encode()


def test_symlinked_manifest_is_refused(isolated: Path, capsys: pytest.CaptureFixture[str]) -> None:
    real = isolated / "real.json"
    real.write_bytes(_good())
    relative = "fakepkg/m/vllm-hust-extension-v0.2.json"
    write_dist(isolated, "fake-bundle", {TEST_ID: "fakepkg.m"}, {})
    (isolated / relative).parent.mkdir(parents=True)
    (isolated / relative).symlink_to(real)
    (isolated / "fake_bundle-1.0.dist-info" / "RECORD").write_text(f"{relative},,\n")
    code, _, err = invoke(["extension", "validate", TEST_ID], capsys)
    assert code == 2
    assert f"{TEST_ID!r} manifest is invalid: manifest must be a regular non-symlink file" in err


@pytest.mark.parametrize("payload", [b"\xff\xfe{}", b"{not json"], ids=["non-utf8", "not-json"])
def test_unreadable_manifest_is_refused(
    isolated: Path, capsys: pytest.CaptureFixture[str], payload: bytes
) -> None:
    write_dist(
        isolated,
        "fake-bundle",
        {TEST_ID: "fakepkg.m"},
        {"fakepkg/m/vllm-hust-extension-v0.2.json": payload},
    )
    code, _, err = invoke(["extension", "validate", TEST_ID], capsys)
    assert code == 2
    assert f"{TEST_ID!r} manifest is invalid: manifest cannot be read as JSON" in err


def test_registration_must_match_manifest_id(
    isolated: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_dist(
        isolated,
        "fake-bundle",
        {"org.test.other": "fakepkg.m"},
        {"fakepkg/m/vllm-hust-extension-v0.2.json": _good()},
    )
    code, _, err = invoke(["extension", "inspect", "org.test.other"], capsys)
    assert code == 2
    assert f"registration 'org.test.other' does not match {TEST_ID!r}" in err


def test_registration_must_be_a_static_directory(
    isolated: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_dist(
        isolated,
        "fake-bundle",
        {TEST_ID: "fakepkg.m:manifest"},
        {"fakepkg/m/vllm-hust-extension-v0.2.json": _good()},
    )
    code, _, err = invoke(["extension", "validate", TEST_ID], capsys)
    assert code == 2
    assert f"{TEST_ID!r} must register a static module directory" in err


@pytest.mark.parametrize(
    "names",
    [[], ["vllm-hust-extension-v0.2.json", "extension-bundle-v1.json"]],
    ids=["zero", "two"],
)
def test_exactly_one_manifest_file(
    isolated: Path, capsys: pytest.CaptureFixture[str], names: list[str]
) -> None:
    files = {f"fakepkg/m/{n}": _good() for n in names} or {"fakepkg/m/README": b""}
    write_dist(isolated, "fake-bundle", {TEST_ID: "fakepkg.m"}, files)
    code, _, err = invoke(["extension", "validate", TEST_ID], capsys)
    assert code == 2
    assert f"{TEST_ID!r} must contain exactly one Bundle v1 manifest" in err


def test_duplicate_registrations_are_refused(
    isolated: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("fake-one", "fake-two"):
        write_dist(
            isolated / name,
            name,
            {TEST_ID: f"{name.replace('-', '_')}.m"},
            {f"{name.replace('-', '_')}/m/vllm-hust-extension-v0.2.json": _good()},
        )
    import sys

    # Two distributions, each on its own sys.path entry, register the same id.
    sys.path[:0] = [str(isolated / "fake-one"), str(isolated / "fake-two")]
    try:
        code, _, err = invoke(["extension", "validate", TEST_ID], capsys)
        listed_code, out, _ = invoke(["extension", "list", "--json"], capsys)
    finally:
        del sys.path[:2]
    assert code == 2
    assert f"duplicate Bundle registrations: [{TEST_ID!r}]" in err
    # ``list`` is tolerant: the duplicate is one diagnostic, not a listed bundle.
    assert listed_code == 0
    assert [d for d in json.loads(out) if d["bundle_id"] == TEST_ID] == [
        {
            "bundle_id": TEST_ID,
            "discovery_error": f"duplicate Bundle registrations: [{TEST_ID!r}]",
            "valid": False,
        }
    ]


def test_uninstalled_id_is_refused(isolated: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = invoke(["extension", "inspect", "org.test.none"], capsys)
    assert code == 2
    assert "enabled Bundles are not installed: ['org.test.none']" in err


def test_editable_install_is_found_through_direct_url(
    isolated: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    source = tmp_path / "checkout"
    (source / "src" / "fakepkg" / "m").mkdir(parents=True)
    (source / "src" / "fakepkg" / "m" / "vllm-hust-extension-v0.2.json").write_bytes(_good())
    write_dist(isolated, "fake-bundle", {TEST_ID: "fakepkg.m"}, {})
    info = isolated / "fake_bundle-1.0.dist-info"
    (info / "direct_url.json").write_text(
        json.dumps({"url": source.as_uri(), "dir_info": {"editable": True}})
    )
    code, out, _ = invoke(["extension", "inspect", TEST_ID], capsys)
    assert code == 0
    assert json.loads(out)["manifest_path"] == str(
        source / "src" / "fakepkg" / "m" / "vllm-hust-extension-v0.2.json"
    )
    (info / "direct_url.json").write_text("{broken")
    code, _, err = invoke(["extension", "inspect", TEST_ID], capsys)
    assert code == 2
    assert "editable direct_url.json is invalid" in err
    # A tree whose path cannot even be looked at (Python 3.11's is_file raises on a name
    # too long) holds no manifest; it used to end in "[Errno 36] File name too long".
    (info / "direct_url.json").write_text(json.dumps(
        {"url": (tmp_path / ("x" * 300)).as_uri(), "dir_info": {"editable": True}}))
    code, _, err = invoke(["extension", "inspect", TEST_ID], capsys)
    assert code == 2
    assert err.splitlines()[-1].endswith(
        f"{TEST_ID!r} must contain exactly one Bundle v1 manifest"), err


def test_list_is_tolerant_of_invalid_bundles(
    isolated: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_dist(
        isolated,
        "fake-bundle",
        {TEST_ID: "fakepkg.m"},
        {"fakepkg/m/vllm-hust-extension-v0.2.json": b"{"},
    )
    code, out, err = invoke(["extension", "list", "--json"], capsys)
    assert code == 0
    invalid = [d for d in json.loads(out) if d.get("bundle_id") == TEST_ID]
    assert invalid == [
        {
            "bundle_id": TEST_ID,
            "discovery_error": f"{TEST_ID!r} manifest is invalid: manifest cannot be read as JSON",
            "valid": False,
        }
    ]
    code, out, err = invoke(["extension", "list"], capsys)
    assert code == 0
    assert (
        f"{TEST_ID} invalid {TEST_ID!r} manifest is invalid: manifest cannot be read as JSON" in err
    )


BROKEN_ID = "org.test.broken"


def test_a_manifest_number_json_reads_is_accepted_as_the_official_manager_does(
    isolated: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The official loader is ``json.loads``: NaN/Infinity in an activation's
    additional_config are accepted (manager-protocol.md: accepted inputs must match)."""
    document = base_manifest()
    document["activation"]["additional_config"] = {"x": "PLACEHOLDER"}
    payload = json.dumps(document).replace('"PLACEHOLDER"', "NaN").encode()
    write_dist(isolated, "fake-bundle", {TEST_ID: "fakepkg.m"},
               {"fakepkg/m/vllm-hust-extension-v0.2.json": payload})
    code, _, err = invoke(["extension", "validate", TEST_ID], capsys)
    assert code == 0, err


@pytest.mark.parametrize(("damage", "error"), [
    ({"direct_url.json": b'{"url": "file://[x/", "dir_info": {"editable": true}}'},
     "editable direct_url.json is invalid"),
    ({"direct_url.json": b"\xff\xfe{"}, "editable direct_url.json is invalid"),
    ({"RECORD": b"\xff\n"}, "distribution RECORD cannot be read"),
    # Rows importlib cannot unpack (it raises TypeError): a blank one, one of four columns.
    ({"RECORD": b"x.py,,\n\n"}, "distribution RECORD cannot be read"),
    ({"RECORD": b"a,b,c,d\n"}, "distribution RECORD cannot be read"),
    ({"METADATA": b"Name: \xff\n"}, "distribution METADATA cannot be read"),
    ({"METADATA": b"Metadata-Version: 2.1\nVersion: 1.0\n"}, "has no distribution name"),
    ({"METADATA": b"Metadata-Version: 2.1\nName: \nVersion: 1.0\n"}, "has no distribution name"),
    # A Version field missing or empty: pip never installs one, but a hand-made or damaged
    # METADATA can; ``dist.version`` would be None here and a KeyError on newer Pythons.
    ({"METADATA": b"Metadata-Version: 2.1\nName: broken-bundle\n"}, "has no distribution version"),
    ({"METADATA": b"Metadata-Version: 2.1\nName: broken-bundle\nVersion: \n"},
     "has no distribution version"),
    ({"manifest": b"[" * 100_000 + b"]" * 100_000}, "manifest cannot be read as JSON"),
    # An integer over the int/str digit limit: json.loads raises a plain ValueError.
    ({"manifest": b'{"schema_version": 1' + b"0" * 5000 + b"}"}, "manifest cannot be read as JSON"),
])
def test_one_damaged_bundle_is_a_diagnostic_not_a_failure(
    isolated: Path, capsys: pytest.CaptureFixture[str], damage: dict[str, bytes], error: str
) -> None:
    """manager-protocol.md §2: ``list`` is tolerant. Damaged metadata of one bundle (bytes
    that are not UTF-8, a URL urlparse rejects, nesting deeper than the JSON parser follows)
    becomes that bundle's diagnostic, naming it; the healthy bundle is still listed, and
    ``inspect`` of the damaged one is one line naming it."""
    write_dist(isolated, "fake-bundle", {TEST_ID: "fakepkg.m"},
               {"fakepkg/m/vllm-hust-extension-v0.2.json": _good()})
    manifest = damage.pop("manifest", None)
    path = "brokenpkg/m/vllm-hust-extension-v0.2.json"
    write_dist(isolated, "broken-bundle", {BROKEN_ID: "brokenpkg.m"},
               {} if damage.keys() & {"direct_url.json", "RECORD"} else
               {path: manifest or b"{}"})
    info = isolated / "broken_bundle-1.0.dist-info"
    for name, data in damage.items():
        (info / name).write_bytes(data)
    code, out, err = invoke(["extension", "list", "--json"], capsys)
    assert code == 0, err
    listed = {d["bundle_id"]: d for d in json.loads(out)}
    assert listed[TEST_ID].get("valid", True) is not False
    assert listed[BROKEN_ID]["valid"] is False and error in listed[BROKEN_ID]["discovery_error"]
    code, _, err = invoke(["extension", "inspect", BROKEN_ID], capsys)
    assert code == 2 and error in err.splitlines()[-1] and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "plugins_off"),
    [(["--version"], False), (["extension", "list"], False), (["extension", "list"], True),
     (["extension", "status", "org.vllm-hust.bidkv"], True)],
    ids=["version", "list", "list-discovery", "status-discovery"],
)
def test_a_damaged_entry_points_file_anywhere_is_one_line_naming_it(
    tmp_path: Path, argv: list[str], plugins_off: bool
) -> None:
    """An unrelated distribution whose entry_points.txt holds a line without '=' makes
    ``importlib.metadata.entry_points()`` raise a TypeError naming nothing. pydantic calls
    it while the manager's models are built (so every command, ``--version`` included,
    ended in a traceback), and discovery calls it for the bundle group (reached with
    pydantic's plugins off: an "internal error"). Both now end in one line naming the
    distribution and its folder. The real console script runs in a subprocess: the failure
    is at import."""
    site = tmp_path / "site"
    info = site / "junk-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: junk\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[console_scripts]\nbroken line without equals\n")
    env = {**os.environ, "PYTHONPATH": str(site),
           "VLLM_HUST_EXT_CONFIG": str(tmp_path / "config.json")}
    if plugins_off:
        env["PYDANTIC_DISABLE_PLUGINS"] = "__all__"
    cli = str(Path(sys.executable).with_name("vllm-hust-ext"))
    done = subprocess.run([cli, *argv], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith("vllm-hust-ext: error: "), done.stderr
    assert f"installed distribution 'junk' 1.0 in {site} has an entry_points.txt Python " \
        "cannot parse" in last, done.stderr


@pytest.mark.parametrize(("fields", "named"), [
    ("Name: junk\n", "'junk' (without a version)"),
    ("Name: junk\nVersion: \n", "'junk' (without a version)"),
    ("Version: 1.0\n", "(without a name)"),
    ("Name: \nVersion: 1.0\n", "(without a name)"),
    ("Name: junk\nVersion: 1.0\nVersion: 2.0\n", "'junk' 1.0"),
])
def test_a_damaged_entry_points_file_names_a_distribution_without_a_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fields: str, named: str
) -> None:
    """The one-line account of a damaged entry_points.txt names its distribution from the
    METADATA fields that are there: a missing or empty Version is said so (it read
    "'junk' None" through ``dist.version``, which importlib is deprecating for a KeyError),
    a missing or empty Name is "(without a name)", and of two Version fields the first
    counts, as ``dist.version`` reads it."""
    _damaged_dist(tmp_path, f"Metadata-Version: 2.1\n{fields}".encode(),
                  b"[console_scripts]\nbroken line without equals\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = metadata_scan.unreadable_entry_points()
    assert found is not None and found.startswith(
        f"installed distribution {named} in {tmp_path} has an entry_points.txt"), found


def _damaged_dist(site: Path, metadata: bytes, entry_points: bytes) -> None:
    info = site / "junk-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_bytes(metadata)
    (info / "entry_points.txt").write_bytes(entry_points)


@pytest.mark.parametrize(("metadata", "entry_points", "account"), [
    # Python reads a line without "=" as a TypeError, undecodable bytes as a ValueError.
    (b"Metadata-Version: 2.1\nName: junk\nVersion: 1.0\n", b"[console_scripts]\n\xff\n",
     "'junk' 1.0 in {site} has an entry_points.txt Python cannot parse "
     "(UnicodeDecodeError: "),
    (b"Metadata-Version: 2.1\nName: \xff\n", b"[console_scripts]\nbroken line\n",
     "(unreadable METADATA) in {site} has an entry_points.txt Python cannot parse "
     "(TypeError: "),
], ids=["undecodable-entry-points", "undecodable-metadata"])
def test_undecodable_metadata_files_are_named_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, metadata: bytes, entry_points: bytes,
    account: str
) -> None:
    """Mutants: only a TypeError taken for a damaged entry_points.txt, and only an OSError
    for an unreadable METADATA. Bytes that are not UTF-8 raise UnicodeDecodeError (a
    ValueError) from either file; the account still names what it can, in one line."""
    _damaged_dist(tmp_path, metadata, entry_points)
    monkeypatch.syspath_prepend(str(tmp_path))
    found = metadata_scan.unreadable_entry_points()
    assert found is not None and found.startswith(
        "installed distribution " + account.format(site=tmp_path)), found


def test_descriptor_only_bundle_is_inspectable_but_not_enabled(
    isolated: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = _set("implementation[0].status", "import_only")(base_manifest())
    write_dist(
        isolated,
        "fake-bundle",
        {TEST_ID: "fakepkg.m"},
        {"fakepkg/m/vllm-hust-extension-v0.2.json": json.dumps(document).encode()},
    )
    code, out, _ = invoke(["extension", "inspect", TEST_ID], capsys)
    assert code == 0
    shown = json.loads(out)
    assert shown["activation_ready"] is False
    assert "descriptor-only" in shown["activation_blocker"]
    code, _, err = invoke(["extension", "enable", TEST_ID], capsys)
    assert code == 2
    assert f"cannot enable {TEST_ID!r}: " in err and "descriptor-only" in err
    code, out, _ = invoke(["extension", "render", TEST_ID], capsys)
    assert [a["name"] for a in json.loads(out)] == ["inspection-plan.json"]


def test_two_preemption_components_cannot_render(
    isolated: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = base_manifest()
    second = {**document["components"][0], "component_id": "second"}
    document["components"].append(second)
    write_dist(
        isolated,
        "fake-bundle",
        {TEST_ID: "fakepkg.m"},
        {"fakepkg/m/vllm-hust-extension-v0.2.json": json.dumps(document).encode()},
    )
    code, _, err = invoke(["extension", "plan", TEST_ID], capsys)
    assert code == 2
    assert "exactly one vllm.preemption-policy.v1 component is required" in err


def _install_one(site: Path, document: object) -> None:
    write_dist(
        site,
        "fake-bundle",
        {TEST_ID: "fakepkg.m"},
        {"fakepkg/m/vllm-hust-extension-v0.2.json": json.dumps(document).encode()},
    )


@pytest.mark.parametrize(
    "mutate",
    [
        _drop("components[0]", "permissions"),
        _set("protocols[0].version_range", None),
        _drop("host", "api_range"),
        _set("requires_services", [{**_SERVICE, "endpoint_config": "url", "optional": True}]),
    ],
    ids=["no-permissions", "null-protocol-range", "no-api-range", "optional-service"],
)
def test_optional_fields_may_be_left_out_or_null(
    isolated: Path, capsys: pytest.CaptureFixture[str], mutate: Callable[[dict[str, Any]], Any]
) -> None:
    """§1.2-§1.3: a component's ``permissions`` and ``host.api_range`` are optional, a
    protocol's ``version_range`` may be null, a service may be optional; each validates and
    inspect shows what the manifest says (absent permissions as [], absent range as null)."""
    document = mutate(base_manifest())
    _install_one(isolated, document)
    code, out, err = invoke(["extension", "validate", TEST_ID], capsys)
    assert code == 0, err
    shown = json.loads(out)
    assert shown["protocols"] == document["protocols"]
    assert shown["host"]["api_range"] == document["host"].get("api_range")
    assert shown["components"][0]["permissions"] == document["components"][0].get(
        "permissions", []
    )
    assert [s["optional"] for s in shown["requires_services"]] == [
        s.get("optional", False) for s in document["requires_services"]
    ]


def test_inspect_prints_environment_and_additional_config_sorted_by_key(
    isolated: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§1.2 activation and §4 inspect: both are stored sorted by key and print as
    ``[key, value]`` pairs in that order, whatever order the manifest file uses."""
    document = base_manifest()
    document["activation"]["environment"] = {"B_VAR": "1", "A_VAR": "2"}
    document["activation"]["additional_config"] = {"zeta": 1, "alpha": {"k": 2}}
    _install_one(isolated, document)
    code, out, err = invoke(["extension", "inspect", TEST_ID], capsys)
    assert code == 0, err
    activation = json.loads(out)["activation"]
    assert activation["environment"] == [["A_VAR", "2"], ["B_VAR", "1"]]
    assert activation["additional_config"] == [["alpha", {"k": 2}], ["zeta", 1]]


def _module(status: str) -> dict[str, str]:
    return {"type": "python_module", "module": "m", "object": "O", "status": status}


@pytest.mark.parametrize(
    ("implementation", "ready"),
    [
        ([_module("import_only"), _module("active")], True),
        ([{"type": "host_builtin", "name": "vllm"}], True),
        ([_module("import_only"), _module("legacy_unregistered")], False),
        ([_module("import_only"), {"type": "python_entry_point", "group": "g", "name": "n"}],
         True),
    ],
    ids=["one-active-module", "no-python-carrier", "all-descriptor-only",
         "module-and-entry-point"],
)
def test_activation_blocker_needs_every_python_carrier_descriptor_only(
    isolated: Path,
    capsys: pytest.CaptureFixture[str],
    implementation: list[dict[str, str]],
    ready: bool,
) -> None:
    """§1.4: a bundle is blocked only when its Python carriers are *all* import_only or
    legacy_unregistered: one active module, or no Python carrier at all, leaves it ready."""
    _install_one(isolated, _set("implementation", implementation)(base_manifest()))
    code, out, err = invoke(["extension", "inspect", TEST_ID], capsys)
    assert code == 0, err
    shown = json.loads(out)
    assert shown["activation_ready"] is ready
    assert (shown["activation_blocker"] is None) is ready
    code, _, err = invoke(["extension", "enable", TEST_ID], capsys)
    assert (code == 0) is ready, err


def _legacy(**changes: object) -> dict[str, Any]:
    document: dict[str, Any] = {
        "schema_version": "1.0",
        "bundle_id": TEST_ID,
        "bundle_version": "2.0",
        "host_api_range": ">=1,<2",
        "components": base_manifest()["components"],
    }
    document.update(changes)
    return document


def test_a_legacy_bundle_v1_manifest_is_read_by_the_legacy_parser(
    isolated: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§1.1: ``"schema_version": "1.0"`` dispatches to the legacy Bundle v1 parser; the
    bundle validates with its components and host API range, and is not experimental."""
    _install_one(isolated, _legacy())
    code, out, err = invoke(["extension", "validate", TEST_ID], capsys)
    assert code == 0, err
    shown = json.loads(out)
    assert shown["experimental"] is False and shown["bundle_version"] == "2.0"
    assert shown["host"]["api_range"] == ">=1,<2"
    assert [c["component_id"] for c in shown["components"]] == ["victim-selector"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"host_api_range": ">=2"}, "bundle requires host API >=2, host provides 1.0"),
        ({"components": []}, "components must be a non-empty array"),
        ({"name": "x"}, "manifest contains unknown fields: ['name']"),
    ],
    ids=["host-api", "no-components", "unknown-field"],
)
def test_a_legacy_manifest_breaking_a_legacy_rule_is_refused(
    isolated: Path, capsys: pytest.CaptureFixture[str], changes: dict[str, Any], message: str
) -> None:
    """The legacy rules: the fixed host API 1.0 must be in ``host_api_range``, components are
    required and non-empty, and no unknown field is accepted."""
    _install_one(isolated, _legacy(**changes))
    code, _, err = invoke(["extension", "validate", TEST_ID], capsys)
    assert code == 2
    assert err.splitlines()[-1] == (
        f"vllm-hust-ext: error: {TEST_ID!r} manifest is invalid: {message}"
    )


@pytest.mark.parametrize(
    ("prefix", "editable", "found"),
    [
        ("file://", True, True),
        ("file://localhost", True, True),
        ("file://", False, False),
        ("file://build-host", True, False),
        ("file://", "true", False),
        ("https://", True, False),
    ],
    ids=["editable", "localhost", "not-editable", "remote-host", "editable-string",
         "not-a-file-url"],
)
def test_only_a_local_editable_direct_url_is_searched(
    isolated: Path,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    prefix: str,
    editable: object,
    found: bool,
) -> None:
    """§2: the source tree named by ``direct_url.json`` (its root here, not ``src/``) is
    searched only when ``dir_info.editable`` is JSON ``true`` (not a truthy string) and the
    URL is a ``file:`` URL whose host is empty or ``localhost``; a plain directory install,
    another machine's path or another scheme is not."""
    source = tmp_path / "checkout"
    (source / "fakepkg" / "m").mkdir(parents=True)
    (source / "fakepkg" / "m" / "vllm-hust-extension-v0.2.json").write_bytes(_good())
    write_dist(isolated, "fake-bundle", {TEST_ID: "fakepkg.m"}, {})
    (isolated / "fake_bundle-1.0.dist-info" / "direct_url.json").write_text(
        json.dumps({"url": prefix + str(source), "dir_info": {"editable": editable}})
    )
    code, out, err = invoke(["extension", "inspect", TEST_ID], capsys)
    if found:
        assert code == 0, err
        assert json.loads(out)["manifest_path"] == str(
            source / "fakepkg" / "m" / "vllm-hust-extension-v0.2.json"
        )
    else:
        assert code == 2
        assert err.splitlines()[-1] == (
            f"vllm-hust-ext: error: {TEST_ID!r} must contain exactly one Bundle v1 manifest"
        )


def test_strict_discovery_returns_the_requested_order(isolated: Path) -> None:
    """§2: strict resolution returns the bundles in the requested order, not sorted."""
    from hust_ext_manager.discovery import discover

    files = {
        f"fakepkg/{leaf}/vllm-hust-extension-v0.2.json": json.dumps(
            {**base_manifest(), "extension_id": f"org.test.{leaf}"}
        ).encode()
        for leaf in ("a", "b")
    }
    write_dist(isolated, "fake-bundle", {"org.test.b": "fakepkg.b", "org.test.a": "fakepkg.a"},
               files)
    for requested in (["org.test.b", "org.test.a"], ["org.test.a", "org.test.b"]):
        assert [b.bundle_id for b in discover(requested)] == requested


# --- conformance of our own manifest --------------------------------------------------

_OFFICIAL_TOP = {
    "schema_version",
    "extension_id",
    "extension_version",
    "kind",
    "host",
    "runtime",
    "lifecycle_owner",
    "protocols",
    "implementation",
    "requires_services",
    "components",
    "activation",
}


def test_bidkv_manifest_satisfies_the_official_rules() -> None:
    """Each rule of manager-protocol.md §1-§2, checked independently of our parser."""
    document = json.loads(BIDKV_MANIFEST.read_text(encoding="utf-8"))
    assert not BIDKV_MANIFEST.is_symlink()
    assert set(document) <= _OFFICIAL_TOP and _OFFICIAL_TOP - {"components", "activation"} <= set(
        document
    )
    assert document["schema_version"] == "0.2-experimental"
    assert re.fullmatch(r"[a-z0-9][a-z0-9.-]*", document["extension_id"])
    assert document["extension_id"] == "org.vllm-hust.bidkv"
    from bidkv_ext._version import __version__

    assert Version(document["extension_version"]) == Version(__version__)
    assert document["kind"] == "scheduler_policy" and document["lifecycle_owner"] == "vllm"
    host = document["host"]
    assert set(host) == {"provider", "name", "version_range", "api_range"}
    assert host["provider"] == "vllm" and host["name"] == "vllm"
    assert Version("0.33.0") in SpecifierSet(host["version_range"])
    assert Version("0.28.1rc1.dev319") in SpecifierSet(host["version_range"])
    assert Version("1.0") in SpecifierSet(host["api_range"])
    assert document["runtime"] == {
        "type": "python",
        "process_scope": "scheduler",
        "isolation": "trusted_in_process",
    }
    assert document["protocols"] == [{"name": "vllm.preemption-policy", "version_range": ">=1,<2"}]
    (carrier,) = document["implementation"]
    assert set(carrier) == {"type", "module", "object", "status"} and carrier["status"] == "active"
    (component,) = document["components"]
    assert set(component) <= {
        "component_id",
        "contracts",
        "execution_planes",
        "isolation",
        "implementation_ref",
        "permissions",
    }
    assert component["contracts"] == ["vllm.preemption-policy.v1"]
    assert component["implementation_ref"] == f"{carrier['module']}:{carrier['object']}"
    assert re.fullmatch(
        r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*",
        component["implementation_ref"],
    )
    activation = document["activation"]
    assert set(activation) <= {"entry_points", "environment", "additional_config"}
    assert all(isinstance(v, str) for v in activation["environment"].values())
    assert document["requires_services"] == []
    # The official parser accepts it, and the JSON Schema does too.
    parsed = manifest_module.parse_manifest(document)
    assert parsed.activation_blocker is None
    jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text())).validate(document)


def test_bidkv_registration_points_at_a_static_directory() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    value = project["project"]["entry-points"]["vllm_hust.extension_bundles"]["org.vllm-hust.bidkv"]
    assert re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", value)
    assert (ROOT / Path(*value.split(".")) / "vllm-hust-extension-v0.2.json").is_file()


def test_no_verb_imports_the_bundle_or_the_host(
    isolated: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§2 and §4: discovery, ``inspect``/``validate`` (static parse only) and the vLLM
    provider read metadata and files; neither the bundle's manifest package, its
    implementation module nor the host package is ever imported, by any verb up to
    ``run --dry-run``."""
    marker = tmp_path / "imported"
    poison = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n".encode()
    document = base_manifest()
    document["implementation"] = [
        {
            "type": "python_module",
            "module": "fakepoison.impl",
            "object": "Policy",
            "status": "active",
        }
    ]
    document["components"][0]["implementation_ref"] = "fakepoison.impl:Policy"
    write_dist(
        isolated,
        "fake-poison",
        {TEST_ID: "fakepoison.m"},
        {
            "fakepoison/__init__.py": poison,
            "fakepoison/m/__init__.py": poison,
            "fakepoison/m/vllm-hust-extension-v0.2.json": json.dumps(document).encode(),
            "fakepoison/impl.py": poison,
        },
    )
    # A host in range that ships the preemption contract, so status is compatible and
    # run proceeds; every module of it is poisoned too.
    host = isolated / "host"
    write_dist(
        host,
        "vllm",
        {},
        {"vllm/__init__.py": poison, "vllm/v1/core/sched/preemption.py": poison},
        version="0.28.5",
    )
    import sys

    sys.path.insert(0, str(host))
    settings = tmp_path / "settings.json"
    settings.write_text("{}")
    try:
        for argv in (
            ["extension", "list"],
            ["extension", "list", "--json"],
            ["extension", "inspect", TEST_ID],
            ["extension", "validate", TEST_ID],
            ["extension", "configure", TEST_ID, "--file", str(settings)],
            ["extension", "enable", TEST_ID],
            ["extension", "status", TEST_ID],
            ["extension", "check", TEST_ID],
            ["extension", "plan", TEST_ID],
            ["extension", "render", TEST_ID],
            ["extension", "env"],
            ["run", "--dry-run", "--", "x"],
            ["extension", "disable", TEST_ID],
        ):
            code, out, err = invoke(argv, capsys)
            assert code == 0, (argv, err)
            if argv[1] == "status":
                assert "compatible" in json.loads(out)["states"]
    finally:
        sys.path.remove(str(host))
    assert not marker.exists(), marker.read_text()
