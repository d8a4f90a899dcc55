"""Manifest 0.2 (and legacy Bundle v1) parsing into frozen pydantic models.

Validation runs in two layers. The protocol's own rules come first, in the protocol's
order, so the first failure carries the exact error text users and tests expect. The JSON
Schema in ``schema/`` then checks the same document structurally; it is deliberately no
stricter than the rules, so it only ever catches a rule this module forgot.
"""

from __future__ import annotations

import json
import re
import stat
from collections.abc import Iterator
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict

from hust_ext_manager.jsonio import JSONInputError, load_json

__all__ = [
    "EXPERIMENTAL_SCHEMA",
    "RESERVED_QUALIFICATION_KEY",
    "Activation",
    "Carrier",
    "Component",
    "EntryPointRef",
    "HostSpec",
    "Manifest",
    "ManifestError",
    "ProtocolSpec",
    "RequiredService",
    "RuntimeSpec",
    "load_manifest",
    "manifest_schema",
    "parse_manifest",
]

EXPERIMENTAL_SCHEMA = "0.2-experimental"
RESERVED_QUALIFICATION_KEY = "_manager_runtime_qualification"
SCHEMA_FILE = "vllm-hust-extension-v0.2.schema.json"

_IDENTIFIER = re.compile(r"^[a-z0-9][a-z0-9.-]*$")
_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_OBJECT = re.compile(r"^[A-Za-z_]\w*$")
_REFERENCE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")

_KINDS = frozenset(
    {
        "in_process_plugin",
        "scheduler_policy",
        "kv_connector",
        "kv_service_adapter",
        "control_plane_extension",
        "runtime_bridge",
    }
)
_OWNERS = frozenset({"vllm", "host", "external_operator", "kubernetes", "user"})
_RUNTIME_TYPES = frozenset({"python", "external_service", "oci", "kubernetes", "composite"})
_CARRIERS = frozenset(
    {
        "host_builtin",
        "python_entry_point",
        "python_module",
        "external_service",
        "oci_image",
        "helm_values",
        "kubernetes_manifest",
        "crd",
        "controller",
    }
)
_MODULE_STATUSES = frozenset({"active", "import_only", "legacy_unregistered"})
_INACTIVE_STATUSES = frozenset({"import_only", "legacy_unregistered"})
_PLANES = frozenset({"api", "scheduler", "worker", "native", "device", "bridge"})
_ISOLATIONS = frozenset({"trusted_in_process", "process_isolated", "sandboxed_process"})
_PERMISSIONS = frozenset(
    {
        "device_access",
        "filesystem_read",
        "filesystem_write",
        "ipc",
        "network_egress",
        "shared_memory",
        "subprocess",
    }
)
_TOP_REQUIRED = frozenset(
    {
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
    }
)
_TOP_OPTIONAL = frozenset({"components", "activation"})
_COMPONENT_REQUIRED = frozenset(
    {"component_id", "contracts", "execution_planes", "isolation", "implementation_ref"}
)
_SERVICE_REQUIRED = frozenset({"service_id", "protocol", "version_range", "endpoint_config"})
_LEGACY_FIELDS = frozenset(
    {"schema_version", "bundle_id", "bundle_version", "host_api_range", "components", "activation"}
)
# Components are checked by the legacy rules against this fixed host API version.
_LEGACY_HOST_API = Version("1.0")


class ManifestError(ValueError):
    """A manifest breaks a Manifest 0.2 rule; the message is the protocol's text."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class HostSpec(_Frozen):
    provider: str
    name: str
    version_range: str
    api_range: str | None = None


class RuntimeSpec(_Frozen):
    type: str
    process_scope: str
    isolation: str


class ProtocolSpec(_Frozen):
    name: str
    version_range: str | None


class Carrier(_Frozen):
    type: str
    attributes: tuple[tuple[str, Any], ...]

    def attribute(self, key: str) -> Any:
        return dict(self.attributes).get(key)


class RequiredService(_Frozen):
    service_id: str
    protocol: str
    version_range: str | None
    endpoint_config: str
    optional: bool = False


class Component(_Frozen):
    component_id: str
    contracts: tuple[str, ...]
    execution_planes: tuple[str, ...]
    isolation: str
    implementation_ref: str
    permissions: tuple[str, ...] = ()


class EntryPointRef(_Frozen):
    group: str
    name: str


class Activation(_Frozen):
    entry_points: tuple[EntryPointRef, ...] = ()
    environment: tuple[tuple[str, str], ...] = ()
    additional_config: tuple[tuple[str, Any], ...] = ()


class Manifest(_Frozen):
    schema_version: str
    extension_id: str
    extension_version: str
    kind: str
    host: HostSpec
    runtime: RuntimeSpec
    lifecycle_owner: str
    protocols: tuple[ProtocolSpec, ...]
    implementation: tuple[Carrier, ...]
    requires_services: tuple[RequiredService, ...]
    components: tuple[Component, ...] = ()
    activation: Activation = Activation()
    experimental: bool = True

    @property
    def activation_blocker(self) -> str | None:
        """Why the bundle can only be inspected, or None when it can be activated.

        Python carriers that are all descriptor-only (``import_only`` or
        ``legacy_unregistered`` modules) name code no host may load.
        """
        python = [
            c for c in self.implementation if c.type in {"python_module", "python_entry_point"}
        ]
        if python and all(
            c.type == "python_module" and c.attribute("status") in _INACTIVE_STATUSES
            for c in python
        ):
            return (
                "Python implementation carriers are descriptor-only "
                "(import_only or legacy_unregistered); the bundle can be inspected "
                "but not activated"
            )
        return None

    @property
    def environment(self) -> dict[str, str]:
        return dict(self.activation.environment)

    @property
    def additional_config(self) -> dict[str, Any]:
        return dict(self.activation.additional_config)


# --- small rule helpers -------------------------------------------------------------


def _object(value: object, location: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ManifestError(f"{location} must be an object with string keys")
    return value


def _objects(values: list[Any], location: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each element of an array that must hold objects, with its location for messages."""
    for index, raw in enumerate(values):
        where = f"{location}[{index}]"
        yield where, _object(raw, where)


def _string(value: object, location: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ManifestError(f"{location} must be a non-empty string")
    return value


def _strings(value: object, location: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ManifestError(f"{location} must be an array of strings")
    if len(value) != len(set(value)):
        raise ManifestError(f"{location} must not contain duplicates")
    return tuple(value)


def _known(values: tuple[str, ...], allowed: frozenset[str], location: str) -> None:
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise ManifestError(f"{location} contains unsupported values: {unknown}")


def _keys(
    item: dict[str, Any], required: frozenset[str], optional: frozenset[str], where: str
) -> None:
    unknown = sorted(item.keys() - required - optional)
    missing = sorted(required - item.keys())
    if unknown or missing:
        raise ManifestError(f"{where} has unknown={unknown} missing={missing}")


def _range(value: object, location: str, *, nullable: bool = False) -> str | None:
    if value is None and nullable:
        return None
    text = _string(value, location)
    try:
        SpecifierSet(text)
    except InvalidSpecifier as error:
        raise ManifestError(f"{location} is not a valid version range") from error
    return text


def _version(value: object, location: str) -> str:
    text = _string(value, location)
    try:
        Version(text)
    except InvalidVersion as error:
        raise ManifestError(f"{location} is not a valid version") from error
    return text


def _identifier(value: object, location: str) -> str:
    text = _string(value, location)
    if not _IDENTIFIER.fullmatch(text):
        raise ManifestError(f"{location} is invalid")
    return text


# --- sections -----------------------------------------------------------------------


def _components(value: object) -> tuple[Component, ...]:
    if not value:
        return ()
    if not isinstance(value, list):
        raise ManifestError("components must be a non-empty array")
    result: list[Component] = []
    for where, item in _objects(value, "components"):
        _keys(item, _COMPONENT_REQUIRED, frozenset({"permissions"}), where)
        component_id = _identifier(item["component_id"], f"{where}.component_id")
        contracts = _strings(item["contracts"], f"{where}.contracts")
        if not contracts or not all(c.startswith("vllm.") for c in contracts):
            raise ManifestError(f"{where}.contracts is invalid")
        planes = _strings(item["execution_planes"], f"{where}.execution_planes")
        _known(planes, _PLANES, f"{where}.execution_planes")
        isolation = _string(item["isolation"], f"{where}.isolation")
        _known((isolation,), _ISOLATIONS, f"{where}.isolation")
        reference = _string(item["implementation_ref"], f"{where}.implementation_ref")
        if not _REFERENCE.fullmatch(reference):
            raise ManifestError(f"{where}.implementation_ref is invalid")
        permissions = _strings(item.get("permissions", []), f"{where}.permissions")
        _known(permissions, _PERMISSIONS, f"{where}.permissions")
        result.append(
            Component(
                component_id=component_id,
                contracts=contracts,
                execution_planes=planes,
                isolation=isolation,
                implementation_ref=reference,
                permissions=permissions,
            )
        )
    ids = [c.component_id for c in result]
    if len(ids) != len(set(ids)):
        raise ManifestError("component_id values must be unique")
    return tuple(result)


def _activation(value: object) -> Activation:
    if value is None:
        return Activation()
    activation = _object(value, "activation")
    unknown = sorted(activation.keys() - {"entry_points", "environment", "additional_config"})
    if unknown:
        raise ManifestError(f"activation contains unknown fields: {unknown}")
    raw_entries = activation.get("entry_points", [])
    if not isinstance(raw_entries, list):
        raise ManifestError("activation.entry_points must be an array")
    entries: list[EntryPointRef] = []
    for where, item in _objects(raw_entries, "activation.entry_points"):
        if item.keys() != {"group", "name"}:
            raise ManifestError(f"{where} requires group and name")
        entries.append(
            EntryPointRef(
                group=_string(item["group"], f"{where}.group"),
                name=_string(item["name"], f"{where}.name"),
            )
        )
    environment = _object(activation.get("environment", {}), "activation.environment")
    if not all(isinstance(v, str) for v in environment.values()):
        raise ManifestError("activation.environment values must be strings")
    extra = _object(activation.get("additional_config", {}), "activation.additional_config")
    return Activation(
        entry_points=tuple(entries),
        environment=tuple(sorted(environment.items())),
        additional_config=tuple(sorted(extra.items())),
    )


def _host(value: object) -> HostSpec:
    host = _object(value, "host")
    _keys(host, frozenset({"provider", "name", "version_range"}), frozenset({"api_range"}), "host")
    provider = _string(host["provider"], "host.provider")
    if not _IDENTIFIER.fullmatch(provider):
        raise ManifestError("host.provider is invalid")
    name = _string(host["name"], "host.name")
    version_range = _range(host["version_range"], "host.version_range")
    api_range = _range(host.get("api_range"), "host.api_range", nullable=True)
    assert version_range is not None
    return HostSpec(provider=provider, name=name, version_range=version_range, api_range=api_range)


def _runtime(value: object) -> RuntimeSpec:
    runtime = _object(value, "runtime")
    if runtime.keys() != {"type", "process_scope", "isolation"}:
        raise ManifestError("runtime requires type, process_scope, and isolation")
    kind = _string(runtime["type"], "runtime.type")
    _known((kind,), _RUNTIME_TYPES, "runtime.type")
    return RuntimeSpec(
        type=kind,
        process_scope=_string(runtime["process_scope"], "runtime.process_scope"),
        isolation=_string(runtime["isolation"], "runtime.isolation"),
    )


def _protocols(value: object) -> tuple[ProtocolSpec, ...]:
    if not isinstance(value, list):
        raise ManifestError("protocols must be an array")
    result: list[ProtocolSpec] = []
    for where, item in _objects(value, "protocols"):
        if item.keys() != {"name", "version_range"}:
            raise ManifestError(f"{where} requires name and version_range")
        result.append(
            ProtocolSpec(
                name=_string(item["name"], f"{where}.name"),
                version_range=_range(
                    item["version_range"], f"{where}.version_range", nullable=True
                ),
            )
        )
    return tuple(result)


def _implementation(value: object) -> tuple[Carrier, ...]:
    if not isinstance(value, list) or not value:
        raise ManifestError("implementation must be a non-empty array")
    result: list[Carrier] = []
    for where, item in _objects(value, "implementation"):
        kind = _string(item.get("type"), f"{where}.type")
        _known((kind,), _CARRIERS, f"{where}.type")
        attributes = {k: v for k, v in item.items() if k != "type"}
        if not attributes:
            raise ManifestError(f"{where} has no carrier attributes")
        if kind == "python_module":
            _python_module(attributes, where)
        result.append(Carrier(type=kind, attributes=tuple(sorted(attributes.items()))))
    return tuple(result)


def _python_module(attributes: dict[str, Any], where: str) -> None:
    if attributes.keys() != {"module", "object", "status"}:
        raise ManifestError(f"{where} python_module requires module, object, and status")
    module, obj, status = attributes["module"], attributes["object"], attributes["status"]
    if not isinstance(module, str) or not _MODULE.fullmatch(module):
        raise ManifestError(f"{where}.module is invalid")
    if not isinstance(obj, str) or not _OBJECT.fullmatch(obj):
        raise ManifestError(f"{where}.object is invalid")
    if not isinstance(status, str) or status not in _MODULE_STATUSES:
        raise ManifestError(f"{where}.status is unsupported")


def _services(value: object) -> tuple[RequiredService, ...]:
    if not isinstance(value, list):
        raise ManifestError("requires_services must be an array")
    result: list[RequiredService] = []
    for where, item in _objects(value, "requires_services"):
        _keys(item, _SERVICE_REQUIRED, frozenset({"optional"}), where)
        optional = item.get("optional", False)
        if not isinstance(optional, bool):
            raise ManifestError(f"{where}.optional must be boolean")
        result.append(
            RequiredService(
                service_id=_string(item["service_id"], f"{where}.service_id"),
                protocol=_string(item["protocol"], f"{where}.protocol"),
                version_range=_range(
                    item["version_range"], f"{where}.version_range", nullable=True
                ),
                endpoint_config=_string(item["endpoint_config"], f"{where}.endpoint_config"),
                optional=optional,
            )
        )
    return tuple(result)


# --- documents ----------------------------------------------------------------------


@cache
def manifest_schema() -> dict[str, Any]:
    """The Manifest 0.2 JSON Schema shipped inside this package."""
    text = resources.files("hust_ext_manager").joinpath("schema", SCHEMA_FILE).read_text("utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


@cache
def _schema_validator() -> jsonschema.Draft202012Validator:
    schema = manifest_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _schema_check(document: dict[str, Any]) -> None:
    error = jsonschema.exceptions.best_match(_schema_validator().iter_errors(document))
    if error is not None:
        where = "".join(
            f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p))
            for i, p in enumerate(error.absolute_path)
        )
        message = error.message.splitlines()[0]
        raise ManifestError(
            f"{where or 'manifest'} does not match the Manifest 0.2 schema: {message}"
        )


def _parse_experimental(document: dict[str, Any]) -> Manifest:
    unknown = sorted(document.keys() - _TOP_REQUIRED - _TOP_OPTIONAL)
    missing = sorted(_TOP_REQUIRED - document.keys())
    if unknown or missing:
        raise ManifestError(f"experimental manifest has unknown={unknown} missing={missing}")
    extension_id = _string(document["extension_id"], "extension_id")
    if not _IDENTIFIER.fullmatch(extension_id):
        raise ManifestError("extension_id is invalid")
    version = _version(document["extension_version"], "extension_version")
    kind = _string(document["kind"], "kind")
    _known((kind,), _KINDS, "kind")
    owner = _string(document["lifecycle_owner"], "lifecycle_owner")
    _known((owner,), _OWNERS, "lifecycle_owner")
    components = _components(document.get("components"))
    activation = _activation(document.get("activation"))
    manifest = Manifest(
        schema_version=EXPERIMENTAL_SCHEMA,
        extension_id=extension_id,
        extension_version=version,
        kind=kind,
        lifecycle_owner=owner,
        components=components,
        activation=activation,
        host=_host(document["host"]),
        runtime=_runtime(document["runtime"]),
        protocols=_protocols(document["protocols"]),
        implementation=_implementation(document["implementation"]),
        requires_services=_services(document["requires_services"]),
    )
    _schema_check(document)
    return manifest


def _parse_legacy(document: dict[str, Any]) -> Manifest:
    unknown = sorted(document.keys() - _LEGACY_FIELDS)
    if unknown:
        raise ManifestError(f"manifest contains unknown fields: {unknown}")
    missing = sorted(_LEGACY_FIELDS - {"activation"} - document.keys())
    if missing:
        raise ManifestError(f"manifest is missing fields: {missing}")
    bundle_id = _string(document["bundle_id"], "bundle_id")
    if not _IDENTIFIER.fullmatch(bundle_id):
        raise ManifestError("bundle_id must use lowercase letters, digits, dots, or hyphens")
    version = _version(document["bundle_version"], "bundle_version")
    api_range = _range(document["host_api_range"], "host_api_range")
    assert api_range is not None
    if _LEGACY_HOST_API not in SpecifierSet(api_range):
        raise ManifestError(
            f"bundle requires host API {api_range}, host provides {_LEGACY_HOST_API}"
        )
    components = _components(document["components"])
    if not components:
        raise ManifestError("components must be a non-empty array")
    return Manifest(
        schema_version="1.0",
        extension_id=bundle_id,
        extension_version=version,
        kind="legacy_vllm_bundle",
        host=HostSpec(provider="vllm", name="vllm", version_range=">=0", api_range=api_range),
        runtime=RuntimeSpec(
            type="python", process_scope="vllm_processes", isolation="trusted_in_process"
        ),
        lifecycle_owner="vllm",
        protocols=(),
        implementation=(),
        requires_services=(),
        components=components,
        activation=_activation(document.get("activation")),
        experimental=False,
    )


def parse_manifest(document: object) -> Manifest:
    """Validate one decoded manifest document; raise ManifestError with the protocol text."""
    if not isinstance(document, dict) or not all(isinstance(k, str) for k in document):
        raise ManifestError("manifest must be an object with string keys")
    version = document.get("schema_version")
    if version == EXPERIMENTAL_SCHEMA:
        return _parse_experimental(document)
    if version == "1.0":
        return _parse_legacy(document)
    raise ManifestError("unsupported schema_version")


def load_manifest(path: Path) -> tuple[Manifest, dict[str, Any]]:
    """Read a manifest file (regular, non-symlink, UTF-8 JSON) and parse it.

    Returns the model and the raw document (``run`` merges the raw additional_config).
    """
    try:
        info = path.lstat()
    except OSError as error:
        raise ManifestError("manifest must be a regular non-symlink file") from error
    if not stat.S_ISREG(info.st_mode):
        raise ManifestError("manifest must be a regular non-symlink file")
    try:
        document = load_json(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, JSONInputError) as error:
        raise ManifestError("manifest cannot be read as JSON") from error
    return parse_manifest(document), document
