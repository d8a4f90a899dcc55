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

__all__ = ["unreadable_entry_points"]


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
        name, version = dist.metadata["Name"], dist.version
    except (OSError, ValueError, KeyError):
        return "(unreadable METADATA)"
    return f"{name!r} {version}" if name else "(without a name)"
