"""``vllm-hust-ext`` writing into a pipe whose reader has gone (``... | head -1``).

Guarded: the manager stops as a pipeline's writer does, quietly and with the shell's status
for SIGPIPE (141), whether its output is buffered or not, for a verb's output and for
``--help`` / ``--version``. Before, it printed a usage line and "error: [Errno 32] Broken
pipe" (exit 2), or Python's "Exception ignored ... BrokenPipeError" at exit (exit 120), or,
for ``--help``, a traceback. The real console script runs in a subprocess whose standard
output is a pipe with its read end closed before the process starts, so every write fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CLI = Path(sys.executable).with_name("vllm-hust-ext")


def _run_into_closed_pipe(args: list[str], config: Path, *, buffered: bool) -> tuple[int, str]:
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["VLLM_HUST_EXT_CONFIG"] = str(config)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    try:
        done = subprocess.run([str(CLI), *args], stdout=write_end, stderr=subprocess.PIPE,
                              env=env, text=True, timeout=120, check=False)
    finally:
        os.close(write_end)
    return done.returncode, done.stderr


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize(
    "args",
    [["extension", "inspect", "org.vllm-hust.bidkv"], ["extension", "list"], ["--help"],
     ["--version"]],
    ids=["inspect", "list", "help", "version"],
)
def test_a_reader_that_left_ends_the_manager_quietly(
    tmp_path: Path, args: list[str], buffered: bool
) -> None:
    """Exit 141 and nothing on stderr: no usage line, no error, no traceback. (Unbuffered,
    argparse itself ignores a failed write of --help or --version and exits 0.)"""
    code, err = _run_into_closed_pipe(args, tmp_path / "config.json", buffered=buffered)
    swallowed_by_argparse = args[0].startswith("--") and not buffered
    assert (code, err) == (0 if swallowed_by_argparse else 128 + 13, "")


def test_a_verb_still_saves_its_change_when_the_reader_left(tmp_path: Path) -> None:
    """``enable`` saved the state before printing its line; the pipe does not undo it."""
    config = tmp_path / "config.json"
    code, err = _run_into_closed_pipe(["extension", "enable", "org.vllm-hust.bidkv"], config,
                                      buffered=False)
    assert (code, err) == (141, "")
    assert '"enabled": true' in config.read_text()
