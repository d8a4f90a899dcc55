"""Trace input for ``bidkv-replay``: Azure CSV and Mooncake JSONL parsing, windows and rate
scaling, Mooncake prefix sharing in the fake prompts, and bad rows or files reported as one
line naming the file and line with exit code 2 (no traceback, no vLLM import needed).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bidkv_ext.replay.cli import SAMPLE_TRACE, main
from bidkv_ext.replay.tokens import PromptFactory
from bidkv_ext.replay.trace import TraceError, load_trace, select_requests

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
