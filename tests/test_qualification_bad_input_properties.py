"""Fuzzed bad input to ``python -m qualification``: one clear line, nothing created or lost.

Guarded behaviour, the project standard applied to the qualification CLI (its module
docstring and README "Exit status"): bad input exits 2 with exactly one stderr line
``qualification: error: <message>`` naming the file, key, flag or variable at fault and
what was expected, never a traceback or another exception escaping ``main``; a refused
``run`` creates nothing and changes nothing (no ``--out`` directory, no arm directory, an
earlier run's files in a reused ``--out`` byte for byte as they were, nothing written
outside ``--out``); accepted input behaves as documented (``--dry-run`` prints the plan,
``run`` writes ``record.json``, exit 0 or 1); the readers of the gates' files raise only
``QualificationError`` with a one-line message, and the lenient ones never raise.

Hypothesis draws corruptions of valid inputs and an oracle, written from the README and
the profile schema's documented rules, says accept, refuse or either:

1. Profiles: the shipped TOML files (``qualification/profiles/``), with keys deleted,
   values of the wrong type, extra keys, retexted strings (path-like and multi-line names,
   bad placeholders, bad ranges and patterns), special numbers (NaN, inf, huge, negative),
   and byte damage (truncated, invalid UTF-8, NUL, BOM, empty, a 5000-digit integer, deep
   nesting, a duplicate key), through ``run PATH --dry-run`` and ``run PATH --out DIR``.
2. Options and environment: ``--repeats`` text, ``--out`` (new, reused, a file, under a
   file, an undecodable name), ``VLLM_HUST_COMMIT`` and the manager-owned variables and
   ``VLLM_HUST_EXT_CONFIG`` that every arm must drop or override.
3. The replay's ``report.json`` (built from the existing tests' valid reports), each arm
   exiting 0, 1 or timing out, through the real ``run_replay_arm``.
4. The lenient readers: manager evidence JSONL, Prometheus text, the engine log.
5. ``release-check``: record files (from test_qualification_release's helpers) and the
   tree's files.

Nothing is launched (each stub says so where it is installed): the manager verbs and its
``run --dry-run``, git, the nvidia-smi/npu-smi probes, matplotlib, the replay process and
the arms of a ``run`` (a fake arm builds its real command, creates its arm directory as
the real arms do and returns canned figures). Every property counts what it exercised and
asserts that each corruption kind ran and that both outcomes occurred where both can
(non-vacuity). The tests at the end pin the defects these properties found. Examples are
deterministic (``tests/property_settings.py``). The hand-picked cases live in
test_qualification_plans.py, test_qualification_cpu_replay.py, test_qualification_serve.py
and test_qualification_release.py.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import re
import shutil
import subprocess
import tempfile
import threading
import tomllib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

import qualification.manager
import qualification.replay
import qualification.rollback
import qualification.runner
from qualification import RECORD_SCHEMA
from qualification.cli import main
from qualification.errors import QualificationError
from qualification.evidence import (
    counters_from_evidence,
    counters_from_metrics,
    enabled_from_log,
    parse_prometheus,
)
from qualification.manager import ManagerSession
from qualification.profile import (
    MAX_REPEATS,
    PROFILE_DIR,
    CellSpec,
    ManagerSpec,
    Profile,
    ReplaySpec,
    ServerSpec,
    WorkloadSpec,
    load_profile,
)
from qualification.replay import arm_from_report, read_report
from qualification.verdict import COUNTER_NAMES, ArmResult
from tests.fuzz_helpers import SHORT_TEXT, put, shape, tally_report, walk
from tests.property_settings import REAL_SCHEDULER
from tests.test_qualification_cpu_replay import _controller, _replay_arm_report
from tests.test_qualification_release import _record, _tree

ERROR = "qualification: error: "
# argparse's own refusals (a bad --repeats): usage lines, then this prefix.
USAGE_ERROR = re.compile(r"python -m qualification(?: run| release-check)?: error: ")
OWNED_BY_MANAGER = (
    "VLLM_ECPA_EVIDENCE_SINK",
    "VLLM_ECPA_EVIDENCE_STRICT",
    "VLLM_ECPA_PLAN_ID",
    "VLLM_ECPA_LAUNCH_ID",
    "VLLM_HUST_EXT_EVIDENCE_PATH",
    "VLLM_EXTENSION_MANIFESTS",
    "VLLM_EXTENSION_BUNDLES",
)
BAD_UTF8 = (b"\xff", b"\xc3(", b"\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf")


def _fuzz(examples: int) -> settings:
    """Deterministic settings (derandomized, no database, no deadline) with ``examples``."""
    return settings(REAL_SCHEDULER, max_examples=examples)


def shown(text: str) -> str:
    """``text`` as a one-line message shows it: a character that is not printable (a line
    break, a control character, an undecodable file name's surrogate escape) appears as
    its backslash escape."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# --- running the CLI in-process and judging one outcome ------------------------------


@dataclass(frozen=True)
class Outcome:
    code: int
    out: str
    err: str


def cli(argv: Sequence[str]) -> Outcome:
    """``python -m qualification ARGV`` in-process through ``main(argv)``. Any exception
    but SystemExit (argparse) propagates and fails the test: it would reach the user as a
    traceback. The streams are a UTF-8 terminal's: stdout strict, stderr escaping."""
    out_bytes, err_bytes = io.BytesIO(), io.BytesIO()
    out = io.TextIOWrapper(out_bytes, encoding="utf-8", errors="strict")
    err = io.TextIOWrapper(err_bytes, encoding="utf-8", errors="backslashreplace")
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as stop:
            assert isinstance(stop.code, int), stop.code
            code = stop.code
    out.flush()
    err.flush()
    return Outcome(code, out_bytes.getvalue().decode(), err_bytes.getvalue().decode())


def check_refused(outcome: Outcome, any_of: Sequence[str], *, usage: bool = False) -> str:
    """Exit 2, nothing on stdout, one final error line naming one of ``any_of``."""
    assert outcome.code == 2, f"expected a refusal (exit 2), got {outcome}"
    assert outcome.out == "", f"a refused command printed {outcome.out!r}"
    assert "Traceback" not in outcome.err, outcome.err
    lines = outcome.err.splitlines()
    if usage:  # argparse's own refusals: one line too, no usage block
        assert len(lines) == 1, f"not one line: {outcome.err!r}"
        found = USAGE_ERROR.match(lines[0])
        assert found is not None, outcome.err
        message = lines[0][found.end() :]
    else:
        assert len(lines) == 1 and outcome.err.endswith("\n"), f"not one line: {outcome.err!r}"
        assert lines[0].startswith(ERROR), outcome.err
        message = lines[0][len(ERROR) :]
    assert message.strip(), "an empty error message"
    assert any(name in message for name in any_of), f"{message!r} names none of {any_of!r}"
    return message


def check_accepted(outcome: Outcome, codes: Sequence[int] = (0, 1)) -> None:
    assert outcome.code in codes, f"expected exit {codes}, got {outcome}"
    assert "Traceback" not in outcome.err and ERROR not in outcome.err, outcome.err


def snapshot(root: Path) -> dict[str, object]:
    """Every entry under ``root``: a file's bytes, or what kind of entry it is."""
    seen: dict[str, object] = {}
    for entry in sorted(root.rglob("*")):
        rel = str(entry.relative_to(root))
        if entry.is_symlink():
            seen[rel] = ("link", os.readlink(entry))
        elif entry.is_dir():
            seen[rel] = "dir"
        elif entry.is_file():
            seen[rel] = entry.read_bytes()
        else:
            seen[rel] = "special"
    return seen


# --- stubs: nothing is launched -------------------------------------------------------


def _stub_plot(path: Path, _outcomes: object) -> None:
    path.write_bytes(b"\x89PNG stub")


def _no_prepare(_session: ManagerSession, _arm: str) -> None:
    return None


def _fake_dry_run(
    _session: ManagerSession, command: Sequence[str], extra_env: dict[str, str]
) -> dict[str, object]:
    return {"command": list(command), "environment": dict(extra_env)}


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stubs for everything that would start a process or take long."""
    # `git rev-parse` / `git status` (subprocesses) and the nvidia-smi / npu-smi probes.
    monkeypatch.setattr(qualification.runner, "_git", lambda *_a: None)
    monkeypatch.setattr(qualification.runner, "_accelerator_facts", lambda kind: {"kind": kind})
    # matplotlib needs ~0.3 s a plot: a stub file stands for deltas.png.
    monkeypatch.setattr(qualification.runner, "write_plot", _stub_plot)
    # Every tool "is on PATH" (an empty command still is not): PATH lookups only.
    monkeypatch.setattr(qualification.manager, "resolve_tool", lambda c: list(c) if c else None)
    # The manager's verbs (`extension disable/configure/enable`) and its `run --dry-run`
    # are subprocesses.
    monkeypatch.setattr(ManagerSession, "prepare", _no_prepare)
    monkeypatch.setattr(ManagerSession, "dry_run", _fake_dry_run)
    for name in (*OWNED_BY_MANAGER, "VLLM_HUST_COMMIT"):
        monkeypatch.delenv(name, raising=False)


@dataclass
class FakeArms:
    """Stands for the serve and replay arms of a ``run``: builds the arm's real command
    (so a bad placeholder fails where it fails for real), creates its directory as the
    real arms do, checks the arm's environment, and returns canned figures."""

    out: Path | None = None
    ran: int = 0

    def __call__(self, profile: Profile) -> Any:
        from qualification.replay import replay_command
        from qualification.serve import serve_command, serve_environment

        def run(
            arm: Any, cell: CellSpec, repetition: int, arm_dir: Path, session: ManagerSession
        ) -> ArmResult:
            assert self.out is not None
            inside = os.path.normpath(self.out / "cells") + os.sep
            assert os.path.normpath(arm_dir).startswith(inside), f"{arm_dir} escapes --out"
            arm_dir.mkdir(parents=True, exist_ok=True)
            if profile.kind == "replay":
                command = replay_command(profile, arm, cell, repetition, arm_dir / "replay")
                env = session.environment(profile.replay.environment if profile.replay else {})
            else:
                assert profile.server is not None
                command = serve_command(profile)
                env = session.environment(serve_environment(profile.server, arm))
            # Every arm has a private manager state; the caller's manager variables go.
            assert env["VLLM_HUST_EXT_CONFIG"] == str(session.config_path)
            assert session.config_path.is_relative_to(self.out)
            assert not set(OWNED_BY_MANAGER) & set(env), env
            self.ran += 1
            counters = dict.fromkeys(COUNTER_NAMES, 0)
            if arm == "candidate":
                counters.update(calls=4, selections=1, abstentions=3)
            return ArmResult(
                arm=arm, throughput=100.0, ttft_p50=0.1, ttft_p95=0.2, latency_p50=1.0,
                latency_p95=2.0, requests=2, completed=2, counters=counters,
                policy_enabled=arm == "candidate", recovery_ok=True, command=tuple(command),
            )

        return run


@pytest.fixture
def fake_arms(offline: None, monkeypatch: pytest.MonkeyPatch) -> FakeArms:
    arms = FakeArms()
    monkeypatch.setattr(qualification.runner, "_serve_runner", arms)
    monkeypatch.setattr(qualification.runner, "_replay_runner", arms)
    return arms


@contextlib.contextmanager
def box(root: Path) -> Iterator[Path]:
    """A fresh directory for one example."""
    root.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(dir=root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def check_run_accepted(outcome: Outcome, out: Path) -> dict[str, Any]:
    check_accepted(outcome)
    record = json.loads((out / "record.json").read_text(encoding="utf-8"))
    assert record["schema"] == RECORD_SCHEMA
    assert (out / "report.md").is_file() and (out / "deltas.png").is_file()
    assert outcome.out.splitlines()[0] == f"record: {shown(str(out / 'record.json'))}"
    assert ("gate: PASSED" in outcome.out) is (outcome.code == 0)
    return record  # type: ignore[no-any-return]


# --- family 1: profiles ---------------------------------------------------------------

SHIPPED = {p.stem: p for p in sorted(PROFILE_DIR.glob("*.toml"))}
DOCS: dict[str, dict[str, Any]] = {
    name: tomllib.loads(path.read_text(encoding="utf-8")) for name, path in SHIPPED.items()
}
KNOWN_FIELDS = {
    f for model in (Profile, ManagerSpec, ServerSpec, WorkloadSpec, ReplaySpec, CellSpec)
    for f in model.model_fields
}
MODEL_TABLES = {(), ("manager",), ("server",), ("workload",), ("replay",), ("cells", "*")}
FREE_TABLES = {("manager", "configuration"), ("manager", "dry_run_configuration")}
STRING_MAPS = {
    ("server", "environment"), ("server", "candidate_environment"), ("replay", "environment")
}
TEMPLATES = {
    ("replay", "args", "*"), ("replay", "baseline_args", "*"), ("replay", "candidate_args", "*"),
    ("cells", "*", "replay_args", "*"),
}
TEMPLATE_FIELDS = {"seed": "0", "repeat": "0", "offset": "0", "out": "<out>", "cell": "c"}


def required(kind: str) -> set[tuple[str, ...]]:
    """The keys a profile of ``kind`` cannot do without (profile.py, README)."""
    keys = {("name",), ("kind",), ("accelerator",), ("model",), ("host_version_range",),
            ("cells",), ("cells", "*", "name")}
    if kind == "serve":
        return keys | {("server",), ("cells", "*", "paragraph_repeats")}
    return keys | {("replay",)}


def get(doc: Any, path: Sequence[Any]) -> Any:
    for part in path:
        doc = doc[part]
    return doc


def free_form(path: Sequence[Any]) -> bool:
    return any(tuple(path[:2]) == t and len(path) > 2 for t in FREE_TABLES)


def toml_string(text: str) -> str:
    # A JSON string is a TOML basic string once DEL is escaped too.
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    assert isinstance(value, dict), value
    return "{" + ", ".join(f"{toml_string(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def dump_toml(doc: dict[str, Any]) -> bytes:
    return "".join(f"{toml_string(k)} = {toml_value(v)}\n" for k, v in doc.items()).encode()


def kind_of(value: object) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "array", dict: "table"}[type(value)]


toml_scalars = (
    st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | SHORT_TEXT
)
toml_values = st.recursive(
    toml_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(SHORT_TEXT, inner, max_size=3),
    max_leaves=5,
)
RETEXTS = [
    "", " ", ".", "..", "../escape", "../../escape", "/abs-escape", "a/b", "a\\b", "a\nb",
    "\t", "x\x00y", "\x7f", "é", "{nope}", "{seed}", "{seed[x]}", "{seed.real}", "{0}", "{",
    "}", "{seed:\n}", "{seed.a\nb}", ">=0", "not a range", "(rank=(\\d+)", "(\\d+)",
    "homogeneous-long", "azure-conv-30s",
]
retexts = st.sampled_from(RETEXTS) | SHORT_TEXT
SPECIAL_NUMBERS = [
    math.nan, math.inf, -math.inf, 0, -1, 0.5, 1.0, 1e300, 2**63, 10**30, -0.0, 7, MAX_REPEATS,
    MAX_REPEATS + 1,
]
extra_keys = st.text(
    st.sampled_from("abcXYZ019-_. \né/"), min_size=1, max_size=6
).filter(lambda k: k not in KNOWN_FIELDS)


def safe_name(name: str) -> bool:
    """A profile or cell name becomes a directory name under ``--out`` (or the default
    records directory): one printable path component."""
    return name not in ("", ".", "..") and name.isprintable() and not set(name) & {"/", "\\"}


def template_ok(template: str) -> bool | None:
    if "[" in template:
        return None  # indexing: valid or not depending on the value
    try:
        template.format(**TEMPLATE_FIELDS)
    except Exception:
        return False
    return True


def retext_verdict(doc: dict[str, Any], path: tuple[Any, ...], text: str) -> str | None:
    s = shape(path)
    if s in (("name",), ("cells", "*", "name")):
        others = [c["name"] for i, c in enumerate(doc["cells"]) if s == ("name",) or i != path[1]]
        return "accept" if safe_name(text) and (s == ("name",) or text not in others) else "refuse"
    if s == ("kind",):
        return "accept" if text == doc["kind"] else "refuse"
    if s in (("accelerator",), ("model",)):
        return "accept" if text else "refuse"
    if s == ("host_version_range",):
        try:
            SpecifierSet(text)
        except InvalidSpecifier:
            return "refuse"
        return "accept"
    if s == ("server", "tp_rank_pattern"):
        try:
            return "accept" if re.compile(text).groups == 1 else "refuse"
        except re.error:
            return "refuse"
    if s in TEMPLATES and doc["kind"] == "replay":
        ok = template_ok(text)
        return None if ok is None else ("accept" if ok else "refuse")
    return "accept"


@dataclass(frozen=True)
class ProfileCase:
    base: str
    kind: str
    data: bytes
    verdict: str | None  # "accept", "refuse" or None (either)
    path: tuple[Any, ...] | None  # the corrupted key (a refusal must be located there)
    kind_of_profile: str
    cells: int  # cells after the change (for the plan's size)


STRUCTURED = ("delete", "delete_item", "swap", "extra", "retext", "number")
BYTES = ("truncate", "invalid_utf8", "nul", "empty", "bom", "huge_int", "deep", "duplicate")
PROFILE_KINDS = STRUCTURED + BYTES


@st.composite
def profile_cases(draw: st.DrawFn, kind: str) -> ProfileCase:
    base = draw(st.sampled_from(sorted(DOCS)))
    doc = copy.deepcopy(DOCS[base])
    slots = [(p, v) for p, v in walk(doc) if p]
    verdict: str | None
    path: tuple[Any, ...] | None = None
    if kind in BYTES:
        text = SHIPPED[base].read_bytes()
        verdict = "refuse"
        if kind == "truncate":
            # Anywhere, or after a whole line (often still TOML, then the schema decides).
            lines = [i + 1 for i, byte in enumerate(text) if byte == ord("\n")]
            cut = draw(st.integers(0, len(text) - 1) | st.sampled_from(lines[:-1]))
            data, verdict = text[:cut], None
        elif kind in ("invalid_utf8", "nul"):
            at = draw(st.integers(0, len(text)))
            bad = draw(st.sampled_from(BAD_UTF8)) if kind == "invalid_utf8" else b"\x00"
            data = text[:at] + bad + text[at:]
        elif kind == "empty":
            data = draw(st.sampled_from([b"", b"\n", b"# nothing\n"]))
        elif kind == "bom":
            data = b"\xef\xbb\xbf" + text
        elif kind == "huge_int":
            data = text.replace(b"repeats = 3", b"repeats = 1" + b"0" * 5000, 1)
        elif kind == "deep":
            depth = draw(st.sampled_from([3, 40, 100_000]))
            data = b"deep = " + b"[" * depth + b"]" * depth + b"\n" + text
        else:
            data = b'name = "dup"\n' + text
        try:
            cells = len(tomllib.loads(data.decode()).get("cells", []))
        except (ValueError, RecursionError, TypeError):
            cells = 0  # not TOML, or cells not an array: refused before any plan
        return ProfileCase(base, kind, data, verdict, None, doc["kind"], cells)
    if kind == "delete":
        keys = [p for p, _ in slots if isinstance(p[-1], str)]
        want_required = draw(st.booleans())
        pool = [p for p in keys if (shape(p) in required(doc["kind"])) is want_required]
        path = draw(st.sampled_from(pool))
        del get(doc, path[:-1])[path[-1]]
        verdict = "refuse" if want_required else "accept"
    elif kind == "delete_item":
        path = draw(st.sampled_from([p for p, _ in slots if isinstance(p[-1], int)]))
        del get(doc, path[:-1])[path[-1]]
        path, verdict = path[:-1], None
    elif kind == "swap":
        path, original = draw(st.sampled_from(slots))
        value = draw(toml_values.filter(lambda v: kind_of(v) != kind_of(original)))
        put(doc, path, value)
        if free_form(path):
            verdict = "accept"
        elif isinstance(original, dict | list | str):
            verdict = "refuse"
        else:
            verdict = None  # pydantic's lax numbers and booleans
    elif kind == "extra":
        tables = [p for p, v in walk(doc) if isinstance(v, dict)]
        table = draw(st.sampled_from(tables))
        key = draw(extra_keys.filter(lambda k: k not in get(doc, table)))
        value = draw(toml_values)
        get(doc, table)[key] = value
        path = (*table, key)
        if shape(table) in MODEL_TABLES:
            verdict = "refuse"
        elif table in STRING_MAPS:
            verdict = "accept" if isinstance(value, str) else "refuse"
        else:
            verdict = "accept"
    elif kind == "retext":
        path, _ = draw(st.sampled_from([(p, v) for p, v in slots if isinstance(v, str)]))
        text = draw(retexts)
        put(doc, path, text)
        verdict = retext_verdict(doc, path, text)
    else:
        numeric = [p for p, v in slots if isinstance(v, int | float) and not isinstance(v, bool)]
        path = draw(st.sampled_from(numeric))
        put(doc, path, draw(st.sampled_from(SPECIAL_NUMBERS)))
        verdict = None
    cells = len(doc["cells"]) if isinstance(doc.get("cells"), list) else 0
    return ProfileCase(base, kind, dump_toml(doc), verdict, path, doc["kind"], cells)


def located(message: str, where: str, path: tuple[Any, ...]) -> bool:
    """A validation message is located at the corrupted key, one of its tables, a value
    inside it, or the whole profile (its model rules)."""
    rest = message[len(where) :]
    dotted = [shown(str(p)) for p in path]
    places = ["<top level>: "] + [".".join(dotted[:n]) + ": " for n in range(1, len(path) + 1)]
    return any(rest.startswith(p) for p in places) or rest.startswith(".".join(dotted) + ".")


def judge_profile_refusal(case: ProfileCase, message: str, path: Path) -> str:
    """What kind of refusal ``message`` is; asserts it names the thing."""
    where = f"profile {path}: "
    if message.startswith(where):
        if message[len(where) :].startswith("cannot be read as TOML ("):
            assert case.kind in BYTES, message  # a structured change always stays TOML
            return "toml"
        assert re.search(r" \(\d+ error\(s\)\)$", message), message
        if case.path is not None:
            assert located(message, where, case.path), (case.path, message)
        return "schema"
    if "replay argument " in message:
        assert message.startswith("profile ") and "expected plain {name}" in message, message
        return "placeholder"
    assert "not found on PATH" in message, message  # an emptied command
    return "tool"


@pytest.mark.parametrize("kind", PROFILE_KINDS)
def test_a_corrupted_profile_is_refused_on_one_line_or_runs(
    kind: str, tmp_path: Path, fake_arms: FakeArms
) -> None:
    """Each drawn profile, through ``run --dry-run`` or ``run --out``: a refusal is exit 2
    with one line naming the file and the key (or the replay argument, or the missing
    command) and leaves the directory exactly as it was; an accepted profile prints its
    plan or writes its record, everything under ``--out``."""
    seen: Counter[tuple[str, str]] = Counter()

    @_fuzz(14 if kind in STRUCTURED or kind == "truncate" else 6)
    @given(case=profile_cases(kind), dry_run=st.booleans(), reuse=st.booleans())
    def run(case: ProfileCase, dry_run: bool, reuse: bool) -> None:
        with box(tmp_path / "boxes") as root:
            path = root / "profile.toml"
            path.write_bytes(case.data)
            out = root / "out"
            if reuse:
                (out / "cells").mkdir(parents=True)
                (out / "record.json").write_text('{"earlier": "run"}\n')
            argv = ["run", str(path), "--repeats", "1", "--quiet"]
            argv += ["--dry-run"] if dry_run else ["--out", str(out)]
            fake_arms.out = out
            before = snapshot(root)
            outcome = cli(argv)
            after = snapshot(root)
            if outcome.code == 2:
                message = check_refused(outcome, ["profile ", "not found on PATH"])
                seen[("refusal", judge_profile_refusal(case, message, path))] += 1
                assert case.verdict != "accept", f"refused an accepted change: {message}"
                assert after == before, "a refused run created or changed files"
            else:
                assert case.verdict != "refuse", f"accepted a refused change: {outcome}"
                if dry_run:
                    check_accepted(outcome, (0,))
                    plan = json.loads(outcome.out)
                    assert len(plan["arms"]) == 2 * case.cells
                    assert after == before, "--dry-run wrote files"
                else:
                    check_run_accepted(outcome, out)
                    outside = {k: v for k, v in after.items() if not k.startswith("out")}
                    assert outside == {k: v for k, v in before.items() if not k.startswith("out")}
            seen[("outcome", "refused" if outcome.code == 2 else "accepted")] += 1
            seen[("mode", "dry-run" if dry_run else "run")] += 1

    run()
    tally_report(f"profile {kind}", seen)
    assert seen[("mode", "dry-run")] and seen[("mode", "run")], seen
    if kind in ("delete", "extra", "retext", "number", "truncate"):
        assert seen[("outcome", "accepted")] and seen[("outcome", "refused")], seen
    if kind in BYTES and kind != "truncate":
        assert not seen[("outcome", "accepted")], seen


def test_the_toml_writer_round_trips_the_shipped_profiles() -> None:
    """The fuzz writes structured changes with its own TOML writer: unchanged, every
    shipped profile comes back equal and loads."""
    for name, doc in DOCS.items():
        assert tomllib.loads(dump_toml(doc).decode()) == doc, name
        Profile.model_validate(doc)


# --- family 1b: the parsing layer called directly -------------------------------------


@_fuzz(60)
@given(kind=st.sampled_from(PROFILE_KINDS), data=st.data())
def test_load_profile_raises_only_its_error_on_one_line(kind: str, data: st.DataObject) -> None:
    """``load_profile`` on any drawn profile returns a Profile or raises QualificationError
    with one printable line naming the file; nothing else escapes."""
    case = data.draw(profile_cases(kind))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.toml"
        path.write_bytes(case.data)
        try:
            profile = load_profile(str(path))
        except QualificationError as exc:
            message = str(exc)
            assert message.isprintable(), repr(message)
            assert message.startswith(f"profile {path}: "), message
            assert case.verdict != "accept", message
            return
        assert case.verdict != "refuse", case
        assert profile.source_sha256 is not None


# --- family 2: options and environment ------------------------------------------------

REPEATS_TEXT = [
    "1", "2", "3", "0", "-1", str(MAX_REPEATS), str(MAX_REPEATS + 1), "99999999999999999999",
    "abc", "1.5", "", " 2 ", "1_0", "\u0663", "0x10", "1e3", "+3", "9" * 5000, "--1",
]
OUT_KINDS = ("new", "reused", "nested", "file", "under_file", "undecodable")
COMMITS = [None, "a4d6aa02", "", "abc def", "a\nb", "x\udcffy", "\t", "\u00e9t\u00e9", "0" * 40]


def judge_options(
    repeats: str | None, out_kind: str, commit: str | None, dry_run: bool
) -> list[str]:
    """The refusals the options call for, in no particular order; [] to accept.
    ``usage:`` marks argparse's own refusal."""
    if repeats is not None:
        try:
            n = int(repeats)  # argparse's type=int
        except ValueError:
            return ["usage:"]
        if not 1 <= n <= MAX_REPEATS:
            return [f"--repeats {n} is invalid: expected an integer from 1 to {MAX_REPEATS}"]
    if dry_run:
        return []
    problems = []
    if out_kind == "file":
        problems.append("exists and is not a directory")
    if out_kind == "under_file":
        problems.append("cannot be created")
    if commit and not commit.isprintable():
        problems.append("VLLM_HUST_COMMIT")
    return problems


def test_options_and_environment_are_checked_before_anything_is_written(
    tmp_path: Path, fake_arms: FakeArms, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--repeats`` text, ``--out`` targets, ``VLLM_HUST_COMMIT`` and the manager's own
    variables: a refusal is exit 2 with one line naming the flag or variable (argparse's
    usage error for a non-integer) and creates or changes nothing; an accepted run writes
    its record under ``--out`` (an undecodable name included, and it prints the paths),
    every arm with a private manager state and without the caller's manager variables."""
    seen: Counter[tuple[str, str]] = Counter()

    @_fuzz(70)
    @given(
        repeats=st.none() | st.sampled_from(REPEATS_TEXT),
        out_kind=st.sampled_from(OUT_KINDS),
        commit=st.sampled_from(COMMITS),
        owned=st.sets(st.sampled_from(OWNED_BY_MANAGER)),
        dry_run=st.booleans(),
    )
    def run(
        repeats: str | None, out_kind: str, commit: str | None, owned: set[str], dry_run: bool
    ) -> None:
        with contextlib.suppress(TypeError, ValueError):
            if not dry_run and 3 < int(repeats) <= MAX_REPEATS:  # type: ignore[arg-type]
                repeats = "2"  # keep the (fake) runs short
        with box(tmp_path / "boxes") as root, pytest.MonkeyPatch.context() as patch:
            out = {
                "new": root / "out",
                "reused": root / "out",
                "nested": root / "a" / "b" / "out",
                "file": root / "afile",
                "under_file": root / "afile" / "out",
                "undecodable": root / "out-\udcff",
            }[out_kind]
            (root / "afile").write_text("not a directory\n")
            if out_kind == "reused":
                out.mkdir()
                (out / "record.json").write_text('{"earlier": "run"}\n')
            if commit is not None:
                patch.setenv("VLLM_HUST_COMMIT", commit)
            for name in owned:
                patch.setenv(name, "inherited")
            callers = root / "callers-config.json"
            patch.setenv("VLLM_HUST_EXT_CONFIG", str(callers))
            argv = ["run", "cpu-replay", "--quiet", "--out", str(out)]
            argv += ["--dry-run"] if dry_run else []
            argv += [] if repeats is None else [f"--repeats={repeats}"]
            fake_arms.out = out
            before = snapshot(root)
            outcome = cli(argv)
            after = snapshot(root)
            expected = judge_options(repeats, out_kind, commit, dry_run)
            if expected:
                usage = expected == ["usage:"]
                names = ["argument --repeats: invalid int value"] if usage else expected
                check_refused(outcome, names, usage=usage)
                assert after == before, "a refused run created or changed files"
                seen[("refused", "usage" if usage else expected[0].split()[0])] += 1
            elif dry_run:
                check_accepted(outcome, (0,))
                assert json.loads(outcome.out)["profile"] == "cpu-replay"
                assert after == before, "--dry-run wrote files"
                seen[("accepted", "dry-run")] += 1
            else:
                record = check_run_accepted(outcome, out)
                n = 3 if repeats is None else int(repeats)
                assert record["profile"]["repeats"] == n
                assert record["host"]["commit"] == (commit or None) or not commit
                assert not callers.exists(), "an arm used the caller's manager state"
                seen[("accepted", out_kind)] += 1
            seen[("owned", "set" if owned else "none")] += 1

    run()
    tally_report("options", seen)
    refused = {k for (what, k) in seen if what == "refused"}
    assert {"usage", "--repeats", "exists", "cannot", "VLLM_HUST_COMMIT"} <= refused, seen
    accepted = {k for (what, k) in seen if what == "accepted"}
    assert {"dry-run", "new", "reused", "nested", "undecodable"} <= accepted, seen


# --- family 3: the replay's report.json -----------------------------------------------

BASELINE_REPORT = json.loads(
    _replay_arm_report(
        throughput=10.0, ttft_p95=0.2, e2e_p95=2.0, controller=_controller(enabled=False)
    )
)
CANDIDATE_REPORT = json.loads(
    _replay_arm_report(
        throughput=11.0, ttft_p95=0.3, e2e_p95=2.0,
        controller=_controller(enabled=True, policy_name="p", calls=5, selections=2,
                               abstentions=3),
        conservation={"all_completed_once": True, "exact_output_lengths": True,
                      "free_blocks_end": 120, "usable_blocks": 120},
    )
)
REFERENCE_ARM = {"label": "oracle", "kind": "reference", "reference": True, "requests": 4}
COUNTS = ("requests", "completed", "output_tokens")
NUMBER_LITERALS = (
    "NaN", "Infinity", "-Infinity", "1e999", "-1", "-0", "2.5", "0", "true", "null", '"3"',
    "1" + "0" * 400,  # parses, but is too large for a float
    "1" + "0" * 5000,  # past the int/str digit limit: json.loads raises a plain ValueError
)
REPORT_KINDS = (
    "delete", "swap", "extra", "number", "truncate", "invalid_utf8", "empty", "not_object",
    "deep", "arms",
)
SLOT = "@@SLOT@@"
json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | SHORT_TEXT
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(SHORT_TEXT, inner, max_size=3),
    max_leaves=5,
)


def json_kind(value: object) -> str:
    return "null" if value is None else kind_of(value)


def depth(value: object) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, level)
            children = node.values() if isinstance(node, dict) else node
            stack.extend((c, level + 1) for c in children)
    return deepest


def judge_report(data: bytes) -> tuple[str, tuple[str, ...], int | None]:
    """("accept", (), requests) or ("refuse", what the message must name, None), from the
    documented report rules: a JSON object, not deeply nested, an 'arms' list with exactly
    one non-reference arm whose three counts are non-negative finite numbers and whose
    gated figures (throughput, TTFT and E2E P50/P95) are there, as numbers or null."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        return "refuse", ("cannot be read as JSON",), None
    if not isinstance(doc, dict):
        return "refuse", ("expected a JSON object",), None
    if depth(doc) > 100:
        return "refuse", ("nested too deeply",), None
    arms = doc.get("arms")
    if not isinstance(arms, list):
        return "refuse", ("expected an 'arms' list",), None
    online = [a for a in arms if isinstance(a, dict) and not a.get("reference")]
    if len(online) != 1:
        return "refuse", ("expected exactly one policy arm",), None
    bad = tuple(
        f"expected {key!r}"
        for key in COUNTS
        if not (
            isinstance(v := online[0].get(key), int | float)
            and not isinstance(v, bool)
            and 0 <= v < math.inf
        )
    )
    bad += tuple(f"expected {'.'.join(path)!r}" for path in FIGURES
                 if not _figure_ok(online[0], path))
    if bad:
        return "refuse", bad, None
    return "accept", (), int(online[0]["requests"])


FIGURES = (("throughput_output_tok_s",), ("ttft_s", "p50"), ("ttft_s", "p95"),
           ("e2e_s", "p50"), ("e2e_s", "p95"))


def _figure_ok(arm: dict[str, Any], path: tuple[str, ...]) -> bool:
    node: Any = arm
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return node is None or (isinstance(node, int | float) and not isinstance(node, bool))


def delete_a_key(draw: st.DrawFn, doc: Any, slots: list[tuple[tuple[Any, ...], Any]]) -> None:
    """Delete one drawn object key of a JSON document (``slots``: its walk, root left out)."""
    path = draw(st.sampled_from([p for p, _ in slots if isinstance(p[-1], str)]))
    del get(doc, path[:-1])[path[-1]]


def swap_a_type(draw: st.DrawFn, doc: Any, slots: list[tuple[tuple[Any, ...], Any]]) -> None:
    """Replace one drawn value of a JSON document by a value of another JSON kind."""
    path, original = draw(st.sampled_from(slots))
    put(doc, path, draw(json_values.filter(lambda v: json_kind(v) != json_kind(original))))


@st.composite
def report_bytes(draw: st.DrawFn, kind: str, valid: dict[str, Any]) -> bytes:
    doc = copy.deepcopy(valid)
    if draw(st.booleans()):
        doc["arms"].insert(draw(st.integers(0, 1)), dict(REFERENCE_ARM))
    indent = draw(st.sampled_from([None, 2]))
    slots = [(p, v) for p, v in walk(doc) if p]
    if kind == "delete":
        delete_a_key(draw, doc, slots)
    elif kind == "swap":
        swap_a_type(draw, doc, slots)
    elif kind == "extra":
        table = draw(st.sampled_from([p for p, v in walk(doc) if isinstance(v, dict)]))
        get(doc, table)[draw(SHORT_TEXT)] = draw(json_values)
    elif kind in ("number", "deep"):
        numeric = [p for p, v in slots if isinstance(v, int | float) and not isinstance(v, bool)]
        if kind == "number":
            path = draw(st.sampled_from(numeric))
            literal = draw(st.sampled_from(NUMBER_LITERALS))
        else:
            online = next(i for i, a in enumerate(doc["arms"]) if not a.get("reference"))
            path = draw(st.sampled_from([
                ("arms", online, "conservation"), ("arms", online, "label"),
                ("arms", online, "controller"), ("extra",), *numeric,
            ]))
            n = draw(st.sampled_from([2, 8, 150, 400, 900, 100_000]))
            literal = draw(st.sampled_from(["[" * n + "]" * n, '{"a":' * n + "1" + "}" * n]))
        if path == ("extra",):
            doc["extra"] = SLOT
        else:
            put(doc, path, SLOT)
        return json.dumps(doc, indent=indent).replace(json.dumps(SLOT), literal).encode()
    elif kind == "arms":
        online = next(a for a in doc["arms"] if not a.get("reference"))
        change = draw(st.sampled_from(["duplicate", "all_reference", "empty", "not_objects"]))
        if change == "duplicate":
            doc["arms"].append(copy.deepcopy(online))
        elif change == "all_reference":
            online["reference"] = True
        elif change == "empty":
            doc["arms"] = []
        else:
            doc["arms"] = [json.dumps(online), 3, None]
    text = json.dumps(doc, indent=indent).encode()
    if kind == "truncate":
        return text[: draw(st.integers(0, len(text) - 1))]
    if kind == "invalid_utf8":
        at = draw(st.integers(0, len(text)))
        return text[:at] + draw(st.sampled_from(BAD_UTF8)) + text[at:]
    if kind == "empty":
        return draw(st.sampled_from([b"", b" ", b"\n"]))
    if kind == "not_object":
        return draw(st.sampled_from([b"[]", b"[1, 2]", b"3", b'"report"', b"null", b"true"]))
    return text


class FakeReplay:
    """Stands for the ``subprocess`` module in qualification.replay: instead of running
    ``vllm-hust-ext run -- bidkv-replay ...`` it writes the drawn report into the arm's
    ``--output-dir`` and exits with the drawn status (None: the replay timed out)."""

    TimeoutExpired = subprocess.TimeoutExpired
    STDOUT = subprocess.STDOUT

    def __init__(self) -> None:
        self.plan: dict[str, tuple[bytes | None, int | None]] = {}

    def run(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[bytes]:
        arm = "baseline" if "builtin" in argv else "candidate"  # cpu-replay's baseline_args
        data, rc = self.plan[arm]
        out = Path(argv[argv.index("--output-dir") + 1])
        if data is not None:
            (out / "report.json").write_bytes(data)
        if rc:
            kw["stdout"].write(b"bidkv-replay: error: conservation violated for x\n")
        if rc is None:
            raise subprocess.TimeoutExpired(argv, kw["timeout"])
        return subprocess.CompletedProcess(argv, rc)


@pytest.mark.parametrize("kind", REPORT_KINDS)
def test_a_corrupted_replay_report_is_named_on_one_line_or_recorded(
    kind: str, tmp_path: Path, offline: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run cpu-replay`` whose replay arms leave a drawn report.json and exit 0, 1 or time
    out: the run always writes its record (exit 0 or 1), with each arm's figures from its
    report, or the arm failed with its reason. A report the rules refuse (from an arm that
    exited 0) fails that arm with one line naming that report.json and what was expected;
    it used to end the run with exit 2 and no record, losing the arms already run."""
    fake = FakeReplay()
    monkeypatch.setattr(qualification.replay, "subprocess", fake)
    seen: Counter[tuple[str, str]] = Counter()
    valid = {"baseline": BASELINE_REPORT, "candidate": CANDIDATE_REPORT}

    @_fuzz(10)
    @given(
        data=st.data(),
        corrupt=st.sampled_from([("baseline",), ("candidate",), ("baseline", "candidate")]),
        rc=st.sampled_from([0, 0, 0, 1, None]),
    )
    def run(data: st.DataObject, corrupt: tuple[str, ...], rc: int | None) -> None:
        reports = {
            arm: data.draw(report_bytes(kind, valid[arm]))
            if arm in corrupt else json.dumps(valid[arm]).encode()
            for arm in ("baseline", "candidate")
        }
        fake.plan = {arm: (reports[arm], rc if arm in corrupt else 0) for arm in reports}
        with box(tmp_path / "boxes") as root:
            out = root / "out"
            out.mkdir()
            (out / "record.json").write_text('{"earlier": "run"}\n')
            outcome = cli(["run", "cpu-replay", "--out", str(out), "--repeats", "1", "--quiet"])
            verdicts = {arm: judge_report(reports[arm]) for arm in reports}
            record = check_run_accepted(outcome, out)
            (pair,) = record["cells"][0]["pairs"]
            refused = False
            for arm, (_, status) in fake.plan.items():
                error = pair[arm]["error"]
                if status == 0 and verdicts[arm][0] == "refuse":
                    report = (out / "cells" / "azure-conv-30s" / "rep-0" / arm / "replay"
                              / "report.json")
                    assert error.startswith(
                        f"bidkv-replay exit 0 but its report is unusable: bidkv-replay "
                        f"report {report}"), error
                    assert any(name in error for name in verdicts[arm][1]), error
                    assert "\n" not in error and pair[arm]["started"] is False
                    refused = True
                elif status == 0:
                    assert pair[arm]["requests"] == verdicts[arm][2], pair[arm]
                    assert error is None
                else:
                    assert error, pair[arm]
                    assert "\n" not in error
            seen[("outcome", "refused" if refused else "accepted")] += 1
            seen[("rc", str(rc))] += 1

    run()
    tally_report(f"report {kind}", seen)
    assert seen[("rc", "0")] and (seen[("rc", "1")] or seen[("rc", "None")]), seen
    if kind != "extra":  # an extra key is refused only where it replaces a needed one
        assert seen[("outcome", "refused")], seen
    if kind in ("delete", "swap", "extra", "number", "deep", "truncate"):
        assert seen[("outcome", "accepted")], seen


@_fuzz(80)
@given(kind=st.sampled_from(REPORT_KINDS), data=st.data())
def test_report_readers_raise_only_their_error_on_one_line(
    kind: str, data: st.DataObject
) -> None:
    """``read_report`` + ``arm_from_report`` on a drawn report.json: the arm's figures, or
    QualificationError with one printable line naming the file; nothing else escapes."""
    raw = data.draw(report_bytes(kind, CANDIDATE_REPORT))
    verdict, names, requests = judge_report(raw)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "report.json"
        path.write_bytes(raw)
        try:
            arm = arm_from_report("candidate", read_report(path), [], 0.0, str(path))
        except QualificationError as exc:
            message = str(exc)
            assert message.isprintable() and f"bidkv-replay report {path}" in message, message
            assert verdict == "refuse" and any(n in message for n in names), (names, message)
            return
    assert verdict == "accept", (names, raw[:200])
    assert arm.requests == requests
    ArmResult.as_dict(arm)  # the record's copy of the arm


# --- family 4: the lenient readers ----------------------------------------------------

EVIDENCE_KINDS = ("stats", "utf8", "torn", "deep", "huge", "no_stats")


@st.composite
def evidence_lines(
    draw: st.DrawFn,
) -> tuple[bytes, dict[str, int], bool | None, str | None, set[str]]:
    """JSONL the manager's evidence could hold: stats lines (some with undecodable bytes,
    read as U+FFFD) and junk that must not count (torn, deep, huge, no stats), with the
    oracle's expectations."""
    lines: list[bytes] = []
    counters: dict[str, int] = {}
    enabled: bool | None = None
    name: str | None = None
    kinds: set[str] = set()
    for _ in range(draw(st.integers(0, 6))):
        choice = draw(st.sampled_from(EVIDENCE_KINDS))
        kinds.add(choice)
        stats = {
            "calls": draw(st.integers(0, 10**6)),
            **{k: draw(st.integers(0, 100)) for k in COUNTER_NAMES[1:] if draw(st.booleans())},
        }
        if draw(st.booleans()):
            stats["enabled"] = draw(st.booleans())
        if draw(st.booleans()):
            stats["policy_name"] = draw(SHORT_TEXT)
        line = json.dumps({"event": "effective", "stats": stats}).encode()
        if choice in ("stats", "utf8"):
            # Undecodable bytes (inside the "event" key here) read as U+FFFD: still counted.
            at = draw(st.sampled_from(BAD_UTF8)) if choice == "utf8" else b""
            lines.append(line[:5] + at + line[5:])
            for key in COUNTER_NAMES:
                if key in stats:
                    counters[key] = max(counters.get(key, 0), int(stats[key]))
            enabled = stats.get("enabled", enabled)  # type: ignore[assignment]
            name = stats.get("policy_name", name)  # type: ignore[assignment]
        elif choice == "torn":
            lines.append(line[: draw(st.integers(0, len(line) - 1))])
        elif choice == "deep":
            lines.append(b'{"stats": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
        elif choice == "huge":
            lines.append(b'{"stats": {"calls": 1' + b"0" * 5000 + b"}}")
        else:
            lines.append(json.dumps(draw(json_values)).encode().replace(b"calls", b"c"))
    return b"\n".join(lines), counters, enabled, name, kinds


def test_evidence_reader_counts_only_whole_stats_lines(tmp_path: Path) -> None:
    """The manager's runtime evidence: the largest counters of the whole stats lines, the
    last enabled flag and policy name; torn, deep or huge lines are skipped, never raised,
    and undecodable bytes are read as U+FFFD."""
    seen: Counter[str] = Counter()

    @_fuzz(60)
    @given(case=evidence_lines())
    def run(case: tuple[bytes, dict[str, int], bool | None, str | None, set[str]]) -> None:
        data, counters, enabled, name, kinds = case
        path = tmp_path / "runtime-evidence.jsonl"
        path.write_bytes(data)
        got = counters_from_evidence(path)
        # A torn line lacks its closing braces, so it never parses as a stats object.
        assert got[0] == (counters or None), (got, counters)
        assert got[1] == enabled and got[2] == name, got
        seen.update(kinds)

    run()
    print(f"\nevidence lines: {dict(sorted(seen.items()))}")
    assert set(seen) == set(EVIDENCE_KINDS), seen


PROMETHEUS_TEMPLATES = [
    'vllm:preemption_policy_events_total{event="calls"} @',
    'vllm:preemption_policy_events{event="selections",engine="0"} @',
    "vllm:preemption_policy_enabled @", "# HELP x y", "", "garbage line", "@",
    "vllm:num_preemptions_total @", 'vllm:x{a="unterminated} @',
]
PROMETHEUS_VALUES = ["1", "NaN", "+Inf", "-Inf", "1e999", "9" * 5000, "x", "-3"]
prometheus_lines = st.lists(
    st.tuples(st.sampled_from(PROMETHEUS_TEMPLATES), st.sampled_from(PROMETHEUS_VALUES)).map(
        lambda tv: tv[0].replace("@", tv[1])
    ),
    max_size=8,
)


def test_metrics_and_log_readers_never_raise() -> None:
    """Prometheus text and the engine log (damaged, odd numbers, no policy lines) give
    counters/None and a flag/None, never an exception; a counter is a finite count."""
    seen: Counter[str] = Counter()

    @_fuzz(60)
    @given(before=prometheus_lines, after=prometheus_lines, log=st.text(max_size=200))
    def run(before: list[str], after: list[str], log: str) -> None:
        counters, enabled = counters_from_metrics(
            parse_prometheus("\n".join(before)), parse_prometheus("\n".join(after))
        )
        assert counters is None or set(counters) <= set(COUNTER_NAMES)
        assert all(isinstance(v, int) for v in (counters or {}).values()), counters
        assert enabled in (None, True, False)
        last = "\nPreemption policy initialized: policy=x enabled=True"
        assert enabled_from_log(log + last) == (True, "x")
        assert enabled_from_log(log)[0] in (None, True, False)
        seen["counted" if counters else "no counters"] += 1
        seen.update(v for v in PROMETHEUS_VALUES[1:5] if any(v in line for line in after))

    run()
    print(f"\nmetrics: {dict(sorted(seen.items()))}")
    assert seen["counted"] and seen["no counters"], seen
    assert all(seen[v] for v in PROMETHEUS_VALUES[1:5]), seen


# --- family 5: release-check ----------------------------------------------------------

RECORD_NAMES = ("record.json", "a\nb.json", "r\udcff.json", "x y.json")
RECORD_KINDS = ("delete", "swap", "retext", "number", "truncate", "invalid_utf8", "not_object",
                "deep", "directory")
RECORD_RETEXTS = [
    "1.2.3", "1.2.3\n", "1.2.3\nfake", "0.33.0", "0.34.0\n", "0.34.0\nx", "cpu", "", "x\udcffy",
    RECORD_SCHEMA, RECORD_SCHEMA + "\n", "cuda",
]


def judge_record(data: bytes) -> bool:
    """Whether a record qualifies release 1.2.3 of ``_tree`` (README "Release check")."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        return False
    if not isinstance(doc, dict) or doc.get("schema") != RECORD_SCHEMA:
        return False
    gate, ext, host, profile = (doc.get(k) for k in ("gate", "extension", "host", "profile"))
    if not (isinstance(gate, dict) and gate.get("passed") is True):
        return False
    if not (isinstance(ext, dict) and ext.get("version") == "1.2.3"):
        return False
    version = host.get("version") if isinstance(host, dict) else None
    try:
        if version is None or Version(str(version)) not in SpecifierSet(">=0.28.1rc1.dev319,<0.34"):
            return False
    except InvalidVersion:
        return False
    accelerator = profile.get("accelerator") if isinstance(profile, dict) else None
    return isinstance(accelerator, str) and accelerator not in ("", "cpu")


@st.composite
def record_bytes(draw: st.DrawFn, kind: str, valid: bytes) -> bytes:
    doc = json.loads(valid)
    slots = [(p, v) for p, v in walk(doc) if p]
    if kind == "delete":
        delete_a_key(draw, doc, slots)
    elif kind == "swap":
        swap_a_type(draw, doc, slots)
    elif kind == "retext":
        path = draw(st.sampled_from([p for p, v in slots if isinstance(v, str)]))
        put(doc, path, draw(st.sampled_from(RECORD_RETEXTS)))
    elif kind in ("number", "deep"):
        path = draw(st.sampled_from([p for p, _ in slots]))
        n = draw(st.sampled_from([3, 400, 100_000]))
        literal = (
            draw(st.sampled_from(NUMBER_LITERALS)) if kind == "number" else "[" * n + "]" * n
        )
        put(doc, path, SLOT)
        return json.dumps(doc).replace(json.dumps(SLOT), literal).encode()
    text = json.dumps(doc).encode()
    if kind == "truncate":
        return text[: draw(st.integers(0, len(text) - 1))]
    if kind == "invalid_utf8":
        at = draw(st.integers(0, len(text)))
        return text[:at] + draw(st.sampled_from(BAD_UTF8)) + text[at:]
    if kind == "not_object":
        return draw(st.sampled_from([b"[]", b"3", b"null", b'"record"']))
    return text


def check_release_output(outcome: Outcome) -> list[str]:
    """The check's listing: a header, then one ``  - `` line per problem."""
    assert outcome.code in (0, 1), outcome
    assert "Traceback" not in outcome.err and outcome.err == "", outcome.err
    lines = outcome.out.splitlines()
    assert lines, outcome
    if outcome.code == 0:
        assert len(lines) == 1 and lines[0].startswith("release check passed for "), lines
        return []
    assert lines[0].startswith("release check FAILED for "), lines
    assert all(line.startswith("  - ") for line in lines[1:]), f"a problem spans lines: {lines}"
    return lines[1:]


def test_a_corrupted_record_is_listed_on_one_line_or_qualifies(tmp_path: Path) -> None:
    """One drawn record (under an odd file name, sometimes beside a valid one): release-check
    exits 0 exactly when a record qualifies (README rule 4), else 1 with one line per
    problem; a record that cannot be parsed is named by its file name; nothing raises."""
    root = _tree(tmp_path)
    valid = _record(tmp_path / "template").read_bytes()
    seen: Counter[tuple[str, str]] = Counter()

    @_fuzz(70)
    @given(
        kind=st.sampled_from(RECORD_KINDS),
        name=st.sampled_from(RECORD_NAMES),
        with_valid=st.booleans(),
        data=st.data(),
    )
    def run(kind: str, name: str, with_valid: bool, data: st.DataObject) -> None:
        with box(tmp_path / "boxes") as records:
            path = records / "run1" / name
            path.parent.mkdir()
            if kind == "directory":
                path.mkdir()
                raw = None
            else:
                raw = data.draw(record_bytes(kind, valid))
                path.write_bytes(raw)
            if with_valid:
                (records / "good").mkdir()
                (records / "good" / "record.json").write_bytes(valid)
            before = snapshot(records)
            outcome = cli(["release-check", "--root", str(root), "--records", str(records)])
            assert snapshot(records) == before, "release-check changed a record"
            problems = check_release_output(outcome)
            qualifies = raw is not None and judge_record(raw)
            assert (outcome.code == 0) is (qualifies or with_valid), (outcome, raw)
            unparsable = raw is None or judge_report(raw)[1] == ("cannot be read as JSON",)
            if outcome.code == 1 and unparsable:
                assert any(shown(name) in p for p in problems), (name, problems)
            seen[("kind", kind)] += 1
            seen[("outcome", "passed" if outcome.code == 0 else "failed")] += 1

    run()
    tally_report("records", seen)
    assert {k for (what, k) in seen if what == "kind"} == set(RECORD_KINDS), seen
    assert seen[("outcome", "passed")] and seen[("outcome", "failed")], seen


TREE_TARGETS = {
    "version": "src/bidkv_ext/_version.py",
    "pyproject": "pyproject.toml",
    "manifest": "manifests/bidkv/vllm-hust-extension-v0.2.json",
    "changelog": "CHANGELOG.md",
}


TREE_CHANGES = ("none", "retext", "truncate", "invalid_utf8", "empty")


def test_a_corrupted_tree_is_listed_one_problem_a_line(tmp_path: Path) -> None:
    """The version file, pyproject, the manifest or the changelog, damaged or with a
    version holding a line break or an undecodable character: release-check exits 0 or 1
    with one line per problem, never a traceback; the tree is only read."""
    seen: Counter[tuple[str, str]] = Counter()

    @_fuzz(50)
    @given(
        target=st.sampled_from(sorted(TREE_TARGETS)),
        change=st.sampled_from(TREE_CHANGES),
        text=st.sampled_from(["1.2.3\nX", "1.2\n", "9.9", "1.2.3", "x\udcffy", "\t"]),
        data=st.data(),
    )
    def run(target: str, change: str, text: str, data: st.DataObject) -> None:
        with box(tmp_path / "boxes") as tmp:
            root = _tree(tmp)
            _record(tmp / "records")
            path = root / TREE_TARGETS[target]
            raw = path.read_bytes()
            if change == "retext":
                escaped = json.dumps(text)[1:-1].encode()  # a Python, TOML or JSON string
                raw = raw.replace(b"1.2.3", escaped) if target != "pyproject" else raw.replace(
                    b'dynamic = ["version"]', b'version = "' + escaped + b'"')
            elif change == "truncate":
                raw = raw[: data.draw(st.integers(0, len(raw)))]
            elif change == "invalid_utf8":
                at = data.draw(st.integers(0, len(raw)))
                raw = raw[:at] + data.draw(st.sampled_from(BAD_UTF8)) + raw[at:]
            elif change == "empty":
                raw = b""
            path.write_bytes(raw)
            before = snapshot(tmp)
            outcome = cli(["release-check", "--root", str(root), "--records", str(tmp / "records")])
            check_release_output(outcome)
            if change == "none":  # the control: the tree _tree builds is releasable
                assert outcome.code == 0, outcome
            assert snapshot(tmp) == before, "release-check changed the tree"
            seen[("change", f"{target}/{change}")] += 1
            seen[("outcome", "passed" if outcome.code == 0 else "failed")] += 1

    run()
    tally_report("tree", seen)
    changes = {tuple(k.split("/")) for (what, k) in seen if what == "change"}
    assert {t for t, _ in changes} == set(TREE_TARGETS), seen
    assert {c for _, c in changes} == set(TREE_CHANGES), seen
    assert seen[("outcome", "passed")] and seen[("outcome", "failed")], seen


# --- the defects these properties found -----------------------------------------------


def _variant(tmp_path: Path, base: str, old: str, new: str) -> Path:
    text = (PROFILE_DIR / f"{base}.toml").read_text()
    assert old in text
    path = tmp_path / "variant.toml"
    path.write_text(text.replace(old, new, 1))
    return path


@pytest.mark.parametrize("placeholder", ["{nope}", "{seed[x]}"])
def test_a_bad_placeholder_is_refused_before_the_run_creates_anything(
    tmp_path: Path, placeholder: str, offline: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay argument the arms cannot format used to be refused only inside the first
    arm: after ``--out`` and the arm's directory existed and the manager had run
    `extension disable` there ({seed[x]} even escaped as a TypeError traceback). It is
    refused before anything is created or launched."""
    prepared: list[str] = []
    monkeypatch.setattr(ManagerSession, "prepare", lambda _s, arm: prepared.append(arm))
    variant = _variant(tmp_path, "cpu-replay", '"--seed", "{seed}"', f'"--seed", "{placeholder}"')
    out = tmp_path / "out"
    outcome = cli(["run", str(variant), "--out", str(out), "--quiet"])
    check_refused(outcome, [f"replay argument {placeholder!r}"])
    assert not out.exists() and prepared == []


@pytest.mark.parametrize(
    ("old", "new", "where"),
    [
        ('name = "azure-conv-30s"', 'name = "../../escaped"', "cells.0.name"),
        ('name = "azure-conv-30s"', 'name = "/tmp/escaped"', "cells.0.name"),
        ('name = "azure-conv-30s"', 'name = "a\\u0000b"', "cells.0.name"),
        ('name = "cpu-replay"', 'name = "../cpu-replay"', "name"),
        ('name = "cpu-replay"', 'name = "cpu\\nreplay"', "name"),
    ],
)
def test_a_name_that_is_not_one_directory_name_is_refused(
    tmp_path: Path, old: str, new: str, where: str, fake_arms: FakeArms
) -> None:
    """Cell names are directories under ``--out/cells`` and the profile name one under
    ``qualification/records``: a name with a path separator, NUL or line break used to
    write outside ``--out`` (or fail as ValueError), and a line break split the
    placeholder message in two. It is refused on load, naming the key."""
    variant = _variant(tmp_path, "cpu-replay", old, new)
    out = tmp_path / "out"
    fake_arms.out = out
    outcome = cli(["run", str(variant), "--out", str(out), "--quiet"])
    check_refused(outcome, [f"profile {variant}: {where}: Value error, expected a name"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["variant.toml"]


@pytest.mark.parametrize(
    ("old", "new", "shown_as"),
    [
        ('"--seed", "{seed}"', '"--seed", "{seed.a\\nb}"', "has no attribute 'a\\nb'"),
        ("[manager]\n", '[manager]\n"bad\\nkey" = 1\n', "manager.bad\\nkey: Extra inputs"),
    ],
)
def test_a_message_quoting_a_line_break_stays_on_one_line(
    tmp_path: Path, old: str, new: str, shown_as: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An exception text or a key holding a line break is shown escaped: the message is
    one line, through the CLI and from ``load_profile`` alike."""
    variant = _variant(tmp_path, "cpu-replay", old, new)
    assert main(["run", str(variant), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and shown_as in err, err
    try:
        load_profile(str(variant))
    except QualificationError as exc:
        assert str(exc).isprintable() and shown_as in str(exc), str(exc)


@pytest.mark.parametrize("variable", ["VLLM_HUST_COMMIT", "QUALIFICATION_IMAGE_DIGEST"])
@pytest.mark.parametrize("commit", ["abc\udcffdef", "abc\ndef"])
def test_a_malformed_declared_variable_is_refused_before_the_run(
    tmp_path: Path,
    variable: str,
    commit: str,
    fake_arms: FakeArms,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``VLLM_HUST_COMMIT`` holding undecodable bytes used to end a finished run with a
    UnicodeEncodeError traceback while writing report.md (record.json written, no report,
    no plot); one with a line break broke the report's line. ``QUALIFICATION_IMAGE_DIGEST``
    was read only when the record was built, so a bad one was refused after every arm had
    run, with no record. All are refused before anything is created."""
    monkeypatch.setenv(variable, commit)
    out = tmp_path / "out"
    fake_arms.out = out
    outcome = cli(["run", "cpu-replay", "--out", str(out), "--quiet"])
    check_refused(outcome, [f"{variable} {commit!r}"])
    assert not out.exists() and fake_arms.ran == 0


def test_a_malformed_ascend_commit_is_refused_before_the_run(
    tmp_path: Path, fake_arms: FakeArms, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Ascend lane's ``VLLM_ASCEND_HUST_COMMIT`` is checked with the others, before the
    first arm (the lane's tools are not here, so the arms are the fake ones)."""
    monkeypatch.setenv("VLLM_ASCEND_HUST_COMMIT", "abc\ndef")
    out = tmp_path / "out"
    fake_arms.out = out
    profile = load_profile("ascend-tp4")
    with pytest.raises(QualificationError, match="VLLM_ASCEND_HUST_COMMIT 'abc\\\\ndef'"):
        qualification.runner.run_profile(profile, out, repeats=1, arm_runner=fake_arms(profile))
    assert not out.exists() and fake_arms.ran == 0


def test_undecodable_paths_are_printed_escaped(tmp_path: Path, fake_arms: FakeArms) -> None:
    """An ``--out`` or record path with undecodable bytes used to finish the whole run (or
    the check) and then raise UnicodeEncodeError printing it on a UTF-8 terminal."""
    out = tmp_path / "out-\udcff"
    fake_arms.out = out
    outcome = cli(["run", "cpu-replay", "--out", str(out), "--quiet", "--repeats", "1"])
    check_run_accepted(outcome, out)
    assert f"record: {tmp_path}/out-\\udcff/record.json" in outcome.out
    records = tmp_path / "records-\udcff"
    records.mkdir()
    root = _tree(tmp_path)
    outcome = cli(["release-check", "--root", str(root), "--records", str(records)])
    assert outcome.code == 1 and "records-\\udcff" in outcome.out, outcome
    _record(records / "r\udcff")
    outcome = cli(["release-check", "--root", str(root), "--records", str(records)])
    assert outcome.code == 0 and "r\\udcff/record.json" in outcome.out, outcome


def test_a_record_value_with_a_line_break_is_one_listed_problem(tmp_path: Path) -> None:
    """A record whose extension version holds a line break used to print a problem over
    two lines of the listing."""
    root = _tree(tmp_path)
    path = _record(tmp_path / "records", version="1.2.2\n- fake: all good")
    outcome = cli(["release-check", "--root", str(root), "--records", str(path.parent)])
    (problem,) = check_release_output(outcome)
    assert "extension version 1.2.2\\n- fake: all good != 1.2.3" in problem


def test_a_fifo_among_the_records_is_named_not_read(tmp_path: Path) -> None:
    """A FIFO named like a record used to block release-check forever on its read."""
    root = _tree(tmp_path)
    records = tmp_path / "records"
    records.mkdir()
    fifo = records / "stuck.json"
    os.mkfifo(fifo)
    outcome = _without_blocking(["release-check", "--root", str(root), "--records",
                                 str(records)], fifo)
    (problem,) = check_release_output(outcome)
    assert "stuck.json (not a regular file)" in problem


@pytest.mark.parametrize(
    ("field", "literal", "message"),
    [
        ("conservation", '{"a":' * 700 + "1" + "}" * 700, "nested too deeply"),
        ("label", "[" * 700 + "]" * 700, "nested too deeply"),
        ("throughput_output_tok_s", "1" + "0" * 400, None),
    ],
)
def test_a_hostile_value_inside_a_report_is_not_a_traceback(
    tmp_path: Path, field: str, literal: str, message: str | None
) -> None:
    """A value nested hundreds deep parses but overflowed the stack when the record copied
    it (RecursionError), and an integer figure too large for a float raised OverflowError:
    the first is refused naming the report, the second is an infinite figure."""
    entry = dict(CANDIDATE_REPORT["arms"][0])
    entry[field] = SLOT
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"arms": [entry]}).replace(json.dumps(SLOT), literal))
    if message is None:
        arm = arm_from_report("candidate", read_report(path), [], 0.0, str(path))
        assert arm.throughput == math.inf
        return
    with pytest.raises(QualificationError, match=f"report {path}: cannot be read as JSON"):
        read_report(path)


def test_a_huge_tensor_parallel_size_does_not_hang_the_gates(
    tmp_path: Path, fake_arms: FakeArms
) -> None:
    """``tensor_parallel_size = 10**30`` is a valid integer to the schema; the TP-rank gate
    used to build ``set(range(tensor_parallel_size))`` and never finished (or ran out of
    memory) after the arms had run. The run ends with the gate failed (ranks missing)."""
    variant = _variant(
        tmp_path, "ascend-tp4", "tensor_parallel_size = 4", f"tensor_parallel_size = {10**30}"
    )
    out = tmp_path / "out"
    fake_arms.out = out
    outcome = cli(["run", str(variant), "--out", str(out), "--quiet", "--repeats", "1"])
    check_run_accepted(outcome, out)
    from qualification.verdict import Pair, evaluate_gates

    arm = ArmResult(arm="baseline", throughput=1.0, ttft_p50=1.0, ttft_p95=1.0, latency_p50=1.0,
                    latency_p95=1.0, requests=1, completed=1, tp_ranks=(0, 1, 2, 3))
    pair = Pair("c", 0, "baseline", arm, arm)
    for tp, status in ((10**30, "fail"), (4, "pass"), (5, "fail")):
        gates = evaluate_gates([pair], cancel_bound_s=None, tensor_parallel_size=tp)
        assert {g.name: g.status for g in gates}["graph-capture-and-tp-ranks"] == status


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
def test_a_non_finite_policy_counter_is_no_count(value: str) -> None:
    """A /metrics counter sample of NaN or +-Inf (legal Prometheus) used to raise from
    round() while the serve arm read its figures, losing every arm already run."""
    before = parse_prometheus('vllm:preemption_policy_events_total{event="calls"} 1\n')
    after = parse_prometheus(
        f'vllm:preemption_policy_events_total{{event="calls"}} {value}\n'
        'vllm:preemption_policy_events_total{event="selections"} 2\n'
    )
    # calls stays unknown (its sample is not a count); the events with no series are 0.
    unused = {"abstentions": 0, "failures": 0, "invalid_selections": 0}
    assert counters_from_metrics(before, after) == ({"selections": 2, **unused}, None)


@pytest.mark.parametrize(
    ("after", "expected"),
    [
        ('{engine="0",event="calls"} +Inf\nX{engine="1",event="calls"} -Inf', None),
        ('{engine="0",event="calls"} 1e308\nX{engine="1",event="calls"} 1e308', None),
        ('{engine="0",event="calls"} 2\nX{engine="1",event="calls"} 3',
         {"calls": 4, "selections": 0, "abstentions": 0, "failures": 0,
          "invalid_selections": 0}),
    ],
)
def test_summing_extreme_policy_counters_is_no_crash(
    after: str, expected: dict[str, int] | None
) -> None:
    """Two engines' samples of +Inf and -Inf (or two of 1e308) made math.fsum raise
    ValueError (OverflowError) while the serve arm read its figures."""
    name = "vllm:preemption_policy_events_total"
    before = parse_prometheus(f'{name}{{event="calls"}} 1\n')
    samples = parse_prometheus(name + after.replace("X", name) + "\n")
    assert counters_from_metrics(before, samples) == (expected, None)


# A file name longer than any file system allows (NAME_MAX is 255 bytes on Linux).
TOO_LONG = "a" * 300


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["release-check", "--records", "{long}"], "--records {long}"),
        (["release-check", "--records", "{loop}"], "--records {loop}"),
        (["run", TOO_LONG, "--dry-run"], f"profile {TOO_LONG!r}"),
        (["run", "{long}.toml", "--dry-run"], "profile '{long}.toml'"),
        (["run", "{loop}", "--dry-run"], "profile '{loop}'"),
        (["run", "cpu-replay", "--out", "{long}", "--quiet"], "--out {long}"),
        (["run", "cpu-replay", "--out", "{loop}", "--quiet"], "--out {loop}"),
    ],
)
def test_a_path_that_cannot_be_examined_is_refused_on_one_line(
    tmp_path: Path, argv: list[str], named: str, fake_arms: FakeArms
) -> None:
    """A records, profile or ``--out`` path with a name too long for the file system used
    to escape as an OSError traceback (ENAMETOOLONG from ``Path.exists``); a symbolic-link
    loop was called missing, or (``--out``) failed only at creation. Both are refused on
    one line naming the option and the reason, before anything is created."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    paths = {"long": str(tmp_path / TOO_LONG), "loop": str(loop)}
    fake_arms.out = tmp_path / "unused"
    message = check_refused(cli([a.format(**paths) for a in argv]), [named.format(**paths)])
    assert "cannot be examined" in message and "expected " in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop"] and fake_arms.ran == 0


def test_a_tool_name_too_long_is_not_found(tmp_path: Path) -> None:
    """A profile's manager command too long to be a file name used to raise OSError from
    the look-up beside the interpreter (``Path.is_file``); it is not found, like any
    command missing from PATH, before the manager is started."""
    variant = _variant(
        tmp_path, "cpu-replay", "[manager]\n", f'[manager]\ncommand = ["{TOO_LONG}"]\n'
    )
    outcome = cli(["run", str(variant), "--dry-run"])
    check_refused(outcome, [f"command {TOO_LONG!r} not found on PATH"])


def _without_blocking(argv: list[str], fifo: Path) -> Outcome:
    """``cli(argv)`` in a thread; a read of ``fifo`` that blocks fails the test."""
    result: list[Outcome] = []
    worker = threading.Thread(target=lambda: result.append(cli(argv)), daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # unblock the reader so the thread ends, then fail
        with open(fifo, "wb"):
            pass
        worker.join(10)
        pytest.fail(f"{argv} blocked reading a FIFO")
    return result[0]


def test_a_fifo_as_the_engine_log_is_refused_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rollback --verify-log FIFO`` used to block forever on the read: anything but a
    regular file is refused on one line, before any manager verb runs."""
    monkeypatch.setattr(qualification.rollback, "manager_step", _no_manager_step)
    fifo = tmp_path / "engine.log"
    os.mkfifo(fifo)
    outcome = _without_blocking(["rollback", "--disable", "--verify-log", str(fifo)], fifo)
    message = check_refused(outcome, [f"--verify-log {fifo}"])
    assert "not a regular file" in message, message


def test_a_shells_pipe_as_the_engine_log_is_read(tmp_path: Path) -> None:
    """``rollback --verify-log <(docker logs ...)`` (or ``/dev/stdin`` in a pipeline)
    names an unnamed pipe, whose writer exists from the start: it is read to its end, here
    from a writer that answers late, and judged; only a named FIFO is refused. A directory
    is refused without keeping its descriptor open."""
    line = "INFO Preemption policy initialized: policy=builtin enabled=False"
    writer = subprocess.Popen(["sh", "-c", f"sleep 0.3; echo '{line}'"],
                              stdout=subprocess.PIPE)
    assert writer.stdout is not None
    try:
        outcome = cli(["rollback", "--verify-log", f"/dev/fd/{writer.stdout.fileno()}"])
    finally:
        writer.stdout.close()
        writer.wait(timeout=10)
    assert outcome.code == 0, outcome
    assert "all policy=builtin enabled=False" in outcome.out, outcome
    open_before = len(os.listdir("/proc/self/fd"))
    message = check_refused(cli(["rollback", "--verify-log", str(tmp_path)]),
                            [f"--verify-log {tmp_path}"])
    assert "not a regular file" in message, message
    assert len(os.listdir("/proc/self/fd")) == open_before


def _no_manager_step(*_args: object) -> tuple[bool, str]:
    raise AssertionError("a manager verb ran before the bad input was refused")


def test_a_fifo_given_as_the_record_is_named_not_read(tmp_path: Path) -> None:
    """A FIFO given as ``--records`` itself was skipped unnamed (neither a file nor a
    directory): it is listed as not a regular file, without waiting on it."""
    root = _tree(tmp_path)
    fifo = tmp_path / "record.json"
    os.mkfifo(fifo)
    argv = ["release-check", "--root", str(root), "--records", str(fifo)]
    (problem,) = check_release_output(_without_blocking(argv, fifo))
    assert "record.json (not a regular file)" in problem, problem
