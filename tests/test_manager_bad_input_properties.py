"""Fuzzed bad input for ``vllm-hust-ext``: clear one-line errors, and nothing is lost.

The project standard, checked under randomly corrupted inputs: a malformed state file,
bundle manifest, environment variable or argument gives exit code 2 and one error line
(``vllm-hust-ext: error: ...``, after argparse's usage, manager-protocol.md §4) naming
the thing at fault, never a traceback or an ``internal error``; the state file's bytes
are unchanged by every refused command and by every read-only one, a refused mutating
verb creates no state file, no ``.config-*`` temp file is ever left behind, and an
accepted change keeps every other stored entry. ``extension list`` tolerates damaged
bundles (exit 0, one ``<id> invalid <error>`` line each) and agrees with strict
discovery. Each drawn case is judged by an oracle written from manager-protocol.md §2-§4
(not from the manager's code), with "either" where the spec does not pin the outcome.

Families: the state file (wrong shapes and types, truncated, invalid UTF-8, NaN and huge
numbers, deep nesting, empty, BOM, legacy schema, unknown keys); the two real manifests
under ``manifests/`` (field deletions, type swaps, extra keys, retexts, truncation,
invalid UTF-8, BOM, deep and huge values); the environment variables the manager reads
(``VLLM_HUST_EXT_CONFIG``, ``XDG_CONFIG_HOME``/``HOME`` behind the default location,
``VLLM_HUST_EXT_EVIDENCE_PATH`` and the other run-evidence variables, ``VLLM_PLUGINS``,
``VLLMHUST_EXT_ENABLED_BUNDLES``, ``VLLM_EXTENSION_MANIFESTS``/``_BUNDLES``); and the
command line (odd ids, usage errors, bad ``--file`` contents, bad grace periods). The CLI
runs in-process through ``main(argv)``; a few cases also go through the console script.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from hust_ext_manager.cli import main
from hypothesis import given, settings
from hypothesis import strategies as st
from platformdirs import user_config_path

from tests.fuzz_helpers import SHORT_TEXT, put, shape, tally_report, walk
from tests.property_settings import REAL_SCHEDULER
from tests.test_manager_manifest import write_dist

ROOT = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).with_name("vllm-hust-ext"))
PREFIX = "vllm-hust-ext: error: "
CONFIG_ENV = "VLLM_HUST_EXT_CONFIG"
EVIDENCE_PATH_ENV = "VLLM_HUST_EXT_EVIDENCE_PATH"
EVIDENCE_ENV = (
    "VLLM_ECPA_EVIDENCE_SINK",
    "VLLM_ECPA_EVIDENCE_STRICT",
    "VLLM_ECPA_PLAN_ID",
    "VLLM_ECPA_LAUNCH_ID",
    EVIDENCE_PATH_ENV,
)
NATIVE_ENV = ("VLLM_EXTENSION_MANIFESTS", "VLLM_EXTENSION_BUNDLES")
MANAGED_ENV = (
    CONFIG_ENV,
    "XDG_CONFIG_HOME",
    "HOME",
    "VLLM_PLUGINS",
    "VLLMHUST_EXT_ENABLED_BUNDLES",
    *EVIDENCE_ENV,
    *NATIVE_ENV,
)

# Three bundles of one fake distribution: two copies of the real manifests (the targets
# of manifest corruption) and a bystander that always stays valid.
GOOD = "org.test.fuzz.good"
TARGETS = {"bidkv": "org.test.fuzz.bidkv", "kvcached": "org.test.fuzz.kvcached"}
SOURCES = {key: ROOT / "manifests" / key / "vllm-hust-extension-v0.2.json" for key in TARGETS}
PRISTINE: dict[str, dict[str, Any]] = {
    key: {**json.loads(path.read_text()), "extension_id": TARGETS[key]}
    for key, path in SOURCES.items()
}
MANIFEST_AT = {
    GOOD: "fakefuzz/good/vllm-hust-extension-v0.2.json",
    TARGETS["bidkv"]: "fakefuzz/bidkv/vllm-hust-extension-v0.2.json",
    TARGETS["kvcached"]: "fakefuzz/kvcached/vllm-hust-extension-v0.2.json",
}
GONE = "org.test.gone"

# Configurations under which the provider finds the bundle compatible with the installed
# (stock) vLLM, so that ``run --dry-run`` can launch it; ``{}`` leaves bidkv unverified
# (no preemption-policy contract) and kvcached incompatible (host 0.33 is outside <0.31).
COMPAT_BIDKV = {"host_version": "0.33.0", "protocol_versions": {"vllm.preemption-policy": "1.0"}}
COMPAT_KV = {"host_version": "0.30.0"}
COMPAT = {GOOD: COMPAT_BIDKV, TARGETS["bidkv"]: COMPAT_BIDKV, TARGETS["kvcached"]: COMPAT_KV}
NATIVE_IDS = {GOOD, TARGETS["bidkv"]}  # host.api_range declared: a native manifest
SAFE_CONFIGS: dict[str, list[dict[str, Any]]] = {
    GOOD: [{}, COMPAT_BIDKV, {"note": [1.5, None, "x"]}, {"note": float("nan")}],
    TARGETS["bidkv"]: [{}, COMPAT_BIDKV],
    TARGETS["kvcached"]: [{}, COMPAT_KV, {**COMPAT_KV, "note": float("inf")}],
}

NUMBER_LITERALS = (
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "-1e999",
    "-0",
    "2.0",
    "1E400",
    "1" + "0" * 5000,  # past the int/str digit limit: json.loads raises a plain ValueError
)
BAD_UTF8 = (b"\xff", b"\xc3(", b"\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf")
BOM = b"\xef\xbb\xbf"
SLOT = "@@SLOT@@"


# --- running the CLI and checking one outcome ----------------------------------------


@dataclass(frozen=True)
class Outcome:
    code: int
    out: str
    err: str


def cli(argv: Sequence[str]) -> Outcome:
    """``vllm-hust-ext ARGV`` in-process; any exception but SystemExit propagates (a
    traceback would reach the user) and fails the test. The streams are those of a UTF-8
    terminal: stdout strict (Python's default outside the C locale), stderr escaping."""
    out_bytes, err_bytes = io.BytesIO(), io.BytesIO()
    out = io.TextIOWrapper(out_bytes, encoding="utf-8", errors="strict")
    err = io.TextIOWrapper(err_bytes, encoding="utf-8", errors="backslashreplace")
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as stop:
            assert stop.code is None or isinstance(stop.code, int), stop.code
            code = stop.code or 0
    out.flush()
    err.flush()
    return Outcome(code, out_bytes.getvalue().decode(), err_bytes.getvalue().decode())


def norm(text: str) -> str:
    """The CLI prints each message as one line: each line break becomes a space."""
    return " ".join(text.splitlines())


# argparse reports a usage error through the sub-parser that found it, whose prog names
# the sub-command too; every other refusal goes through the top-level parser.
USAGE_PREFIX = re.compile(r"vllm-hust-ext(?: extension(?: [a-z]+)?| run)?: error: ")


def error_message(outcome: Outcome, *, usage: bool = False) -> str:
    """The single error line of a refusal (argparse's usage may precede it), unprefixed."""
    assert "Traceback" not in outcome.err, outcome.err
    lines = outcome.err.splitlines()
    assert lines, "a refusal must say why on stderr"
    prefix = USAGE_PREFIX if usage else re.compile(re.escape(PREFIX))
    errors = [line for line in lines if prefix.match(line)]
    assert errors == [lines[-1]], f"not exactly one final error line: {outcome.err!r}"
    assert lines[0].startswith("usage: "), outcome.err
    assert all(line.startswith(" ") for line in lines[1:-1]), f"stray stderr: {outcome.err!r}"
    found = prefix.match(lines[-1])
    assert found is not None
    message = lines[-1][found.end() :]
    assert message.strip(), "empty error message"
    assert "internal error" not in message, message
    return message


def check_refused(
    outcome: Outcome, any_of: Sequence[str], all_of: Sequence[str] = (), *, usage: bool = False
) -> str:
    assert outcome.code == 2, f"expected a refusal (exit 2), got {outcome}"
    assert outcome.out == "", f"a refused command printed {outcome.out!r}"
    message = error_message(outcome, usage=usage)
    wanted = [norm(n) for n in any_of if norm(n)]
    assert any(n in message for n in wanted), f"{message!r} names none of {wanted!r}"
    for name in all_of:
        assert norm(name) in message, f"{message!r} does not name {name!r}"
    return message


def check_accepted(outcome: Outcome) -> None:
    assert outcome.code == 0, f"expected success, got {outcome}"
    assert "Traceback" not in outcome.err and PREFIX not in outcome.err, outcome.err


# --- the state file oracle (manager-protocol.md §3) ----------------------------------

Entries = dict[str, tuple[bool, Any]]


@dataclass(frozen=True)
class StateVerdict:
    entries: Entries | None  # None: the file is refused
    names: tuple[str, ...] = ()  # what a refusal must name (any one of them)


def judge_state(raw: bytes | None, path: Path) -> StateVerdict:
    if raw is None:
        return StateVerdict({})
    where = (str(path), os.path.realpath(path))
    try:
        document = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return StateVerdict(None, where)
    if not isinstance(document, dict):
        return StateVerdict(None, ("vllm-hust-ext config must be an object",))
    schema = document.get("schema_version")
    if type(schema) is int and schema == 1:
        legacy = document.get("enabled", [])
        if not isinstance(legacy, list) or not all(isinstance(i, str) for i in legacy):
            return StateVerdict(None, ("legacy enabled",))
        return StateVerdict({i: (True, {}) for i in legacy})
    if type(schema) is not int or schema != 2:
        return StateVerdict(None, ("vllm-hust-ext config has an unsupported schema",))
    extensions = document.get("extensions", {})
    if not isinstance(extensions, dict):
        return StateVerdict(None, ("vllm-hust-ext extensions",))
    entries: Entries = {}
    for key, value in extensions.items():
        named = f"extension {key!r}"
        if not isinstance(value, dict) or value.keys() - {"enabled", "configuration"}:
            return StateVerdict(None, (f"{named} config",))
        enabled = value.get("enabled", False)
        if not isinstance(enabled, bool):
            return StateVerdict(None, (f"{named} enabled",))
        configuration = value.get("configuration", {})
        if not isinstance(configuration, dict):
            return StateVerdict(None, (f"{named} configuration",))
        entries[key] = (enabled, configuration)
    return StateVerdict(entries)


def canonical(entries: Entries) -> str:
    """Comparable text (NaN compares equal to itself once dumped)."""
    return json.dumps({k: [e, c] for k, (e, c) in entries.items()}, sort_keys=True)


def snapshot(path: Path) -> bytes | None:
    """The file's bytes; None when absent; a marker when it cannot be read at all."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        return f"<unreadable: {error.errno}>".encode()


# --- expectations --------------------------------------------------------------------

Change = Callable[[Entries], Entries]


@dataclass(frozen=True)
class Expect:
    outcome: str  # "accept", "refuse" or "either"
    any_of: tuple[str, ...] = ()
    all_of: tuple[str, ...] = ()
    change: Change | None = None  # the stored entries after an accepted mutating verb
    usage: bool = False  # an argparse usage error


def refuse(*any_of: str, all_of: tuple[str, ...] = (), usage: bool = False) -> Expect:
    return Expect("refuse", tuple(any_of), all_of, usage=usage)


ACCEPT = Expect("accept")
MUTATING = frozenset({"enable", "disable", "forget", "configure"})


def set_enabled(bundle_id: str, enabled: bool) -> Change:
    def change(entries: Entries) -> Entries:
        return {**entries, bundle_id: (enabled, entries.get(bundle_id, (False, {}))[1])}

    return change


def set_configuration(bundle_id: str, configuration: Any) -> Change:
    def change(entries: Entries) -> Entries:
        return {**entries, bundle_id: (entries.get(bundle_id, (False, {}))[0], configuration)}

    return change


def forget(bundle_id: str) -> Change:
    return lambda entries: {k: v for k, v in entries.items() if k != bundle_id}


def is_text(value: str) -> bool:
    """False for an argument holding undecodable bytes (surrogate escapes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def installed_ids() -> set[str]:
    return {e.name for e in entry_points(group="vllm_hust.extension_bundles")}


def expect_verb(verb: str, bundle_id: str, entries: Entries, **extra: Any) -> Expect:
    """§4 for a readable state, valid manifests and the safe configurations only."""
    installed = installed_ids()
    enabled = sorted(k for k, (on, _) in entries.items() if on)
    if verb not in ("list", "list --json", "env", "run-dry", "run") and not is_text(bundle_id):
        return refuse(f"extension id {bundle_id!r} is not valid UTF-8")
    if verb in ("list", "list --json", "status", "check", "inspect", "validate", "plan", "render"):
        if verb in ("list", "list --json") or bundle_id in installed:
            return ACCEPT
        return refuse(repr(bundle_id))
    if verb == "enable":
        if bundle_id not in installed:
            return refuse(repr(bundle_id))
        return Expect("accept", change=set_enabled(bundle_id, True))
    if verb == "disable":
        return Expect("accept", change=set_enabled(bundle_id, False))
    if verb == "forget":
        if bundle_id not in entries:
            return refuse(f"extension {bundle_id!r} has no stored state")
        if entries[bundle_id][0]:
            return refuse(f"disable {bundle_id!r} before forgetting")
        return Expect("accept", change=forget(bundle_id))
    if verb == "configure":
        if bundle_id not in installed:
            return refuse(repr(bundle_id))
        return Expect("accept", change=set_configuration(bundle_id, extra["configuration"]))
    missing = [i for i in enabled if i not in installed]
    if missing:
        return refuse(*(repr(i) for i in missing))
    if verb == "env":
        return ACCEPT
    assert verb in ("run-dry", "run"), verb
    if any(norm(json.dumps(entries[i][1])) != norm(json.dumps(COMPAT.get(i))) for i in enabled):
        return refuse(*(repr(i) for i in enabled))
    return ACCEPT


def argv_for(verb: str, bundle_id: str, file: Path | None = None) -> list[str]:
    if verb == "list --json":
        return ["extension", "list", "--json"]
    if verb in ("list", "env"):
        return ["extension", verb]
    if verb == "run-dry":
        return ["run", "--dry-run", "--", "true"]
    if verb == "run":
        return ["run", "--", "true"]
    if verb == "configure":
        assert file is not None
        return ["extension", "configure", bundle_id, "--file", str(file)]
    return ["extension", verb, bundle_id]


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(".config-")]


def exercise(argv: Sequence[str], expect: Expect, state_path: Path, root: Path) -> Outcome:
    """Run one command and check the outcome, the state file and the temp files."""
    before = snapshot(state_path)
    outcome = cli(argv)
    after = snapshot(state_path)
    if expect.outcome == "accept" or (expect.outcome == "either" and outcome.code == 0):
        check_accepted(outcome)
    else:
        check_refused(outcome, expect.any_of, expect.all_of, usage=expect.usage)
    verb = argv[1] if argv[:1] == ["extension"] and len(argv) > 1 else "".join(argv[:1])
    if outcome.code != 0 or verb not in MUTATING:
        assert after == before, f"{argv!r} (exit {outcome.code}) changed the state file"
    else:
        old = judge_state(before, state_path).entries
        new = judge_state(after, state_path).entries
        assert after is not None, f"{argv!r} succeeded without writing the state file"
        assert old is not None and new is not None, "an accepted change left a bad state file"
        if expect.change is not None:
            assert canonical(new) == canonical(expect.change(old)), "stored entries lost"
    assert temp_files(root) == [], f"temp files left by {argv!r}"
    return outcome


# --- the fake installed distribution and one sandbox per example ---------------------


@dataclass
class World:
    site: Path
    boxes: Path

    def write_manifest(self, bundle_id: str, data: bytes) -> None:
        (self.site / MANIFEST_AT[bundle_id]).write_bytes(data)

    def reset(self) -> None:
        self.write_manifest(GOOD, json.dumps({**PRISTINE["bidkv"], "extension_id": GOOD}).encode())
        for key, bundle_id in TARGETS.items():
            self.write_manifest(bundle_id, json.dumps(PRISTINE[key], indent=2).encode())


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    site = tmp_path / "site"
    registrations = {i: p.rsplit("/", 1)[0].replace("/", ".") for i, p in MANIFEST_AT.items()}
    files = {p: b"{}" for p in MANIFEST_AT.values()}
    files["fakefuzz/kvplugin.py"] = b"def register():\n    pass\n"
    write_dist(site, "fake-fuzz", registrations, files)
    # kvcached's manifest declares a vLLM plugin: its distribution must publish it (§2).
    entry_points_txt = next(site.glob("*.dist-info")) / "entry_points.txt"
    with entry_points_txt.open("a") as stream:
        stream.write("[vllm.general_plugins]\nkvcached_provider = fakefuzz.kvplugin:register\n")
    created = World(site, tmp_path / "boxes")
    created.boxes.mkdir()
    created.reset()
    monkeypatch.syspath_prepend(str(site))
    # The sandboxes redirect every path the manager writes; the user's own state file
    # (where the environment the tests started in points) must come out untouched.
    real = Path(os.environ.get(CONFIG_ENV) or user_config_path("vllm-hust-ext") / "config.json")
    before = snapshot(real)
    yield created
    assert snapshot(real) == before, f"the tests wrote {real}"


@contextlib.contextmanager
def sandbox(world: World) -> Iterator[tuple[Path, pytest.MonkeyPatch]]:
    """A fresh directory, environment and working directory for one example; the state
    file defaults to ``<root>/cfg/config.json`` (never the user's real one)."""
    root = Path(tempfile.mkdtemp(dir=world.boxes))
    for name in ("cwd", "home"):
        (root / name).mkdir()
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name in MANAGED_ENV:
                patch.delenv(name, raising=False)
            patch.setenv("HOME", str(root / "home"))
            patch.setenv(CONFIG_ENV, str(root / "cfg" / "config.json"))
            patch.chdir(root / "cwd")
            yield root, patch
    finally:
        world.reset()
        shutil.rmtree(root, ignore_errors=True)


def write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


# --- strategies: JSON values and state documents -------------------------------------

def kind_of(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(value)]


scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | SHORT_TEXT
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(SHORT_TEXT, inner, max_size=3),
    max_leaves=6,
)
json_objects = st.dictionaries(SHORT_TEXT, json_values, max_size=3)


def of_other_kind(original: object) -> st.SearchStrategy[Any]:
    return json_values.filter(lambda v: kind_of(v) != kind_of(original))


def nested(depth: int, opener: str) -> str:
    if opener == "[":
        return "[" * depth + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


def nesting(draw: st.DrawFn, opener: str = "[") -> tuple[str, bool]:
    """Nested JSON text a reader clearly follows, or clearly does not (the recursion limit
    is 1000), and whether it is the shallow kind."""
    shallow = draw(st.booleans())
    depth = draw(st.integers(1, 40) if shallow else st.integers(3000, 60000))
    return nested(depth, opener), shallow


other_ids = st.sampled_from([GONE, "x", "", "org.test.fuzz.good ", "ORG.TEST.FUZZ.GOOD"]) | st.text(
    st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=12
).filter(lambda s: not s.startswith("org.vllm-hust."))


@st.composite
def state_entry(draw: st.DrawFn, bundle_id: str) -> dict[str, Any]:
    if bundle_id in SAFE_CONFIGS:
        configuration = draw(st.sampled_from(SAFE_CONFIGS[bundle_id]))
    else:
        configuration = draw(json_objects)
    entry: dict[str, Any] = {}
    if draw(st.booleans()):  # both keys are optional (defaults false and {})
        entry["enabled"] = draw(st.booleans())
    if configuration or draw(st.booleans()):
        entry["configuration"] = configuration
    return entry


@st.composite
def state_documents(draw: st.DrawFn) -> dict[str, Any]:
    if draw(st.integers(0, 5)) == 0:
        document: dict[str, Any] = {"schema_version": 1}
        if draw(st.booleans()):
            document["enabled"] = draw(
                st.lists(st.sampled_from([GOOD, TARGETS["kvcached"], GONE]), max_size=2)
            )
        return document
    ids = draw(
        st.lists(st.sampled_from([GOOD, *TARGETS.values()]) | other_ids, max_size=4, unique=True)
    )
    document = {"schema_version": 2}
    if ids or draw(st.booleans()):
        document["extensions"] = {i: draw(state_entry(i)) for i in ids}
    if draw(st.integers(0, 4)) == 0:
        document[draw(SHORT_TEXT.filter(lambda k: k not in document))] = draw(json_values)
    return document


def dump_state(draw: st.DrawFn, document: object) -> bytes:
    indent = draw(st.sampled_from([None, 2, 0]))
    text = json.dumps(document, indent=indent, sort_keys=draw(st.booleans()))
    return (text + draw(st.sampled_from(["", "\n"]))).encode("utf-8")


def state_slots(document: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Where a field of a state document can be replaced."""
    slots: list[tuple[Any, ...]] = [("schema_version",), ("comment",)]  # comment: ignored
    if document.get("schema_version") == 1:
        slots.append(("enabled",))
        slots += [("enabled", i) for i in range(len(document.get("enabled", [])))]
        return slots
    slots.append(("extensions",))
    for key, entry in document.get("extensions", {}).items():
        slots += [("extensions", key), ("extensions", key, "enabled")]
        slots.append(("extensions", key, "configuration"))
        if "configuration" in entry:
            slots.append(("extensions", key, "configuration", "note"))
    return slots


def get(document: Any, path: Sequence[Any]) -> Any:
    target = document
    for key in path:
        if isinstance(target, dict):
            target = target.get(key)
        elif isinstance(target, list) and isinstance(key, int) and key < len(target):
            target = target[key]
        else:
            return None
    return target


STATE_KINDS = (
    "absent",
    "valid",
    "wrong_shape",
    "field_type",
    "truncated",
    "invalid_utf8",
    "numbers",
    "deep",
    "empty",
    "bom",
    "unknown_entry_key",
)


@st.composite
def state_bytes(draw: st.DrawFn, kind: str) -> bytes | None:
    """A state file of one corruption kind (None: no file)."""
    document = draw(state_documents())
    if kind == "absent":
        return None
    if kind == "valid":
        return dump_state(draw, document)
    if kind == "wrong_shape":
        return dump_state(draw, draw(json_values.filter(lambda v: not isinstance(v, dict))))
    if kind == "empty":
        return draw(st.sampled_from([b"", b" ", b"\n", b"\t \r\n"]))
    if kind == "bom":
        return BOM + dump_state(draw, document)
    if kind == "truncated":
        raw = dump_state(draw, document)
        return raw[: draw(st.integers(0, raw.rindex(b"}")))]  # the object never closes
    if kind == "invalid_utf8":
        raw = dump_state(draw, document)
        at = draw(st.integers(0, len(raw)))
        return raw[:at] + draw(st.sampled_from(BAD_UTF8)) + raw[at:]
    if kind == "unknown_entry_key":
        extensions = dict(document.get("extensions", {}))
        key = draw(SHORT_TEXT.filter(lambda k: k not in ("enabled", "configuration")))
        extensions[draw(other_ids)] = {key: draw(json_values)}
        return dump_state(draw, {**document, "schema_version": 2, "extensions": extensions})
    slots = state_slots(document)
    if kind in ("numbers", "deep") and draw(st.booleans()):
        slots = [p for p in slots if p[0] == "comment" or p[-1:] == ("note",)]  # any value goes
    path = draw(st.sampled_from(slots))
    if kind == "field_type":
        put(document, path, draw(of_other_kind(get(document, path))))
        return dump_state(draw, document)
    # numbers / deep: a literal json.dumps cannot write, put where a value goes
    if kind == "numbers":
        literal = draw(st.sampled_from(NUMBER_LITERALS))
    else:
        literal, _ = nesting(draw, draw(st.sampled_from("[{")))
    put(document, path, SLOT)
    text = dump_state(draw, document).decode("utf-8")
    return text.replace(json.dumps(SLOT), literal).encode("utf-8")


def restore(path: Path, raw: bytes | None) -> None:
    """Put the drawn state file back before the next command of the same example."""
    if snapshot(path) != raw:
        if raw is None:
            Path(os.path.realpath(path)).unlink()
        else:
            write_file(path, raw)


# --- family 1: the state file ---------------------------------------------------------

STATE_COMMANDS = (
    "list",
    "list --json",
    "inspect",
    "validate",
    "status",
    "plan",
    "render",
    "env",
    "enable",
    "disable",
    "disable-other",
    "forget",
    "configure",
    "run-dry",
)


ALWAYS_BAD = frozenset({"wrong_shape", "truncated", "invalid_utf8", "empty", "bom"})


@pytest.mark.parametrize("kind", STATE_KINDS)
def test_a_corrupt_state_file_is_refused_by_every_verb_and_left_untouched(
    world: World, kind: str
) -> None:
    """A state file of the drawn kind (wrong shape or types, truncated, not UTF-8, NaN and
    huge numbers, deep, empty, BOM, legacy schema, unknown keys, absent, valid): every verb
    is refused in one line naming the file or the field, or does what the oracle expects
    of the entries it holds; a refusal leaves the file's bytes as they were."""
    seen: Counter[tuple[str, str]] = Counter()

    examples = {"valid": 7, "absent": 4, "numbers": 6, "deep": 6}.get(kind, 4)

    @settings(REAL_SCHEDULER, max_examples=examples)
    @given(
        raw=state_bytes(kind),
        other=other_ids.filter(lambda s: not s.startswith("-")),
        configuration=st.sampled_from(SAFE_CONFIGS[GOOD]),
    )
    def run(raw: bytes | None, other: str, configuration: dict[str, Any]) -> None:
        with sandbox(world) as (root, _):
            path = root / "cfg" / "config.json"
            verdict = judge_state(raw, path)
            settings_file = root / "settings.json"
            settings_file.write_text(json.dumps(configuration))
            seen[("state", "readable" if verdict.entries is not None else "refused")] += 1
            for command in STATE_COMMANDS:
                restore(path, raw)
                verb, bundle_id = (command, GOOD)
                if command == "disable-other":
                    verb, bundle_id = "disable", other
                entries = verdict.entries
                expect = (
                    refuse(*verdict.names)
                    if entries is None
                    else expect_verb(verb, bundle_id, entries, configuration=configuration)
                )
                outcome = exercise(argv_for(verb, bundle_id, settings_file), expect, path, root)
                if outcome.code == 0 and verb == "list --json":
                    assert isinstance(json.loads(outcome.out), list)
                seen[("command", command)] += 1
                seen[("outcome", "accepted" if outcome.code == 0 else "refused")] += 1

    run()
    tally_report(f"state {kind}", seen)
    assert {k for (what, k) in seen if what == "command"} == set(STATE_COMMANDS)
    if kind in ALWAYS_BAD:
        assert seen[("state", "readable")] == 0
    if kind in ("absent", "valid", "numbers", "deep"):
        assert seen[("outcome", "accepted")] and seen[("outcome", "refused")], seen
    if kind not in ("absent", "valid"):
        assert seen[("state", "refused")], seen


# --- family 2: bundle manifests -------------------------------------------------------


def render(path: Sequence[Any]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def located(path: Sequence[Any]) -> tuple[str, ...]:
    """What a message about ``path`` may name: the field or one of its parents."""
    names = [render(path[:n]) for n in range(1, len(path) + 1)]
    if path and isinstance(path[-1], str):
        names.append(repr(path[-1]))
    if path[:1] == ("extension_id",):
        names.append("registration")
    return tuple(names)


REQUIRED = {
    *(
        (k,)
        for k in (
            "schema_version",
            "extension_id",
            "extension_version",
            "kind",
            "host",
            "runtime",
            "lifecycle_owner",
            "protocols",
            "implementation",
            "requires_services",
        )
    ),
    ("host", "provider"),
    ("host", "name"),
    ("host", "version_range"),
    ("runtime", "type"),
    ("runtime", "process_scope"),
    ("runtime", "isolation"),
    ("protocols", "*", "name"),
    ("protocols", "*", "version_range"),
    ("implementation", "*", "type"),
    ("implementation", "*", "module"),
    ("implementation", "*", "object"),
    ("implementation", "*", "status"),
    *(
        ("components", "*", k)
        for k in (
            "component_id",
            "contracts",
            "execution_planes",
            "isolation",
            "implementation_ref",
        )
    ),
    ("activation", "entry_points", "*", "group"),
    ("activation", "entry_points", "*", "name"),
}
NULLABLE = {("host", "api_range"), ("protocols", "*", "version_range"), ("activation",)}
CLOSED = {  # objects whose keys are fixed: an extra key is refused
    (),
    ("host",),
    ("runtime",),
    ("protocols", "*"),
    ("components", "*"),
    ("implementation", "*"),  # both manifests' carriers are python_module
    ("activation",),
    ("activation", "entry_points", "*"),
}
KNOWN_FIELDS = {
    part for document in PRISTINE.values() for p, _ in walk(document) for part in p
} | {"components", "activation", "api_range", "permissions", "optional", "endpoint_config"}

MANIFEST_KINDS = (
    "delete",
    "delete_item",
    "swap",
    "retext",
    "extra",
    "truncate",
    "invalid_utf8",
    "bom",
    "not_object",
    "huge_number",
    "deep",
)


# Replacement strings, often with the whitespace a one-line message must not pass through.
retexts = st.sampled_from(["", " ", "a b", "x\ny", "\t", "kvcached_provider\n"]) | SHORT_TEXT


@dataclass(frozen=True)
class ManifestCase:
    target: str  # the corrupted bundle's id
    kind: str
    data: bytes
    verdict: str | None  # "accept", "refuse", or None where the rules decide
    names: tuple[str, ...]  # the location a refusal may name


@st.composite
def manifest_cases(draw: st.DrawFn, kind: str) -> ManifestCase:
    key = draw(st.sampled_from(sorted(TARGETS)))
    target = TARGETS[key]
    document = copy.deepcopy(PRISTINE[key])
    slots = [(p, v) for p, v in walk(document) if p]
    whole = ("manifest",)

    def dump(value: object) -> bytes:
        return json.dumps(value, indent=draw(st.sampled_from([None, 2]))).encode("utf-8")

    valid = draw(st.booleans())  # delete and extra: aim at an accepted or a refused change
    if kind == "delete":
        keys = [p for p, _ in slots if isinstance(p[-1], str)]
        optional = [p for p in keys if shape(p) not in REQUIRED]
        path = draw(st.sampled_from(optional if valid else [p for p in keys if p not in optional]))
        del get(document, path[:-1])[path[-1]]
        verdict = "refuse" if shape(path) in REQUIRED else "accept"
        return ManifestCase(target, kind, dump(document), verdict, located(path))
    if kind == "delete_item":
        items = [(p, v) for p, v in slots if isinstance(p[-1], int)]
        path, _ = draw(st.sampled_from(items))
        del get(document, path[:-1])[path[-1]]
        return ManifestCase(target, kind, dump(document), None, located(path[:-1]))
    if kind in ("swap", "retext"):
        candidates = slots if kind == "swap" else [(p, v) for p, v in slots if isinstance(v, str)]
        path, original = draw(st.sampled_from(candidates))
        value = draw(of_other_kind(original) if kind == "swap" else retexts)
        put(document, path, value)
        verdict: str | None = None if kind == "retext" else "refuse"
        if kind == "swap" and value is None and shape(path) in NULLABLE:
            verdict = "accept"
        elif kind == "swap" and path == ("components",) and not value:
            verdict = None  # §1: a falsy components value means "none"
        return ManifestCase(target, kind, dump(document), verdict, located(path))
    if kind == "extra":
        containers = [p for p, v in walk(document) if isinstance(v, dict)]
        open_ones = [p for p in containers if shape(p) not in CLOSED]
        closed = [p for p in containers if p not in open_ones]
        path = draw(st.sampled_from(open_ones if valid else closed))
        name = draw(SHORT_TEXT.filter(lambda k: k not in KNOWN_FIELDS))
        value = draw(SHORT_TEXT if valid else json_values)
        get(document, path)[name] = value
        if shape(path) in CLOSED:
            verdict = "refuse"
        elif path == ("activation", "environment"):
            verdict = "accept" if isinstance(value, str) else "refuse"
        else:
            verdict = "accept"
        names = (*located(path), repr(name)) if path else (repr(name),)
        return ManifestCase(target, kind, dump(document), verdict, names)
    if kind == "huge_number" or kind == "deep":
        literal, small = nesting(draw)
        if kind == "huge_number":
            literal = "1" + "0" * 5000
        document["activation"] = {**document.get("activation", {}), "additional_config": {}}
        document["activation"]["additional_config"]["x"] = SLOT
        data = dump(document).decode().replace(json.dumps(SLOT), literal).encode()
        ok = kind == "deep" and small
        return ManifestCase(target, kind, data, "accept" if ok else "refuse", whole)
    raw = json.dumps(document, indent=2).encode("utf-8")
    if kind == "truncate":
        data = raw[: draw(st.integers(0, raw.rindex(b"}")))]
    elif kind == "invalid_utf8":
        at = draw(st.integers(0, len(raw)))
        data = raw[:at] + draw(st.sampled_from(BAD_UTF8)) + raw[at:]
    elif kind == "bom":
        data = BOM + raw
    else:
        data = dump(draw(json_values.filter(lambda v: not isinstance(v, dict))))
    return ManifestCase(target, kind, data, "refuse", whole)


BOTH_WAYS = frozenset({"delete", "delete_item", "extra", "deep"})
MANIFEST_COMMANDS = (
    "list",
    "list --json",
    "validate",
    "inspect",
    "status",
    "plan",
    "render",
    "enable",
    "configure",
    "env",
    "run-dry",
)


PROVIDER_VERBS = frozenset({"status", "plan", "render", "env", "run-dry"})


def listed(outcome: Outcome, bundle_id: str) -> str | None:
    """``list``'s verdict on one bundle: None when valid, else its diagnostic."""
    check_accepted(outcome)
    valid = [line for line in outcome.out.splitlines() if line.split(" ")[0] == bundle_id]
    invalid = [line for line in outcome.err.splitlines() if line.startswith(f"{bundle_id} ")]
    assert len(valid) + len(invalid) == 1, (bundle_id, outcome)
    registered = installed_ids()
    for line in outcome.err.splitlines():  # one line per diagnostic, nothing else
        assert line.split(" invalid ")[0] in registered and " invalid " in line, line
    return invalid[0].split(" invalid ", 1)[1] if invalid else None


@pytest.mark.parametrize("kind", MANIFEST_KINDS)
def test_a_corrupt_manifest_is_named_strictly_and_tolerated_by_list(
    world: World, kind: str
) -> None:
    """A corrupted copy of a real manifest: ``extension list`` tolerates it with one
    ``<id> invalid <error>`` line that says what ``validate`` says; every other verb is
    refused naming the bundle and the field, or behaves as for a valid manifest; the state
    file is never changed by a refusal."""
    seen: Counter[tuple[str, str]] = Counter()

    @settings(REAL_SCHEDULER, max_examples=6 if kind in BOTH_WAYS else 3)
    @given(case=manifest_cases(kind), stored=st.sampled_from(["absent", "disabled", "enabled"]))
    def run(case: ManifestCase, stored: str) -> None:
        target = case.target
        with sandbox(world) as (root, _):
            world.write_manifest(target, case.data)
            path = root / "cfg" / "config.json"
            settings_file = root / "settings.json"
            settings_file.write_text(json.dumps(COMPAT[target]))

            diagnostic = listed(cli(["extension", "list"]), target)
            reference = cli(["extension", "validate", target])
            if case.verdict is not None:
                assert (diagnostic is None) == (case.verdict == "accept"), (case, diagnostic)
            assert (reference.code == 0) == (diagnostic is None), (reference, diagnostic)
            if diagnostic is not None:  # strict and tolerant discovery say the same
                message = check_refused(reference, case.names, all_of=(repr(target),))
                assert message == norm(diagnostic)
            seen[("manifest", "valid" if diagnostic is None else "invalid")] += 1

            for command in MANIFEST_COMMANDS:
                state = "enabled" if command in ("env", "run-dry") else stored
                entries: Entries = {}
                raw = None
                if state != "absent":
                    entries = {target: (state == "enabled", COMPAT[target])}
                    entry = {"enabled": state == "enabled", "configuration": COMPAT[target]}
                    raw = json.dumps({"schema_version": 2, "extensions": {target: entry}})
                restore(path, None if raw is None else raw.encode())
                if diagnostic is not None and command not in ("list", "list --json"):
                    expect = refuse(*case.names, all_of=(repr(target),))
                elif command == "run-dry" or (case.verdict is None and command in PROVIDER_VERBS):
                    # A valid manifest the rules did not pin may still be refused by the
                    # provider (another host.provider, an unverified host): then it is named.
                    expect = Expect("either", (repr(target),))
                else:
                    expect = expect_verb(command, target, entries, configuration=COMPAT[target])
                argv = argv_for(command, target, settings_file)
                outcome = exercise(argv, expect, path, root)
                if command == "list --json":
                    documents = json.loads(outcome.out)
                    mine = [d for d in documents if d["bundle_id"] == target]
                    assert len(mine) == 1
                    assert ("discovery_error" in mine[0]) == (diagnostic is not None)
                seen[("command", command)] += 1
                seen[("outcome", "accepted" if outcome.code == 0 else "refused")] += 1

    run()
    tally_report(f"manifest {kind}", seen)
    assert {k for (what, k) in seen if what == "command"} == set(MANIFEST_COMMANDS)
    if kind in BOTH_WAYS:
        assert seen[("manifest", "valid")] and seen[("manifest", "invalid")], seen
    elif kind != "retext":
        assert not seen[("manifest", "valid")], seen
    assert seen[("outcome", "refused")], seen


def test_a_line_break_in_any_manifest_string_keeps_every_message_one_line(world: World) -> None:
    """Each string of both manifests in turn holds the drawn text: ``list`` still gives
    one ``<id> invalid <error>`` line per bad bundle, and strict discovery agrees."""
    seen: Counter[str] = Counter()

    @settings(REAL_SCHEDULER, max_examples=2)
    @given(text=st.sampled_from(["a\nb", "\r\n", "x\u2028y", " \t "]) | retexts)
    def run(text: str) -> None:
        with sandbox(world) as (root, _):
            path = root / "cfg" / "config.json"
            for key, target in TARGETS.items():
                for slot, value in walk(PRISTINE[key]):
                    if not isinstance(value, str):
                        continue
                    document = copy.deepcopy(PRISTINE[key])
                    put(document, slot, text)
                    world.write_manifest(target, json.dumps(document).encode())
                    listing = exercise(["extension", "list"], ACCEPT, path, root)
                    diagnostic = listed(listing, target)
                    expect = Expect("either", (repr(target),))
                    outcome = exercise(["extension", "validate", target], expect, path, root)
                    assert (outcome.code == 0) == (diagnostic is None)
                    if diagnostic is not None:
                        assert norm(diagnostic) == error_message(outcome)
                    seen["valid" if diagnostic is None else "invalid"] += 1
                world.reset()

    run()
    assert seen["invalid"] and seen["valid"] + seen["invalid"] >= 60, seen


# --- family 3: environment variables --------------------------------------------------

path_garbage = (
    st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=30)
    .map(lambda s: s.lstrip("/"))
    .filter(
        lambda s: bool(s.strip())
        and ".." not in Path(s).parts
        and Path(s) != Path(".")
        and not s.startswith("~")
    )
)
CONFIG_KINDS = (
    "unset",
    "empty",
    "blank",
    "relative",
    "garbage",
    "absolute",
    "directory",
    "under_file",
    "too_long",
    "dangling_link",
    "loop_link",
)
XDG_KINDS = ("unset", "empty", "blank", "relative", "absolute")
EVIDENCE_KINDS = ("unset", "empty", "blank", "garbage", "directory", "junk_file")
ENV_COMMANDS = ("list", "status", "enable", "disable", "forget", "env", "run-dry", "run")
ENV_STATES: dict[str, dict[str, Any] | None] = {
    "none": None,
    "good-disabled": {"schema_version": 2, "extensions": {GOOD: {"enabled": False}}},
    "good-enabled": {
        "schema_version": 2,
        "extensions": {GOOD: {"enabled": True, "configuration": COMPAT_BIDKV}},
    },
    "kvcached-enabled": {
        "schema_version": 2,
        "extensions": {TARGETS["kvcached"]: {"enabled": True, "configuration": COMPAT_KV}},
    },
    "legacy-kvcached": {"schema_version": 1, "enabled": [TARGETS["kvcached"]]},
}


@dataclass(frozen=True)
class EnvCase:
    config: tuple[str, str]
    xdg: tuple[str, str]
    evidence: tuple[str, str]
    plugins: str | None
    enabled_var: str | None
    native: tuple[str, str] | None
    ecpa: tuple[str, str] | None
    state: dict[str, Any] | None


# One parameter per (variable, kind): that variable takes that kind, the others are drawn.
# Behind a refused VLLM_HUST_EXT_CONFIG nothing else is read, so the other foci keep it usable.
REFUSING_CONFIG = ("blank", "directory", "under_file", "too_long", "loop_link")
ENV_FOCI = (
    *(("config", k) for k in CONFIG_KINDS),
    *(("xdg", k) for k in XDG_KINDS),
    *(("evidence", k) for k in EVIDENCE_KINDS),
    *((name, "set") for name in ("plugins", "enabled_var", "native", "ecpa")),
)


@st.composite
def env_cases(draw: st.DrawFn, focus: str, kind: str) -> EnvCase:
    def pick(name: str, kinds: Sequence[str]) -> tuple[str, str]:
        chosen = kind if focus == name else draw(st.sampled_from(kinds))
        return chosen, draw(path_garbage)

    usable = [k for k in CONFIG_KINDS if k not in REFUSING_CONFIG]
    config_kinds = ("unset", "empty") if focus == "xdg" else usable
    text = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=9)

    def maybe(name: str, value: st.SearchStrategy[Any]) -> Any:
        if focus in ("ecpa", "evidence") and name == "native":
            return None  # the native refusal comes first: it would hide theirs
        return draw(value) if focus == name else draw(st.none() | value)

    return EnvCase(
        config=pick("config", config_kinds),
        xdg=pick("xdg", XDG_KINDS),
        evidence=pick("evidence", EVIDENCE_KINDS),
        plugins=maybe("plugins", text),
        enabled_var=maybe("enabled_var", text),
        native=maybe("native", st.tuples(st.sampled_from(NATIVE_ENV), text)),
        ecpa=maybe("ecpa", st.tuples(st.sampled_from(EVIDENCE_ENV[:4]), text)),
        state=ENV_STATES[FOCUS_STATE.get(focus) or draw(st.sampled_from(sorted(ENV_STATES)))],
    )


# A state under which the focused variable has its effect: nothing enabled, so that
# ``run`` gets as far as the evidence check; a native-manifest bundle enabled; the
# plugin-declaring bundle enabled.
FOCUS_STATE = {
    "ecpa": "good-disabled",
    "evidence": "good-disabled",
    "native": "good-enabled",
    "plugins": "kvcached-enabled",
}


def apply_env(case: EnvCase, root: Path, patch: pytest.MonkeyPatch) -> tuple[Path, Expect | None]:
    """Set the drawn variables; the state file they select, or the refusal they cause."""
    cwd = root / "cwd"
    xdg_kind, xdg_text = case.xdg
    xdg = {"unset": None, "empty": "", "blank": " ", "relative": xdg_text}.get(
        xdg_kind, str(root / "xdg")
    )
    if xdg is not None:
        patch.setenv("XDG_CONFIG_HOME", xdg)
    base = root / "xdg" if xdg_kind == "absolute" else root / "home" / ".config"
    default = base / "vllm-hust-ext" / "config.json"
    kind, text = case.config
    value: str | None
    expect: Expect | None = None
    if kind == "unset":
        value, path = None, default
    elif kind == "empty":
        value, path = "", default
    elif kind == "blank":
        value, path = (" ", "\t", " \n ")[len(text) % 3], default
        expect = refuse(CONFIG_ENV)
    elif kind in ("relative", "garbage"):
        value = "sub/dir/config.json" if kind == "relative" else text
        path = cwd / value
    elif kind == "absolute":
        path = root / "abs" / "config.json"
        value = str(path)
    elif kind == "directory":
        path = root / "adir"
        path.mkdir()
        value, expect = str(path), refuse(str(path))
    elif kind == "under_file":
        (root / "afile").write_text("x")
        path = root / "afile" / "config.json"
        value, expect = str(path), refuse(str(path), str(path.parent))
    elif kind == "too_long":
        path = root / ("x" * 300)
        value, expect = str(path), refuse(str(path))
    elif kind == "dangling_link":
        path = root / "link.json"
        path.symlink_to(root / "target" / "config.json")
        value = str(path)
    else:
        path = root / "loop.json"
        path.symlink_to(path)
        value, expect = str(path), refuse(str(path))
    if value is None:
        patch.delenv(CONFIG_ENV)
    else:
        patch.setenv(CONFIG_ENV, value)
    evidence_kind, evidence_text = case.evidence
    evidence = {
        "unset": None,
        "empty": "",
        "blank": " ",
        "garbage": evidence_text,
        "directory": str(root / "cwd"),
        "junk_file": str(root / "junk.jsonl"),
    }[evidence_kind]
    (root / "junk.jsonl").write_bytes(b'\xff{"event": "effective"\n[1,2]\nNaN\n')
    if evidence is not None:
        patch.setenv(EVIDENCE_PATH_ENV, evidence)
    plain = [("VLLM_PLUGINS", case.plugins), ("VLLMHUST_EXT_ENABLED_BUNDLES", case.enabled_var)]
    for pair in (*plain, case.native, case.ecpa):
        if pair is not None and pair[1] is not None:
            patch.setenv(pair[0], pair[1])
    if expect is None and case.state is not None and kind not in ("dangling_link",):
        write_file(path, json.dumps(case.state).encode())
    return path, expect


# The verbs that read each variable (all of them read the state file's location).
ENV_READERS = {
    "evidence": ("status", "run-dry", "run"),
    "plugins": ("env", "run-dry"),
    "enabled_var": ("env", "status", "run-dry"),
    "native": ("run-dry", "run"),
    "ecpa": ("status", "run-dry", "run"),
}


@pytest.mark.parametrize(("focus", "kind"), ENV_FOCI, ids=[f"{f}-{k}" for f, k in ENV_FOCI])
def test_bad_environment_variables_are_named_or_tolerated(
    world: World, focus: str, kind: str
) -> None:
    """One environment variable the manager reads, at a drawn bad value: a command that
    needs it is refused in one line naming the variable (or the path it gives); one that
    does not read it works; ``env`` composes ``VLLM_PLUGINS`` with the caller's names."""
    seen: Counter[tuple[str, str]] = Counter()

    @settings(REAL_SCHEDULER, max_examples=2)
    @given(case=env_cases(focus, kind))
    def run(case: EnvCase) -> None:
        with sandbox(world) as (root, patch):
            path, config_refusal = apply_env(case, root, patch)
            raw = snapshot(path)
            for command in ENV_READERS.get(focus, ENV_COMMANDS):
                restore(path, raw)
                with pytest.MonkeyPatch.context() as extra:
                    if command == "run" and not any(n in os.environ for n in EVIDENCE_ENV):
                        extra.setenv("VLLM_ECPA_PLAN_ID", "")  # never really launch
                    expect, enabled = expect_env(case, command, path, config_refusal)
                    outcome = exercise(argv_for(command, GOOD), expect, path, root)
                if outcome.code == 0 and command == "env":
                    shown = json.loads(outcome.out)
                    assert shown["VLLMHUST_EXT_ENABLED_BUNDLES"] == ",".join(enabled)
                    if TARGETS["kvcached"] in enabled:  # the caller's names pass through
                        names = [n for n in os.environ.get("VLLM_PLUGINS", "").split(",") if n]
                        names += ["ascend", "kvcached_provider"]
                        assert shown["VLLM_PLUGINS"] == ",".join(dict.fromkeys(names))
                        seen[("plugins", "shown")] += 1
                seen[("command", command)] += 1
                seen[("outcome", "accepted" if outcome.code == 0 else "refused")] += 1
                for name in (CONFIG_ENV, *EVIDENCE_ENV, *NATIVE_ENV):
                    if expect.outcome == "refuse" and name in expect.any_of:
                        seen[("named", name)] += 1

    run()
    tally_report(f"environment {focus}={kind}", seen)
    assert {k for (w, k) in seen if w == "command"} == set(ENV_READERS.get(focus, ENV_COMMANDS))
    if focus == "config" and kind in REFUSING_CONFIG:
        assert not seen[("outcome", "accepted")], seen
    else:
        assert seen[("outcome", "accepted")], seen
    if focus in ("config", "xdg"):
        assert seen[("outcome", "refused")], seen  # at least run, with evidence preset
    if focus in ("ecpa", "evidence"):
        assert any(w == "named" and n in EVIDENCE_ENV for (w, n) in seen), seen
    if focus == "native":
        assert seen[("named", NATIVE_ENV[0])], seen
    if focus == "plugins":
        assert seen[("plugins", "shown")], seen


def expect_env(
    case: EnvCase, command: str, path: Path, config_refusal: Expect | None
) -> tuple[Expect, list[str]]:
    """§3, §4 and §6.2 for the drawn variables; also the enabled ids ``env`` must show."""
    if config_refusal is not None:
        return config_refusal, []
    entries = judge_state(snapshot(path), path).entries
    assert entries is not None
    expect = expect_verb(command, GOOD, entries)
    enabled = sorted(k for k, (on, _) in entries.items() if on)
    launching = command in ("run", "run-dry") and expect.outcome == "accept"
    if launching and case.native is not None and NATIVE_IDS & set(enabled):
        expect = refuse(*NATIVE_ENV)  # §6.2: the manager owns these variables
    elif launching and command == "run":
        expect = refuse(*(n for n in EVIDENCE_ENV if n in os.environ))
    return expect, enabled


# --- family 4: command arguments ------------------------------------------------------

# Arguments as Python decodes argv: bytes that are not UTF-8 become surrogate escapes.
argv_ids = (
    st.binary(min_size=1, max_size=8)
    .filter(lambda b: b"\x00" not in b)
    .map(lambda b: b.decode("utf-8", "surrogateescape"))
)
odd_ids = st.sampled_from(
    [
        "",
        " ",
        "\n",
        "-",
        "org.test.fuzz.good\n",
        " org.test.fuzz.good",
        "ORG.TEST.FUZZ.GOOD",
        "x" * 5000,
        "\udcff",
        "a\tb",
        "'",
        '"',
        "\\",
        "é",
        "\U0001f600",
        GONE,
        GOOD,
        TARGETS["kvcached"],
    ]
) | (st.text(st.characters(exclude_characters="\x00"), max_size=16) | argv_ids).filter(
    lambda s: not (s.startswith("-") and s != "-") and not s.startswith("org.vllm-hust.")
)
ID_VERBS = (
    "inspect",
    "validate",
    "enable",
    "disable",
    "forget",
    "status",
    "check",
    "plan",
    "render",
)
FILE_KINDS = (
    "object",
    "array",
    "scalar",
    "invalid_json",
    "invalid_utf8",
    "bom",
    "huge_number",
    "deep",
    "empty",
    "missing",
    "directory",
)
USAGE_CASES: tuple[tuple[list[str], tuple[str, ...]], ...] = (
    (["extension", "frobnicate", GOOD], ("argument verb",)),
    (["extension"], ("verb",)),
    ([], ("command",)),
    (["bogus"], ("argument command",)),
    (["extension", "enable"], ("extension_id",)),
    (["extension", "enable", GOOD, "extra"], ("unrecognized arguments: extra",)),
    (["extension", "list", "--bogus"], ("--bogus",)),
    (["extension", "enable", "-x"], ("-x", "extension_id")),
    (["extension", "configure", GOOD], ("--file",)),
    (["extension", "configure", GOOD, "--file"], ("--file",)),
    (["run", "--shutdown-grace-seconds", "abc", "--", "true"], ("--shutdown-grace-seconds",)),
    (["run", "--shutdown-grace-seconds", "nan", "--", "true"], ("--shutdown-grace-seconds",)),
    (["run", "--shutdown-grace-seconds", "1e999", "--", "true"], ("--shutdown-grace-seconds",)),
    (["run", "--shutdown-grace-seconds", "-1", "--", "true"], ("--shutdown-grace-seconds",)),
    (["run", "--dry-run", "--"], ("command after --", repr(TARGETS["kvcached"]))),
)
ARG_STATE = {
    "schema_version": 2,
    "extensions": {
        GOOD: {"enabled": False},
        TARGETS["kvcached"]: {"enabled": True},
        GONE: {"configuration": {"k": [1]}},
        "\n": {},
    },
}


@st.composite
def file_cases(draw: st.DrawFn, kind: str) -> tuple[bytes | None, Any]:
    """A ``configure --file`` content of one kind, and the object it holds (None: none)."""
    content: Any = draw(json_objects)
    raw = json.dumps(content).encode()
    if kind == "deep":
        literal, shallow = nesting(draw)
        data = ('{"d":' + literal + "}").encode()
        return data, json.loads(data) if shallow else None
    data = {
        "object": raw,
        "array": json.dumps(draw(st.lists(json_values, max_size=2))).encode(),
        "scalar": json.dumps(draw(scalars)).encode(),
        "invalid_json": raw[:-1] if raw != b"{}" else b"{,}",
        "invalid_utf8": b"\xff" + raw,
        "bom": BOM + raw,
        "huge_number": b'{"n": 1' + b"0" * 5000 + b"}",
        "empty": b"",
    }.get(kind)
    return data, content if kind == "object" else None


@pytest.mark.parametrize(
    ("argv", "names"), USAGE_CASES, ids=[" ".join(a) or "(none)" for a, _ in USAGE_CASES]
)
def test_a_usage_error_is_one_named_line_and_changes_nothing(
    world: World, argv: list[str], names: tuple[str, ...]
) -> None:
    """An argparse usage error: exit 2, one error line naming the argument, no state file
    created and an existing one unchanged."""
    for stored in (None, json.dumps(ARG_STATE, indent=1).encode()):
        with sandbox(world) as (root, _):
            path = root / "cfg" / "config.json"
            restore(path, stored)
            exercise(argv, refuse(*names, usage=True), path, root)


def test_odd_ids_are_named_and_change_nothing_they_should_not(world: World) -> None:
    """Ids that are not installed, look alike, or are not UTF-8, through every id verb:
    refused naming the id, or accepted where the protocol allows an id that is not
    installed (``disable``, say); an undecodable id never reaches the state file."""
    seen: Counter[tuple[str, str]] = Counter()

    @settings(REAL_SCHEDULER, max_examples=18)
    @given(bundle_id=odd_ids, stored=st.booleans())
    def run(bundle_id: str, stored: bool) -> None:
        with sandbox(world) as (root, _):
            path = root / "cfg" / "config.json"
            raw = json.dumps(ARG_STATE, indent=1).encode() if stored else None
            entries = judge_state(raw, path).entries
            assert entries is not None
            for verb in ID_VERBS:
                restore(path, raw)
                expect = expect_verb(verb, bundle_id, entries)
                outcome = exercise(["extension", verb, bundle_id], expect, path, root)
                seen[("verb", verb)] += 1
                seen[("outcome", "accepted" if outcome.code == 0 else "refused")] += 1
            seen[("id", "installed" if bundle_id in installed_ids() else "unknown")] += 1
            seen[("id", "text" if is_text(bundle_id) else "not UTF-8")] += 1

    run()
    tally_report("odd ids", seen)
    assert {k for (w, k) in seen if w == "verb"} == set(ID_VERBS)
    assert seen[("id", "unknown")] and seen[("id", "not UTF-8")], seen
    assert seen[("outcome", "accepted")] and seen[("outcome", "refused")], seen


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_a_bad_configuration_file_is_named_and_stores_nothing(world: World, kind: str) -> None:
    """``configure --file`` with a drawn file (not JSON, not UTF-8, an array or scalar, a
    directory, missing, deep): refused naming the file and storing nothing, or an object
    stored for an installed bundle."""
    seen: Counter[tuple[str, str]] = Counter()

    @settings(REAL_SCHEDULER, max_examples=6 if kind == "deep" else 3)
    @given(case=file_cases(kind), target=odd_ids, installed=st.integers(0, 3).map(bool))
    def run(case: tuple[bytes | None, Any], target: str, installed: bool) -> None:
        data, content = case
        target = GOOD if installed else target  # mostly the bundle, so the file is judged
        with sandbox(world) as (root, _):
            path = root / "cfg" / "config.json"
            write_file(path, json.dumps(ARG_STATE).encode())
            entries = judge_state(snapshot(path), path).entries
            assert entries is not None
            file = root / "in" / "settings.json"
            if kind == "directory":
                file.mkdir(parents=True)
            elif data is not None:
                write_file(file, data)
            expect = expect_verb("configure", target, entries, configuration=content)
            if expect.outcome == "accept" and kind in ("array", "scalar"):
                expect = refuse("extension configuration file must contain an object")
            elif expect.outcome == "accept" and content is None:
                expect = refuse(str(file))  # unreadable, not UTF-8 JSON, or too deep
            argv = ["extension", "configure", target, "--file", str(file)]
            outcome = exercise(argv, expect, path, root)
            seen[("target", "installed" if target == GOOD else "other")] += 1
            seen[("outcome", "accepted" if outcome.code == 0 else "refused")] += 1

    run()
    tally_report(f"configure file {kind}", seen)
    assert seen[("target", "installed")], seen
    if kind in ("object", "deep"):
        assert seen[("outcome", "accepted")], seen
    if kind != "object":
        assert seen[("outcome", "refused")], seen


# --- regressions: defects this fuzzing found ----------------------------------------


def test_a_plugin_name_with_a_line_break_is_one_diagnostic_line(world: World) -> None:
    """Found while writing these properties: discovery put a declared plugin entry
    point's name into its message raw, so ``extension list`` printed a name holding a
    newline as two stderr lines (the second looking like a line of its own) and the strict
    error showed a name that is not the manifest's. The name is now quoted and escaped
    when it is not one printable token; an ordinary name reads as before."""
    document = copy.deepcopy(PRISTINE["kvcached"])
    document["activation"]["entry_points"][0]["name"] = "kvcached\nprovider: injected"
    world.write_manifest(TARGETS["kvcached"], json.dumps(document).encode())
    with sandbox(world) as (root, _):
        path = root / "cfg" / "config.json"
        target = TARGETS["kvcached"]
        diagnostic = listed(exercise(["extension", "list"], ACCEPT, path, root), target)
        shown = "vllm.general_plugins:'kvcached\\nprovider: injected'"
        assert diagnostic is not None and shown in diagnostic
        refused = exercise(["extension", "validate", target], refuse(shown), path, root)
        assert norm(diagnostic) == error_message(refused)


@pytest.mark.parametrize("verb", ["disable", "enable", "forget", "configure", "inspect"])
def test_an_undecodable_extension_id_is_refused_before_the_state_changes(
    world: World, verb: str
) -> None:
    """Found while writing these properties: ``extension disable $'\\xff'`` stored the id
    (Python decodes the byte as the surrogate escape \\udcff), then failed to echo it on
    a strict UTF-8 stdout: exit 2 with "'utf-8' codec can't encode character", the state
    file created anyway. Such an id is now refused first, naming the argument."""
    for stored in (None, json.dumps(ARG_STATE).encode()):
        with sandbox(world) as (root, _):
            path = root / "cfg" / "config.json"
            restore(path, stored)
            settings_file = root / "settings.json"
            settings_file.write_text("{}")
            expect = refuse("extension id '\\udcff' is not valid UTF-8")
            exercise(argv_for(verb, "\udcff", settings_file), expect, path, root)


# --- the console script: no traceback reaches a real stderr ---------------------------

# (case id, state file bytes, corrupted manifest bytes for the bidkv copy, argv)
SCRIPT_CASES: tuple[tuple[str, bytes | None, bytes | None, list[str]], ...] = (
    ("truncated-state", b'{"schema_version": 2, "exten', None, ["extension", "disable", GOOD]),
    ("invalid-utf8-state", b'{"schema_version": 2\xff}', None, ["extension", "list"]),
    ("deep-state", b"[" * 50000, None, ["run", "--dry-run", "--", "true"]),
    ("bom-manifest", None, BOM + json.dumps(PRISTINE["bidkv"]).encode(), ["extension", "list"]),
    (
        "truncated-manifest",
        None,
        b'{"schema_version": "0.2-exp',
        ["extension", "enable", TARGETS["bidkv"]],
    ),
    ("surrogate-id", None, None, ["extension", "disable", "\udcff"]),
)


@pytest.mark.parametrize(
    ("state", "manifest", "argv"), [c[1:] for c in SCRIPT_CASES], ids=[c[0] for c in SCRIPT_CASES]
)
def test_the_console_script_prints_no_traceback(
    world: World, tmp_path: Path, state: bytes | None, manifest: bytes | None, argv: list[str]
) -> None:
    """Through the real console script on a strict UTF-8 stdout: no traceback for a bad
    state file, manifest or argument; the refusal names the file or argument and the state
    file's bytes stay as they were, with no temp file left."""
    config = tmp_path / "cfg" / "config.json"
    if state is not None:
        write_file(config, state)
    if manifest is not None:
        world.write_manifest(TARGETS["bidkv"], manifest)
    environment = {k: v for k, v in os.environ.items() if k not in MANAGED_ENV}
    search = os.pathsep.join(filter(None, [str(world.site), os.environ.get("PYTHONPATH")]))
    # A UTF-8 terminal's stdout: strict, as Python has it outside the C locale.
    environment.update(
        {
            CONFIG_ENV: str(config),
            "HOME": str(tmp_path),
            "PYTHONPATH": search,
            "PYTHONIOENCODING": "utf-8:strict",
        }
    )
    done = subprocess.run(
        [CLI, *(a.encode("utf-8", "surrogateescape") for a in argv)],
        env=environment,
        cwd=tmp_path,
        capture_output=True,
        timeout=60,
    )
    err = done.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err, err
    outcome = Outcome(done.returncode, done.stdout.decode("utf-8", "replace"), err)
    if argv == ["extension", "list"] and state is None:
        assert listed(outcome, TARGETS["bidkv"]) is not None  # tolerated, and reported
    else:
        check_refused(outcome, (str(config), repr(argv[-1])))
    assert snapshot(config) == state
    assert temp_files(tmp_path) == []
