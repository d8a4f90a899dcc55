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
