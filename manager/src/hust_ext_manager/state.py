"""The manager's state file: which bundles are enabled and their user configuration.

Schema 2 is ``{"schema_version": 2, "extensions": {id: {"enabled", "configuration"}}}``;
schema 1 (``{"schema_version": 1, "enabled": [...]}``) is read and migrated. Writers hold
an exclusive ``flock`` on a sibling lock file for the whole read-modify-write, so
concurrent invocations changing different ids never lose each other's updates; the file
itself is replaced atomically, so readers need no lock. A state file that cannot be
understood is refused and never rewritten. As in the official manager, top-level keys
other than the schema's are ignored (and not written back), and numbers are read and
written as Python's json module does (NaN included). A state file that is a symlink stays
one: the new state replaces the link's target.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import platformdirs
from pydantic import BaseModel, ConfigDict

from hust_ext_manager.fileio import NotARegularFileError, open_regular
from hust_ext_manager.jsonio import JSONInputError, load_json

__all__ = [
    "CONFIG_ENV",
    "ExtensionState",
    "State",
    "config_path",
    "load_state",
    "mutate_state",
    "parse_state",
    "write_state",
]

CONFIG_ENV = "VLLM_HUST_EXT_CONFIG"
_ENTRY_KEYS = frozenset({"enabled", "configuration"})


class ExtensionState(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = False
    configuration: Mapping[str, Any] = {}


class State(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    extensions: Mapping[str, ExtensionState] = {}

    def entry(self, extension_id: str) -> ExtensionState | None:
        return self.extensions.get(extension_id)

    def is_enabled(self, extension_id: str) -> bool:
        entry = self.extensions.get(extension_id)
        return entry is not None and entry.enabled

    def configuration(self, extension_id: str) -> dict[str, Any]:
        entry = self.extensions.get(extension_id)
        return {} if entry is None else dict(entry.configuration)

    def enabled_ids(self) -> list[str]:
        return sorted(k for k, v in self.extensions.items() if v.enabled)

    def with_entry(self, extension_id: str, entry: ExtensionState | None) -> State:
        updated = dict(self.extensions)
        if entry is None:
            updated.pop(extension_id, None)
        else:
            updated[extension_id] = entry
        return State(extensions=updated)

    def to_document(self) -> dict[str, Any]:
        return {
            "schema_version": 2,
            "extensions": {
                key: {"enabled": value.enabled, "configuration": dict(value.configuration)}
                for key, value in sorted(self.extensions.items())
            },
        }


def config_path() -> Path:
    override = os.environ.get(CONFIG_ENV)
    if not override:  # unset or empty: the default location
        return platformdirs.user_config_path("vllm-hust-ext") / "config.json"
    if not override.strip():
        # Path(" ") is a file named " " in the working directory: surely not what was meant.
        raise ValueError(f"{CONFIG_ENV} must be a path to the state file, not only whitespace")
    path = Path(override)
    if path.name in ("", ".."):
        # "/", "." or "..": a directory by its spelling alone, never a file's path (and
        # the sibling lock file of "/" has no name to take).
        raise ValueError(
            f"{CONFIG_ENV} must be a path to the state file, not the directory {override!r}"
        )
    return path


def parse_state(document: object) -> State:
    """Turn a decoded state document into a State, with the protocol's error texts."""
    if not isinstance(document, dict):
        raise ValueError("vllm-hust-ext config must be an object")
    schema = document.get("schema_version")
    if schema == 1 and type(schema) is int:
        legacy = document.get("enabled", [])
        if not isinstance(legacy, list) or not all(isinstance(i, str) for i in legacy):
            raise ValueError("legacy enabled must be an array of strings")
        return State(extensions={i: ExtensionState(enabled=True) for i in legacy})
    if schema != 2 or type(schema) is not int:
        raise ValueError("vllm-hust-ext config has an unsupported schema")
    raw = document.get("extensions", {})
    if not isinstance(raw, dict):
        raise ValueError("vllm-hust-ext extensions must be an object")
    return State(extensions={key: _entry(key, value) for key, value in raw.items()})


def _entry(extension_id: str, value: object) -> ExtensionState:
    if not isinstance(value, dict):
        raise ValueError(f"extension {extension_id!r} config must be an object")
    unknown = sorted(value.keys() - _ENTRY_KEYS)
    if unknown:
        raise ValueError(f"extension {extension_id!r} config has unknown keys: {unknown}")
    enabled = value.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ValueError(f"extension {extension_id!r} enabled must be boolean")
    configuration = value.get("configuration", {})
    if not isinstance(configuration, dict):
        raise ValueError(f"extension {extension_id!r} configuration must be an object")
    return ExtensionState(enabled=enabled, configuration=configuration)


def _not_regular(target: Path) -> ValueError:
    return ValueError(f"vllm-hust-ext config {target} is not a regular file")


def load_state(path: Path | None = None) -> State:
    target = config_path() if path is None else path
    try:
        with open_regular(target) as stream:
            text = stream.read().decode("utf-8")
    except FileNotFoundError:
        return State()
    except NotARegularFileError as error:
        raise _not_regular(target) from error
    except UnicodeDecodeError as error:
        raise ValueError(f"vllm-hust-ext config {target} is not UTF-8") from error
    try:
        document = load_json(text)
    except JSONInputError as error:
        raise ValueError(f"vllm-hust-ext config {target} is not valid JSON: {error}") from error
    return parse_state(document)


def _resolved(path: Path) -> Path:
    """The file a (possibly symlinked) state path names; replacing a link would orphan it.

    ``realpath`` rather than ``Path.resolve``: it does not raise on a symlink loop (the
    read before any write then fails with ELOOP, naming the path).
    """
    return Path(os.path.realpath(path))


def _make_parent(target: Path) -> None:
    """Create the state file's directory; when that fails, say which file it was for
    (a bare ``[Errno 2] No such file or directory: '/x'`` names neither)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        # mkdir says "File exists" when a file stands where the directory should be.
        reason = ("a file is in the way" if error.errno == errno.EEXIST
                  else error.strerror or str(error))
        raise ValueError(
            f"vllm-hust-ext config {target}: cannot create its directory {target.parent} "
            f"({reason}; {CONFIG_ENV} sets where the state file lives)"
        ) from None


def write_state(state: State, path: Path | None = None) -> None:
    """Atomic replace of the (link-resolved) file: temp file in its directory, 0600,
    fsync, ``os.replace``."""
    target = _resolved(config_path() if path is None else path)
    text = json.dumps(state.to_document(), indent=2, sort_keys=True) + "\n"
    _make_parent(target)
    fd, temp = tempfile.mkstemp(prefix=".config-", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(temp, 0o600)
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    _make_parent(target)
    lock_path = target.with_name(target.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def _refuse_non_regular(target: Path) -> None:
    """Refuse a state path that names a directory, FIFO or device before its lock file is
    created, so that a refused command leaves no ``<name>.lock`` behind. (A lock file
    cannot be removed afterwards instead: another writer may already be waiting on it.)
    The read under the lock checks again; this only keeps the refusal clean."""
    try:
        mode = os.stat(target).st_mode
    except OSError:  # missing (a new state file) or unreadable: the locked read decides
        return
    if not stat.S_ISREG(mode):
        raise _not_regular(target)


def mutate_state(change: Callable[[State], State], path: Path | None = None) -> State:
    """Read, change and write the state under the lock; refuses (raises) on a bad file."""
    target = config_path() if path is None else path
    real = _resolved(target)
    _refuse_non_regular(real)
    # Lock, read and write the resolved file: two links to one state file share one lock,
    # and a link retargeted meanwhile cannot make us write one file's state over another.
    with _locked(real):
        updated = change(load_state(real))
        write_state(updated, real)
    return updated
