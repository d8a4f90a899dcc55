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

__all__ = ["JSONInputError", "load_json"]


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
