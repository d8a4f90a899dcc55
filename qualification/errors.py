"""The one error type the CLI turns into a one-line message and a non-zero exit."""

from __future__ import annotations

__all__ = ["ManagerVerbError", "QualificationError", "one_line", "unparsable_reason"]


def one_line(text: str) -> str:
    """``text`` as one printable line: a line break, another control character or an
    undecodable byte's surrogate escape (in a file name, key or value a message quotes)
    is written as its backslash escape, so the line never splits and always encodes."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class QualificationError(Exception):
    """Bad input or an environment that cannot run a profile; the message names the thing
    (on one line, whatever it quotes)."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


class ManagerVerbError(QualificationError):
    """A ``vllm-hust-ext`` verb refused one arm's state change; the run records that arm
    as not run (with this one-line reason) and goes on, so finished arms are kept."""


def unparsable_reason(exc: BaseException) -> str:
    """One line for a failed ``json``/``tomllib`` parse.

    Besides their DecodeError (a ValueError, as is UnicodeDecodeError) both raise a plain
    ValueError for an integer over 4300 digits (Python's int-from-string limit) and a
    RecursionError for deeply nested arrays or tables, so every parse site catches
    ``(ValueError, RecursionError)``. RecursionError's own text names no input, and the
    int-limit message ends in advice (``sys.set_int_max_str_digits``) meant for programmers.
    """
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc).split("; use sys.set_int_max_str_digits", 1)[0]
