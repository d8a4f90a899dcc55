"""Decoding JSON the manager did not write itself: one exception type for every bad text.

``json.loads`` does not fail with ``JSONDecodeError`` alone: an integer literal longer than
the interpreter's int/str digit limit is a plain ``ValueError``, undecodable bytes are a
``UnicodeDecodeError`` and nesting deeper than the parser follows is a ``RecursionError``.
A handler catching only ``JSONDecodeError`` lets those escape without naming the file, so
every parse site goes through :func:`load_json` and catches :class:`JSONInputError`.
"""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn

__all__ = ["JSONInputError", "load_json"]


class JSONInputError(ValueError):
    """The text is not JSON (or, when finite numbers are required, holds a non-finite one)."""


def _refuse_constant(name: str) -> NoReturn:
    raise JSONInputError(f"{name} is not a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # e.g. 1e400, which float() turns into inf
        raise JSONInputError(f"{text} is not a finite number")
    return value


def load_json(data: str | bytes, *, finite: bool = False) -> Any:
    """``json.loads``, raising :class:`JSONInputError` (one line) for any bad input.

    ``finite`` also refuses ``NaN``, ``Infinity`` and overflowing literals: Python's
    parser accepts them, but they are not standard JSON and cannot be written back as it.
    """
    try:
        if finite:
            return json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float)
        return json.loads(data)
    except JSONInputError:
        raise
    except (ValueError, RecursionError) as error:
        raise JSONInputError(" ".join(str(error).split()) or type(error).__name__) from error
