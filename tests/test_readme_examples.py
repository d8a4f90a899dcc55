"""The Python examples in README.md and the docs run as written, and print what they say.

Guarded behaviour: every fenced ``python`` block of README.md, docs/*.md,
benchmarks/README.md, benchmarks/replay/README.md and qualification/README.md is run in a
fresh interpreter (from an empty directory, so only the installed packages count) and must
exit 0; README's API example must list the reference BidKV's strategy names it shows in its
comments (``largest-first``, ``preempt-evict``, ``static-random``) and name the
``preempt-evict`` strategy as such. So an example cannot rot when an API changes.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
        REPO / "benchmarks" / "README.md", REPO / "benchmarks" / "replay" / "README.md",
        REPO / "qualification" / "README.md"]
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
ENV = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1"}


def python_blocks(path: Path) -> list[str]:
    return _BLOCK.findall(path.read_text(encoding="utf-8"))


def run_block(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=120, check=False)


EXAMPLES = [(path, i, code) for path in DOCS for i, code in enumerate(python_blocks(path))]


def test_readme_has_python_examples() -> None:
    assert python_blocks(REPO / "README.md"), "README.md lost its Python example"


@pytest.mark.parametrize(
    ("path", "index", "code"), EXAMPLES,
    ids=[f"{p.relative_to(REPO)}#{i}" for p, i, _ in EXAMPLES],
)
def test_example_runs(path: Path, index: int, code: str, tmp_path: Path) -> None:
    done = run_block(code, tmp_path)
    assert done.returncode == 0, f"{path.relative_to(REPO)} block {index}:\n{done.stderr}"


def test_readme_api_example_prints_what_its_comments_say(tmp_path: Path) -> None:
    code = next(c for c in python_blocks(REPO / "README.md") if "BaselineRegistry" in c)
    lines = run_block(code, tmp_path).stdout.splitlines()
    names = ast.literal_eval(lines[0])
    for name in ("largest-first", "preempt-evict", "static-random"):
        assert name in names
    assert lines[1] == "preempt-evict"


def test_a_broken_example_is_caught(tmp_path: Path) -> None:
    # The harness itself must be able to fail: a renamed API makes the run exit non-zero.
    code = python_blocks(REPO / "README.md")[0].replace("BidKVConfig", "BidKVConfigOld")
    assert run_block(code, tmp_path).returncode != 0
