"""``release-check``: may this tree be released?

Checks, all reported together:

1. The version in ``src/bidkv_ext/_version.py`` is the distribution version: pyproject
   either reads it dynamically from that attribute or states the same static version.
2. Every bundle manifest the pyproject registers (``vllm_hust.extension_bundles``, a
   dotted package path under the root or ``src/``) has ``extension_version`` equal to that
   version.
3. ``CHANGELOG.md`` has a released section ``## [<version>]`` (Keep a Changelog).
4. A passing qualification record exists for this version whose host version lies in the
   BidKV manifest's host range, from an accelerator run (the CPU replay record gates CI,
   not releases).
5. If the manifest carries ``activation.additional_config._manager_runtime_qualification``,
   a passing record in range also matches that profile (accelerator, model, tensor
   parallel size, execution mode; ``tested_runtime_commit`` when the record's commit is not
   null), each value of the profile's own JSON type.

The profile is *optional* in the manifest. With it present, ``vllm-hust-ext run`` refuses
the bundle until the operator declares a matching passed ``runtime_qualification``
(manager-protocol.md §5.2), which would also block the qualification runs themselves and
every first start on the stock-vLLM CPU host. So the release gate is the record (rule 4);
when the profile is present it must agree with a record (rule 5).
"""

from __future__ import annotations

import ast
import json
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from qualification import RECORD_SCHEMA
from qualification.errors import QualificationError, unparsable_reason
from qualification.paths import path_kind, read_regular

__all__ = ["ReleaseCheck", "check_release"]

BUNDLE_GROUP = "vllm_hust.extension_bundles"
MANIFEST_NAMES = ("vllm-hust-extension-v0.2.json", "vllm-hust-extension-v1.json")
PROFILE_KEY = "_manager_runtime_qualification"
PROFILE_MATCH_KEYS = ("accelerator", "model", "tensor_parallel_size", "execution_mode")
PRIMARY_BUNDLE = "org.vllm-hust.bidkv"
RECORDS_EXPECTED = "a record file or a directory of records"
CI_ACCELERATOR = "cpu"
# A bundle's manifest directory as vllm-hust-ext reads the entry point (discovery.py):
# identifiers joined by dots, so the manifest always lies inside the tree checked.
DOTTED_DIRECTORY = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


@dataclass(frozen=True, slots=True)
class ReleaseCheck:
    version: str | None
    problems: tuple[str, ...]
    matched_records: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.problems


def _read_text(path: Path) -> str:
    """A file of the release tree or a record, as UTF-8 text; a FIFO at the path is refused
    at once (OSError) rather than blocking ``release-check`` forever. An OSError or
    UnicodeDecodeError is for the caller to list as a problem."""
    return read_regular(path).decode("utf-8")


def read_version(root: Path, problems: list[str]) -> str | None:
    path = root / "src" / "bidkv_ext" / "_version.py"
    try:
        tree = ast.parse(_read_text(path))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError) as exc:
        # ValueError: NUL bytes (Python 3.11); UnicodeDecodeError: not UTF-8.
        problems.append(
            f"{path}: cannot read __version__ ({exc}); "
            'expected a UTF-8 Python file with __version__ = "X.Y.Z"'
        )
        return None
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            return node.value.value
    problems.append(f"{path}: no string __version__ assignment")
    return None


_TOML_KINDS = {str: "a string", bool: "a boolean", int: "an integer", float: "a float"}


def _toml_kind(value: object) -> str:
    return "an array" if isinstance(value, list) else _TOML_KINDS.get(type(value), "a date/time")


def _table(
    problems: list[str], node: Mapping[str, object], *keys: str, under: tuple[str, ...] = ()
) -> Mapping[str, object]:
    """``node[k1][k2]...`` as a TOML table ({} when absent); a value of another type is a
    problem naming it (``under``: the keys that led to ``node``), never an AttributeError
    on ``.get``."""
    for depth, key in enumerate(keys, 1):
        value = node.get(key, {})
        if not isinstance(value, Mapping):
            name = ".".join(f'"{k}"' if "." in k else k for k in (*under, *keys[:depth]))
            problems.append(f"pyproject.toml: {name} is {_toml_kind(value)}; expected a table")
            return {}
        node = value
    return node


def _check_pyproject(root: Path, version: str, problems: list[str]) -> dict[str, object]:
    path = root / "pyproject.toml"
    try:
        data = tomllib.loads(_read_text(path))
    except (OSError, ValueError, RecursionError) as exc:
        problems.append(
            f"{path}: cannot be read as TOML ({unparsable_reason(exc)}); "
            "expected a UTF-8 TOML file"
        )
        return {}
    project = _table(problems, data, "project")
    static = project.get("version")
    if static is not None:
        if static != version:
            problems.append(f"pyproject.toml version {static} != _version.py {version}")
    else:
        dynamic = project.get("dynamic", [])
        attr = _table(problems, data, "tool", "setuptools", "dynamic", "version").get("attr")
        if (
            not isinstance(dynamic, list)
            or "version" not in dynamic
            or attr != "bidkv_ext._version.__version__"
        ):
            problems.append(
                "pyproject.toml: version must be dynamic from bidkv_ext._version.__version__ "
                f"(found dynamic={dynamic}, attr={attr})"
            )
    entry_points = _table(problems, project, "entry-points", BUNDLE_GROUP, under=("project",))
    return dict(entry_points)


def _manifest_path(root: Path, dotted: str) -> Path | None:
    """The bundle's manifest in the tree (at the dotted package path under the root or
    ``src/``), or None. A candidate that cannot be examined (a part longer than a file
    name may be) raises QualificationError, for the caller to list."""
    for base in (root, root / "src"):
        for name in MANIFEST_NAMES:
            candidate = base.joinpath(*dotted.split(".")) / name
            if path_kind(candidate, str(candidate), "a manifest file") == "file":
                return candidate
    return None


def _load_manifests(
    root: Path, entry_points: Mapping[str, object], version: str, problems: list[str]
) -> dict[str, dict[str, object]]:
    manifests: dict[str, dict[str, object]] = {}
    if PRIMARY_BUNDLE not in entry_points:
        problems.append(
            f"pyproject.toml registers no {BUNDLE_GROUP} entry point {PRIMARY_BUNDLE!r}"
        )
    for bundle_id, dotted in sorted(entry_points.items()):
        if not isinstance(dotted, str) or not DOTTED_DIRECTORY.fullmatch(dotted):
            # An absolute path or a '/' in it would name a manifest outside the tree,
            # which is not what gets released (and vllm-hust-ext refuses it).
            problems.append(
                f"bundle {bundle_id}: manifest location {dotted!r} is not a dotted package "
                "path; expected one like manifests.bidkv, under the root or src/"
            )
            continue
        try:
            path = _manifest_path(root, dotted)
        except QualificationError as exc:
            problems.append(f"bundle {bundle_id}: {exc}")
            continue
        if path is None:
            problems.append(f"bundle {bundle_id}: no manifest under {dotted}")
            continue
        try:
            doc = json.loads(_read_text(path))
        except (OSError, ValueError, RecursionError) as exc:
            problems.append(
                f"{path}: cannot be read as JSON ({unparsable_reason(exc)}); "
                "expected a UTF-8 JSON object"
            )
            continue
        if not isinstance(doc, dict):
            problems.append(f"{path}: manifest is not a JSON object")
            continue
        if doc.get("extension_version") != version:
            problems.append(
                f"{path.relative_to(root)}: extension_version {doc.get('extension_version')} "
                f"!= {version}"
            )
        manifests[bundle_id] = doc
    return manifests


def _check_changelog(root: Path, version: str, problems: list[str]) -> None:
    path = root / "CHANGELOG.md"
    try:
        text = _read_text(path)
    except FileNotFoundError:
        problems.append("CHANGELOG.md is missing")
        return
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(f"{path}: cannot be read ({exc}); expected a UTF-8 Markdown file")
        return
    if not re.search(rf"^##\s*\[{re.escape(version)}\]", text, flags=re.MULTILINE):
        problems.append(f"CHANGELOG.md has no released section '## [{version}]'")


def _record_files(base: Path) -> list[Path]:
    """The ``*.json`` under a directory, else ``base`` itself (a FIFO given as the record
    is then named as not a regular file); none when nothing is there."""
    kind = path_kind(base, f"--records {base}", RECORDS_EXPECTED)
    if kind == "directory":
        return sorted(base.rglob("*.json"))
    return [] if kind == "missing" else [base]


def _iter_records(
    dirs: Iterable[Path], unreadable: list[str]
) -> Iterable[tuple[Path, dict[str, object]]]:
    """The records under ``dirs``; a ``*.json`` that cannot be parsed is added to
    ``unreadable`` (it may be a damaged record, so it is named rather than dropped)."""
    for base in dirs:
        for path in _record_files(base):
            try:
                doc = json.loads(_read_text(path))
            except OSError as exc:  # a FIFO, say: named as such, not as bad JSON
                unreadable.append(f"{path.name} ({exc.strerror or exc})")
                continue
            except (ValueError, RecursionError) as exc:
                unreadable.append(f"{path.name} (cannot be read as JSON: {unparsable_reason(exc)})")
                continue
            if isinstance(doc, dict) and doc.get("schema") == RECORD_SCHEMA:
                yield path, doc


def _record_in_range(
    doc: Mapping[str, object], version: str, host_range: SpecifierSet
) -> str | None:
    """None when the record qualifies this release's host range, else why not."""
    gate, ext, host = doc.get("gate"), doc.get("extension"), doc.get("host")
    if not (isinstance(gate, Mapping) and gate.get("passed") is True):
        return "gate did not pass"
    if not (isinstance(ext, Mapping) and ext.get("version") == version):
        got = ext.get("version") if isinstance(ext, Mapping) else None
        return f"extension version {got} != {version}"
    host_version = host.get("version") if isinstance(host, Mapping) else None
    try:
        if host_version is None or Version(str(host_version)) not in host_range:
            return f"host version {host_version} outside {host_range}"
    except InvalidVersion:
        return f"host version {host_version!r} is not a version"
    rec_profile = doc.get("profile")
    profile = rec_profile if isinstance(rec_profile, Mapping) else {}
    accelerator = profile.get("accelerator")
    if not isinstance(accelerator, str) or not accelerator:
        return "names no accelerator"
    if accelerator == CI_ACCELERATOR or profile.get("kind") == "replay":
        # qualification.md §9: the CPU replay gates CI; a release needs a run on the
        # accelerator and model it names (the cuda or ascend-tp4 profile). A replay profile
        # runs no accelerator whatever its free-text `accelerator` says.
        return "a CPU replay record is the CI gate, not a release qualification"
    return None


def _same(wanted: object, got: object) -> bool:
    """Equal and of the same JSON type: Python's ``True == 1 == 1.0`` would let a record's
    ``true`` or ``1.0`` match a manifest's tensor parallel size 1."""
    return type(wanted) is type(got) and wanted == got


def _profile_mismatch(
    doc: Mapping[str, object], profile: Mapping[str, object]
) -> dict[str, object]:
    rec_profile = doc.get("profile")
    rec = rec_profile if isinstance(rec_profile, Mapping) else {}
    diff: dict[str, object] = {
        key: (profile[key], rec.get(key))
        for key in PROFILE_MATCH_KEYS
        if key in profile and not _same(profile[key], rec.get(key))
    }
    ext = doc.get("extension")
    commit = ext.get("commit") if isinstance(ext, Mapping) else None
    wanted = profile.get("tested_runtime_commit")
    # A record names no commit with null; any other value (false, [], "") is a commit
    # that must match, not a record without one.
    if wanted and commit is not None and not _same(wanted, commit):
        diff["tested_runtime_commit"] = (wanted, commit)
    func = profile.get("functional_compatibility")
    if isinstance(func, Mapping) and func.get("status") != "passed":
        diff["functional_compatibility.status"] = (func.get("status"), "passed")
    return diff


def check_release(root: Path, record_dirs: Sequence[Path]) -> ReleaseCheck:
    problems: list[str] = []
    version = read_version(root, problems)
    if version is None:
        return ReleaseCheck(None, tuple(problems), ())
    entry_points = _check_pyproject(root, version, problems)
    manifests = _load_manifests(root, entry_points, version, problems)
    _check_changelog(root, version, problems)
    primary = manifests.get(PRIMARY_BUNDLE)
    if primary is None:
        return ReleaseCheck(version, tuple(problems), ())
    host = primary.get("host")
    raw_range = host.get("version_range") if isinstance(host, Mapping) else None
    try:
        host_range = SpecifierSet(str(raw_range))
    except InvalidSpecifier:
        problems.append(f"{PRIMARY_BUNDLE} manifest: host.version_range {raw_range!r} is invalid")
        return ReleaseCheck(version, tuple(problems), ())
    activation = primary.get("activation")
    extra = activation.get("additional_config") if isinstance(activation, Mapping) else None
    profile = extra.get(PROFILE_KEY) if isinstance(extra, Mapping) else None
    if profile is not None and not isinstance(profile, Mapping):
        problems.append(f"{PRIMARY_BUNDLE} manifest: {PROFILE_KEY} must be an object")
        profile = None

    rejected: list[str] = []
    records = list(_iter_records(record_dirs, rejected))
    in_range: list[tuple[Path, dict[str, object]]] = []
    for path, doc in records:
        why = _record_in_range(doc, version, host_range)
        if why is None:
            in_range.append((path, doc))
        else:
            rejected.append(f"{path.name} ({why})")
    matched = in_range
    if not in_range:
        where = ", ".join(str(d) for d in record_dirs) or "<none>"
        detail = f"; rejected: {', '.join(rejected)}" if rejected else ""
        problems.append(
            f"no passing qualification record for {version} with a host in {host_range} "
            f"under {where}{detail}"
        )
    elif profile is not None:
        diffs = [(p, _profile_mismatch(d, profile)) for p, d in in_range]
        matched = [(p, d) for (p, d), (_, diff) in zip(in_range, diffs, strict=True) if not diff]
        if not matched:
            problems.append(
                f"no passing record matches the manifest's {PROFILE_KEY}: "
                + "; ".join(f"{p.name}: {diff}" for p, diff in diffs)
            )
    return ReleaseCheck(version, tuple(problems), tuple(str(p) for p, _ in matched))
