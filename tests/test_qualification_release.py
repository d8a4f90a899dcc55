"""Guards `python -m qualification release-check`: versions must agree across
`_version.py`, pyproject (a static version, or one read dynamically from exactly
`bidkv_ext._version.__version__`), every registered manifest (at the package path or under
`src/`; the BidKV bundle must be registered) and CHANGELOG.md, and a passing record (gate
`passed` exactly true, this project's record schema; a record file or a directory) for the
manifest's valid host range and, when present, its `_manager_runtime_qualification` profile
(an object; accelerator, model, TP, mode, its runtime commit when the record names one, and
a passed functional status) must exist; failures list everything missing, a tree file that
is not a regular file (a FIFO) included, without waiting on it. Also (from a mutation audit):
the CHANGELOG section is matched literally (a local version segment), a profile matches only
on the keys it names, a `vllm-hust-extension-v1.json` manifest is found, and only passing
records are listed as matched."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from qualification import RECORD_SCHEMA
from qualification.cli import main
from qualification.release import check_release

REPO = Path(__file__).resolve().parent.parent

PYPROJECT = """\
[project]
name = "vllm-hust-bidkv"
dynamic = ["version"]

[project.entry-points."vllm_hust.extension_bundles"]
"org.vllm-hust.bidkv" = "manifests.bidkv"

[tool.setuptools.dynamic]
version = { attr = "bidkv_ext._version.__version__" }
"""


def _profile(**change: object) -> dict[str, object]:
    """A manifest qualification profile matching ``_record``'s defaults, with ``change``."""
    return {"accelerator": "cuda", "model": "M", "tensor_parallel_size": 1,
            "execution_mode": "graph", "functional_compatibility": {"status": "passed"},
            **change}


def _tree(tmp: Path, version: str = "1.2.3", profile: dict[str, object] | None = None, *,
          changelog: str | None = None,
          manifest_name: str = "vllm-hust-extension-v0.2.json") -> Path:
    root = tmp / "repo"
    (root / "src" / "bidkv_ext").mkdir(parents=True)
    (root / "src" / "bidkv_ext" / "_version.py").write_text(f'__version__ = "{version}"\n')
    (root / "pyproject.toml").write_text(PYPROJECT)
    manifest = json.loads((REPO / "manifests/bidkv/vllm-hust-extension-v0.2.json").read_text())
    manifest["extension_version"] = version
    if profile is not None:
        manifest["activation"]["additional_config"] = {"_manager_runtime_qualification": profile}
    (root / "manifests" / "bidkv").mkdir(parents=True)
    (root / "manifests/bidkv" / manifest_name).write_text(json.dumps(manifest))
    (root / "CHANGELOG.md").write_text(
        changelog if changelog is not None
        else f"# Changelog\n\n## [Unreleased]\n\n## [{version}] - 2026-10-01\n"
    )
    return root


def _record(
    dest: Path,
    *,
    version: str = "1.2.3",
    host: str = "0.33.0",
    passed: object = True,
    accelerator: str = "cuda",
    tp: int = 1,
    commit: str | None = None,
    schema: str = RECORD_SCHEMA,
    mode: str = "graph",
) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    doc = {
        "schema": schema,
        "extension": {"id": "org.vllm-hust.bidkv", "version": version, "commit": commit},
        "host": {"name": "vllm", "version": host},
        "profile": {
            "name": "x",
            "accelerator": accelerator,
            "model": "M",
            "tensor_parallel_size": tp,
            "execution_mode": mode,
        },
        "gate": {"passed": passed, "failures": [] if passed else ["cell: gate"]},
    }
    path = dest / "record.json"
    path.write_text(json.dumps(doc))
    return path


def test_passing_release(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _tree(tmp_path)
    _record(tmp_path / "records" / "run1")
    result = check_release(root, [tmp_path / "records"])
    assert result.passed, result.problems
    assert result.version == "1.2.3"
    assert main(["release-check", "--root", str(root), "--records", str(tmp_path / "records")]) == 0
    assert "passed for 1.2.3" in capsys.readouterr().out


def test_every_problem_is_listed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _tree(tmp_path)
    (root / "CHANGELOG.md").write_text("# Changelog\n\n## [Unreleased]\n")
    manifest = root / "manifests/bidkv/vllm-hust-extension-v0.2.json"
    doc = json.loads(manifest.read_text())
    doc["extension_version"] = "1.2.2"
    manifest.write_text(json.dumps(doc))
    result = check_release(root, [tmp_path / "none"])
    text = "\n".join(result.problems)
    assert "extension_version 1.2.2 != 1.2.3" in text
    assert "no released section '## [1.2.3]'" in text
    assert "no passing qualification record" in text
    assert len(result.problems) == 3
    (tmp_path / "none").mkdir()  # exists but holds no record
    code = main(["release-check", "--root", str(root), "--records", str(tmp_path / "none")])
    assert code == 1
    assert "FAILED" in capsys.readouterr().out


def test_missing_records_path_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A --records path that does not exist is a typo (exit 2, one line naming it), not a
    # failed release check (exit 1).
    root = _tree(tmp_path)
    _record(tmp_path / "records")
    missing = tmp_path / "no-such-records"
    argv = ["release-check", "--root", str(root), "--records", str(tmp_path / "records")]
    assert main([*argv, "--records", str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("qualification: error: --records ")
    assert str(missing) in captured.err and captured.err.count("\n") == 1
    assert captured.out == ""


def test_static_pyproject_version_must_agree(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "pyproject.toml").write_text(
        PYPROJECT.replace('dynamic = ["version"]', 'version = "9.9"')
    )
    _record(tmp_path / "records")
    problems = check_release(root, [tmp_path / "records"]).problems
    assert problems == ("pyproject.toml version 9.9 != _version.py 1.2.3",)


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"passed": False}, "gate did not pass"),
        ({"version": "1.2.2"}, "extension version 1.2.2 != 1.2.3"),
        ({"host": "0.34.0"}, "host version 0.34.0 outside"),
        ({"accelerator": "cpu"}, "a CPU replay record is the CI gate, not a release"),
        ({"accelerator": ""}, "names no accelerator"),
    ],
)
def test_record_must_pass_for_this_version_and_host_range(
    tmp_path: Path, kw: dict[str, object], why: str
) -> None:
    root = _tree(tmp_path)
    _record(tmp_path / "records", **kw)  # type: ignore[arg-type]
    result = check_release(root, [tmp_path / "records"])
    assert not result.passed
    assert why in result.problems[0]


def test_manifest_profile_must_match_a_record(tmp_path: Path) -> None:
    profile = _profile(accelerator="ascend", tensor_parallel_size=4)
    root = _tree(tmp_path, profile=profile)
    _record(tmp_path / "records" / "cuda")
    result = check_release(root, [tmp_path / "records"])
    assert not result.passed
    assert "_manager_runtime_qualification" in result.problems[0]
    assert "'accelerator': ('ascend', 'cuda')" in result.problems[0]
    _record(tmp_path / "records" / "ascend", accelerator="ascend", tp=4)
    assert check_release(root, [tmp_path / "records"]).passed


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('attr = "bidkv_ext._version.__version__"', 'attr = "bidkv_ext.other.__version__"'),
        ('dynamic = ["version"]', 'dynamic = ["readme"]'),
    ],
)
def test_dynamic_version_must_come_from_version_py(tmp_path: Path, old: str, new: str) -> None:
    root = _tree(tmp_path)
    (root / "pyproject.toml").write_text(PYPROJECT.replace(old, new))
    _record(tmp_path / "records")
    (problem,) = check_release(root, [tmp_path / "records"]).problems
    assert problem.startswith(
        "pyproject.toml: version must be dynamic from bidkv_ext._version.__version__")


def test_the_bidkv_bundle_must_be_registered(tmp_path: Path) -> None:
    """Without the BidKV entry point nothing names the manifest whose host range and record
    make the release: that is a problem, not a silent pass."""
    root = _tree(tmp_path)
    (root / "pyproject.toml").write_text(PYPROJECT.replace('"org.vllm-hust.bidkv" =', '"x.y" ='))
    _record(tmp_path / "records")
    result = check_release(root, [tmp_path / "records"])
    assert not result.passed
    assert result.problems == (
        "pyproject.toml registers no vllm_hust.extension_bundles entry point "
        "'org.vllm-hust.bidkv'",)


def test_a_manifest_under_src_is_found(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "src" / "manifests").mkdir()
    (root / "manifests").rename(root / "src" / "manifests")
    _record(tmp_path / "records")
    assert check_release(root, [tmp_path / "records"]).passed


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"passed": "yes"}, "gate did not pass"),  # only a JSON true passes
        ({"schema": "other/1"}, None),  # another tool's record is not read at all
    ],
)
def test_only_a_passing_record_of_this_schema_counts(
    tmp_path: Path, kw: dict[str, object], why: str | None
) -> None:
    root = _tree(tmp_path)
    _record(tmp_path / "records", **kw)  # type: ignore[arg-type]
    (problem,) = check_release(root, [tmp_path / "records"]).problems
    assert problem.startswith("no passing qualification record for 1.2.3")
    assert (f"record.json ({why})" in problem) if why else ("rejected" not in problem)


def test_records_may_be_given_as_a_file(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    path = _record(tmp_path / "records")
    result = check_release(root, [path])
    assert result.passed and result.matched_records == (str(path),)


@pytest.mark.parametrize(
    ("change", "record_commit", "passes"),
    [
        ({"tested_runtime_commit": "abc123"}, "abc123", True),
        ({"tested_runtime_commit": "abc123"}, None, True),  # the record names no commit
        ({"tested_runtime_commit": "abc123"}, "def456", False),
        ({"functional_compatibility": {"status": "failed"}}, None, False),
    ],
)
def test_manifest_profile_commit_and_functional_status(
    tmp_path: Path, change: dict[str, object], record_commit: str | None, passes: bool
) -> None:
    profile = _profile(**change)
    root = _tree(tmp_path, profile=profile)
    _record(tmp_path / "records", commit=record_commit)
    result = check_release(root, [tmp_path / "records"])
    assert result.passed is passes, result.problems
    if not passes:
        assert "_manager_runtime_qualification" in result.problems[0]


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (
            lambda m: m["host"].update(version_range="not a range"),
            "org.vllm-hust.bidkv manifest: host.version_range 'not a range' is invalid",
        ),
        (
            lambda m: m["activation"].update(
                additional_config={"_manager_runtime_qualification": "cuda"}),
            "org.vllm-hust.bidkv manifest: _manager_runtime_qualification must be an object",
        ),
    ],
)
def test_malformed_primary_manifest_fields_are_listed(
    tmp_path: Path, edit: object, problem: str
) -> None:
    root = _tree(tmp_path)
    path = root / "manifests/bidkv/vllm-hust-extension-v0.2.json"
    manifest = json.loads(path.read_text())
    edit(manifest)  # type: ignore[operator]
    path.write_text(json.dumps(manifest))
    _record(tmp_path / "records")
    assert problem in check_release(root, [tmp_path / "records"]).problems


def test_the_repository_itself_is_checked(tmp_path: Path) -> None:
    # Today's tree: whatever it lacks is listed, nothing raises.
    result = check_release(REPO, [tmp_path])
    assert result.version is not None
    assert any("no passing qualification record" in p for p in result.problems)


def test_missing_version_file(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    shutil.rmtree(root / "src")
    result = check_release(root, [])
    assert not result.passed and "_version.py" in result.problems[0]


@pytest.mark.parametrize(
    "target", ["src/bidkv_ext/_version.py", "pyproject.toml", "manifest", "CHANGELOG.md"]
)
def test_non_utf8_file_is_a_listed_problem(
    tmp_path: Path, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file that is not UTF-8 is one listed problem naming it and what was expected
    (exit 1), not a UnicodeDecodeError traceback."""
    root = _tree(tmp_path)
    _record(tmp_path / "records")
    name = "manifests/bidkv/vllm-hust-extension-v0.2.json" if target == "manifest" else target
    path = root / name
    path.write_bytes(b"\xff\xfe" + path.read_bytes())
    argv = ["release-check", "--root", str(root), "--records", str(tmp_path / "records")]
    assert main(argv) == 1
    out = capsys.readouterr().out
    (problem,) = [line for line in out.splitlines() if str(path) in line]
    assert "can't decode byte 0xff" in problem and "expected a UTF-8" in problem


@pytest.mark.parametrize(
    "target", ["src/bidkv_ext/_version.py", "pyproject.toml", "manifest", "CHANGELOG.md"]
)
def test_a_fifo_in_the_tree_is_a_listed_problem_not_a_hang(
    tmp_path: Path, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A FIFO where a tree file should be (which a plain open() waits on forever) is one
    listed problem naming it (exit 1), found at once."""
    root = _tree(tmp_path)
    _record(tmp_path / "records")
    name = "manifests/bidkv/vllm-hust-extension-v0.2.json" if target == "manifest" else target
    path = root / name
    path.unlink()
    os.mkfifo(path)
    argv = ["release-check", "--root", str(root), "--records", str(tmp_path / "records")]
    codes: list[int] = []
    worker = threading.Thread(target=lambda: codes.append(main(argv)), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), f"release-check blocked on the FIFO at {name}"
    assert codes == [1]
    lines = capsys.readouterr().out.splitlines()
    if target == "manifest":  # the manifest search looks for regular files only
        assert any("no manifest under manifests.bidkv" in line for line in lines), lines
    else:
        assert any(str(path) in line and "not a regular file" in line for line in lines), lines


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (PYPROJECT, 'project = "x"\n', "pyproject.toml: project is a string; expected a table"),
        (
            '[project.entry-points."vllm_hust.extension_bundles"]\n',
            '[project.entry-points]\n"vllm_hust.extension_bundles" = 3\n[x]\n',
            'pyproject.toml: project.entry-points."vllm_hust.extension_bundles" is an integer; '
            "expected a table",
        ),
        (
            'version = { attr = "bidkv_ext._version.__version__" }',
            'version = ["bidkv_ext._version.__version__"]',
            "pyproject.toml: tool.setuptools.dynamic.version is an array; expected a table",
        ),
        ('dynamic = ["version"]', "dynamic = 1", "version must be dynamic"),
    ],
)
def test_pyproject_value_of_the_wrong_type_is_a_listed_problem(
    tmp_path: Path, old: str, new: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pyproject value that is not the table (or array) the check navigates is a listed
    problem naming it, not an AttributeError/TypeError traceback from `.get` or `in`."""
    root = _tree(tmp_path)
    _record(tmp_path / "records")
    text = PYPROJECT.replace(old, new)
    assert text != PYPROJECT
    (root / "pyproject.toml").write_text(text)
    argv = ["release-check", "--root", str(root), "--records", str(tmp_path / "records")]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert out.count(message) == 1, out


HUGE = "1" + "0" * 5000  # over Python's 4300-digit int-from-string limit
DEEP = "[" * 100_000


@pytest.mark.parametrize(
    ("target", "text", "message"),
    [
        ("pyproject.toml", f"x = {HUGE}\n", "cannot be read as TOML (Exceeds the limit"),
        ("pyproject.toml", f"x = {DEEP}\n", "cannot be read as TOML (nested too deeply)"),
        ("manifest", f'{{"x": {HUGE}}}', "cannot be read as JSON (Exceeds the limit"),
        ("manifest", DEEP, "cannot be read as JSON (nested too deeply)"),
    ],
)
def test_hostile_tree_file_is_a_listed_problem(
    tmp_path: Path, target: str, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A huge integer (a plain ValueError) or deep nesting (RecursionError) in pyproject or
    a manifest is one listed problem naming the file (exit 1), not a traceback."""
    root = _tree(tmp_path)
    _record(tmp_path / "records")
    name = "manifests/bidkv/vllm-hust-extension-v0.2.json" if target == "manifest" else target
    (root / name).write_text(text)
    argv = ["release-check", "--root", str(root), "--records", str(tmp_path / "records")]
    assert main(argv) == 1
    out = capsys.readouterr().out
    (problem,) = [line for line in out.splitlines() if str(root / name) in line]
    assert message in problem


@pytest.mark.parametrize(
    ("text", "message"),
    [(f'{{"schema": {HUGE}}}', "value has 5001 digits"), (DEEP, "nested too deeply")],
)
def test_hostile_record_is_named_not_a_traceback(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _tree(tmp_path)
    records = tmp_path / "records"
    records.mkdir()
    (records / "bad.json").write_text(text)
    assert main(["release-check", "--root", str(root), "--records", str(records)]) == 1
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if "bad.json (cannot be read as JSON: " in line]
    assert message in line
    # A readable passing record beside it still qualifies the release.
    _record(records / "run1")
    assert main(["release-check", "--root", str(root), "--records", str(records)]) == 0


@pytest.mark.parametrize(
    ("location", "problem"),
    [
        ("{elsewhere}", "manifest location '{elsewhere}' is not a dotted package path"),
        ("manifests/../../x", "manifest location 'manifests/../../x' is not a dotted"),
        ("manifests." + "b" * 300, "cannot be examined (File name too long)"),
    ],
)
def test_a_manifest_location_outside_the_tree_is_a_listed_problem(
    tmp_path: Path, location: str, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bundle entry point naming a path outside the root (whose manifest, at the wrong
    extension_version, is not what is released) used to end in a ValueError traceback from
    ``relative_to``; a dotted part too long for a file name, in an OSError one. Each is one
    listed problem naming the bundle (exit 1)."""
    root = _tree(tmp_path)
    _record(tmp_path / "records")
    elsewhere = tmp_path / "elsewhere" / "fakem"
    elsewhere.mkdir(parents=True)
    manifest = root / "manifests/bidkv/vllm-hust-extension-v0.2.json"
    doc = json.loads(manifest.read_text())
    doc["extension_version"] = "9.9.9"
    (elsewhere / manifest.name).write_text(json.dumps(doc))
    location = location.format(elsewhere=elsewhere)
    (root / "pyproject.toml").write_text(PYPROJECT.replace('"manifests.bidkv"', f'"{location}"'))
    argv = ["release-check", "--root", str(root), "--records", str(tmp_path / "records")]
    assert main(argv) == 1
    lines = capsys.readouterr().out.splitlines()
    (line,) = [line for line in lines if "org.vllm-hust.bidkv:" in line]
    assert line.startswith("  - bundle org.vllm-hust.bidkv: ")
    assert problem.format(elsewhere=elsewhere) in line, lines


@pytest.mark.parametrize(
    ("change", "tp", "commit"),
    [
        ({}, True, None),  # JSON true is not a tensor parallel size of 1
        ({"tensor_parallel_size": 4}, 4.0, None),
        ({"tested_runtime_commit": "abc123"}, 1, False),  # false is not "no commit"
        ({"tested_runtime_commit": "abc123"}, 1, ""),
        ({"tested_runtime_commit": "abc123"}, 1, ["abc123"]),
    ],
)
def test_a_record_value_of_another_type_does_not_match_the_manifest_profile(
    tmp_path: Path, change: dict[str, object], tp: object, commit: object
) -> None:
    """Rule 5 compared with Python's ``==``, so a record's ``true`` or ``4.0`` matched the
    manifest's tensor parallel size 1 or 4, and a commit of ``false`` or ``""`` counted as
    naming no commit: a record matches only with values of the profile's own types."""
    root = _tree(tmp_path, profile=_profile(**change))
    _record(tmp_path / "records", tp=tp, commit=commit)  # type: ignore[arg-type]
    result = check_release(root, [tmp_path / "records"])
    assert not result.passed
    (problem,) = result.problems
    assert problem.startswith("no passing record matches the manifest's"), problem


def test_a_version_with_a_local_segment_finds_its_changelog_section(tmp_path: Path) -> None:
    """release rule 3: the section ``## [<version>]`` is matched literally: a '+' or '.'
    in the version is not a regular-expression operator."""
    root = _tree(tmp_path / "a", "1.2.3+hust.1")
    _record(tmp_path / "a" / "records", version="1.2.3+hust.1")
    result = check_release(root, [tmp_path / "a" / "records"])
    assert result.passed, result.problems
    lookalike = _tree(tmp_path / "b", changelog="# Changelog\n\n## [1x2x3]\n")
    _record(tmp_path / "b" / "records")
    problems = check_release(lookalike, [tmp_path / "b" / "records"]).problems
    assert problems == ("CHANGELOG.md has no released section '## [1.2.3]'",)


def test_a_manifest_profile_matches_only_on_the_keys_it_names(tmp_path: Path) -> None:
    """release rule 5 matches the profile's accelerator, model, TP and mode *when present*:
    a profile naming only the accelerator and model does not demand the others."""
    root = _tree(tmp_path, profile={"accelerator": "cuda", "model": "M"})
    _record(tmp_path / "records")
    result = check_release(root, [tmp_path / "records"])
    assert result.passed, result.problems


def test_a_manifest_profile_execution_mode_must_match_a_record(tmp_path: Path) -> None:
    """release rule 5: execution mode is one of the matched keys (a graph-mode
    qualification does not cover an eager run, qualification.md §1)."""
    root = _tree(tmp_path, profile={"accelerator": "cuda", "model": "M",
                                            "execution_mode": "graph"})
    _record(tmp_path / "records", mode="eager")
    result = check_release(root, [tmp_path / "records"])
    assert not result.passed
    assert "execution_mode" in result.problems[0]


def test_a_v1_manifest_is_found(tmp_path: Path) -> None:
    """release rule 2 reads the bundle manifest under either name the manager reads,
    ``vllm-hust-extension-v0.2.json`` or ``vllm-hust-extension-v1.json``."""
    root = _tree(tmp_path, manifest_name="vllm-hust-extension-v1.json")
    _record(tmp_path / "records")
    result = check_release(root, [tmp_path / "records"])
    assert result.passed, result.problems


def test_only_passing_records_are_listed_as_matched(tmp_path: Path) -> None:
    """``release-check`` prints the records the release rests on: a failed record beside
    the passing one is not one of them."""
    root = _tree(tmp_path)
    good = _record(tmp_path / "records" / "good")
    _record(tmp_path / "records" / "bad", passed=False)
    result = check_release(root, [tmp_path / "records"])
    assert result.passed, result.problems
    assert result.matched_records == (str(good),)
