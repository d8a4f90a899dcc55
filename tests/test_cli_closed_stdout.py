"""``kvcached-provider``, ``python -m qualification`` and ``bidkv-replay`` writing into a
pipe whose reader has gone (``... | head -1``).

Guarded: the first two stop as a pipeline's writer does, quietly and with the shell's
status for SIGPIPE (141); the replay stops printing but still writes its report files.
Before, ``qualification profiles`` ended in a BrokenPipeError traceback with unbuffered
output, ``--help`` of either in Python's "Exception ignored ... BrokenPipeError" (exit
120) with buffered output, and the replay lost its reports. The manager's own case is
tests/test_manager_closed_stdout.py. Real subprocesses, whose standard output is a pipe
with its read end closed before they start, so every write fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KVCACHED = [str(Path(sys.executable).with_name("kvcached-provider"))]
QUALIFICATION = [sys.executable, "-m", "qualification"]


def _run_into_closed_pipe(command: list[str], *, buffered: bool) -> tuple[int, str]:
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    try:
        done = subprocess.run(command, stdout=write_end, stderr=subprocess.PIPE, env=env,
                              cwd=ROOT, text=True, timeout=120, check=False)
    finally:
        os.close(write_end)
    return done.returncode, done.stderr


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_qualification_profiles_into_a_closed_pipe(buffered: bool) -> None:
    """The profile list: exit 141, nothing on stderr."""
    assert _run_into_closed_pipe([*QUALIFICATION, "profiles"], buffered=buffered) == (141, "")


@pytest.mark.parametrize("command", [KVCACHED, QUALIFICATION], ids=["kvcached", "qualification"])
def test_help_into_a_closed_pipe(command: list[str]) -> None:
    """Buffered --help: exit 141, nothing on stderr. (Unbuffered, argparse itself ignores
    the failed write and exits 0.)"""
    assert _run_into_closed_pipe([*command, "--help"], buffered=True) == (141, "")
    assert _run_into_closed_pipe([*command, "--help"], buffered=False) == (0, "")


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_a_replay_into_a_closed_pipe_still_writes_its_reports(
    tmp_path: Path, buffered: bool
) -> None:
    """``bidkv-replay ... | head``: the reader leaving does not cost the report files still
    to be written (before, with unbuffered output, a BrokenPipeError traceback ended the
    run before any file was written), and nothing about the pipe reaches stderr."""
    out = tmp_path / "out"
    code, err = _run_into_closed_pipe(
        [sys.executable, "-m", "bidkv_ext.replay.cli", "--policies", "builtin",
         "--max-requests", "3", "--num-gpu-blocks", "400", "--no-progress", "--no-plots",
         "--output-dir", str(out)], buffered=buffered)
    assert code == 0, err
    assert "BrokenPipe" not in err and "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md", "timing.json"]
