"""Small pieces shared by the bad-input fuzz tests (no vLLM needed).

Documents are JSON-like trees (dicts, lists, scalars); a path is the tuple of keys and
list indices that leads to one value in them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from hypothesis import strategies as st

__all__ = ["SHORT_TEXT", "put", "shape", "tally_report", "walk"]

# Short text that any environment, file and argv can hold: no NUL, no lone surrogate.
SHORT_TEXT = st.text(
    st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=8
)


def walk(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every (path, value) of a document, the document itself first (path ``()``)."""
    yield path, value
    if isinstance(value, dict):
        for key, child in value.items():
            yield from walk(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from walk(child, (*path, index))


def put(document: Any, path: Sequence[Any], value: object) -> None:
    """Replace the value at ``path`` (which must exist up to its parent) by ``value``."""
    target = document
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value


def shape(path: Sequence[Any]) -> tuple[Any, ...]:
    """``path`` with every list index as ``"*"``: the schema position it stands for."""
    return tuple("*" if isinstance(p, int) else p for p in path)


def tally_report(name: str, seen: Counter[tuple[str, str]]) -> None:
    """Print a test's non-vacuity tally (shown with ``pytest -s``)."""
    print(f"\n{name}: " + ", ".join(f"{k[0]}={k[1]}:{n}" for k, n in sorted(seen.items())))
