"""Trace loading: Azure LLM inference 2023 CSV and Mooncake FAST'25 JSONL.

Both formats become a tuple of :class:`TraceRequest` with arrival times in seconds from the
first row. Any malformed row stops loading with a :class:`TraceError` whose message names
the file and the 1-based line, so the CLI can print one line and exit 2.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from bidkv_ext.replay import jsontext

__all__ = [
    "MOONCAKE_HASH_BLOCK_TOKENS",
    "TraceError",
    "TraceFormat",
    "TraceRequest",
    "TraceSelection",
    "detect_format",
    "load_trace",
    "select_requests",
]

TraceFormat = Literal["auto", "azure", "mooncake"]

# One Mooncake hash id stands for one 512-token prompt block (traces/README.md).
MOONCAKE_HASH_BLOCK_TOKENS = 512

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_AZURE_TIME_FORMAT = "%Y-%m-%d %H:%M:%S.%f"
# ASCII digits only: str.isdigit() also accepts "²" and other digits int() refuses.
_INTEGER_TEXT = re.compile(r"[+-]?[0-9]+")


class TraceError(ValueError):
    """A trace file or row that cannot be used; the message names file and line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. ``arrival`` is seconds after the trace's first row."""

    index: int
    arrival: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class TraceSelection:
    """The requests a replay runs, plus what was cut and why (recorded in every report)."""

    requests: tuple[TraceRequest, ...]
    rows_in_window: int
    filtered_too_long: int


_SNIFF_BYTES = 64 * 1024


def detect_format(path: Path) -> Literal["azure", "mooncake"]:
    """``.jsonl``/``.json`` -> mooncake, ``.csv`` -> azure; otherwise sniff the first
    character that is not a byte-order mark, blank line or space (the loaders skip those)."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "mooncake"
    if suffix == ".csv":
        return "azure"
    try:
        with path.open("rb") as handle:
            head = handle.read(_SNIFF_BYTES)
    except OSError as exc:
        raise TraceError(f"{path}: cannot read trace: {exc.strerror or exc}") from None
    return "mooncake" if head.removeprefix(b"\xef\xbb\xbf").lstrip()[:1] == b"{" else "azure"


def load_trace(path: Path, fmt: TraceFormat = "auto") -> tuple[TraceRequest, ...]:
    """Read a whole trace file; raises :class:`TraceError` on the first bad row."""
    kind = detect_format(path) if fmt == "auto" else fmt
    try:
        # utf-8-sig: a byte-order mark (Excel writes one) is not part of the first name.
        with path.open(encoding="utf-8-sig", newline="") as handle:
            rows = _load_azure(path, handle) if kind == "azure" else _load_mooncake(path, handle)
            requests = tuple(rows)
    except OSError as exc:
        raise TraceError(f"{path}: cannot read trace: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: trace is not UTF-8 text") from None
    if not requests:
        raise TraceError(f"{path}: trace has no requests")
    return requests


def _positive_int(
    path: Path, line: int, name: str, raw: object, minimum: int, *, text_ok: bool = True
) -> int:
    """An integer >= ``minimum``; CSV cells (``text_ok``) may spell it in ASCII digits."""
    expected = f"{path}:{line}: {name} must be an integer >= {minimum}"
    if isinstance(raw, bool):
        raise TraceError(f"{expected}, got {raw!r}")
    if isinstance(raw, int):
        value = raw
    elif text_ok and isinstance(raw, str) and _INTEGER_TEXT.fullmatch(raw.strip()):
        try:
            value = int(raw)
        except ValueError:  # more digits than int() converts (sys.get_int_max_str_digits)
            raise TraceError(f"{expected}, got a {len(raw.strip())}-digit number") from None
    else:
        raise TraceError(f"{expected}, got {_shown(raw)}")
    if value < minimum:
        raise TraceError(f"{expected}, got {_shown(value)}")
    return value


def _shown(raw: object) -> str:
    """``repr`` cut to one readable length: a bad cell may be megabytes long."""
    text = repr(raw)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _parse_azure_time(path: Path, line: int, raw: str) -> datetime:
    # The trace has 7 fractional digits; %f takes at most 6.
    text = raw.strip()
    head, dot, frac = text.partition(".")
    text = f"{head}.{frac[:6]}" if dot else f"{head}.0"
    try:
        return datetime.strptime(text, _AZURE_TIME_FORMAT)
    except ValueError:
        raise TraceError(
            f"{path}:{line}: TIMESTAMP must look like 2023-11-16 18:15:46.6805900, "
            f"got {_shown(raw)}"
        ) from None


def _csv_rows(path: Path, reader: Iterator[list[str]], line: Callable[[], int]
              ) -> Iterator[list[str]]:
    """The reader's rows; a CSV-level error (a field over ``csv.field_size_limit()``, a NUL
    byte, an unterminated quote) becomes a :class:`TraceError` naming the line."""
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise TraceError(f"{path}:{line()}: not valid CSV ({exc})") from None
        yield row


def _load_azure(path: Path, handle: Iterator[str]) -> Iterator[TraceRequest]:
    reader = csv.reader(handle)
    rows = _csv_rows(path, reader, lambda: reader.line_num)
    header = next(rows, None)
    if header is None:
        raise TraceError(f"{path}:1: empty file, expected an Azure CSV header")
    names = [cell.strip() for cell in header]
    missing = [c for c in _AZURE_COLUMNS if c not in names]
    if missing:
        raise TraceError(
            f"{path}:1: Azure CSV header must contain {', '.join(_AZURE_COLUMNS)}; missing "
            f"{', '.join(missing)}"
        )
    twice = [c for c in _AZURE_COLUMNS if names.count(c) > 1]
    if twice:  # which of the two columns would be meant is anybody's guess
        raise TraceError(f"{path}:1: column {', '.join(twice)} appears more than once")
    t_col, in_col, out_col = (names.index(c) for c in _AZURE_COLUMNS)
    first: datetime | None = None
    previous = -math.inf
    for index, row in enumerate(rows):
        line = reader.line_num
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) != len(names):
            raise TraceError(f"{path}:{line}: expected {len(names)} columns, got {len(row)}")
        stamp = _parse_azure_time(path, line, row[t_col])
        if first is None:
            first = stamp
        arrival = (stamp - first).total_seconds()
        if arrival < previous:
            raise TraceError(f"{path}:{line}: TIMESTAMP goes backwards (rows must be sorted)")
        previous = arrival
        yield TraceRequest(
            index=index,
            arrival=arrival,
            input_length=_positive_int(path, line, "ContextTokens", row[in_col], 1),
            output_length=_positive_int(path, line, "GeneratedTokens", row[out_col], 1),
        )


def _json_line(path: Path, line: int, text: str) -> object:
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        row = dict(pairs)
        if len(row) != len(pairs):  # json.loads would keep the last silently
            keys = [k for k, _ in pairs]
            twice = next(k for k in keys if keys.count(k) > 1)
            raise TraceError(f"{path}:{line}: key {twice!r} appears more than once")
        return row

    try:
        return jsontext.loads(text, object_pairs_hook=unique)
    except jsontext.JsonTextError as exc:
        raise TraceError(f"{path}:{line}: {exc.in_line()}") from None


def _timestamp(path: Path, line: int, raw: object) -> float:
    """Milliseconds as a finite float >= 0. json.loads accepts NaN, Infinity and 1e999 (inf),
    which every comparison below would let through; a huge integer overflows float()."""
    expected = f"{path}:{line}: timestamp must be a finite number of milliseconds >= 0"
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise TraceError(f"{expected}, got {_shown(raw)}")
    try:
        stamp = float(raw)
    except OverflowError:
        raise TraceError(f"{expected}, got an integer too large for a float") from None
    if not math.isfinite(stamp) or stamp < 0:
        raise TraceError(f"{expected}, got {_shown(raw)}")
    return stamp


def _load_mooncake(path: Path, handle: Iterator[str]) -> Iterator[TraceRequest]:
    previous = -math.inf
    first: float | None = None
    index = 0
    for line, text in enumerate(handle, start=1):
        if not text.strip():
            continue
        row = _json_line(path, line, text)
        if not isinstance(row, dict):
            raise TraceError(f"{path}:{line}: expected a JSON object per line")
        missing = [k for k in ("timestamp", "input_length", "output_length") if k not in row]
        if missing:
            raise TraceError(f"{path}:{line}: missing field(s) {', '.join(missing)}")
        stamp = _timestamp(path, line, row["timestamp"])
        if stamp < previous:
            raise TraceError(f"{path}:{line}: timestamp goes backwards (rows must be sorted)")
        previous = stamp
        if first is None:
            first = stamp
        # JSON numbers only, as for the timestamp: "600" is a string, not a length.
        input_length = _positive_int(
            path, line, "input_length", row["input_length"], 1, text_ok=False
        )
        output_length = _positive_int(
            path, line, "output_length", row["output_length"], 1, text_ok=False
        )
        yield TraceRequest(
            index=index,
            arrival=(stamp - first) / 1000.0,
            input_length=input_length,
            output_length=output_length,
            hash_ids=_hash_ids(path, line, row.get("hash_ids"), input_length),
        )
        index += 1


def _hash_ids(path: Path, line: int, raw: object, input_length: int) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in raw
    ):
        raise TraceError(f"{path}:{line}: hash_ids must be a list of integers >= 0")
    expected = -(-input_length // MOONCAKE_HASH_BLOCK_TOKENS)
    if len(raw) != expected:
        raise TraceError(
            f"{path}:{line}: hash_ids has {len(raw)} ids, expected ceil(input_length/512) = "
            f"{expected}"
        )
    return tuple(raw)


def select_requests(
    requests: Sequence[TraceRequest],
    *,
    start: float = 0.0,
    duration: float | None = None,
    max_requests: int | None = None,
    rate_scale: float = 1.0,
    max_model_len: int | None = None,
) -> TraceSelection:
    """Cut a time window, keep the first ``max_requests``, compress time, drop long requests.

    The window is taken on the trace's own clock; arrivals are then rebased to the window
    start and divided by ``rate_scale`` (s > 1 compresses gaps, raising the rate by s).
    Requests whose prompt plus output exceed ``max_model_len`` are removed and counted.
    """
    if rate_scale <= 0:
        raise ValueError("rate scale must be > 0")
    end = math.inf if duration is None else start + duration
    window = [r for r in requests if start <= r.arrival < end]
    rows_in_window = len(window)
    if max_requests is not None:
        window = window[:max_requests]
    kept: list[TraceRequest] = []
    too_long = 0
    for r in window:
        if max_model_len is not None and r.input_length + r.output_length > max_model_len:
            too_long += 1
            continue
        kept.append(r)
    rebased = tuple(
        TraceRequest(
            index=r.index,
            arrival=(r.arrival - start) / rate_scale,
            input_length=r.input_length,
            output_length=r.output_length,
            hash_ids=r.hash_ids,
        )
        for r in kept
    )
    return TraceSelection(
        requests=rebased, rows_in_window=rows_in_window, filtered_too_long=too_long
    )
