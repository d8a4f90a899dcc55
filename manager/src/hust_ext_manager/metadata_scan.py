"""Name the installed distribution whose entry points Python cannot read.

``importlib.metadata.entry_points()`` parses every installed distribution's
``entry_points.txt`` and raises a bare ``TypeError`` or ``ValueError`` that names none of
them when one holds a line without ``=``. pydantic calls it when the manager's first model
class is built, and discovery calls it for the bundle group, so one damaged distribution
anywhere on the path would end every command in a traceback or an "internal error" naming
nothing. This module only reads metadata (no pydantic, nothing of ours), so the console
entry can use it even when importing the manager failed.
"""

from __future__ import annotations

import importlib.metadata
from importlib.metadata import PackageMetadata

__all__ = ["metadata_field", "unreadable_entry_points"]


def metadata_field(fields: PackageMetadata, key: str) -> str | None:
    """The first ``key`` field of a METADATA, or None when it has none, on every Python:
    ``fields[key]`` (and ``dist.version``, which is ``fields["Version"]``) gives None on
    3.11 despite its annotation, and a KeyError once importlib drops that deprecated None."""
    values = fields.get_all(key)
    return str(values[0]) if values else None


def unreadable_entry_points() -> str | None:
    """A one-line account of the first distribution whose entry points cannot be parsed."""
    for dist in importlib.metadata.distributions():
        try:
            dist.entry_points  # noqa: B018 - parsing is the point
        except (TypeError, ValueError) as error:
            return (
                f"installed distribution {_name(dist)} in {dist.locate_file('')} has an "
                f"entry_points.txt Python cannot parse ({type(error).__name__}: {error}); "
                "repair or uninstall it"
            )
    return None


def _name(dist: importlib.metadata.Distribution) -> str:
    try:
        fields = dist.metadata
        name, version = metadata_field(fields, "Name"), metadata_field(fields, "Version")
    except (OSError, ValueError):
        return "(unreadable METADATA)"
    if not name:
        return "(without a name)"
    return f"{name!r} {version}" if version else f"{name!r} (without a version)"
