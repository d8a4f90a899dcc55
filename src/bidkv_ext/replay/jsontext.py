"""JSON text from the command line and input files, with each refusal put in words.

``json.loads`` refuses text in three ways: a syntax error (``JSONDecodeError``), nesting
deeper than the interpreter's recursion limit (``RecursionError``, not a ``ValueError``)
and an integer longer than ``sys.get_int_max_str_digits()`` (a bare ``ValueError`` whose
message would echo nothing useful). Every replay input that holds JSON (a Mooncake trace
line, a capacity schedule, ``--additional-config``, a ``--policies`` override) turns each
of them into a one-line error that names the input; telling the three apart is done here,
once, and each caller adds its own name for the input.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["JsonTextError", "error_location", "loads"]


class JsonTextError(ValueError):
    """JSON text that ``json.loads`` refused; ``str()`` says why, without echoing the text.

    ``syntax`` is true for malformed text and false for text the parser's limits refused
    (nesting depth, integer length): a caller that falls back to reading a malformed
    value as a plain string must still refuse the latter.
    """

    def __init__(self, reason: str, *, syntax: bool, in_line: str | None = None) -> None:
        super().__init__(reason)
        self.syntax = syntax
        self._in_line = in_line

    def in_line(self) -> str:
        """The reason for text that is one line of a file (a Mooncake trace row): only the
        column, which is where in that line the parser stopped. The row's own line and
        column count from its start, and its line break made them read "line 2, column 1"
        on a file line that is not line 2."""
        return self._in_line or str(self)


def loads(text: str | bytes, **options: Any) -> Any:
    """``json.loads(text, **options)``, raising only :class:`JsonTextError` for bad text.

    Exceptions raised by hooks in ``options`` (``parse_float``, ``parse_constant``...)
    pass through unchanged, unless they are a bare ``ValueError``: that one is how the
    parser reports an over-long integer, so hooks should raise something more specific.
    """
    try:
        return json.loads(text, **options)
    except json.JSONDecodeError as exc:
        raise JsonTextError(f"not valid JSON (line {exc.lineno}, column {exc.colno}: "
                            f"{exc.msg})", syntax=True,
                            in_line=f"not valid JSON (column {exc.pos + 1}: {exc.msg})") from None
    except RecursionError:
        raise JsonTextError("JSON nested too deeply", syntax=False) from None
    except ValueError as exc:
        if type(exc) is not ValueError:  # a hook's own, more specific error
            raise
        # The text is not shown: it holds those thousands of digits.
        raise JsonTextError(f"an integer has more than {sys.get_int_max_str_digits()} "
                            "digits", syntax=False) from None


def error_location(loc: Iterable[object], empty: str) -> str:
    """A pydantic error's location as ``key.key.0``, or ``empty`` for the document itself.

    The keys are the input file's own text: one that is not printable (a line break, a
    U+2028) is shown with ``repr()``, so the message that names it stays on one line.
    """
    parts = (str(part) for part in loc)
    return ".".join(text if text.isprintable() else repr(text) for text in parts) or empty
