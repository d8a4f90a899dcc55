"""Find installed bundles from package metadata alone: nothing is imported.

A bundle registers ``[vllm_hust.extension_bundles] <extension_id> = <dotted.directory>``.
The manifest is located through the distribution's RECORD (``dist.files``), or, for an
editable install, through ``direct_url.json`` under the source root and ``src/``. A
declared vLLM plugin's module is looked for the same way, and also under the root and
``src/`` of a source checkout whose ``.egg-info`` is the distribution found.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib.metadata import Distribution, EntryPoint, entry_points
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote, urlparse

from hust_ext_manager.manifest import Manifest, ManifestError, load_manifest
from hust_ext_manager.metadata_scan import metadata_field, unreadable_entry_points

__all__ = [
    "BUNDLE_GROUP",
    "CHECK_GROUP",
    "MANIFEST_FILENAMES",
    "PLUGIN_GROUPS",
    "SHUTDOWN_GROUP",
    "Diagnostic",
    "DiscoveryError",
    "InstalledBundle",
    "discover",
    "discover_tolerant",
    "file_exists",
    "source_roots",
]

BUNDLE_GROUP = "vllm_hust.extension_bundles"
CHECK_GROUP = "vllm_hust_ext.bundle_checks"
SHUTDOWN_GROUP = "vllm_hust_ext.bundle_shutdown"
# vLLM's plugin groups: a bundle's activation entry points there must be its own.
PLUGIN_GROUPS = frozenset({"vllm.general_plugins", "vllm.platform_plugins"})
MANIFEST_FILENAMES = (
    "vllm-hust-extension-v0.2.json",
    "vllm-hust-extension-v1.json",
    "extension-bundle-v1.json",
)
_STATIC_DIRECTORY = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class DiscoveryError(ValueError):
    """Installed bundle metadata is missing, ambiguous or invalid."""


@dataclass(frozen=True, slots=True)
class InstalledBundle:
    bundle_id: str
    distribution: str
    distribution_version: str
    manifest_path: Path
    manifest: Manifest
    raw: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Diagnostic:
    bundle_id: str
    error: str


def _editable_roots(dist: Distribution) -> list[Path]:
    try:
        text = dist.read_text("direct_url.json")
        if not text:
            return []
        direct_url = json.loads(text)
        editable = direct_url.get("dir_info", {}).get("editable") is True
        url = urlparse(str(direct_url.get("url", "")))
    except (OSError, ValueError, AttributeError, RecursionError) as error:
        # ValueError: undecodable bytes, bad JSON, or a URL urlparse rejects.
        raise DiscoveryError("editable direct_url.json is invalid") from error
    if not editable or url.scheme != "file" or url.netloc not in ("", "localhost"):
        return []
    root = Path(unquote(url.path))
    return [root, root / "src"]


def _source_tree_roots(dist: Distribution) -> list[Path]:
    """Where modules live when ``dist`` is an ``.egg-info`` directory in a source checkout.

    setuptools leaves ``<name>.egg-info`` at a project's root when it finds packages there
    (an editable install does so too), and Python puts that root on ``sys.path`` whenever
    it runs from it (``python -m ...``), so the checkout itself is the distribution found
    first. Its SOURCES.txt lists files under the project's package directories (``src/``),
    not by module path, so modules are looked for under the root and ``src/``, as for an
    editable install. A distribution with a RECORD is installed and never read this way.
    """
    try:
        if dist.read_text("RECORD") is not None or dist.read_text("SOURCES.txt") is None:
            return []  # a RECORD lists what was installed, wherever the sources are
    except (OSError, ValueError):  # unreadable metadata: the RECORD check reports it
        return []
    root = Path(str(dist.locate_file("")))
    return [root, root / "src"]


def source_roots(dist: Distribution) -> list[Path]:
    """Where ``dist``'s modules live when its RECORD does not list them: the source tree of
    an editable install or of a source checkout (empty otherwise). Raises DiscoveryError
    for an editable install whose ``direct_url.json`` is invalid."""
    return [*_editable_roots(dist), *_source_tree_roots(dist)]


def _recorded(bundle_id: str, dist: Distribution) -> set[PurePosixPath]:
    """The files the distribution's RECORD lists."""
    try:
        return {PurePosixPath(str(f)) for f in (dist.files or ())}
    # Undecodable (OSError/ValueError), or a row of 0 or 4+ columns (TypeError).
    except (OSError, ValueError, TypeError) as error:
        raise DiscoveryError(f"{bundle_id!r} distribution RECORD cannot be read") from error


def _ships_module(dist: Distribution, recorded: set[PurePosixPath], module: str) -> bool:
    """Whether ``module``'s file (source, package or extension) exists, as ``dist``'s RECORD
    lists it or, for an editable install, in its source tree; nothing is imported."""
    *parents, leaf = module.split(".")
    folder = PurePosixPath(*parents)
    sources = [folder / f"{leaf}.py", folder / leaf / "__init__.py"]
    listed = [p for p in recorded if p in sources or (
        p.parent == folder and p.name.startswith(f"{leaf}.") and p.suffix in (".so", ".pyd"))]
    if any(file_exists(Path(str(dist.locate_file(str(p))))) for p in listed):
        return True
    return any(file_exists(root / p) for root in source_roots(dist) for p in sources)


def file_exists(path: Path) -> bool:
    """Whether a regular file is at ``path``. A path Python 3.11's ``is_file()`` cannot
    stat (a name too long, a folder without search permission: it raises) counts as none;
    nothing there could be imported either."""
    try:
        return path.is_file()
    except OSError:
        return False


def _token(text: str) -> str:
    """A name from the manifest as it is when it is one printable token, else quoted and
    escaped: a message naming it stays one line and shows exactly what the manifest holds."""
    return text if text.isprintable() and not any(c.isspace() for c in text) else repr(text)


def _check_plugins(
    bundle_id: str,
    dist: Distribution,
    dist_name: str,
    recorded: set[PurePosixPath],
    manifest: Manifest,
) -> None:
    """Each declared vLLM plugin entry point is the bundle's own (the newer managers' rule):
    published by its distribution, with the target module in it. Otherwise the bundle would
    put a plugin name in ``VLLM_PLUGINS`` that vLLM never finds, and silently not activate.
    """
    declared = [e for e in manifest.activation.entry_points if e.group in PLUGIN_GROUPS]
    if not declared:
        return
    published = {(e.group, e.name): e for e in dist.entry_points}
    for ref in declared:
        where = f"{bundle_id!r} activation entry point {ref.group}:{_token(ref.name)}"
        found = published.get((ref.group, ref.name))
        if found is None:
            raise DiscoveryError(f"{where} is not published by distribution {dist_name!r}")
        module = _target_module(found)
        if module is None:
            raise DiscoveryError(
                f"{where} has the value {found.value!r} in distribution {dist_name!r}'s "
                "entry_points.txt: expected 'module:attribute'"
            )
        if not _ships_module(dist, recorded, module):
            raise DiscoveryError(
                f"{where} targets module {module!r}, which distribution {dist_name!r} "
                "does not contain"
            )


def _target_module(entry_point: EntryPoint) -> str | None:
    """The module an entry point's value names; ``None`` for a value that names none.

    ``EntryPoint.module`` fails with an AttributeError (an AssertionError on newer
    Pythons) on such a value, and entry_points.txt is the distribution's to write.
    """
    match = entry_point.pattern.match(entry_point.value)
    return None if match is None else match.group("module")


def _manifest_path(
    name: str, directory: str, dist: Distribution, recorded: set[PurePosixPath]
) -> Path:
    wanted = [PurePosixPath(*directory.split("."), f) for f in MANIFEST_FILENAMES]
    matches = [Path(str(dist.locate_file(str(p)))) for p in wanted if p in recorded]
    if not matches:
        # Editable installs record only a finder/.pth; the files live in the source tree.
        matches = [
            root / p for root in _editable_roots(dist) for p in wanted if file_exists(root / p)
        ]
    if len(matches) != 1:
        raise DiscoveryError(f"{name!r} must contain exactly one Bundle v1 manifest")
    return matches[0]


def _load(registration: EntryPoint) -> InstalledBundle:
    bundle_id = registration.name
    dist = registration.dist
    if dist is None:
        raise DiscoveryError(f"{bundle_id!r} has no distribution metadata")
    try:
        fields = dist.metadata
        dist_name, dist_version = metadata_field(fields, "Name"), metadata_field(fields, "Version")
    except (OSError, ValueError) as error:  # undecodable METADATA
        raise DiscoveryError(f"{bundle_id!r} distribution METADATA cannot be read") from error
    if not dist_name:
        raise DiscoveryError(f"{bundle_id!r} has no distribution name")
    if not dist_version:
        raise DiscoveryError(f"{bundle_id!r} has no distribution version")
    if not _STATIC_DIRECTORY.fullmatch(registration.value):
        raise DiscoveryError(f"{bundle_id!r} must register a static module directory")
    # One reading of the RECORD serves the manifest and the plugin modules.
    recorded = _recorded(bundle_id, dist)
    path = _manifest_path(bundle_id, registration.value, dist, recorded)
    try:
        manifest, raw = load_manifest(path)
    except ManifestError as error:
        raise DiscoveryError(f"{bundle_id!r} manifest is invalid: {error}") from error
    if manifest.extension_id != bundle_id:
        raise DiscoveryError(f"registration {bundle_id!r} does not match {manifest.extension_id!r}")
    _check_plugins(bundle_id, dist, dist_name, recorded, manifest)
    return InstalledBundle(bundle_id, dist_name, dist_version, path, manifest, raw)


def _registrations() -> dict[str, list[EntryPoint]]:
    try:
        registrations = entry_points(group=BUNDLE_GROUP)
    except (TypeError, ValueError) as error:  # one damaged entry_points.txt on the path
        raise DiscoveryError(
            unreadable_entry_points() or f"installed entry points cannot be read: {error}"
        ) from error
    found: dict[str, list[EntryPoint]] = {}
    for registration in registrations:
        found.setdefault(registration.name, []).append(registration)
    return found


def discover(selected: Iterable[str] | None = None) -> tuple[InstalledBundle, ...]:
    """Strict resolution: every requested id (or every registered id) must load cleanly.

    Results come back in the requested order, or sorted by id when none was requested.
    """
    wanted: Sequence[str] | None = None if selected is None else list(dict.fromkeys(selected))
    registered = _registrations()
    candidates = (
        registered if wanted is None else {k: v for k, v in registered.items() if k in set(wanted)}
    )
    duplicates = sorted(k for k, v in candidates.items() if len(v) != 1)
    if duplicates:
        raise DiscoveryError(f"duplicate Bundle registrations: {duplicates}")
    if wanted is not None:
        missing = sorted(set(wanted) - candidates.keys())
        if missing:
            raise DiscoveryError(f"enabled Bundles are not installed: {missing}")
    loaded = {bundle_id: _load(items[0]) for bundle_id, items in candidates.items()}
    order = wanted if wanted is not None else sorted(loaded)
    return tuple(loaded[bundle_id] for bundle_id in order)


def discover_tolerant() -> tuple[tuple[InstalledBundle, ...], tuple[Diagnostic, ...]]:
    """``list`` discovery: invalid registrations become diagnostics instead of errors."""
    bundles: list[InstalledBundle] = []
    diagnostics: list[Diagnostic] = []
    for bundle_id, items in sorted(_registrations().items()):
        if len(items) != 1:
            diagnostics.append(
                Diagnostic(bundle_id, f"duplicate Bundle registrations: {[bundle_id]}")
            )
            continue
        try:
            bundles.append(_load(items[0]))
        except DiscoveryError as error:
            diagnostics.append(Diagnostic(bundle_id, str(error)))
    return tuple(bundles), tuple(diagnostics)
