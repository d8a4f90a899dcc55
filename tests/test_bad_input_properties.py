"""Fuzzed bad input is refused with one clear line and loses nothing.

Guarded behaviour, the project standard: "a malformed manifest, env var, config file or
trace gives a one-line message naming the thing and what was expected, with a non-zero exit
and no traceback." Hypothesis draws corruptions of small valid inputs and checks, for three
input surfaces:

1. ``bidkv-replay``'s files and numbers: Azure CSV and Mooncake JSONL traces, the
   ``--capacity-schedule`` file (JSON or CSV), the ``--step-model`` file (JSON or TOML) or
   name, and the numeric flags. The parsing layer the CLI uses either accepts the input
   with its documented meaning or raises its own error type with one line naming the file
   (and, for a row, a line at or after the first corrupted one). Every numeric file field
   is also tried with every special value (NaN, +-Infinity, 1e999, negative, huge, denormal,
   boolean, string...) in every row against the format's exact rule. ``main(argv)`` turns that
   into exit 2 and exactly ``bidkv-replay: error: <the same line>``, before any engine
   runs, and never creates ``--output-dir`` for a refused run. An accepted run is stopped
   right after the trace checks (``_check_arrivals`` is wrapped to raise ``_Accepted``), so
   no example replays a workload.
2. The policy configuration: ``BIDKV_UTILITY_*`` variables, ``additional_config["bidkv"]``
   and the reference BidKV's top-level keys. ``BidKVConfig.from_sources`` either accepts
   with the documented meaning (precedence env < reference keys < section; strict booleans;
   numbers in range) or raises ``ConfigError`` with one line naming a variable or key,
   never another exception; through the CLI the same line is printed and the exit is 2.
3. ``kvcached-provider limit`` / ``cleanup``: a bad ``--ipc``, SIZE, ``--timeout``,
   ``KVCACHED_PROVIDER_STATE_DIR`` / ``KVCACHED_PROVIDER_SHM_DIR`` or state file exits 2
   with one ``kvcached-provider: error:`` line naming it (argparse's own refusals exit 2
   naming the argument), no traceback, and leaves the state file as it was. Accepted
   commands stop before they would wait for an engine or read ``/proc``.

Every property counts what its examples exercised and asserts afterwards that each
corruption kind ran and that both outcomes occurred where both are possible (non-vacuity).
The last tests pin the defects these properties found (a key or variable name with a line
break split the message in two; an integer too long to print replaced a ConfigError with a
bare ValueError naming nothing).
Examples are deterministic (``tests/property_settings.py``: derandomized, no database).
The hand-picked cases live in test_replay_cli_errors.py, test_replay_trace.py,
test_replay_input_limits.py, test_config.py and test_kvcached_*.py.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import re
import tomllib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bidkv_ext.config import REFERENCE_KEYS, BidKVConfig, ConfigError
from bidkv_ext.replay import arms, cli
from bidkv_ext.replay.capacity import CapacityScheduleError, load_capacity_schedule
from bidkv_ext.replay.steptime import (
    MIN_STEP_SECONDS,
    StepTimeModelError,
    check_step_bound,
    load_step_model,
)
from bidkv_ext.replay.trace import TraceError, TraceRequest, load_trace
from bidkv_ext.strategies import STRATEGY_NAMES
from kvcached_provider import cli as kv_cli
from kvcached_provider import limit as kv_limit
from kvcached_provider import segments as kv_segments
from tests.property_settings import REAL_SCHEDULER

# The shared traces live beside the repository (benchmarks/replay/run.py's default).
TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


def _fuzz(examples: int) -> settings:
    """Deterministic settings (derandomized, no database, no deadline) with ``examples``."""
    return settings(REAL_SCHEDULER, max_examples=examples)


class _Accepted(Exception):
    """Raised where an accepted command would start real work; not caught by the CLIs."""


# --------------------------------------------------------------------------- shared checks


def _one_line(message: str) -> str:
    """The message is one non-empty line (no character str.splitlines() breaks on)."""
    assert message.strip(), "empty error message"
    assert len(message.splitlines()) == 1, f"multi-line message: {message!r}"
    assert "Traceback" not in message
    return message


def _names_file(message: str, path: Path) -> int | None:
    """The message starts with the file; returns the 1-based line it names, if any."""
    _one_line(message)
    prefix = str(path)
    assert message.startswith(prefix), f"message does not name {path}: {message!r}"
    found = re.match(r":(\d+): ", message[len(prefix):])
    if found is not None:
        return int(found.group(1))
    assert message[len(prefix):].startswith(": "), message
    return None


_BAD_UTF8 = [b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80", b"\xf8\x88\x80\x80",
             b"\xe2\x82"]
_BOM = b"\xef\xbb\xbf"
# Text that can be written to a UTF-8 file (no lone surrogates).
_FILE_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=24)
_SPACE = st.sampled_from(["", " ", "  ", "\t", "\u3000", "\u2003"])


def _padded(core: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.tuples(_SPACE, core, _SPACE).map("".join)


_JSON_NUMBERS = st.one_of(
    st.sampled_from(["-1", "0", "-0", "0.5", "600.0", "6e2", "NaN", "Infinity", "-Infinity",
                     "1e999", "-1e999", "1" + "0" * 400, "1" + "0" * 5000, "1e-320",
                     "9007199254740993", "1e300"]),
    st.integers(-(10**30), 10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(json.dumps),
)
_JSON_WRONG_TYPES = st.sampled_from(
    ['"600"', '"abc"', "true", "false", "null", "[600]", "{}", "[]", '"\\u0000"', '" 7 "'])
_JSON_VALUES: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**20), 10**20) | st.floats() | _FILE_TEXT,
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(_FILE_TEXT, inner, max_size=3),
    max_leaves=6,
)
_JSON_TOKENS = st.one_of(_JSON_NUMBERS, _JSON_WRONG_TYPES, _JSON_VALUES.map(json.dumps),
                         _FILE_TEXT)
_CELLS = st.one_of(
    _padded(st.sampled_from(["-1", "0", "-0", "+0", "+7", "12", "1.5", "1e3", "nan", "inf",
                             "-inf", "1e999", "1_000", "\u0663", "\u00b2", "0x10", "9" * 5000,
                             "1" + "0" * 30, "", "true", "null", "[1]"])),
    st.integers(-(10**20), 10**20).map(str),
    st.floats().map(repr),
    _FILE_TEXT,
)


def _breaks(text: str) -> bool:
    """Whether ``text`` holds a line break to a file read with universal newlines."""
    return "\r" in text or "\n" in text


def _cuts(seed: bytes) -> st.SearchStrategy[int]:
    """Where to truncate: anywhere, or (as often) just after a line break."""
    ends = [k + 1 for k, byte in enumerate(seed[:-1]) if byte == ord("\n")]
    return st.integers(0, len(seed) - 1) | st.sampled_from(ends or [0])


def _line_of(data: bytes, offset: int) -> int:
    """1-based line holding byte ``offset``."""
    return data[:offset].count(b"\n") + 1


# ------------------------------------------------------------------ 1a. trace corruptions

AZURE_LINES = cli.SAMPLE_TRACE.read_text(encoding="utf-8").splitlines()[:7]
AZURE_HEADER = AZURE_LINES[0].split(",")
AZURE_ROWS = [line.split(",") for line in AZURE_LINES[1:]]
# The real Mooncake trace's shape (a test below checks it against ../shared/traces), with
# prompts over one 512-token block so that a one-id hash list is always wrong, and strictly
# increasing timestamps so that any swap goes backwards.
MOONCAKE_ROWS: list[dict[str, Any]] = [
    {"timestamp": t, "input_length": n, "output_length": o,
     "hash_ids": list(range(k, k + -(-n // 512)))}
    for t, n, o, k in [(0, 600, 10, 0), (1203, 1100, 34, 2), (2405, 513, 7, 5),
                       (3600, 2048, 120, 7), (5000, 700, 3, 11)]
]
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
TRACE_KINDS = ("truncate", "bad_cell", "number", "wrong_type", "invalid_utf8", "bom", "empty",
               "extra_column", "missing_column", "unsorted", "garbage_line", "format")


@dataclass
class FileCase:
    """One corrupted input file: its bytes, suffix, and what is known of the outcome."""

    kind: str
    fmt: str
    content: bytes
    suffix: str
    first_bad: int | None = None  # lines before it are intact seed lines
    expect: str | None = None  # "accept", "refuse" or None (either, checked by invariants)
    exact_line: int | None = None  # the line a refusal must name
    needle: str | None = None  # text a refusal must contain
    same_as_seed: bool = False  # an acceptance must equal the seed's requests
    check: Callable[[Any], None] | None = None  # run on what an acceptance loaded


def _csv_bytes(rows: list[list[str]]) -> bytes:
    """CSV as a spreadsheet writes it. The writer quotes only the characters of its line
    terminator, so a cell holding a bare CR (a line break to the reader) gets CRLF lines."""
    terminator = "\r\n" if any("\r" in cell for row in rows for cell in row) else "\n"
    out = io.StringIO()
    csv.writer(out, lineterminator=terminator).writerows(rows)
    return out.getvalue().encode()


def _azure_text(header: list[str], rows: list[list[str]]) -> bytes:
    return _csv_bytes([header, *rows])


def _mooncake_line(row: Mapping[str, Any], raw: Mapping[str, str] | None = None) -> str:
    """One JSONL line; ``raw`` gives fields as literal JSON text (possibly not JSON)."""
    parts = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in row.items()]
    parts += [f"{json.dumps(k)}: {v}" for k, v in (raw or {}).items()]
    return "{" + ", ".join(parts) + "}"


def _mooncake_text(lines: list[str]) -> bytes:
    return "".join(f"{line}\n" for line in lines).encode()


def _seed(fmt: str) -> tuple[bytes, str]:
    if fmt == "azure":
        return _azure_text(AZURE_HEADER, AZURE_ROWS), ".csv"
    return _mooncake_text([_mooncake_line(r) for r in MOONCAKE_ROWS]), ".jsonl"


def _azure_case(kind: str, data: st.DataObject) -> FileCase:
    seed, _ = _seed("azure")
    rows = [list(r) for r in AZURE_ROWS]
    case = FileCase(kind, "azure", seed, ".csv")
    i = data.draw(st.integers(0, len(rows) - 1), label="row")
    if kind == "truncate":
        cut = data.draw(_cuts(seed), label="cut")
        case.content, case.first_bad = seed[:cut], _line_of(seed, cut)
    elif kind in ("bad_cell", "number", "wrong_type"):
        column = data.draw(st.integers(0, 2), label="column") if kind == "bad_cell" else \
            data.draw(st.integers(1, 2), label="column")
        valid = st.integers(1, 5000).map(str)
        cell = data.draw({"bad_cell": st.one_of(_CELLS, _FILE_TEXT, valid), "number": _CELLS,
                          "wrong_type": st.sampled_from(["true", "null", "[374]", "abc",
                                                         "1.0", "", "374 tokens", "0x1a"])
                          }[kind], label="cell")
        rows[i][column] = cell
        case.content, case.first_bad = _azure_text(AZURE_HEADER, rows), i + 2
        name = AZURE_HEADER[column]
        if column:
            digits = cell.strip().lstrip("+-")
            ok = (re.fullmatch(r"[+-]?[0-9]+", cell.strip()) is not None
                  and len(digits) <= 4300 and int(cell) >= 1)
            case.expect = "accept" if ok else "refuse"
            if not ok:
                case.needle = f"{name} must be an integer >= 1"
                if not _breaks(cell):
                    case.exact_line = i + 2
            else:
                value, position = int(cell), column - 1

                def check(reqs: tuple[TraceRequest, ...]) -> None:
                    r = reqs[i]
                    assert (r.input_length, r.output_length)[position] == value

                case.check = check
        else:
            case.needle = "TIMESTAMP"
    elif kind == "invalid_utf8":
        at = data.draw(st.integers(0, len(seed)), label="offset")
        bad = data.draw(st.sampled_from(_BAD_UTF8), label="bytes")
        case.content, case.expect, case.needle = seed[:at] + bad + seed[at:], "refuse", "UTF-8"
    elif kind == "bom":
        case.content, case.expect, case.same_as_seed = _BOM + seed, "accept", True
    elif kind == "empty":
        case.content = data.draw(st.sampled_from(
            [b"", b"\n", b"\n \n\n", (AZURE_LINES[0] + "\n").encode(),
             (AZURE_LINES[0] + "\n\n,,\n").encode()]), label="content")
        case.expect = "refuse"
    elif kind == "extra_column":
        if data.draw(st.booleans(), label="whole column"):
            name = data.draw(st.sampled_from(["extra", "Notes", "TIMESTAMP2", ""]), label="name")
            value = data.draw(_FILE_TEXT, label="value")
            case.content = _azure_text([*AZURE_HEADER, name], [[*r, value] for r in rows])
            case.expect, case.same_as_seed = "accept", True
        else:
            value = data.draw(_FILE_TEXT, label="value")
            rows[i].append(value)
            case.content, case.expect = _azure_text(AZURE_HEADER, rows), "refuse"
            case.first_bad = i + 2
            # The reader names a record's last physical line; a quoted line break adds one.
            case.exact_line = None if _breaks(value) else i + 2
            case.needle = "expected 3 columns, got 4"
    elif kind == "missing_column":
        column = data.draw(st.integers(0, 2), label="column")
        if data.draw(st.booleans(), label="whole column"):
            header = [h for j, h in enumerate(AZURE_HEADER) if j != column]
            case.content = _azure_text(header, [[c for j, c in enumerate(r) if j != column]
                                                for r in rows])
            case.expect, case.exact_line = "refuse", 1
            case.needle = f"missing {AZURE_HEADER[column]}"
        else:
            del rows[i][column]
            case.content, case.expect = _azure_text(AZURE_HEADER, rows), "refuse"
            case.first_bad = case.exact_line = i + 2
            case.needle = "expected 3 columns, got 2"
    elif kind == "unsorted":
        j = data.draw(st.integers(0, len(rows) - 1).filter(lambda j: j != i), label="other")
        a, b = sorted((i, j))
        rows[a], rows[b] = rows[b], rows[a]
        case.content, case.expect = _azure_text(AZURE_HEADER, rows), "refuse"
        case.first_bad, case.exact_line = a + 2, a + 3
        case.needle = "TIMESTAMP goes backwards"
    elif kind == "garbage_line":
        at = data.draw(st.integers(0, len(AZURE_LINES)), label="line")
        junk = data.draw(_FILE_TEXT, label="junk")
        lines = [*AZURE_LINES[:at], junk, *AZURE_LINES[at:]]
        case.content, case.first_bad = "".join(f"{x}\n" for x in lines).encode(), at + 1
    elif kind == "format":
        case.suffix = data.draw(st.sampled_from([".jsonl", ".json", "", ".CSV", ".txt"]),
                                label="suffix")
        if case.suffix in (".jsonl", ".json"):
            case.expect, case.exact_line, case.needle = "refuse", 1, "not valid JSON"
        else:
            case.expect, case.same_as_seed = "accept", True
    return case


def _mooncake_case(kind: str, data: st.DataObject) -> FileCase:
    seed, _ = _seed("mooncake")
    rows = [dict(r) for r in MOONCAKE_ROWS]
    lines = [_mooncake_line(r) for r in rows]
    case = FileCase(kind, "mooncake", seed, ".jsonl")
    i = data.draw(st.integers(0, len(rows) - 1), label="row")

    def with_raw(key: str, token: str) -> bytes:
        row = {k: v for k, v in rows[i].items() if k != key}
        return _mooncake_text([*lines[:i], _mooncake_line(row, {key: token}), *lines[i + 1:]])

    if kind == "truncate":
        cut = data.draw(_cuts(seed), label="cut")
        case.content, case.first_bad = seed[:cut], _line_of(seed, cut)
    elif kind in ("bad_cell", "number", "wrong_type"):
        keys = MOONCAKE_KEYS if kind != "number" else MOONCAKE_KEYS[:3]
        key = data.draw(st.sampled_from(keys), label="key")
        near = _padded(st.sampled_from([json.dumps(rows[i][key]), "12", "4000", "99999"]))
        token = data.draw({"bad_cell": _JSON_TOKENS | near, "number": _JSON_NUMBERS,
                           "wrong_type": _JSON_WRONG_TYPES}[kind], label="token")
        case.content, case.first_bad = with_raw(key, token), i + 1
        always_bad = {"NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" + "0" * 5000}
        if kind == "wrong_type" or token in always_bad or (key != "timestamp" and token in
                                                            {"0", "-0", "-1", "0.5"}):
            case.expect = "refuse"
            if not _breaks(token):
                case.exact_line = i + 1
    elif kind == "invalid_utf8":
        at = data.draw(st.integers(0, len(seed)), label="offset")
        bad = data.draw(st.sampled_from(_BAD_UTF8), label="bytes")
        case.content, case.expect, case.needle = seed[:at] + bad + seed[at:], "refuse", "UTF-8"
    elif kind == "bom":
        case.content, case.expect, case.same_as_seed = _BOM + seed, "accept", True
    elif kind == "empty":
        case.content = data.draw(st.sampled_from([b"", b"\n", b"  \n\n\t\n"]), label="content")
        case.expect, case.needle = "refuse", "no requests"
    elif kind == "extra_column":
        key = data.draw(_FILE_TEXT.filter(lambda k: k not in MOONCAKE_KEYS), label="key")
        rows[i][key] = data.draw(_JSON_VALUES, label="value")
        case.content = _mooncake_text([_mooncake_line(r) for r in rows])
        case.expect, case.same_as_seed = "accept", True
    elif kind == "missing_column":
        key = data.draw(st.sampled_from(MOONCAKE_KEYS), label="key")
        del rows[i][key]
        case.content = _mooncake_text([_mooncake_line(r) for r in rows])
        case.expect, case.needle = "refuse", key
        case.first_bad = case.exact_line = i + 1
    elif kind == "unsorted":
        j = data.draw(st.integers(0, len(rows) - 1).filter(lambda j: j != i), label="other")
        a, b = sorted((i, j))
        lines[a], lines[b] = lines[b], lines[a]
        case.content, case.expect = _mooncake_text(lines), "refuse"
        case.first_bad, case.exact_line = a + 1, a + 2
        case.needle = "timestamp goes backwards"
    elif kind == "garbage_line":
        at = data.draw(st.integers(0, len(lines)), label="line")
        junk = data.draw(_FILE_TEXT, label="junk")
        case.content, case.first_bad = _mooncake_text([*lines[:at], junk, *lines[at:]]), at + 1
        if junk.strip() and not _breaks(junk):
            case.expect, case.exact_line = "refuse", at + 1
    elif kind == "format":
        case.suffix = data.draw(st.sampled_from([".csv", "", ".json", ".JSONL", ".txt"]),
                                label="suffix")
        if case.suffix == ".csv":
            case.expect, case.exact_line, case.needle = "refuse", 1, "header must contain"
        else:
            case.expect, case.same_as_seed = "accept", True
    return case


def _trace_case(data: st.DataObject) -> FileCase:
    fmt = data.draw(st.sampled_from(("azure", "mooncake")), label="format")
    kind = data.draw(st.sampled_from(TRACE_KINDS), label="kind")
    return (_azure_case if fmt == "azure" else _mooncake_case)(kind, data)


def _rows(requests: tuple[TraceRequest, ...]) -> list[tuple[object, ...]]:
    return [(r.arrival, r.input_length, r.output_length, r.hash_ids) for r in requests]


def _check_requests(requests: tuple[TraceRequest, ...], fmt: str) -> None:
    """What any accepted trace must hold: the invariants the replay relies on."""
    assert isinstance(requests, tuple) and requests
    assert requests[0].arrival == 0.0
    previous = 0.0
    for r in requests:
        assert math.isfinite(r.arrival) and r.arrival >= previous
        previous = r.arrival
        for n in (r.input_length, r.output_length):
            assert type(n) is int and n >= 1
        if fmt == "mooncake":
            assert r.hash_ids is not None and len(r.hash_ids) == -(-r.input_length // 512)
            assert all(type(h) is int and h >= 0 for h in r.hash_ids)
        else:
            assert r.hash_ids is None


def _judge_trace(case: FileCase, path: Path) -> tuple[str, str | None]:
    """Load ``path`` as the CLI does; check the outcome; return it and the error text."""
    try:
        requests = load_trace(path, "auto")
    except TraceError as exc:
        message = str(exc)
        line = _names_file(message, path)
        assert case.expect != "accept", f"{case.kind}: refused {message!r}"
        if line is not None and case.first_bad is not None:
            assert line >= case.first_bad, (message, case.first_bad)
        if case.exact_line is not None:
            assert line == case.exact_line, (message, case.exact_line)
        if case.needle is not None:
            assert case.needle in message, (message, case.needle)
        return "refused", message
    assert case.expect != "refuse", f"{case.kind} accepted: {case.content[:300]!r}"
    _check_requests(requests, case.fmt)
    if case.same_as_seed:
        seed, suffix = _seed(case.fmt)
        seed_path = path.with_name(f"seed-{case.fmt}{suffix}")
        seed_path.write_bytes(seed)
        assert _rows(requests) == _rows(load_trace(seed_path))
    if case.check is not None:
        case.check(requests)
    return "accepted", None


class _Files:
    """Fresh file names in one directory, one per example."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.count = directory, 0

    def write(self, content: bytes, suffix: str, stem: str = "f") -> Path:
        self.count += 1
        path = self.directory / f"{stem}{self.count}{suffix}"
        path.write_bytes(content)
        return path


def test_trace_corruptions_are_refused_in_one_line_or_accepted_intact(tmp_path: Path) -> None:
    """Every drawn corruption of a small Azure CSV / Mooncake JSONL trace either loads into
    requests that keep the replay's invariants (and equal the seed's where the corruption
    cannot change them: a BOM, an extra column or key, a sniffed suffix) or raises
    TraceError with one line naming the file and a line no earlier than the first
    corrupted one; a cell the format defines (ASCII digits) is read as written."""
    files = _Files(tmp_path)
    seen: Counter[tuple[str, str, str]] = Counter()

    @_fuzz(600)
    @given(st.data())
    def prop(data: st.DataObject) -> None:
        case = _trace_case(data)
        outcome, _ = _judge_trace(case, files.write(case.content, case.suffix))
        seen[(case.fmt, case.kind, outcome)] += 1

    prop()
    for fmt in ("azure", "mooncake"):
        for kind in TRACE_KINDS:
            assert seen[(fmt, kind, "accepted")] + seen[(fmt, kind, "refused")], (fmt, kind)
        for kind in ("truncate", "bad_cell", "garbage_line", "format"):
            assert seen[(fmt, kind, "accepted")] and seen[(fmt, kind, "refused")], (fmt, kind)
    for kind in ("number", "extra_column", "missing_column", "unsorted", "invalid_utf8"):
        assert seen[("azure", kind, "refused")], kind
    assert seen[("azure", "number", "accepted")]


def test_seed_traces_have_the_shape_of_the_real_traces(tmp_path: Path) -> None:
    """The seeds stand for the real files: the bundled sample's first rows (Azure) and
    Mooncake rows with the real trace's keys; the head of each shared trace loads and
    keeps the invariants the properties check."""
    assert AZURE_HEADER == ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
    if not TRACES.is_dir():
        pytest.skip(f"{TRACES} is not present")
    with (TRACES / "mooncake_fast25_conversation.jsonl").open(encoding="utf-8") as handle:
        first = json.loads(handle.readline())
    assert tuple(first) == MOONCAKE_KEYS
    for name, fmt in [("azure_llm_2023_conv.csv", "azure"), ("azure_llm_2023_code.csv", "azure"),
                      ("mooncake_fast25_conversation.jsonl", "mooncake")]:
        with (TRACES / name).open("rb") as handle:
            head = b"".join(handle.readline() for _ in range(50))
        if fmt == "azure":
            assert head.decode().splitlines()[0].split(",") == AZURE_HEADER
        copy = tmp_path / name
        copy.write_bytes(head)
        requests = load_trace(copy)
        assert len(requests) == 50 - (fmt == "azure")
        _check_requests(requests, fmt)


# ------------------------------------------------------------ 1b. capacity-schedule files

SCHEDULE = [(0.5, 300), (2.0, 120), (3.25, 399)]
USABLE = 399  # --num-gpu-blocks 400
SCHEDULE_KINDS = ("truncate", "bad_value", "missing_key", "extra_key", "unsorted",
                  "invalid_utf8", "bom", "empty", "container", "format")


def _schedule_json(entries: list[str]) -> bytes:
    return ("[" + ", ".join(entries) + "]").encode()


def _entry(t: object, blocks: object, extra: str = "") -> str:
    return "{" + f'"t": {t}, "blocks": {blocks}{extra}' + "}"


def _schedule_csv(rows: list[list[str]], header: str = "t,blocks") -> bytes:
    return (header + "\n" + "".join(",".join(r) + "\n" for r in rows)).encode()


def _schedule_case(data: st.DataObject) -> FileCase:
    fmt = data.draw(st.sampled_from(("json", "csv")), label="format")
    kind = data.draw(st.sampled_from(SCHEDULE_KINDS), label="kind")
    entries = [_entry(json.dumps(t), b) for t, b in SCHEDULE]
    rows = [[repr(t), str(b)] for t, b in SCHEDULE]
    seed = _schedule_json(entries) if fmt == "json" else _schedule_csv(rows)
    case = FileCase(kind, fmt, seed, f".{fmt}")
    i = data.draw(st.integers(0, len(SCHEDULE) - 1), label="entry")
    field_index = data.draw(st.integers(0, 1), label="field")
    if kind == "truncate":
        case.content = seed[: data.draw(_cuts(seed), label="cut")]
    elif kind == "bad_value":
        token = data.draw(_JSON_TOKENS if fmt == "json" else _CELLS, label="token")
        if fmt == "json":
            t, b = SCHEDULE[i]
            entries[i] = _entry(token, b) if field_index == 0 else _entry(json.dumps(t), token)
            case.content = _schedule_json(entries)
            case.check = _json_schedule_oracle(i, field_index, token, case)
        else:
            rows[i][field_index] = token
            case.content = _csv_bytes([["t", "blocks"], *rows])
    elif kind == "missing_key":
        if fmt == "json":
            t, b = SCHEDULE[i]
            entries[i] = '{"blocks": ' + str(b) + "}" if field_index == 0 else \
                '{"t": ' + json.dumps(t) + "}"
            case.content, case.needle = _schedule_json(entries), f"entry {i + 1}: "
        else:
            del rows[i][field_index]
            case.content, case.needle = _schedule_csv(rows), f"entry {i + 1}: "
        case.expect = "refuse"
    elif kind == "extra_key":
        key = data.draw(_FILE_TEXT.filter(lambda k: k not in ("t", "blocks")), label="key")
        if fmt == "json":
            t, b = SCHEDULE[i]
            entries[i] = _entry(json.dumps(t), b, f", {json.dumps(key)}: 1")
            case.content, case.needle = _schedule_json(entries), f"entry {i + 1}: "
        elif data.draw(st.booleans(), label="in header"):
            case.content = _schedule_csv([[*r, "1"] for r in rows], header="t,blocks,extra")
        else:
            rows[i].append("1")
            case.content, case.needle = _schedule_csv(rows), "more fields than the header"
        case.expect = "refuse"
    elif kind == "unsorted":
        j = data.draw(st.integers(0, len(SCHEDULE) - 1).filter(lambda j: j != i), label="other")
        a, b = sorted((i, j))
        if fmt == "json":
            entries[a], entries[b] = entries[b], entries[a]
            case.content = _schedule_json(entries)
        else:
            rows[a], rows[b] = rows[b], rows[a]
            case.content = _schedule_csv(rows)
        case.expect, case.needle = "refuse", f"entry {a + 2}: t must be greater"
    elif kind == "invalid_utf8":
        at = data.draw(st.integers(0, len(seed)), label="offset")
        bad = data.draw(st.sampled_from(_BAD_UTF8), label="bytes")
        case.content, case.expect = seed[:at] + bad + seed[at:], "refuse"
        case.needle = "cannot read the capacity schedule"
    elif kind == "bom":
        case.content, case.expect, case.same_as_seed = _BOM + seed, "accept", True
    elif kind == "empty":
        choices = [b"", b"  \n", b"[]", b"null", b"{}"] if fmt == "json" else \
            [b"", b"\n", b"t,blocks\n", b"t,blocks\n\n"]
        case.content = data.draw(st.sampled_from(choices), label="content")
        case.expect = "refuse"
    elif kind == "container":
        if fmt == "json":
            case.content = data.draw(st.sampled_from(
                [b'{"t": 1, "blocks": 2}', b"7", b'"t,blocks"', b"[[1, 2]]", b"[null]",
                 b'[{"t": 1, "blocks": 2}, 5]']), label="content")
            case.expect = "refuse"
        else:
            header = data.draw(st.sampled_from(
                ["blocks,t", " t , blocks ", "T,blocks", "t;blocks", "time,blocks", "t"]),
                label="header")
            if header in ("blocks,t", " t , blocks "):
                ordered = [list(reversed(r)) for r in rows] if header == "blocks,t" else rows
                case.content = _schedule_csv(ordered, header=header)
                case.expect, case.same_as_seed = "accept", True
            else:
                case.content, case.expect = _schedule_csv(rows, header=header), "refuse"
                case.needle = "expected a CSV header 't,blocks'"
    elif kind == "format":
        case.suffix = data.draw(st.sampled_from(
            [".csv", ".json", "", ".CSV", ".txt"]), label="suffix")
        reads_csv = case.suffix.lower() == ".csv"
        case.expect = "accept" if reads_csv == (fmt == "csv") else "refuse"
        case.same_as_seed = case.expect == "accept"
    return case


def _json_schedule_oracle(i: int, field_index: int, token: str, case: FileCase
                          ) -> Callable[[Any], None]:
    """JSON schedules are strict: ``t`` a JSON number from 0 to the clock's bound (strictly
    increasing), ``blocks`` a JSON integer in 1..usable; the accepted value is the one
    written."""
    try:
        value = json.loads(token)
    except (ValueError, RecursionError):
        return lambda schedule: None  # not JSON alone; within the file it may still be
    number = _finite(value) and isinstance(value, int | float) and not isinstance(value, bool)
    if field_index == 0:
        ok = number and 0 <= value <= cli.MAX_SIMULATED_SECONDS and (
            i == 0 or value > SCHEDULE[i - 1][0]) and (
            i == len(SCHEDULE) - 1 or value < SCHEDULE[i + 1][0])
    else:
        ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= USABLE
    case.expect = "accept" if ok else "refuse"

    def check(schedule: Any) -> None:
        point = schedule.points[i]
        assert (point.t, point.blocks)[field_index] == value

    return check


def _judge_schedule(case: FileCase, path: Path) -> tuple[str, str | None]:
    try:
        schedule = load_capacity_schedule(path, USABLE)
    except CapacityScheduleError as exc:
        message = str(exc)
        _names_file(message, path)
        assert case.expect != "accept", f"{case.kind}: refused {message!r}"
        if case.needle is not None:
            assert case.needle in message, (message, case.needle)
        return "refused", message
    assert case.expect != "refuse", f"{case.kind} accepted: {case.content[:300]!r}"
    times = [p.t for p in schedule.points]
    assert schedule.points and times == sorted(set(times))
    for p in schedule.points:
        assert math.isfinite(p.t) and p.t >= 0 and type(p.blocks) is int
        assert 1 <= p.blocks <= USABLE
    if case.same_as_seed:
        assert [(p.t, p.blocks) for p in schedule.points] == SCHEDULE
    if case.check is not None:
        case.check(schedule)
    return "accepted", None


def test_capacity_schedule_corruptions_are_refused_in_one_line(tmp_path: Path) -> None:
    """Every drawn corruption of a JSON or CSV capacity schedule either gives a valid,
    strictly increasing schedule within the pool (the seed's own points where nothing
    changed their meaning; a JSON value exactly as written) or CapacityScheduleError with
    one line that starts with the file."""
    files = _Files(tmp_path)
    seen: Counter[tuple[str, str, str]] = Counter()

    @_fuzz(400)
    @given(st.data())
    def prop(data: st.DataObject) -> None:
        case = _schedule_case(data)
        outcome, _ = _judge_schedule(case, files.write(case.content, case.suffix))
        seen[(case.fmt, case.kind, outcome)] += 1

    prop()
    for fmt in ("json", "csv"):
        for kind in SCHEDULE_KINDS:
            assert seen[(fmt, kind, "accepted")] + seen[(fmt, kind, "refused")], (fmt, kind)
        # A cut JSON list never parses; a CSV cut after a row is a shorter schedule.
        for kind in ("bad_value", "format", *(("truncate",) if fmt == "csv" else ())):
            assert seen[(fmt, kind, "accepted")] and seen[(fmt, kind, "refused")], (fmt, kind)


# -------------------------------------------------------------------- 1c. step-model files

STEP_SEED: dict[str, Any] = {"name": "fit", "a": 6.5e-3, "b": 3.25e-5, "c": 2.8e-4,
                             "d": 3.9e-8, "source": "fit of run 7"}
STEP_KINDS = ("truncate", "bad_value", "number", "missing_key", "extra_key", "invalid_utf8",
              "bom", "empty", "container", "huge", "spec")
# The CLI's defaults: --max-num-batched-tokens 8192, --max-num-seqs 256, --max-model-len 32768.
STEP_BOUND = {"prefill_tokens": 8192, "decode_requests": 256, "decode_context": 256 * 32768}


def _step_text(fmt: str, items: Mapping[str, str]) -> bytes:
    """``items`` maps keys to literal value text in the file's own syntax."""
    if fmt == "json":
        return ("{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in items.items()) + "}"
                ).encode()
    return "".join(f"{json.dumps(k, ensure_ascii=False)} = {v}\n"
                   for k, v in items.items()).encode()


def _step_literal(value: object) -> str:
    return json.dumps(value) if not isinstance(value, float) else repr(value)


_TOML_TOKENS = st.one_of(
    st.sampled_from(["nan", "inf", "-inf", "-1", "0", "1e400", "true", '"0.5"', "[1]", "{}",
                     "1979-05-27", "0x10", "1_000", "+0.5", "1e-300", "1e300", '""']),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    _FILE_TEXT,
)


def _step_case(data: st.DataObject, workdir: Path) -> tuple[FileCase, str | None]:
    """A corrupted step-model file (or, for ``spec``, a --step-model name)."""
    fmt = data.draw(st.sampled_from(("json", "toml")), label="format")
    kind = data.draw(st.sampled_from(STEP_KINDS), label="kind")
    items = {k: _step_literal(v) for k, v in STEP_SEED.items()}
    seed = _step_text(fmt, items)
    case = FileCase(kind, fmt, seed, f".{fmt}")
    key = data.draw(st.sampled_from(list(STEP_SEED)), label="key")
    spec = None
    if kind == "truncate":
        case.content = seed[: data.draw(_cuts(seed), label="cut")]
    elif kind == "bad_value":
        items[key] = data.draw(_JSON_TOKENS if fmt == "json" else _TOML_TOKENS, label="token")
        case.content = _step_text(fmt, items)
    elif kind == "missing_key":
        del items[key]
        case.content = _step_text(fmt, items)
        case.expect = "accept" if key == "source" else "refuse"
        case.needle = None if key == "source" else f": {key}: Field required"
    elif kind == "extra_key":
        extra = data.draw(_FILE_TEXT.filter(lambda k: k not in STEP_SEED), label="key")
        case.content = _step_text(fmt, {**items, extra: "1"})
        case.expect = "refuse"
    elif kind == "invalid_utf8":
        at = data.draw(st.integers(0, len(seed)), label="offset")
        bad = data.draw(st.sampled_from(_BAD_UTF8), label="bytes")
        case.content = seed[:at] + bad + seed[at:]
        # json.loads(bytes) decodes with "surrogatepass": an encoded lone surrogate inside
        # a string is read as one, and ``source`` (no constraint) keeps it. Known, harmless
        # (report.json escapes it); every other invalid byte sequence is refused.
        case.expect = None if (fmt, bad) == ("json", b"\xed\xa0\x80") else "refuse"
    elif kind == "bom":
        case.content = _BOM + seed
    elif kind == "empty":
        case.content = data.draw(st.sampled_from([b"", b"\n", b"{}", b"  "]), label="content")
        case.expect = "refuse"
    elif kind == "container":
        case.content = data.draw(st.sampled_from(
            [b"[]", b"7", b'"fit"', b"null", b'[{"name": "fit"}]', b"a = [1, 2]\n"]),
            label="content")
        case.expect = "refuse"
    elif kind == "number":
        coefficient = data.draw(st.sampled_from("abcd"), label="coefficient")
        token = data.draw(_JSON_NUMBERS if fmt == "json" else _TOML_TOKENS, label="token")
        items[coefficient] = token
        case.content = _step_text(fmt, items)
        case.check = _step_number_oracle(fmt, coefficient, token, case)
    elif kind == "huge":
        coefficient = data.draw(st.sampled_from("abcd"), label="coefficient")
        items[coefficient] = data.draw(st.sampled_from(
            ["1e300", "1e-300", "1e6", "1e10", "100.0", "1" + "0" * 400, "1e308"]), label="value")
        case.content = _step_text(fmt, items)
    elif kind == "spec":
        spec = data.draw(st.one_of(
            st.sampled_from(["llama-3.1-8b-H100", "llama", "", ".", "missing.json", "present.toml",
                             "llama-3.1-8b-h100 "]),
            st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00/"),
                    max_size=12)), label="spec")
        (workdir / "present.toml").write_text("not = [toml\n")
        case.expect = "accept" if spec == "llama-3.1-8b-h100" else "refuse"
    return case, spec


def _step_number_oracle(fmt: str, coefficient: str, token: str, case: FileCase
                        ) -> Callable[[Any], None] | None:
    """A coefficient is a finite number >= 0 (``a``, the fixed cost of a step, >= 1e-6) that
    keeps the longest step within the simulated clock's bound; accepted, it is the number
    written."""
    try:
        value = json.loads(token) if fmt == "json" else tomllib.loads(f"x = {token}")["x"]
    except (ValueError, RecursionError):
        return None  # not a value alone (TOML junk): either outcome, checked by invariants
    if not isinstance(value, int | float) or isinstance(value, bool):
        case.expect = "refuse"  # strict: true, "0.5", null are no numbers
        return None
    ok = _finite(value) and (value >= MIN_STEP_SECONDS if coefficient == "a" else value >= 0)
    if ok:
        seed = {k: float(v) for k, v in STEP_SEED.items() if k in "abcd"}
        seed[coefficient] = float(value)
        worst = seed["a"] + seed["b"] * STEP_BOUND["prefill_tokens"] + seed["c"] * \
            STEP_BOUND["decode_requests"] + seed["d"] * STEP_BOUND["decode_context"]
        ok = worst <= cli.MAX_SIMULATED_SECONDS
    case.expect = "accept" if ok else "refuse"

    def check(model: Any) -> None:
        assert getattr(model, coefficient) == value

    return check


def _load_step(spec: str) -> Any:
    """What the CLI does with ``--step-model``: load, then bound the longest step."""
    model = load_step_model(spec)
    check_step_bound(model, spec, cli.MAX_SIMULATED_SECONDS, **STEP_BOUND)
    return model


def _judge_step(case: FileCase, spec: str) -> tuple[str, str | None]:
    try:
        model = _load_step(spec)
    except StepTimeModelError as exc:
        message = _one_line(str(exc))
        assert case.expect != "accept", f"{case.kind}: refused {message!r}"
        assert spec in message or repr(spec) in message, (message, spec)
        if case.needle is not None:
            assert case.needle in message, (message, case.needle)
        return "refused", message
    assert case.expect != "refuse", f"{case.kind} accepted: {case.content[:300]!r}"
    for coefficient in (model.a, model.b, model.c, model.d):
        assert type(coefficient) is float and math.isfinite(coefficient) and coefficient >= 0
    assert isinstance(model.name, str) and model.name
    if case.check is not None:
        case.check(model)
    return "accepted", None


def test_step_model_corruptions_are_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A corrupted --step-model JSON/TOML file, or a name that is neither a preset nor a
    readable file, either gives finite coefficients >= 0 whose longest step the simulated
    clock can hold, or StepTimeModelError with one line naming the file or name (and the
    key for a missing one)."""
    monkeypatch.chdir(tmp_path)  # a drawn relative name must not find a repository file
    files = _Files(tmp_path)
    seen: Counter[tuple[str, str, str]] = Counter()

    @_fuzz(300)
    @given(st.data())
    def prop(data: st.DataObject) -> None:
        case, spec = _step_case(data, tmp_path)
        if spec is None:
            spec = str(files.write(case.content, case.suffix))
        outcome, _ = _judge_step(case, spec)
        seen[(case.fmt, case.kind, outcome)] += 1

    prop()
    for kind in STEP_KINDS:
        assert sum(seen[(f, kind, o)] for f in ("json", "toml")
                   for o in ("accepted", "refused")), kind
    for kind in ("bad_value", "number", "huge", "bom"):
        assert sum(seen[(f, kind, "accepted")] for f in ("json", "toml")), kind
        assert sum(seen[(f, kind, "refused")] for f in ("json", "toml")), kind


# ------------------------------------------ 1d. special numbers in every numeric file field

SPECIAL_JSON = ["-1", "0", "-0", "0.5", "7", "7.0", "1024", "1024.0", "NaN", "Infinity",
                "-Infinity", "1e999", "-1e999", "1" + "0" * 400, "-1" + "0" * 400,
                "1" + "0" * 5000, "1e308", "1e-320", "true", "null", '"7"']
SPECIAL_CELLS = ["-1", "0", "-0", "+7", " 7 ", "7.0", "nan", "inf", "-inf", "1e999",
                 "1" + "0" * 400, "9" * 5000, "\u0663", "\u00b2", "", "0x10", "1_000", "true"]
NUMBER_FIELDS = [("mooncake", "timestamp"), ("mooncake", "input_length"),
                 ("mooncake", "output_length"), ("azure", "ContextTokens"),
                 ("azure", "GeneratedTokens"), ("schedule", "t"), ("schedule", "blocks"),
                 ("step", "a"), ("step", "b"), ("step", "c"), ("step", "d")]


def _special_case(surface: str, name: str, token: str, row: int) -> FileCase:
    """``token`` as field ``name`` of row ``row`` (0-based; wrapped to the seed's size),
    with the exact verdict the format documents."""
    if surface == "azure":
        case = FileCase("special", "azure", b"", ".csv")
        rows = [list(r) for r in AZURE_ROWS]
        row %= len(rows)
        column = AZURE_HEADER.index(name)
        rows[row][column] = token
        case.content = _azure_text(AZURE_HEADER, rows)
        ok = re.fullmatch(r"[+-]?[0-9]+", token.strip()) is not None and \
            len(token.strip().lstrip("+-")) <= 4300 and int(token) >= 1
        case.expect, case.exact_line = ("accept", None) if ok else ("refuse", row + 2)
        case.needle = None if ok else f"{name} must be an integer >= 1"
        if ok:
            def check(reqs: tuple[TraceRequest, ...]) -> None:
                r = reqs[row]
                assert (r.input_length, r.output_length)[column - 1] == int(token)

            case.check = check
        return case
    if surface == "schedule":
        row %= len(SCHEDULE)
        entries = [_entry(json.dumps(t), b) for t, b in SCHEDULE]
        t, b = SCHEDULE[row]
        entries[row] = _entry(token, b) if name == "t" else _entry(json.dumps(t), token)
        case = FileCase("special", "json", _schedule_json(entries), ".json")
        case.check = _json_schedule_oracle(row, ("t", "blocks").index(name), token, case)
        if case.expect is None:  # not JSON at all (an over-long integer)
            case.expect = "refuse"
        return case
    if surface == "step":
        items = {k: _step_literal(v) for k, v in STEP_SEED.items()}
        items[name] = token
        case = FileCase("special", "json", _step_text("json", items), ".json")
        case.check = _step_number_oracle("json", name, token, case)
        if case.expect is None:
            case.expect = "refuse"
        return case
    rows = [dict(r) for r in MOONCAKE_ROWS]
    row %= len(rows)
    try:
        value = json.loads(token)
    except ValueError:
        value = None
    if name == "input_length" and type(value) is int and 1 <= value <= 10**6:
        rows[row]["hash_ids"] = list(range(-(-value // 512)))  # a length, not a hash fault
    lines = [_mooncake_line(r) for r in rows]
    lines[row] = _mooncake_line({k: v for k, v in rows[row].items() if k != name},
                                {name: token})
    case = FileCase("special", "mooncake", _mooncake_text(lines), ".jsonl")
    number = isinstance(value, int | float) and not isinstance(value, bool) and _finite(value)
    if name == "timestamp":
        before = rows[row - 1]["timestamp"] if row else -math.inf
        after = rows[row + 1]["timestamp"] if row + 1 < len(rows) else math.inf
        ok = number and value >= 0 and before <= value <= after
        line = row + 1 if not number or value < 0 or value < before else row + 2
    else:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1 and (
            name == "output_length" or -(-value // 512) == len(rows[row]["hash_ids"]))
        line = row + 1
    case.expect, case.exact_line = ("accept", None) if ok else ("refuse", line)
    if ok:
        def check_value(reqs: tuple[TraceRequest, ...]) -> None:
            r = reqs[row]
            if name == "timestamp":  # arrivals are seconds from the first row's stamp
                first = value if row == 0 else rows[0]["timestamp"]
                # Denormal stamps (1e-320) lose digits in the division; absolute slack.
                assert math.isclose(r.arrival * 1000 + first, value, abs_tol=1e-300), (r, value)
            else:
                assert getattr(r, name) == value, (r, value)

        case.check = check_value
    return case


@pytest.mark.parametrize(("surface", "name"), NUMBER_FIELDS)
def test_special_numbers_in_every_numeric_field_get_their_documented_verdict(
    tmp_path: Path, surface: str, name: str
) -> None:
    """Each numeric field of each input file (Mooncake timestamp and lengths, Azure token
    counts, schedule t and blocks, step coefficients) holding a special value (negative,
    zero, NaN, +-Infinity, 1e999, integers beyond a float or int()'s digit limit, a
    denormal, booleans, null, numeric strings, unicode digits) in any row gets exactly the
    documented verdict: accepted as the number written, or refused in one line naming the
    file (and, for a trace row, the line the format puts the fault on). The space is small
    enough for the examples to cover every (value, row) pair."""
    files = _Files(tmp_path)
    seen: Counter[str] = Counter()
    tokens: Counter[str] = Counter()
    values = SPECIAL_CELLS if surface == "azure" else SPECIAL_JSON

    @_fuzz(len(values) * 5 + 20)
    @given(st.sampled_from(values), st.integers(0, 4))
    def prop(token: str, row: int) -> None:
        case = _special_case(surface, name, token, row)
        path = files.write(case.content, case.suffix)
        if surface in ("mooncake", "azure"):
            outcome, _ = _judge_trace(case, path)
        elif surface == "schedule":
            outcome, _ = _judge_schedule(case, path)
        else:
            outcome, _ = _judge_step(case, str(path))
        seen[outcome] += 1
        tokens[token] += 1

    prop()
    assert seen["accepted"] and seen["refused"], seen
    assert set(tokens) == set(values), set(values) - set(tokens)


# ----------------------------------------------------------- 1e. the CLI: numbers, parity

NUMERIC_FLAGS = {
    "--start": "float", "--duration": "float", "--rate-scale": "float",
    "--max-requests": "int", "--num-gpu-blocks": "int", "--block-size": "int",
    "--max-num-seqs": "int", "--max-num-batched-tokens": "int", "--max-model-len": "int",
    "--blocks-per-page": "int", "--seed": "int",
}
_NUMBER_TEXT = st.one_of(
    _padded(st.sampled_from(["0", "-1", "1", "-0", "nan", "NaN", "inf", "-inf", "1e999",
                             "1e-320", "1e10", "1e300", "0.5", "abc", "", "\u0663", "1_0",
                             "9" * 30, "10000001", "2", "0x10"])),
    st.integers(-(10**20), 10**20).map(str),
    st.floats().map(repr),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
            max_size=8),
)


@dataclass
class _Run:
    """One in-process ``main(argv)``: how it ended and what it printed on stderr."""

    outcome: str  # "accepted", "refused" (exit 2 from main) or "usage" (argparse exit)
    code: int | None
    err: str
    lines: list[str] = field(default_factory=list)


@contextlib.contextmanager
def _stop_after_cheap_checks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Accepted runs end where the engine would start: after the trace checks."""
    original = cli._check_arrivals

    def stop(*args: Any) -> None:
        original(*args)
        raise _Accepted

    monkeypatch.setattr(cli, "_check_arrivals", stop)
    for name in list(os.environ):
        if name.startswith("BIDKV_UTILITY_"):
            monkeypatch.delenv(name)
    yield


def _main(entry: Callable[[list[str]], int], argv: list[str]) -> _Run:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code: int | None = entry(argv)
        except _Accepted:
            return _Run("accepted", None, err.getvalue())
        except SystemExit as exc:
            assert exc.code == 2, exc.code
            text = err.getvalue()
            assert "Traceback" not in text
            return _Run("usage", 2, text, text.splitlines())
    text = err.getvalue()
    assert code == 2, (code, text, out.getvalue())
    assert "Traceback" not in text
    return _Run("refused", code, text, text.splitlines())


def _replay(argv: list[str], out: Path) -> _Run:
    run = _main(cli.main, [*argv, "--output-dir", str(out), "--no-plots", "--no-progress"])
    if run.outcome == "refused":
        assert len(run.lines) == 1 and run.err.endswith("\n"), run.err
        assert run.lines[0].startswith("bidkv-replay: error: "), run.err
        _one_line(run.lines[0])
    elif run.outcome == "usage":  # argparse's refusals: one line too, no usage block
        assert len(run.lines) == 1 and run.lines[0].startswith("bidkv-replay: error: "), run.err
    assert not out.exists(), f"{out} created by a run that did not finish"
    return run


def test_numeric_flags_are_refused_before_any_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One numeric flag at a drawn value (negative, NaN, inf, huge, not a number, unicode
    digits): argparse's own refusal names the flag; a value it parses is either accepted or
    refused by main with exit 2 and one line naming the flag (also where the check is on a
    combination: a scheduler limit that makes the longest step too long, a window that keeps
    no request). No output directory appears."""
    trace = tmp_path / "t.csv"
    trace.write_bytes(_seed("azure")[0])
    seen: Counter[tuple[str, str]] = Counter()

    @_fuzz(200)
    @given(st.sampled_from(sorted(NUMERIC_FLAGS)), _NUMBER_TEXT)
    def prop(flag: str, value: str) -> None:
        run = _replay(["--trace", str(trace), "--policies", "builtin", f"{flag}={value}"],
                      tmp_path / "out")
        seen[(NUMERIC_FLAGS[flag], run.outcome)] += 1
        if run.outcome == "usage":
            assert f"argument {flag}: invalid" in run.lines[-1], run.err
            with pytest.raises(ValueError):
                {"int": int, "float": float}[NUMERIC_FLAGS[flag]](value)
        elif run.outcome == "refused":
            # Every refusal names the flag, the two that check a combination of flags
            # included: the longest step (the scheduler limits times the step model) and
            # an empty window (the window and length filters).
            assert flag in run.lines[0], run.lines[0]

    with _stop_after_cheap_checks(monkeypatch):
        prop()
    for kind in ("int", "float"):
        for outcome in ("accepted", "refused", "usage"):
            assert seen[(kind, outcome)], (kind, outcome, seen)


def test_cli_refuses_corrupt_files_with_the_parsers_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through main(argv): a corrupted trace, capacity schedule or step-model file is
    refused with exit 2 and exactly ``bidkv-replay: error: `` plus the line its parser
    raises (and accepted when its parser accepts it), before any engine runs and without
    creating --output-dir."""
    files = _Files(tmp_path)
    seen: Counter[tuple[str, str]] = Counter()
    trace = files.write(_seed("mooncake")[0], ".jsonl", "trace")

    @_fuzz(150)
    @given(st.data())
    def prop(data: st.DataObject) -> None:
        target = data.draw(st.sampled_from(("trace", "capacity", "step")), label="target")
        argv = ["--policies", "builtin", "--num-gpu-blocks", "400"]
        if target == "trace":
            case = _trace_case(data)
            path = files.write(case.content, case.suffix)
            outcome, message = _judge_trace(case, path)
            argv += ["--trace", str(path)]
        elif target == "capacity":
            case = _schedule_case(data)
            path = files.write(case.content, case.suffix)
            outcome, message = _judge_schedule(case, path)
            argv += ["--trace", str(trace), "--capacity-schedule", str(path)]
        else:
            case, spec = _step_case(data, tmp_path)
            if spec is not None:
                return  # names, not files: the file property covers them
            path = files.write(case.content, case.suffix)
            outcome, message = _judge_step(case, str(path))
            argv += ["--trace", str(trace), "--step-model", str(path)]
        run = _replay(argv, tmp_path / "out")
        if outcome == "refused":
            assert run.outcome == "refused" and run.err == f"bidkv-replay: error: {message}\n"
        elif run.outcome == "refused":
            # A trace that loads can still leave no request after the length filters, or
            # arrive later than the simulated clock holds: refused naming the trace.
            assert target == "trace" and run.lines[0].startswith(
                f"bidkv-replay: error: {path}: "), run.err
        else:
            assert run.outcome == "accepted", run.err
        seen[(target, outcome)] += 1

    with _stop_after_cheap_checks(monkeypatch):
        prop()
    for target in ("trace", "capacity", "step"):
        assert seen[(target, "accepted")] and seen[(target, "refused")], (target, seen)


# ------------------------------------------------------------------- 2. policy configuration

_BOOL_FIELDS = {"enabled", "kill_switch", "use_host_facts", "prefix_caching"}
_INT_FIELDS = {n for n, f in BidKVConfig.model_fields.items() if f.annotation is int}
_FLOAT_FIELDS = {n for n, f in BidKVConfig.model_fields.items() if f.annotation is float}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}
_SECTION = "additional_config['bidkv']"

_ENV_VALUES = st.one_of(
    _padded(st.sampled_from(
        ["1", "0", "true", "False", "YES", "off", "On", "maybe", "2", "-1", "1.5", "1e3", "1e400",
         "nan", "inf", "1_0", "\u0663", "0x10", "+5", "", "bidkv", "lifo", "BIDKV", "1e-3",
         "1000001", "9" * 5000, "none", "null"])),
    st.integers(-(10**12), 10**12).map(str),
    st.floats().map(repr),
    st.text(max_size=10),
)
_CONFIG_VALUES: st.SearchStrategy[Any] = st.one_of(
    _JSON_VALUES,
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([10**400, -(10**400), 10**5000, [10**5000], True, False, "bidkv", "lifo",
                     "on", " 2 ", "1e3", 1e6, 1e6 + 1, 1.0, 0.0, -0.0, 1.25, 0.999]),
    _ENV_VALUES,
)


def _field_names() -> st.SearchStrategy[str]:
    return st.sampled_from(sorted(BidKVConfig.model_fields))


def _bounds(name: str) -> tuple[float, float]:
    """The field's declared range (ge/gt as the low end, le as the high one)."""
    low, high = -math.inf, math.inf
    for bound in BidKVConfig.model_fields[name].metadata:
        for attribute in ("ge", "gt"):
            low = max(low, getattr(bound, attribute, -math.inf))
        high = min(high, getattr(bound, "le", math.inf))
    return low, high


def _near_valid(name: str, *, text: bool) -> st.SearchStrategy[Any]:
    """Values at or near the field's accepted ones (so that acceptances are drawn too)."""
    if name in _BOOL_FIELDS:
        words = _padded(st.sampled_from(["1", "0", "true", "FALSE", "yes", "off", "On", "",
                                         "2"]))
        return words if text else words | st.booleans()
    if name == "strategy":
        names = st.sampled_from(sorted(STRATEGY_NAMES))
        return names | _padded(names) | names.map(str.upper)
    low, high = _bounds(name)
    if name in _INT_FIELDS:
        start = int(max(low, 0))
        numbers: st.SearchStrategy[Any] = st.integers(start - 1, start + 1000)
    else:
        numbers = st.floats(max(low, 0.0) - 0.5, min(high, 1e6) + 1.0)
    return numbers.map(str) if text else numbers | numbers.map(str)


@st.composite
def _config_sources(draw: st.DrawFn, *, json_safe: bool = False
                    ) -> tuple[dict[str, str], dict[Any, Any]]:
    """1-3 settings from the environment, the reference keys and the section."""
    env: dict[str, str] = {}
    additional: dict[Any, Any] = {}
    values = _JSON_VALUES | _ENV_VALUES if json_safe else _CONFIG_VALUES

    def near() -> bool:
        """Two draws in three are near-valid (a one_of of both would be diluted)."""
        return draw(st.integers(0, 2)) > 0

    for _ in range(draw(st.sampled_from([1, 1, 2, 3]))):
        where = draw(st.sampled_from(["env", "env", "section", "section", "reference",
                                      "reference", "unknown"]))
        if where == "env":
            name = draw(_field_names())
            env[BidKVConfig.env_name(name)] = draw(_near_valid(name, text=True)) if near() \
                else draw(_ENV_VALUES)
        elif where == "section":
            section = additional.setdefault("bidkv", {})
            if not isinstance(section, dict):
                continue
            name = draw(_field_names())
            section[name] = draw(_near_valid(name, text=False)) if near() else draw(values)
        elif where == "reference":
            key = draw(st.sampled_from(sorted(REFERENCE_KEYS)))
            additional[key] = draw(_near_valid(REFERENCE_KEYS[key], text=False)) if near() \
                else draw(values)
        else:
            kind = draw(st.sampled_from(["env", "section", "reference", "section_type",
                                         "other"]))
            text = st.text(st.characters(blacklist_categories=("Cs",),
                                         blacklist_characters="\x00="), max_size=10)
            if kind == "env":
                env[BidKVConfig.env_name("") + draw(text)] = draw(_ENV_VALUES)
            elif kind == "section":
                section = additional.setdefault("bidkv", {})
                if isinstance(section, dict):
                    key = draw(text | st.integers(0, 3)) if not json_safe else draw(text)
                    section[key] = draw(values)
            elif kind == "reference":
                additional["utility_" + draw(text)] = draw(values)
            elif kind == "section_type":
                additional["bidkv"] = draw(st.sampled_from([[], "bidkv", 3, None, True]))
            else:
                additional[draw(text)] = draw(values)
                env[draw(text)] = "x"  # not BIDKV_UTILITY_*: ignored
    return env, additional


def _decimal(raw: str) -> Decimal:
    try:
        return Decimal(raw.strip())
    except InvalidOperation:
        raise AssertionError(f"accepted a number Python cannot read: {raw!r}") from None


def _check_meaning(name: str, raw: Any, value: Any) -> None:
    """``value`` is what the documented reading of ``raw`` gives for field ``name``."""
    info = BidKVConfig.model_fields[name]
    if name in _BOOL_FIELDS:
        if isinstance(raw, str):
            lowered = raw.strip().lower()
            assert lowered in _TRUE | _FALSE, raw
            assert value is (lowered in _TRUE), (raw, value)
        else:
            assert raw is value, (raw, value)
        return
    if name == "strategy":
        assert raw == value and value in STRATEGY_NAMES, (raw, value)
        return
    # Numbers: a JSON number (a boolean as 0/1, pydantic's lax reading), or text holding one.
    assert not isinstance(raw, list | dict) and raw is not None, (raw, value)
    expected = _decimal(raw) if isinstance(raw, str) else Decimal(raw)
    if name in _INT_FIELDS:
        assert type(value) is int and Decimal(value) == expected, (raw, value)
    else:
        assert type(value) is float and math.isfinite(value), (raw, value)
        assert value == float(expected), (raw, value)
    for bound in info.metadata:
        for attribute, ok in (("ge", value >= getattr(bound, "ge", -math.inf)),
                              ("gt", value > getattr(bound, "gt", -math.inf)),
                              ("le", value <= getattr(bound, "le", math.inf))):
            assert ok, (name, attribute, value)


def _effective(env: Mapping[str, str], additional: Mapping[Any, Any]) -> dict[str, Any]:
    """The raw value in force per field: env < reference keys < the "bidkv" section."""
    raw: dict[str, Any] = {}
    for name in BidKVConfig.model_fields:
        if BidKVConfig.env_name(name) in env:
            raw[name] = env[BidKVConfig.env_name(name)]
    for key, name in REFERENCE_KEYS.items():
        if key in additional:
            raw[name] = additional[key]
    section = additional.get("bidkv")
    if isinstance(section, Mapping):
        raw.update(section)
    return raw


def _source_names(env: Mapping[str, str], additional: Mapping[Any, Any]) -> list[str]:
    names = [n for n in env if n.startswith("BIDKV_UTILITY_")]
    names += [repr(n) for n in names]
    names += [f"additional_config[{k!r}]" for k in additional]
    section = additional.get("bidkv")
    if isinstance(section, Mapping):
        names += [f"{_SECTION}[{k!r}]" for k in section]
    return names


def test_config_sources_are_read_as_documented_or_refused_in_one_line() -> None:
    """Drawn BIDKV_UTILITY_* values (whitespace, unicode, out of range, unknown names),
    reference top-level keys and additional_config["bidkv"] entries (any JSON type, huge
    integers, NaN): BidKVConfig.from_sources either gives each field the documented
    reading of the value in force (env < reference key < section; strict booleans; numbers
    within their bounds; defaults elsewhere) or raises ConfigError, one line naming a
    variable or key that was set. Never another exception type."""
    seen: Counter[str] = Counter()
    defaults = BidKVConfig()

    @_fuzz(500)
    @given(_config_sources())
    def prop(sources: tuple[dict[str, str], dict[Any, Any]]) -> None:
        env, additional = sources
        try:
            config = BidKVConfig.from_sources(additional, env)
        except ConfigError as exc:
            message = _one_line(str(exc))
            names = _source_names(env, additional)
            assert any(message.startswith(n) for n in names), (message, names)
            seen["refused"] += 1
            seen["refused unknown name" if "is not a BidKV setting" in message or
                 "does not have" in message else "refused value"] += 1
            return
        raw = _effective(env, additional)
        for name in BidKVConfig.model_fields:
            if name in raw:
                _check_meaning(name, raw[name], getattr(config, name))
                kind = ("bool" if name in _BOOL_FIELDS else "int" if name in _INT_FIELDS
                        else "float" if name in _FLOAT_FIELDS else "str")
                seen[f"accepted {kind}"] += 1
            else:
                assert getattr(config, name) == getattr(defaults, name), name
        seen["accepted"] += 1

    prop()
    for key in ("refused", "refused unknown name", "refused value", "accepted",
                "accepted bool", "accepted int", "accepted float", "accepted str"):
        assert seen[key], (key, seen)


def test_cli_prints_the_config_line_and_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through bidkv-replay (--policies bidkv, BIDKV_UTILITY_* in the environment,
    --additional-config JSON): a configuration the arm's BidKVConfig refuses is exit 2 with
    exactly ``bidkv-replay: error: `` plus ConfigError's line, before any engine; one it
    accepts runs on (to the stop after the trace checks). No output directory appears."""
    trace = tmp_path / "t.csv"
    trace.write_bytes(_seed("azure")[0])
    arm = arms.parse_arms("bidkv", preemption_policy=None, policy_classes=[], seed=0)[0]
    seen: Counter[str] = Counter()

    @_fuzz(100)
    @given(_config_sources(json_safe=True))
    def prop(sources: tuple[dict[str, str], dict[Any, Any]]) -> None:
        env, additional = sources
        env = {k: v for k, v in env.items() if k.startswith("BIDKV_UTILITY_")}
        if not _finite(additional) or not all(_settable(k) and _settable(v)
                                              for k, v in env.items()):
            return
        text = json.dumps(additional, allow_nan=False)
        try:
            # The user's own settings first (an arm's settings must not hide a malformed
            # one), then the arm's merged configuration, as check_arms does.
            BidKVConfig.from_sources(additional, env, block_size=16, prefix_caching=True)
            arms.arm_config(arm, additional, environ=env, block_size=16, prefix_caching=True)
            expected = None
        except ConfigError as exc:
            expected = str(exc)
        with pytest.MonkeyPatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            run = _replay(["--trace", str(trace), "--policies", "bidkv",
                           "--additional-config", text], tmp_path / "out")
        if expected is None:
            assert run.outcome == "accepted", run.err
        else:
            assert run.err == f"bidkv-replay: error: {expected}\n", (run.err, expected)
        seen[run.outcome] += 1

    with _stop_after_cheap_checks(monkeypatch):
        prop()
    assert seen["accepted"] and seen["refused"], seen


def _settable(text: str) -> bool:
    """Whether os.environ can hold ``text`` (no NUL, no lone surrogate it cannot encode)."""
    try:
        os.fsencode(text)
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


def _finite(value: Any) -> bool:
    """No float in ``value`` is NaN or infinite and no integer is beyond a float's range."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _finite(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return not (isinstance(value, int) and abs(value) > 10**300)


# -------------------------------------------------------------------- 3. kvcached-provider

IPC = "inst1"
_STATE = {"schema_version": 1, "instances": {IPC: {"revision": 3, "limit_bytes": 1 << 30,
                                                   "status": "applied", "records": {}}}}
KV_PARTS = ("ipc", "size", "timeout", "state_env", "shm_env", "state_file")
_IPC_TEXT = st.one_of(
    st.sampled_from(["inst1", "a" * 64, "a" * 65, "", " inst1", "inst1\n", "in st", "x/y", "..",
                     "-", "_g1", "inst\u00e91", "inst1\x00"]),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
            max_size=10),
)
_SIZE_TEXT = st.one_of(
    _padded(st.sampled_from(["512M", "8G", "1.5GiB", "4096", "0", "1T", "9" * 30 + "T", "8P",
                             "-1G", "1e9", "nan", "inf", "G", "1.5.5M", "8 G", "8GB", "8gib",
                             "\u0663M", "0x10", "9223372036854775807", "9223372036854775808"])),
    st.integers(-(10**20), 10**20).map(str),
    st.text(max_size=8).filter(lambda s: "\x00" not in s),
)
_TIMEOUT_TEXT = st.one_of(
    st.sampled_from(["5", "0", "-1", "nan", "inf", "3600", "3600.5", "1e-9", "abc", "",
                     "1e999", " 2 ", "\u0663"]),
    st.floats().map(repr),
)
_DIR_KINDS = st.sampled_from(["unset", "empty", "blank", "file", "under_file", "fresh",
                              "existing"])
_STATE_FILES = st.one_of(
    st.sampled_from([b"", b"{", b"null", b"[]", b'{"schema_version": 2}', b"\xff\xfe",
                     b'{"instances": {"inst1": {"revision": -1}}}',
                     b'{"instances": {"inst1": {"revision": "3"}}}',
                     b'{"instances": {"inst1": {"revision": 1' + b"0" * 5000 + b"}}}",
                     b"[" * 10000, _BOM + json.dumps(_STATE).encode()]),
    _JSON_VALUES.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(_FILE_TEXT, _JSON_VALUES, max_size=2).map(
        lambda extra: json.dumps({**_STATE, **extra}).encode()),
    st.dictionaries(_FILE_TEXT, st.integers(), min_size=1, max_size=2).map(
        lambda extra: json.dumps({**_STATE, "instances": {IPC: {"revision": 1, **extra}}}
                                 ).encode()),
)


def _directory(kind: str, base: Path, name: str) -> str | None:
    """An environment value for a directory variable, of the drawn kind."""
    target = base / name
    if kind == "unset":
        return None
    if kind in ("empty", "blank"):
        return "" if kind == "empty" else " \t"
    if kind == "file":
        target.write_text("x")
    elif kind == "under_file":
        (base / "plain").write_text("x")
        target = base / "plain" / name
    elif kind == "existing":
        target.mkdir()
    return str(target)


def _kv_parse_ok(text: str, parse: Callable[[str], object]) -> bool:
    try:
        parse(text)
    except (ValueError, kv_limit.LimitError):
        return False
    return True


def test_kvcached_limit_refuses_bad_arguments_and_settings_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kvcached-provider limit`` with one drawn part bad (--ipc, SIZE, --timeout, the
    state or shm directory variable, or the state file's content): argparse's refusal exits
    2 naming the argument; otherwise exit 2 with one ``kvcached-provider: error:`` line
    naming that part, no traceback, and the state file byte for byte as it was. An accepted
    command stops before it would ask an engine (``_serves`` raises ``_Accepted``)."""
    seen: Counter[tuple[str, str]] = Counter()
    counter = iter(range(10**6))

    def accepted(ipc: str) -> bool:
        raise _Accepted

    monkeypatch.setattr(kv_limit, "_serves", accepted)
    for name in ("KVCACHED_PROVIDER_STATE_DIR", "KVCACHED_PROVIDER_SHM_DIR", "KVCACHED_IPC_NAME"):
        monkeypatch.delenv(name, raising=False)

    @_fuzz(300)
    @given(st.data())
    def prop(data: st.DataObject) -> None:
        part = data.draw(st.sampled_from(KV_PARTS), label="part")
        base = tmp_path / f"case{next(counter)}"
        base.mkdir()
        ipc, size, timeout = IPC, "1G", "0.5"
        state_kind, shm_kind, content = "existing", "existing", json.dumps(_STATE).encode()
        if part == "ipc":
            ipc = data.draw(_IPC_TEXT, label="ipc")
        elif part == "size":
            size = data.draw(_SIZE_TEXT, label="size")
        elif part == "timeout":
            timeout = data.draw(_TIMEOUT_TEXT, label="timeout")
        elif part == "state_env":
            state_kind = data.draw(_DIR_KINDS, label="state dir")
        elif part == "shm_env":
            shm_kind = data.draw(_DIR_KINDS, label="shm dir")
        else:
            content = data.draw(_STATE_FILES, label="state file")
        state = _directory(state_kind, base, "state")
        shm = _directory(shm_kind, base, "shm")
        state_file = Path(state) / "instances.json" if state and state.strip() else None
        if state_kind == "existing" and state_file is not None:
            state_file.write_bytes(content)
        before = state_file.read_bytes() if state_file and state_file.is_file() else None
        with pytest.MonkeyPatch.context() as patch:
            for name, value in (("KVCACHED_PROVIDER_STATE_DIR", state),
                                ("KVCACHED_PROVIDER_SHM_DIR", shm)):
                if value is not None:
                    patch.setenv(name, value)
            # The defaults (per-user state, /dev/shm) stay untouched.
            patch.setenv("XDG_STATE_HOME", str(base / "xdg"))
            if shm_kind in ("unset", "empty"):
                patch.setattr(kv_limit, "shm_dir", lambda: base / "default-shm")
            run = _main(kv_cli.main, ["limit", f"--ipc={ipc}", f"--timeout={timeout}", "--",
                                      size])
        seen[(part, run.outcome)] += 1
        if run.outcome == "usage":
            assert part == "timeout" and not _kv_parse_ok(timeout, float), run.err
            assert run.lines[-1].startswith("kvcached-provider limit: error: argument --timeout")
        if run.outcome == "accepted":
            return
        assert state_file is None or not state_file.exists() or \
            state_file.read_bytes() == before, "a refused command changed the state file"
        if run.outcome == "refused":
            assert len(run.lines) == 1, run.err
            line = _one_line(run.lines[0])
            assert line.startswith("kvcached-provider: error: "), line
            needle = {
                "ipc": f"--ipc {ipc!r} is invalid",
                "size": f"size {size!r} is invalid",
                "timeout": "--timeout ",
                "state_env": "KVCACHED_PROVIDER_STATE_DIR" if state_kind == "blank" else
                str(state),
                "shm_env": "KVCACHED_PROVIDER_SHM_DIR" if shm_kind == "blank" else str(shm),
                "state_file": str(state_file),
            }[part]
            assert needle in line, (needle, line)

    prop()
    for part in KV_PARTS:
        assert seen[(part, "refused")], (part, seen)
        assert seen[(part, "accepted")], (part, seen)
    assert seen[("timeout", "usage")], seen


def test_kvcached_cleanup_refuses_bad_names_and_directories_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kvcached-provider cleanup --dry-run`` with a drawn --ipc or shm directory variable:
    exit 2 with one line naming the name or the variable/directory, or accepted (stopped
    before it reads /proc, so nothing is ever removed)."""
    seen: Counter[tuple[str, str]] = Counter()
    counter = iter(range(10**6))

    def accepted() -> object:
        raise _Accepted

    monkeypatch.setattr(kv_segments, "_snapshot", accepted)
    monkeypatch.delenv("KVCACHED_PROVIDER_SHM_DIR", raising=False)

    @_fuzz(120)
    @given(st.sampled_from(["ipc", "shm_env"]), _IPC_TEXT, _DIR_KINDS)
    def prop(part: str, ipc: str, shm_kind: str) -> None:
        base = tmp_path / f"case{next(counter)}"
        base.mkdir()
        if part == "ipc":
            shm_kind = "existing"
        else:
            ipc = IPC
        shm = _directory(shm_kind, base, "shm")
        with pytest.MonkeyPatch.context() as patch:
            if shm is not None:
                patch.setenv("KVCACHED_PROVIDER_SHM_DIR", shm)
            if shm_kind in ("unset", "empty"):
                patch.setattr(kv_segments, "shm_dir", lambda: base / "default-shm")
            run = _main(kv_cli.main, ["cleanup", "--dry-run", f"--ipc={ipc}"])
        seen[(part, run.outcome)] += 1
        if run.outcome == "refused":
            assert len(run.lines) == 1, run.err
            line = _one_line(run.lines[0])
            assert line.startswith("kvcached-provider: error: "), line
            needle = f"--ipc {ipc!r}" if part == "ipc" else (
                "KVCACHED_PROVIDER_SHM_DIR" if shm_kind == "blank" else str(
                    shm if shm else base / "default-shm"))
            assert needle in line, (needle, line)
        else:
            assert run.outcome == "accepted", run.err

    prop()
    for part in ("ipc", "shm_env"):
        assert seen[(part, "refused")] and seen[(part, "accepted")], (part, seen)


# ------------------------------------------------------- regressions found by the properties


@pytest.mark.parametrize("key", ["x\ny", "\x85", "\u2028", "\r"])
def test_a_key_with_a_line_break_is_shown_on_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str
) -> None:
    """An unknown key with a line break in a step-model file (JSON or TOML), a capacity
    schedule entry or the kvcached-provider state file used to split the error in two;
    the key is now shown as repr() and the message stays one line naming the file."""
    step = tmp_path / "step.json"
    step.write_text(json.dumps({**STEP_SEED, key: 1}))
    toml = tmp_path / "step.toml"
    toml.write_bytes(_step_text("toml", {**{k: _step_literal(v) for k, v in STEP_SEED.items()},
                                         key: "1"}))
    schedule = tmp_path / "schedule.json"
    schedule.write_text(json.dumps([{"t": 1, "blocks": 2, key: 3}]))
    for path, load, error in [
        (step, lambda p: load_step_model(str(p)), StepTimeModelError),
        (toml, lambda p: load_step_model(str(p)), StepTimeModelError),
        (schedule, lambda p: load_capacity_schedule(p, USABLE), CapacityScheduleError),
    ]:
        with pytest.raises(error) as caught:
            load(path)
        assert f"{path}: " in _one_line(str(caught.value))
        assert repr(key) in str(caught.value)

    state, shm = tmp_path / "state", tmp_path / "shm"
    state.mkdir()
    shm.mkdir()
    bad = json.dumps({**_STATE, key: 1}).encode()
    (state / "instances.json").write_bytes(bad)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVCACHED_PROVIDER_STATE_DIR", str(state))
        patch.setenv("KVCACHED_PROVIDER_SHM_DIR", str(shm))
        assert kv_cli.main(["limit", "--ipc", IPC, "--timeout", "0.1", "1G"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvcached-provider: error: {state / 'instances.json'} is not")
    assert len(err.splitlines()) == 1 and repr(key) in err, err
    assert (state / "instances.json").read_bytes() == bad


def test_an_integer_too_long_to_print_still_names_the_key() -> None:
    """additional_config (a plain dict from Python, e.g. LLM(additional_config=...)) holding
    an integer over Python's int-digits limit used to escape from_sources as a bare
    ValueError ("Exceeds the limit (4300 digits)...") naming nothing; it is now a
    ConfigError naming the key."""
    huge = 10**5000
    for additional, source in [
        ({"bidkv": {"base_cost": huge}}, f"{_SECTION}['base_cost']"),
        ({"bidkv": {"enabled": [huge]}}, f"{_SECTION}['enabled']"),
        ({"utility_epsilon": -huge}, "additional_config['utility_epsilon']"),
    ]:
        with pytest.raises(ConfigError) as caught:
            BidKVConfig.from_sources(additional, {})
        message = _one_line(str(caught.value))
        assert message.startswith(f"{source}=<a"), message
        assert "more than 4300 digits> is invalid: " in message, message


def test_an_environment_name_with_a_line_break_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unknown BIDKV_UTILITY_* name holding a line break (``env $'BIDKV_UTILITY_\\r=0'``)
    used to print a two-line error; it is now shown as repr(), from from_sources and
    through bidkv-replay (exit 2, one line)."""
    name = "BIDKV_UTILITY_\r"
    with pytest.raises(ConfigError) as caught:
        BidKVConfig.from_sources(None, {name: "0"})
    assert _one_line(str(caught.value)).startswith(f"{name!r} is not a BidKV setting")
    trace = tmp_path / "t.csv"
    trace.write_bytes(_seed("azure")[0])
    with _stop_after_cheap_checks(monkeypatch):
        monkeypatch.setenv(name, "0")
        run = _replay(["--trace", str(trace), "--policies", "bidkv"], tmp_path / "out")
    assert run.outcome == "refused"
    assert run.lines == [f"bidkv-replay: error: {caught.value}"]
