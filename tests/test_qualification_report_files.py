"""How the qualification writes record.json and report.md.

Guards: both are replaced atomically, so a write that fails keeps the previous file and
leaves no temporary file beside it (report.md used to be written in place); both get the
mode any new file gets under the umask (record.json used to be created 0600 by
``tempfile.mkstemp``, so a record copied into a shared records folder could not be read
by the release check run by another user); a second run replaces both.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from qualification.profile import PROFILE_DIR, load_profile
from qualification.report import write_json_atomic, write_markdown
from qualification.runner import build_record


def _record() -> dict[str, object]:
    record = build_record(load_profile(str(PROFILE_DIR / "cpu-replay.toml")), [], 3)
    record["gate"] = {"passed": True}
    return record


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_files_get_the_umask_mode(tmp_path: Path, umask_022: None) -> None:
    write_json_atomic(tmp_path / "record.json", {"a": 1})
    write_markdown(tmp_path / "report.md", _record(), [])
    assert _mode(tmp_path / "record.json") == 0o644
    assert _mode(tmp_path / "report.md") == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json", "report.md"]


def test_a_tighter_umask_is_honoured(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        write_markdown(tmp_path / "report.md", _record(), [])
    finally:
        os.umask(old)
    assert _mode(tmp_path / "report.md") == 0o600


def test_a_failed_report_write_keeps_the_previous_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = tmp_path / "report.md"
    report.write_text("previous report\n")

    def no_space(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("qualification.report.os.replace", no_space)
    with pytest.raises(OSError, match="No space left"):
        write_markdown(report, _record(), [])
    assert report.read_text() == "previous report\n"
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]


def test_a_second_run_replaces_both(tmp_path: Path) -> None:
    write_json_atomic(tmp_path / "record.json", {"run": 1})
    write_json_atomic(tmp_path / "record.json", {"run": 2})
    record = _record()
    write_markdown(tmp_path / "report.md", record, [])
    first = (tmp_path / "report.md").read_text()
    record["gate"] = {"passed": False}
    write_markdown(tmp_path / "report.md", record, [])
    assert (tmp_path / "record.json").read_text() == '{\n  "run": 2\n}\n'
    assert "(PASSED)" in first and "(FAILED)" in (tmp_path / "report.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json", "report.md"]


def test_a_cell_name_with_a_pipe_keeps_every_table_row_whole(tmp_path: Path) -> None:
    """A cell may be named with a "|" (any printable directory name): every table of
    report.md escapes it, so each row has as many columns as its table's header."""
    import re

    from qualification.verdict import ArmResult, Pair, evaluate_cell

    def arm(name: str, throughput: float) -> ArmResult:
        counters = {"calls": 3, "selections": 1, "abstentions": 2, "failures": 0,
                    "invalid_selections": 0}
        return ArmResult(arm=name, throughput=throughput, latency_p95=1.0, ttft_p50=0.1,
                         ttft_p95=0.2, latency_p50=0.5, requests=4, completed=4,
                         counters=counters, policy_enabled=name == "candidate",
                         short_hash="abc", preemptions=2)

    pairs = [Pair("a|b", r, "baseline", arm("baseline", 100.0), arm("candidate", 101.0 + r))
             for r in range(3)]
    outcome = evaluate_cell("a|b", pairs, cancel_bound_s=None, tensor_parallel_size=1)
    record = build_record(load_profile(str(PROFILE_DIR / "cuda.toml")), [outcome], 3)
    record["gate"] = {"passed": False}
    record["blocked_cells"] = ["c|d"]
    write_markdown(tmp_path / "report.md", record, [outcome])
    lines = (tmp_path / "report.md").read_text().splitlines()
    tables: list[list[int]] = [[]]
    for line in lines:
        if line.startswith("|"):
            tables[-1].append(len(re.findall(r"(?<!\\)\|", line)))
        elif tables[-1]:
            tables.append([])
    tables = [t for t in tables if t]
    assert len(tables) >= 4
    for columns in tables:
        assert set(columns) == {columns[0]}, columns
    assert sum(line.startswith("| a\\|b |") for line in lines) >= 4
    assert "| c\\|d | 0 |" in "\n".join(lines)
