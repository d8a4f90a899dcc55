"""Helpers shared by the manager's in-process CLI tests."""

from __future__ import annotations

import pytest
from hust_ext_manager.cli import main


def invoke(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run ``vllm-hust-ext ARGV`` in-process: (exit code, stdout, stderr)."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = int(stop.code or 0)
    out, err = capsys.readouterr()
    return code, out, err
