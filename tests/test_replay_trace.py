"""Trace input for ``bidkv-replay``: Azure CSV and Mooncake JSONL parsing, windows and rate
scaling, Mooncake prefix sharing in the fake prompts, and bad rows or files reported as
one line naming the file and line with exit code 2 (no traceback, no vLLM import needed).

Also guarded: the format follows the suffix in any case (``.json``/``.jsonl`` Mooncake,
``.csv`` Azure) or else the first byte; a trace without requests, an empty Azure file and
a file that is not UTF-8 are trace errors; Azure columns are found by their (stripped)
header names, rows with blank cells are skipped, a row with another column count, a
timestamp without a fraction and unsorted rows are handled as documented; Mooncake rows
must be sorted (equal timestamps are fine) objects with the three fields, a timestamp >= 0
and hash ids >= 0 (``true`` is no length or id), and a long bad value (a Mooncake field,
an Azure TIMESTAMP) is shown cut. ``select_requests``: the window is [start, start +
duration), the window's row count is taken before ``max_requests`` cuts it and the cut
comes before the length filter (prompt + output == max_model_len fits), arrivals are
rebased to the window start and divided by ``rate_scale`` (which must be > 0), and hash
ids are kept. Fake token ids stay inside the bundled model's vocabulary and clear of its
special ids, and the fake output token differs between requests (it is never EOS, which
would end a request whose max_tokens is not exact).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bidkv_ext.replay.cli import SAMPLE_TRACE, main
from bidkv_ext.replay.tokens import PromptFactory
from bidkv_ext.replay.trace import (
    TraceError,
    TraceRequest,
    detect_format,
    load_trace,
    select_requests,
)

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_azure_rows_become_requests_with_relative_arrivals(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "t.csv",
        AZURE_HEADER
        + "2023-11-16 18:15:46.6805900,374,44\n"
        + "2023-11-16 18:15:47.1805909,396,109\n",
    )
    first, second = load_trace(path)
    assert (first.arrival, first.input_length, first.output_length) == (0.0, 374, 44)
    assert second.arrival == pytest.approx(0.5)
    assert first.hash_ids is None


def test_bundled_sample_loads() -> None:
    requests = load_trace(SAMPLE_TRACE)
    assert len(requests) == 1000
    assert requests[0].arrival == 0.0


def test_mooncake_hash_ids_share_prompt_prefixes(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "m.jsonl",
        '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [7, 8]}\n'
        '{"timestamp": 1500, "input_length": 700, "output_length": 1, "hash_ids": [7, 9]}\n',
    )
    a, b = load_trace(path)
    assert b.arrival == 1.5 and a.hash_ids == (7, 8)
    prompts = PromptFactory(seed=3)
    pa, pb = prompts.prompt(a), prompts.prompt(b)
    assert len(pa) == 600 and len(pb) == 700
    assert pa[:512] == pb[:512]
    assert pa[512:600] != pb[512:600]
    assert PromptFactory(seed=3).prompt(a) == pa


def test_window_rate_scale_and_length_filter() -> None:
    requests = load_trace(SAMPLE_TRACE)
    picked = select_requests(requests, start=10.0, duration=20.0, rate_scale=2.0,
                             max_model_len=1000)
    window = [r for r in requests if 10.0 <= r.arrival < 30.0]
    assert picked.rows_in_window == len(window)
    too_long = [r for r in window if r.input_length + r.output_length > 1000]
    assert picked.filtered_too_long == len(too_long) > 0
    assert len(picked.requests) == len(window) - len(too_long)
    assert all(0.0 <= r.arrival < 10.0 for r in picked.requests)
    assert select_requests(requests, max_requests=5).requests == requests[:5]


@pytest.mark.parametrize(
    ("name", "text", "where", "what"),
    [
        ("bad.csv", AZURE_HEADER + "2023-11-16 18:15:46.1,10,5\n2023-11-16 18:15:47.1,x,5\n",
         ":3:", "ContextTokens"),
        ("bad.csv", AZURE_HEADER + "yesterday,10,5\n", ":2:", "TIMESTAMP"),
        ("bad.csv", AZURE_HEADER + "2023-11-16 18:15:46.1,10,0\n", ":2:", "GeneratedTokens"),
        ("bad.csv", "a,b\n1,2\n", ":1:", "header"),
        ("bad.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
         "{not json\n", ":2:", "JSON"),
        ("bad.jsonl", '{"timestamp": 0, "input_length": 600, "output_length": 1, '
         '"hash_ids": [1]}\n', ":1:", "hash_ids"),
    ],
)
def test_bad_rows_name_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str, where: str,
    what: str,
) -> None:
    path = _write(tmp_path, name, text)
    with pytest.raises(TraceError):
        load_trace(path)
    code = main(["--trace", str(path), "--no-progress", "--output-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("bidkv-replay: error: ")
    assert f"{path}{where}" in err[0] and what in err[0]


def test_missing_file_and_bad_flags_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--trace", str(tmp_path / "nope.csv")]) == 2
    assert "nope.csv" in capsys.readouterr().err
    assert main(["--additional-config", "[1]"]) == 2
    assert "--additional-config must contain a JSON object" in capsys.readouterr().err
    assert main(["--policies", "nonsense"]) == 2
    assert "unknown policy 'nonsense'" in capsys.readouterr().err
    assert main(["--step-model", str(tmp_path / "missing.json")]) == 2
    assert "step model" in capsys.readouterr().err


MOONCAKE_ROWS = (
    '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [7, 8]}\n'
    '{"timestamp": 1500, "input_length": 700, "output_length": 1, "hash_ids": [7, 9]}\n'
)
AZURE_ROWS = "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:47.1805909,396,109\n"


@pytest.mark.parametrize(
    ("name", "text", "mooncake"),
    [
        # A leading blank line: the first byte alone would say Azure.
        ("m.json", "\n" + MOONCAKE_ROWS, True),
        ("m.JSONL", "\n" + MOONCAKE_ROWS, True),
        ("a.CSV", AZURE_HEADER + AZURE_ROWS, False),
        ("m.trace", MOONCAKE_ROWS, True),
        ("a.trace", AZURE_HEADER + AZURE_ROWS, False),
    ],
)
def test_format_follows_the_suffix_or_the_first_byte(
    tmp_path: Path, name: str, text: str, mooncake: bool
) -> None:
    path = _write(tmp_path, name, text)
    assert detect_format(path) == ("mooncake" if mooncake else "azure")
    first, second = load_trace(path)
    assert (first.hash_ids is not None) is mooncake
    assert first.input_length == (600 if mooncake else 374)
    assert second.arrival == pytest.approx(1.5 if mooncake else 0.5)


@pytest.mark.parametrize(
    ("name", "text"),
    [("a.csv", AZURE_HEADER), ("a.csv", AZURE_HEADER + ",,\n\n"), ("m.jsonl", "\n  \n")],
)
def test_a_trace_without_requests_is_refused(tmp_path: Path, name: str, text: str) -> None:
    path = _write(tmp_path, name, text)
    with pytest.raises(TraceError, match=f"{path}: trace has no requests"):
        load_trace(path)


def test_azure_columns_by_header_name_and_blank_rows_skipped(tmp_path: Path) -> None:
    """Columns are found by their header names (any order, surrounding blanks, extra
    columns), rows whose cells are all blank are skipped, and a timestamp may have no
    fractional part."""
    path = _write(
        tmp_path,
        "a.csv",
        " GeneratedTokens , Region, TIMESTAMP ,ContextTokens\n"
        "44,west,2023-11-16 18:15:46,374\n"
        " , , ,\n"
        "\n"
        "109,east,2023-11-16 18:15:47.5,396\n",
    )
    first, second = load_trace(path)
    assert (first.arrival, first.input_length, first.output_length) == (0.0, 374, 44)
    assert (second.arrival, second.input_length, second.output_length) == (1.5, 396, 109)


@pytest.mark.parametrize(
    ("name", "text", "where", "what"),
    [
        ("a.csv", "", ":1:", "empty file, expected an Azure CSV header"),
        ("a.csv", AZURE_HEADER + "2023-11-16 18:15:46.1,10\n", ":2:", "expected 3 columns, got 2"),
        ("a.csv", AZURE_HEADER + "2023-11-16 18:15:46.1,10,5,7\n", ":2:",
         "expected 3 columns, got 4"),
        ("a.csv", AZURE_HEADER + "2023-11-16 18:15:47.1,10,5\n2023-11-16 18:15:46.1,10,5\n",
         ":3:", "TIMESTAMP goes backwards"),
        ("m.jsonl", MOONCAKE_ROWS + '{"timestamp": 1499, "input_length": 5, "output_length": 1,'
         ' "hash_ids": [1]}\n', ":3:", "timestamp goes backwards"),
        ("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": true, '
         '"hash_ids": [1]}\n', ":1:", "output_length must be an integer >= 1, got True"),
        ("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, '
         '"hash_ids": [true]}\n', ":1:", "hash_ids must be a list of integers >= 0"),
        ("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, '
         '"hash_ids": [-1]}\n', ":1:", "hash_ids must be a list of integers >= 0"),
        ("m.jsonl", '{"timestamp": -5, "input_length": 5, "output_length": 1, '
         '"hash_ids": [1]}\n', ":1:", "timestamp must be a finite number of milliseconds >= 0"),
        ("m.jsonl", MOONCAKE_ROWS + '{"timestamp": 1600, "input_length": 5, "hash_ids": [1]}\n',
         ":3:", "missing field(s) output_length"),
        ("m.jsonl", MOONCAKE_ROWS + "[1600, 5, 1]\n", ":3:", "expected a JSON object per line"),
    ],
)
def test_bad_rows_are_trace_errors(
    tmp_path: Path, name: str, text: str, where: str, what: str
) -> None:
    path = _write(tmp_path, name, text)
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(info.value).startswith(f"{path}{where} {what}")


def test_equal_mooncake_timestamps_are_sorted(tmp_path: Path) -> None:
    """Rows arriving at the same millisecond are in order (only going back is refused)."""
    row = '{"timestamp": 2500, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
    first, second = load_trace(_write(tmp_path, "m.jsonl", row + row))
    assert first.arrival == second.arrival == 0.0


def test_a_broken_mooncake_row_names_its_file_line_and_column_only(tmp_path: Path) -> None:
    """A row that is not valid JSON is named by the file's line and the column in it; the
    row's own line count (its line break made it read "line 2" on any line) is not shown."""
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
    path = _write(tmp_path, "m.jsonl", good * 2 + '{"timestamp": 1, \n' + good)
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(info.value) == (
        f"{path}:3: not valid JSON (column 19: Expecting property name enclosed in double quotes)"
    )


def test_a_long_bad_value_is_shown_cut(tmp_path: Path) -> None:
    value = "x" * 5000
    path = _write(tmp_path, "m.jsonl", '{"timestamp": 0, "input_length": "' + value
                  + '", "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(TraceError) as info:
        load_trace(path)
    message = str(info.value)
    assert message.startswith(f"{path}:1: input_length must be an integer >= 1, got 'xxx")
    assert message.endswith("...") and len(message) < len(str(path)) + 150


def test_a_long_bad_azure_timestamp_is_shown_cut(tmp_path: Path) -> None:
    path = _write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                  + "9" * 5000 + ",10,2\n")
    with pytest.raises(TraceError) as info:
        load_trace(path)
    message = str(info.value)
    assert message.startswith(f"{path}:2: TIMESTAMP must look like 2023-11-16")
    assert message.endswith("...") and len(message) < len(str(path)) + 150


def test_select_requests_window_cut_filter_and_rebase() -> None:
    """Window [1, 4) holds arrivals 1, 2 and 3 (4 is its end); max_requests=2 keeps 1 and
    2 before the length filter drops 1 (115 tokens > 100; 2 has exactly 100); arrival 2
    becomes (2 - 1) / 2."""
    requests = tuple(
        TraceRequest(index=i, arrival=float(i), input_length=10,
                     output_length=105 if i % 2 else 90, hash_ids=(i, i + 1))
        for i in range(6)
    )
    picked = select_requests(requests, start=1.0, duration=3.0, max_requests=2,
                             rate_scale=2.0, max_model_len=100)
    assert (picked.rows_in_window, picked.filtered_too_long) == (3, 1)
    assert picked.requests == (TraceRequest(index=2, arrival=0.5, input_length=10,
                                            output_length=90, hash_ids=(2, 3)),)
    for scale in (0.0, -1.0):
        with pytest.raises(ValueError, match="rate scale must be > 0"):
            select_requests(requests, rate_scale=scale)


def test_token_ids_stay_in_the_vocabulary_clear_of_special_ids() -> None:
    import bidkv_ext.hosts.vllm

    config = json.loads(
        (Path(bidkv_ext.hosts.vllm.__file__).parent / "model" / "config.json").read_text()
    )
    vocab = config["vocab_size"]
    special = {0, 1, 2, 3, config["bos_token_id"], config["eos_token_id"]}
    for seed in (0, 5):
        prompts = PromptFactory(seed=seed)
        azure = TraceRequest(index=3, arrival=0.0, input_length=50_000, output_length=1)
        mooncake = TraceRequest(index=4, arrival=0.0, input_length=5000, output_length=1,
                                hash_ids=tuple(range(10)))
        for request in (azure, mooncake):
            ids = prompts.prompt(request)
            assert len(ids) == request.input_length
            assert min(ids) > max(special) and max(ids) < vocab
        outputs = [prompts.fake_output_token(TraceRequest(i, 0.0, 1, 1)) for i in range(2000)]
        assert len(set(outputs)) == len(outputs)
        assert min(outputs) > max(special) and max(outputs) < vocab


def test_a_trace_that_is_not_utf8_is_a_trace_error(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_bytes(AZURE_HEADER.encode() + b"2023-11-16 18:15:46.1,\xff\xfe,5\n")
    with pytest.raises(TraceError, match=f"{path}: trace is not UTF-8 text"):
        load_trace(path)
