"""Decoding JSON the manager did not write itself: one exception type for every bad text.

``json.loads`` does not fail with ``JSONDecodeError`` alone: an integer literal longer than
the interpreter's int/str digit limit is a plain ``ValueError``, undecodable bytes are a
``UnicodeDecodeError`` and nesting deeper than the parser follows is a ``RecursionError``.
A handler catching only ``JSONDecodeError`` lets those escape without naming the file, so
the parse sites of outside input go through :func:`load_json` and catch
:class:`JSONInputError`.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["JSONInputError", "load_json", "same_json"]


class JSONInputError(ValueError):
    """The text is not JSON that Python's json module reads."""


def load_json(data: str | bytes) -> Any:
    """``json.loads``, raising :class:`JSONInputError` (one line) for any bad input.

    Like the official manager it accepts what ``json.loads`` accepts, ``NaN`` and
    ``Infinity`` included.
    """
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as error:
        raise JSONInputError(" ".join(str(error).split()) or type(error).__name__) from error


def same_json(left: object, right: object) -> bool:
    """Equal as JSON values: Python's ``==`` except that a boolean never equals a number
    (``True == 1`` and ``False == 0.0`` in Python; ``true`` and ``1`` differ in JSON)."""
    if isinstance(left, bool) or isinstance(right, bool):
        return type(left) is type(right) and left == right
    if isinstance(left, dict) and isinstance(right, dict):
        return left.keys() == right.keys() and all(same_json(left[k], right[k]) for k in left)
    if isinstance(left, list) and isinstance(right, list):
        return len(left) == len(right) and all(map(same_json, left, right))
    return bool(left == right)
