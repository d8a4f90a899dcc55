"""The ``vllm-hust-ext`` state file: format, migration, refusal of bad files, concurrency.

Guards: writes are schema 2, sorted, mode 0600 and atomic; schema 1 is migrated on the
next write; a corrupt or unknown-schema file is refused with exit 2 and left byte-for-byte
untouched by every mutating verb; 20 manager processes enabling, disabling and
configuring different ids at the same moment lose none of their updates (the lock file).
Bad input is one error line naming the file or variable: JSON the parser rejects with a
plain ValueError (an over-long integer), a whitespace-only ``VLLM_HUST_EXT_CONFIG``, a
state path that is a FIFO (refused at once, never waited on) or a directory (refused
before its lock file is made), a ``VLLM_HUST_EXT_CONFIG`` spelled as a directory ("/"),
a ``configure --file`` FIFO or directory, a state file whose directory cannot be made. As in
the official manager, unknown top-level keys are ignored and NaN is read and written back.
A symlinked state file stays a link, and its target gets the new state. ``list``,
``inspect`` and ``status`` show the stored enabled flag; ``configure`` needs an installed
bundle.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hust_ext_manager import state as state_module
from hust_ext_manager.state import load_state, parse_state

from tests.manager_helpers import invoke, within

ROOT = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).with_name("vllm-hust-ext"))
BASE = json.loads((ROOT / "manifests" / "bidkv" / "vllm-hust-extension-v0.2.json").read_text())


def write_bundles(site: Path, ids: list[str]) -> None:
    """One fake installed distribution registering a valid manifest per id."""
    info = site / "fake_many-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-many\nVersion: 1.0\n")
    lines = ["[vllm_hust.extension_bundles]"]
    record = []
    for index, bundle_id in enumerate(ids):
        relative = f"fakemany/b{index}/vllm-hust-extension-v0.2.json"
        (site / relative).parent.mkdir(parents=True)
        (site / relative).write_text(json.dumps({**BASE, "extension_id": bundle_id}))
        lines.append(f"{bundle_id} = fakemany.b{index}")
        record.append(f"{relative},,\n")
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    (info / "RECORD").write_text("".join(record))


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cfg" / "config.json"
    monkeypatch.setenv("VLLM_HUST_EXT_CONFIG", str(path))
    site = tmp_path / "site"
    write_bundles(site, ["org.test.a", "org.test.b"])
    monkeypatch.syspath_prepend(str(site))
    return path


def test_enable_writes_schema_2_atomically_with_mode_0600(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert invoke(["extension", "enable", "org.test.a"], capsys)[:2] == (0, "enabled org.test.a\n")
    text = config.read_text()
    assert text.endswith("\n")
    assert json.loads(text) == {
        "schema_version": 2,
        "extensions": {"org.test.a": {"enabled": True, "configuration": {}}},
    }
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert [p.name for p in config.parent.iterdir() if p.name.startswith(".config-")] == []


def test_schema_1_is_migrated_on_the_next_write(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps({"schema_version": 1, "enabled": ["org.test.a"]}))
    assert load_state(config).is_enabled("org.test.a")
    assert invoke(["extension", "disable", "org.test.b"], capsys)[0] == 0
    assert json.loads(config.read_text()) == {
        "schema_version": 2,
        "extensions": {
            "org.test.a": {"enabled": True, "configuration": {}},
            "org.test.b": {"enabled": False, "configuration": {}},
        },
    }


def test_configure_keeps_enabled_and_disable_keeps_configuration(
    config: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    settings = tmp_path / "settings.json"
    settings.write_text('{"host_version": "0.33.0"}')
    assert invoke(["extension", "enable", "org.test.a"], capsys)[0] == 0
    assert invoke(["extension", "configure", "org.test.a", "--file", str(settings)], capsys)[
        :2
    ] == (
        0,
        "configured org.test.a\n",
    )
    assert invoke(["extension", "disable", "org.test.a"], capsys)[0] == 0
    entry = json.loads(config.read_text())["extensions"]["org.test.a"]
    assert entry == {"enabled": False, "configuration": {"host_version": "0.33.0"}}
    settings.write_text("[1]")
    code, _, err = invoke(["extension", "configure", "org.test.a", "--file", str(settings)], capsys)
    assert code == 2
    assert "extension configuration file must contain an object" in err
    settings.write_bytes(b"\xff{}")
    code, _, err = invoke(["extension", "configure", "org.test.a", "--file", str(settings)], capsys)
    assert code == 2
    assert f"extension configuration file {settings} is not valid UTF-8 JSON" in err


def test_configure_refuses_nesting_the_state_file_cannot_hold(
    config: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """JSON's reader follows nesting that the state file's indenting writer cannot: such a
    configuration file is refused in one line naming it, and the stored state is kept as
    it was (it used to end in "internal error: RecursionError")."""
    assert invoke(["extension", "enable", "org.test.a"], capsys)[0] == 0
    settings = tmp_path / "deep.json"
    argv = ["extension", "configure", "org.test.a", "--file", str(settings)]

    def attempt(depth: int) -> tuple[int, str]:
        settings.write_text('{"x": ' + "[" * depth + "]" * depth + "}")
        code, _, err = invoke(argv, capsys)
        return code, err

    # The deepest nesting the command can read here (it depends on the stack in use).
    readable, unreadable = 1, sys.getrecursionlimit() + 1
    while unreadable - readable > 1:
        middle = (readable + unreadable) // 2
        _, err = attempt(middle)
        if "is not valid UTF-8 JSON" in err:
            unreadable = middle
        else:
            readable = middle
    before = config.read_bytes()  # shallower probes were stored: they fit
    code, err = attempt(readable)
    assert code == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == (
        f"vllm-hust-ext: error: extension configuration file {settings} is nested too deeply "
        "to store"
    )
    assert config.read_bytes() == before
    assert sorted(p.name for p in config.parent.iterdir()) == sorted(
        [config.name, config.name + ".lock"])


def test_an_error_keeps_the_spacing_of_the_path_it_names(
    config: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Each refusal is one line, so line breaks in a message become spaces; other runs of
    whitespace stay, or the line would name a path that does not exist."""
    folder = tmp_path / "in  two\tspaces"
    folder.mkdir()
    settings = folder / "settings.json"
    settings.write_text("[1")
    code, _, err = invoke(["extension", "configure", "org.test.a", "--file", str(settings)],
                          capsys)
    assert code == 2
    last = err.splitlines()[-1]
    assert f"extension configuration file {settings} is not valid UTF-8 JSON" in last


def test_forget_rules(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = invoke(["extension", "forget", "org.test.a"], capsys)
    assert (code, err.splitlines()[-1]) == (
        2,
        "vllm-hust-ext: error: extension 'org.test.a' has no stored state",
    )
    invoke(["extension", "enable", "org.test.a"], capsys)
    code, _, err = invoke(["extension", "forget", "org.test.a"], capsys)
    assert (code, err.splitlines()[-1]) == (
        2,
        "vllm-hust-ext: error: disable 'org.test.a' before forgetting its stored state",
    )
    invoke(["extension", "disable", "org.test.a"], capsys)
    assert invoke(["extension", "forget", "org.test.a"], capsys)[:2] == (0, "forgot org.test.a\n")
    assert json.loads(config.read_text())["extensions"] == {}


def test_list_and_inspect_show_the_stored_enabled_flag(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§4: ``list`` prints ``<id> <version> enabled|disabled``, ``inspect``/``list --json``
    carry ``enabled`` and ``status`` has the ``enabled`` state, each read from the state
    file."""
    assert invoke(["extension", "enable", "org.test.a"], capsys)[0] == 0
    code, out, _ = invoke(["extension", "list"], capsys)
    assert code == 0
    assert {"org.test.a 0.1.0 enabled", "org.test.b 0.1.0 disabled"} <= set(out.splitlines())
    code, out, _ = invoke(["extension", "inspect", "org.test.a"], capsys)
    assert code == 0 and json.loads(out)["enabled"] is True
    code, out, _ = invoke(["extension", "list", "--json"], capsys)
    shown = {d["bundle_id"]: d["enabled"] for d in json.loads(out) if "enabled" in d}
    assert (shown["org.test.a"], shown["org.test.b"]) == (True, False)
    for bundle_id, enabled in (("org.test.a", True), ("org.test.b", False)):
        code, out, err = invoke(["extension", "status", bundle_id], capsys)
        assert code == 0, err
        assert ("enabled" in json.loads(out)["states"]) is enabled


def test_configure_needs_an_installed_bundle(
    config: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """§4: ``configure`` resolves the bundle strictly, so an id that is not installed is
    refused and nothing is stored (unlike ``disable``)."""
    settings = tmp_path / "settings.json"
    settings.write_text("{}")
    code, _, err = invoke(
        ["extension", "configure", "org.test.gone", "--file", str(settings)], capsys
    )
    assert code == 2
    assert err.splitlines()[-1] == (
        "vllm-hust-ext: error: enabled Bundles are not installed: ['org.test.gone']"
    )
    assert not config.exists()


def test_disable_works_for_an_uninstalled_id(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert invoke(["extension", "disable", "org.test.gone"], capsys)[:2] == (
        0,
        "disabled org.test.gone\n",
    )


CORRUPT = [
    ("{broken", "is not valid JSON"),
    ("[]", "vllm-hust-ext config must be an object"),
    ('{"schema_version": 3, "extensions": {}}', "vllm-hust-ext config has an unsupported schema"),
    ('{"schema_version": "2", "extensions": {}}', "vllm-hust-ext config has an unsupported schema"),
    # JSON true == 1 and 1.0 == 1 in Python: neither is the integer schema 1 (nor 2.0 schema 2).
    ('{"schema_version": true, "enabled": []}', "vllm-hust-ext config has an unsupported schema"),
    ('{"schema_version": 1.0, "enabled": []}', "vllm-hust-ext config has an unsupported schema"),
    ('{"schema_version": 2.0, "extensions": {}}', "vllm-hust-ext config has an unsupported schema"),
    (
        '{"schema_version": 1, "enabled": "org.test.a"}',
        "legacy enabled must be an array of strings",
    ),
    (
        '{"schema_version": 1, "enabled": ["org.test.a", 7]}',
        "legacy enabled must be an array of strings",
    ),
    ('{"schema_version": 2, "extensions": []}', "vllm-hust-ext extensions must be an object"),
    ('{"schema_version": 2, "extensions": {"x": 1}}', "extension 'x' config must be an object"),
    (
        '{"schema_version": 2, "extensions": {"x": {"on": true}}}',
        "extension 'x' config has unknown keys: ['on']",
    ),
    (
        '{"schema_version": 2, "extensions": {"x": {"enabled": 1}}}',
        "extension 'x' enabled must be boolean",
    ),
    (
        '{"schema_version": 2, "extensions": {"x": {"configuration": []}}}',
        "extension 'x' configuration must be an object",
    ),
    # json.loads raises a plain ValueError (no JSONDecodeError) past the int digit limit.
    ('{"schema_version": 2' + "0" * 5000 + "}", "is not valid JSON: Exceeds the limit"),
]


@pytest.mark.parametrize(("text", "message"), CORRUPT, ids=[m[:60] for _, m in CORRUPT])
@pytest.mark.parametrize("verb", ["enable", "disable", "forget", "status", "configure"])
def test_bad_state_is_refused_and_never_overwritten(
    config: Path,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    text: str,
    message: str,
    verb: str,
) -> None:
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(text)
    before = config.read_bytes()
    settings = tmp_path / "s.json"
    settings.write_text("{}")
    argv = ["extension", verb, "org.test.a"] + (
        ["--file", str(settings)] if verb == "configure" else []
    )
    code, _, err = invoke(argv, capsys)
    assert code == 2
    assert message in err.splitlines()[-1]
    assert config.read_bytes() == before


def _cli(config: str, argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "VLLM_HUST_EXT_CONFIG": config}
    return subprocess.run(
        [CLI, *argv], env=environment, cwd=cwd, capture_output=True, text=True, timeout=60
    )


def _one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2 and "Traceback" not in done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith("vllm-hust-ext: error: ")
    return last


@pytest.mark.parametrize(
    ("text", "argv", "message"),
    [
        (
            '{"schema_version": 2' + "0" * 5000 + "}",
            ["extension", "list"],
            "is not valid JSON: Exceeds the limit (4300 digits)",
        ),
    ],
    ids=["oversized-integer"],
)
def test_a_bad_state_file_is_named_by_the_console_script(
    tmp_path: Path, text: str, argv: list[str], message: str
) -> None:
    path = tmp_path / "c.json"
    path.write_text(text)
    line = _one_error_line(_cli(str(path), argv, tmp_path))
    assert f"vllm-hust-ext config {path} {message}" in line
    assert path.read_text() == text


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_state_path_that_is_not_a_regular_file_is_refused_at_once(
    tmp_path: Path, kind: str
) -> None:
    """A FIFO at the state path (which a plain open() would wait on forever) or a directory:
    a reading and a mutating verb each exit 2 at once with one line naming the path, and
    the path is left as it was, with no temp file beside it."""
    path = tmp_path / "c.json"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    for argv in (["extension", "list"], ["extension", "disable", "org.test.a"]):
        line = _one_error_line(_cli(str(path), argv, tmp_path))
        assert line == f"vllm-hust-ext: error: vllm-hust-ext config {path} is not a regular file"
    assert stat.S_ISFIFO(path.stat().st_mode) if kind == "fifo" else path.is_dir()
    assert not list(tmp_path.glob(".config-*"))


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_configuration_file_that_is_not_a_regular_file_is_refused_at_once(
    config: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path, kind: str
) -> None:
    """``configure --file`` at a FIFO (which a plain open() waits on forever) or a
    directory: exit 2 at once, one line naming the file and what was expected, and the
    stored state is left as it was."""
    assert invoke(["extension", "enable", "org.test.a"], capsys)[0] == 0
    before = config.read_bytes()
    settings = tmp_path / "settings.json"
    if kind == "fifo":
        os.mkfifo(settings)
    else:
        settings.mkdir()
    with within(10):
        code, out, err = invoke(
            ["extension", "configure", "org.test.a", "--file", str(settings)], capsys)
    assert (code, out) == (2, "") and "Traceback" not in err
    assert err.splitlines()[-1] == (
        f"vllm-hust-ext: error: extension configuration file {settings} is not a regular "
        "file or an unnamed pipe: expected a UTF-8 JSON object in a file or a shell's pipe")
    assert config.read_bytes() == before


def test_a_missing_configuration_file_is_named_with_the_systems_reason(
    config: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``configure --file`` at a path that does not exist: one line naming the file and the
    operating system's reason in words (its ``strerror``, not an exception class name),
    and the stored state is left as it was."""
    assert invoke(["extension", "enable", "org.test.a"], capsys)[0] == 0
    before = config.read_bytes()
    missing = tmp_path / "nowhere.json"
    code, out, err = invoke(
        ["extension", "configure", "org.test.a", "--file", str(missing)], capsys)
    assert (code, out) == (2, "")
    assert err.splitlines()[-1] == (
        f"vllm-hust-ext: error: extension configuration file {missing} cannot be read "
        "(No such file or directory): expected a UTF-8 JSON object in a file or a shell's "
        "pipe")
    assert config.read_bytes() == before


def test_a_fifo_is_named_when_proc_cannot_say(
    config: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where ``/proc`` cannot say whether a FIFO has a name (its link cannot be read), it
    counts as named: ``configure --file`` refuses it at once, as not a regular file,
    rather than reading a FIFO whose writer may never come."""
    assert invoke(["extension", "enable", "org.test.a"], capsys)[0] == 0
    settings = tmp_path / "settings.json"
    os.mkfifo(settings)

    def unreadable(path: object, *args: object, **kwargs: object) -> str:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "readlink", unreadable)
    with within(10):
        code, _, err = invoke(
            ["extension", "configure", "org.test.a", "--file", str(settings)], capsys)
    assert code == 2 and err.splitlines()[-1] == (
        f"vllm-hust-ext: error: extension configuration file {settings} is not a regular "
        "file or an unnamed pipe: expected a UTF-8 JSON object in a file or a shell's pipe")


def test_a_configuration_file_may_be_a_shells_pipe(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``configure --file <(...)`` (or ``/dev/stdin`` in a pipeline) names an unnamed pipe
    whose writer exists from the start: it is read to its end, here from a writer that
    answers late, not refused as a FIFO would be."""
    assert invoke(["extension", "enable", "org.test.a"], capsys)[0] == 0
    writer = subprocess.Popen(
        ["sh", "-c", "sleep 0.3; printf '%s' '{\"environment\": {\"A\": \"1\"}}'"],
        stdout=subprocess.PIPE)
    assert writer.stdout is not None
    try:
        fd = writer.stdout.fileno()
        with within(10):
            code, out, err = invoke(
                ["extension", "configure", "org.test.a", "--file", f"/dev/fd/{fd}"], capsys)
    finally:
        writer.stdout.close()
        writer.wait(timeout=10)
    assert (code, out) == (0, "configured org.test.a\n"), err
    assert json.loads(config.read_text())["extensions"]["org.test.a"]["configuration"] == {
        "environment": {"A": "1"}}


@pytest.mark.parametrize("value", ["/", ".", "..", "/.", "sub/.."])
def test_a_config_variable_naming_only_a_directory_is_refused(
    tmp_path: Path, value: str
) -> None:
    """A ``VLLM_HUST_EXT_CONFIG`` that can only name a directory ("/" has no name at all,
    which used to end in "PosixPath('/') has an empty name") is one line naming the
    variable and saying a path to the state file was expected, for a reading and a
    mutating verb."""
    for argv in (["extension", "list"], ["extension", "disable", "org.test.a"]):
        line = _one_error_line(_cli(value, argv, tmp_path))
        assert line == (
            "vllm-hust-ext: error: VLLM_HUST_EXT_CONFIG must be a path to the state file, "
            f"not the directory {value!r}")


def test_a_state_path_that_is_an_unnamed_pipe_is_refused_and_left_unread(
    config: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only ``extension configure --file`` reads a shell's pipe: a state path naming one
    (``VLLM_HUST_EXT_CONFIG=<(...)``) is refused as not a regular file, like a FIFO,
    with its text left in the pipe (state is a file the manager rewrites in place)."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"{}")
        os.close(write_end)
        path = f"/dev/fd/{read_end}"
        monkeypatch.setenv("VLLM_HUST_EXT_CONFIG", path)
        code, out, err = invoke(["extension", "list"], capsys)
        assert (code, out) == (2, "")
        assert err.splitlines()[-1] == (
            f"vllm-hust-ext: error: vllm-hust-ext config {path} is not a regular file")
        assert os.read(read_end, 8) == b"{}"
    finally:
        os.close(read_end)


@pytest.mark.parametrize("kind", ["directory", "directory-slash", "fifo"])
def test_a_refused_state_path_leaves_no_lock_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    kind: str,
) -> None:
    """A mutating verb refuses a state path that is a directory (spelled with or without a
    trailing slash) or a FIFO before it creates the sibling lock file: the refused
    command leaves nothing behind."""
    path = tmp_path / "state"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    monkeypatch.setenv("VLLM_HUST_EXT_CONFIG", str(path) + ("/" if kind.endswith("slash") else ""))
    code, _, err = invoke(["extension", "disable", "org.test.a"], capsys)
    assert code == 2
    assert err.splitlines()[-1] == (
        f"vllm-hust-ext: error: vllm-hust-ext config {path} is not a regular file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]


def test_unknown_top_level_keys_and_nan_are_read_as_the_official_manager_reads_them(
    config: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """manager-protocol.md §3 lists every refusal; an unknown top-level key is not one, and
    the official reader ignores it. NaN is what the official writer writes for a NaN in a
    configuration, so a state file holding one stays usable: configure, enable, forget."""
    config.parent.mkdir(parents=True)
    config.write_text(
        '{"schema_version": 2, "comment": "mine", '
        '"extensions": {"org.test.a": {"enabled": false, "configuration": {"t": NaN}}}}'
    )
    settings = tmp_path / "f.json"
    settings.write_text('{"u": Infinity}')
    assert invoke(["extension", "configure", "org.test.b", "--file", str(settings)], capsys)[0] == 0
    assert invoke(["extension", "enable", "org.test.a"], capsys)[0] == 0
    state = load_state(config)
    assert state.is_enabled("org.test.a")
    assert math.isnan(state.extensions["org.test.a"].configuration["t"])
    assert state.extensions["org.test.b"].configuration == {"u": math.inf}
    assert "comment" not in json.loads(config.read_text())  # the schema's keys only
    assert invoke(["extension", "disable", "org.test.a"], capsys)[0] == 0
    assert invoke(["extension", "forget", "org.test.a"], capsys)[0] == 0
    assert "org.test.a" not in load_state(config).extensions


def test_a_whitespace_only_config_variable_is_refused(tmp_path: Path) -> None:
    """``Path(" ")`` would be a file named " " in the working directory."""
    line = _one_error_line(_cli(" ", ["extension", "enable", "org.vllm-hust.kvcached"], tmp_path))
    assert "VLLM_HUST_EXT_CONFIG must be a path" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("below", "reason"), [
    ((), "a file is in the way"),  # mkdir itself says only "File exists"
    (("sub",), "Not a directory"),
])
@pytest.mark.parametrize("argv", [["extension", "disable", "org.test.a"],
                                  ["extension", "enable", "org.vllm-hust.bidkv"]])
def test_a_state_file_whose_directory_cannot_be_made_is_named(
    tmp_path: Path, argv: list[str], below: tuple[str, ...], reason: str
) -> None:
    """A state path under a regular file: mkdir said only ``[Errno 17] File exists:
    '<dir>'`` (or ``[Errno 20] Not a directory``), naming neither the state file nor the
    variable. Now one line names both and why, and the file in the way is left as it was."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("keep\n")
    target = blocker.joinpath(*below, "config.json")
    line = _one_error_line(_cli(str(target), argv, tmp_path))
    assert line == (
        f"vllm-hust-ext: error: vllm-hust-ext config {target}: cannot create its directory "
        f"{target.parent} ({reason}; VLLM_HUST_EXT_CONFIG sets where the state file lives)")
    assert blocker.read_text() == "keep\n"


def test_a_symlinked_state_file_stays_a_link_and_its_target_is_updated(
    config: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    target = tmp_path / "elsewhere" / "real.json"
    target.parent.mkdir()
    target.write_text(json.dumps({"schema_version": 2, "extensions": {}}))
    config.parent.mkdir(parents=True)
    config.symlink_to(target)
    assert invoke(["extension", "enable", "org.test.a"], capsys)[0] == 0
    assert config.is_symlink() and config.resolve() == target
    assert load_state(target).is_enabled("org.test.a")
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert _temp_files(config) == [] and _temp_files(target) == []


def test_a_link_retargeted_while_waiting_for_the_lock_cannot_cross_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state is read from the file that is locked and written, not through the link
    again: retargeted in between, it would write one file's state over another's."""
    first, second = tmp_path / "x.json", tmp_path / "y.json"
    first.write_text(json.dumps({"schema_version": 2, "extensions": {"a": {"enabled": True}}}))
    second.write_text(json.dumps({"schema_version": 2, "extensions": {"b": {"enabled": True}}}))
    link = tmp_path / "config.json"
    link.symlink_to(first)
    locked = state_module._locked

    @contextlib.contextmanager
    def retarget_then_lock(target: Path) -> Iterator[None]:
        link.unlink()
        link.symlink_to(second)  # another process moves the link meanwhile
        with locked(target):
            yield

    monkeypatch.setattr(state_module, "_locked", retarget_then_lock)
    state_module.mutate_state(lambda state: state, link)
    assert set(load_state(first).extensions) == {"a"}
    assert set(load_state(second).extensions) == {"b"}


def _seeded(config: Path) -> bytes:
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps({"schema_version": 2, "extensions": {}}))
    return config.read_bytes()


def _temp_files(config: Path) -> list[str]:
    return sorted(p.name for p in config.parent.iterdir() if p.name.startswith(".config-"))


def test_a_failed_replace_leaves_the_old_file_intact_and_no_temp_file(
    config: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write goes to a temp file then ``os.replace``: when the replace fails, the old
    state file is byte-identical (no in-place truncating write), the temp file is removed,
    and the command fails with one error line."""
    before = _seeded(config)

    def failing_replace(src: object, dst: object) -> None:
        raise OSError("replace refused")

    monkeypatch.setattr(state_module.os, "replace", failing_replace)
    code, out, err = invoke(["extension", "enable", "org.test.a"], capsys)
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == "vllm-hust-ext: error: replace refused"
    assert "Traceback" not in err
    assert config.read_bytes() == before
    assert _temp_files(config) == []


def test_the_temp_file_is_fsynced_before_it_replaces_the_state_file(
    config: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``write_state`` fsyncs the temp file (same directory, ``.config-*``) before the
    ``os.replace`` that publishes it."""
    _seeded(config)
    calls: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def spy_fsync(fd: int) -> None:
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def spy_replace(src: str, dst: str) -> None:
        calls.append(("replace", str(src)))
        real_replace(src, dst)

    monkeypatch.setattr(state_module.os, "fsync", spy_fsync)
    monkeypatch.setattr(state_module.os, "replace", spy_replace)
    assert invoke(["extension", "enable", "org.test.a"], capsys)[0] == 0
    assert [kind for kind, _ in calls] == ["fsync", "replace"]
    synced, replaced = calls[0][1], calls[1][1]
    assert Path(synced) == Path(replaced).resolve()
    assert Path(synced).parent == config.parent.resolve()
    assert Path(synced).name.startswith(".config-")
    assert load_state(config).is_enabled("org.test.a")


def test_parse_state_accepts_defaults() -> None:
    state = parse_state({"schema_version": 2, "extensions": {"x": {}}})
    assert state.configuration("x") == {} and not state.is_enabled("x")


def test_twenty_concurrent_processes_lose_no_update(tmp_path: Path) -> None:
    """10 enable, 5 disable (pre-enabled ids), 5 configure: all at once, every change kept."""
    ids = [f"org.test.c{i:02d}" for i in range(20)]
    site = tmp_path / "site"
    write_bundles(site, ids)
    config = tmp_path / "cfg" / "config.json"
    config.parent.mkdir()
    seeded = {i: {"enabled": True, "configuration": {"seed": i}} for i in ids[10:15]}
    config.write_text(json.dumps({"schema_version": 2, "extensions": seeded}))
    env = {
        **os.environ,
        "VLLM_HUST_EXT_CONFIG": str(config),
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }
    commands = []
    for index, bundle_id in enumerate(ids):
        if index < 10:
            commands.append([CLI, "extension", "enable", bundle_id])
        elif index < 15:
            commands.append([CLI, "extension", "disable", bundle_id])
        else:
            settings = tmp_path / f"{bundle_id}.json"
            settings.write_text(json.dumps({"n": index}))
            commands.append([CLI, "extension", "configure", bundle_id, "--file", str(settings)])
    processes = [
        subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for c in commands
    ]
    results = [(p.wait(timeout=120), p.stderr.read() if p.stderr else b"") for p in processes]
    assert all(code == 0 for code, _ in results), results
    extensions = json.loads(config.read_text())["extensions"]
    assert set(extensions) == set(ids)
    for index, bundle_id in enumerate(ids):
        entry = extensions[bundle_id]
        if index < 10:
            assert entry == {"enabled": True, "configuration": {}}
        elif index < 15:
            assert entry == {"enabled": False, "configuration": {"seed": bundle_id}}
        else:
            assert entry == {"enabled": False, "configuration": {"n": index}}
