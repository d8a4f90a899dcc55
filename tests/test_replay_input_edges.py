"""Replay inputs the loaders used to misread without a word, and what now happens.

- A capacity change far beyond the simulated clock's bound is refused (it froze the clock:
  every later step took no time, TPOT read 0).
- A trace or capacity schedule that is a pipe, device or directory is refused up front:
  each is read more than once (format guess, load, sha256), and a pipe's second read is
  empty, so report.json recorded the empty input's hash.
- ``--no-plots`` writes a report.md that links no figure (it linked whatever an earlier
  run left in the folder).
- A Mooncake trace without a ``.jsonl`` suffix is recognised after a byte-order mark,
  blank lines or spaces, which its loader skips anyway.
- An Azure header naming a required column twice, and a Mooncake line holding a key twice,
  are refused (the first column, the last key won silently).
- A step model whose fixed cost per step is 0 is refused (a run could take no time, and
  throughput divided by a zero makespan).
- A ``--policies`` entry setting the engine's block size or prefix caching is refused: the
  engine's own value replaced it while the label said otherwise.
- argparse's refusals are one line, like every other.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from bidkv_ext.replay.cli import main
from bidkv_ext.replay.trace import TraceError, detect_format, load_trace

MOONCAKE_ROW = '{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [0, 1]}'
AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
QUICK = ["--policies", "builtin", "--duration", "5", "--num-gpu-blocks", "400", "--no-progress"]


def _refused(capsys: pytest.CaptureFixture[str], tmp_path: Path, *argv: str) -> str:
    """Run the CLI expecting a refusal; return its single stderr line."""
    out = tmp_path / "out"
    try:
        code = main([*QUICK, "--no-plots", "--output-dir", str(out), *argv])
    except SystemExit as exc:  # argparse's own refusals
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bidkv-replay: error: "), err
    assert not out.exists()
    return lines[0]


def _trace(tmp_path: Path, name: str = "t.csv", text: str = AZURE) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_capacity_change_beyond_the_clock_bound_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    schedule = tmp_path / "cap.json"
    schedule.write_text(json.dumps([{"t": 0, "blocks": 300}, {"t": 1e20, "blocks": 399}]))
    message = _refused(capsys, tmp_path, "--trace", str(_trace(tmp_path)),
                       "--capacity-schedule", str(schedule))
    assert f"{schedule}: entry 2: t: " in message
    assert "seconds from 0 to 1e+10" in message
    schedule.write_text(json.dumps([{"t": 0, "blocks": 300}, {"t": 1e10, "blocks": 399}]))
    capsys.readouterr()
    from bidkv_ext.replay.capacity import load_capacity_schedule

    assert load_capacity_schedule(schedule, 399).points[-1].t == 1e10  # the bound itself


class _Blocked(Exception):
    pass


def _blocked(signum: int, frame: object) -> None:
    raise _Blocked("still blocked after 30 s: the input was opened, not refused")


@pytest.mark.parametrize("option", ["--trace", "--capacity-schedule"])
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_an_input_that_cannot_be_read_twice_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, option: str, kind: str
) -> None:
    special = tmp_path / "special"
    if kind == "fifo":
        os.mkfifo(special)  # stat() does not open it: no writer is needed, nothing blocks
    else:
        special.mkdir()
    argv = ["--trace", str(special)] if option == "--trace" else [
        "--trace", str(_trace(tmp_path)), "--capacity-schedule", str(special)]
    # Opening a FIFO without a writer blocks: a regression would hang here, so it fails.
    previous = signal.signal(signal.SIGALRM, _blocked)
    signal.setitimer(signal.ITIMER_REAL, 30)
    try:
        message = _refused(capsys, tmp_path, *argv)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert message.startswith(f"bidkv-replay: error: {option} {special}: expected a regular "
                              "file (it is read more than once")


def test_no_plots_writes_a_report_that_links_no_figure(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for stale in ("ttft_cdf.png", "bars.png"):  # an earlier run's figures
        (out / stale).write_bytes(b"old")
    code = main([*QUICK, "--trace", str(_trace(tmp_path)), "--no-plots",
                 "--output-dir", str(out)])
    assert code == 0, capsys.readouterr().err
    report = (out / "report.md").read_text()
    assert "# bidkv-replay report" in report
    assert ".png" not in report


@pytest.mark.parametrize("prefix", ["\ufeff", "\n\n", "  \t", "\ufeff\n  "])
def test_a_mooncake_trace_is_recognised_after_what_its_loader_skips(
    tmp_path: Path, prefix: str
) -> None:
    path = tmp_path / "trace.txt"  # no suffix to go by
    path.write_text(prefix + MOONCAKE_ROW + "\n", encoding="utf-8")
    assert detect_format(path) == "mooncake"
    (request,) = load_trace(path)
    assert (request.input_length, request.output_length) == (600, 10)
    path.write_text(prefix + AZURE, encoding="utf-8")
    assert detect_format(path) == "azure"


@pytest.mark.parametrize("column", ["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
def test_an_azure_column_named_twice_is_refused(tmp_path: Path, column: str) -> None:
    header = f"TIMESTAMP,ContextTokens,GeneratedTokens,{column}\n"
    cell = {"TIMESTAMP": "2023-11-16 18:15:47", "ContextTokens": "9999",
            "GeneratedTokens": "7"}[column]
    path = _trace(tmp_path, text=f"{header}2023-11-16 18:15:46.6805900,374,44,{cell}\n")
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    assert str(caught.value) == f"{path}:1: column {column} appears more than once"


def test_a_mooncake_key_given_twice_is_refused(tmp_path: Path) -> None:
    line = '{"timestamp": 0, "input_length": 600, "input_length": 10, "output_length": 3}\n'
    path = _trace(tmp_path, "t.jsonl", MOONCAKE_ROW + "\n" + line)
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    assert str(caught.value) == f"{path}:2: key 'input_length' appears more than once"
    nested = '{"timestamp": 0, "input_length": 1, "output_length": 3, "x": {"k": 1, "k": 2}}\n'
    path.write_text(nested)
    with pytest.raises(TraceError, match="key 'k' appears more than once"):
        load_trace(path)


def test_a_step_model_that_is_a_pipe_is_refused_not_waited_on(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``--step-model`` naming a FIFO used to block the run for good, reading a pipe no one
    writes to; it is refused in one line, as a directory is."""
    fifo = tmp_path / "model.json"
    os.mkfifo(fifo)
    for spec in (fifo, tmp_path):
        message = _refused(capsys, tmp_path, "--trace", str(_trace(tmp_path)),
                           "--step-model", str(spec))
        assert message.endswith(
            f"step model {str(spec)!r}: expected a preset (llama-3.1-8b-h100) or a regular "
            "file, got a pipe, device or directory")


@pytest.mark.parametrize("fixed", [0, 1e-320, 9.9e-7])
def test_a_step_model_without_a_fixed_step_cost_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fixed: float
) -> None:
    """A step's fixed cost of 0 lets a run take no time; one of 1e-320 s passed and then
    made tokens per second infinite, so report.json could not be written after every arm
    had run. Both are refused up front, as is anything below a microsecond."""
    model = tmp_path / "zero.json"
    model.write_text(json.dumps({"name": "zero", "a": fixed, "b": 1e-4, "c": 0, "d": 0}))
    message = _refused(capsys, tmp_path, "--trace", str(_trace(tmp_path)),
                       "--step-model", str(model))
    assert f"{model}: a: Input should be greater than or equal to 0.000001" in message
    assert "a >= 1e-06 and the others >= 0" in message


@pytest.mark.parametrize(("setting", "flag"), [
    ("block_size=32", "--block-size"), ("prefix_caching=false", "--[no-]prefix-caching")])
def test_an_arm_cannot_set_what_the_engine_decides(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, setting: str, flag: str
) -> None:
    spec = f"bidkv{{{setting}}}"
    message = _refused(capsys, tmp_path, "--trace", str(_trace(tmp_path)), "--policies", spec)
    key = setting.partition("=")[0]
    assert message == (f"bidkv-replay: error: --policies {spec!r}: {key} describes the engine, "
                       f"not one arm; set it for every arm with {flag}")


@pytest.mark.parametrize("argv", [["--start", "abc"], ["--max-requests", "1.5"],
                                  ["--format", "xyz"], ["--no-such-option"]])
def test_argparse_refusals_are_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str]
) -> None:
    message = _refused(capsys, tmp_path, *argv)
    assert message.endswith("(see --help)")
    assert argv[0] in message
