"""``run``: render the launch command and environment, then supervise the child.

Rendering never changes an argument the caller already gave: an equal value is accepted,
a different one is a conflict. Supervision puts the child in its own session so the
whole process tree can be signalled as one group and nothing outlives the manager. A
forwarded signal (SIGTERM, SIGINT, SIGHUP) that was ignored when the manager started is
left ignored, so the child inherits it as it would without the manager (``nohup``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from hust_ext_manager.fileio import read_named_file
from hust_ext_manager.jsonio import JSONInputError, load_json, same_json
from hust_ext_manager.provider import RENDERED_OPTIONS

__all__ = [
    "ENABLED_BUNDLES_ENV",
    "NATIVE_ENVIRONMENT",
    "LaunchPlan",
    "check_grace",
    "config_file_options",
    "group_members",
    "has_option",
    "ignoring_signals",
    "last_value",
    "merge_additional_config",
    "merge_option",
    "supervise",
    "without_option",
    "write_native_manifests",
]

ENABLED_BUNDLES_ENV = "VLLMHUST_EXT_ENABLED_BUNDLES"
NATIVE_ENVIRONMENT = ("VLLM_EXTENSION_MANIFESTS", "VLLM_EXTENSION_BUNDLES")
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_POLL_SECONDS = 0.05


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    command: tuple[str, ...]
    environment: Mapping[str, str]
    native_manifests: Mapping[str, Any] = field(default_factory=dict)

    def dry_run_document(self) -> dict[str, Any]:
        return {
            "command": list(self.command),
            "environment": dict(self.environment),
            "native_extension_manifests": dict(self.native_manifests),
        }


# --- argument rendering -------------------------------------------------------------


def _option_name(arg: str) -> str | None:
    """The option ``arg`` names as vLLM's parser reads it (``--a_b=V`` is ``--a-b``)."""
    if not arg.startswith("--"):
        return None
    return "--" + arg[2:].partition("=")[0].replace("_", "-")


# Options the manager merges or reads: one whose name is a prefix of another's
# (--batch-admission-policy and its -config) is spelled out, never an abbreviation.
_RENDERED_NAMES = RENDERED_OPTIONS | {"--additional-config", "--scheduler-cls"}


# How argparse tells a value from an option: an argument starting with '-' is an option
# unless it is '-' alone, a negative number or holds a space (vLLM has no numeric options).
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def _separate_value(command: list[str], index: int) -> str | None:
    """The value argparse gives an option from the argument at ``index``; ``None`` when
    there is none or it is an option itself (``--opt --port 8000``, ``--opt --``): vLLM
    then reports the value missing, and ``--port`` must stay an option here too."""
    if index >= len(command):
        return None
    arg = command[index]
    if arg.startswith("-") and arg != "-" and " " not in arg and not _NEGATIVE_NUMBER.match(arg):
        return None
    return arg


def _occurrences(command: list[str], option: str) -> list[tuple[int, str | None, bool]]:
    """Every ``--opt V`` or ``--opt=V`` (either spelling of the name's dashes, as vLLM
    accepts): (index, value or None if missing, inline form), in order.

    vLLM uses the last occurrence; a caller's value found only at the first would let a
    later one replace the extension's without a word. ``--opt.key V`` (vLLM's per-key form
    of a JSON option) is refused: it would replace the merged object. So is an
    abbreviation of ``option`` (vLLM's parser accepts unique prefixes): it would be read as
    ``option`` without being found here.
    """
    found: list[tuple[int, str | None, bool]] = []
    for index, arg in enumerate(command):
        name = _option_name(arg)
        if name == option:
            if "=" in arg:
                found.append((index, arg.partition("=")[2], True))
            else:
                found.append((index, _separate_value(command, index + 1), False))
        elif name is not None and name.startswith(option + "."):
            raise ValueError(
                f"{arg.partition('=')[0]} cannot be merged with the extension's {option}: "
                f"give {option} one JSON object instead"
            )
        elif (name is not None and len(name) > 2 and option.startswith(name)
              and name not in _RENDERED_NAMES):
            raise ValueError(
                f"{arg.partition('=')[0]} abbreviates {option}, which vLLM would read it as: "
                f"spell out {option} so that the extension's value can be merged with it"
            )
    return found


def has_option(command: list[str], option: str) -> bool:
    """Whether ``command`` gives ``option`` (either spelling, with or without a value)."""
    return bool(_occurrences(command, option))


def without_option(command: list[str], option: str) -> list[str]:
    """``command`` with every occurrence of ``option`` and its value removed."""
    drop: set[int] = set()
    for index, value, inline in _occurrences(command, option):
        drop.add(index)
        if not inline and value is not None:
            drop.add(index + 1)
    return [arg for index, arg in enumerate(command) if index not in drop]


_CONFIG_EXPECTED = "expected a UTF-8 YAML mapping of options"


def config_file_options(command: list[str]) -> frozenset[str] | None:
    """The options a ``--config FILE`` of ``command`` sets, as vLLM reads them (it inserts
    the YAML file's keys as options before the command line's); ``None`` without one.

    Raises ValueError (one line naming the file) when it cannot be read as a UTF-8 YAML
    mapping.
    """
    if "--config" not in command:  # vLLM expands only this exact token
        return None
    index = command.index("--config")
    if index + 1 >= len(command):
        raise ValueError("--config requires a file")
    path = command[index + 1]
    if not path.endswith((".yaml", ".yml")):
        return None  # not a vLLM config file (vLLM itself refuses one)
    document = _read_config_file(path)
    if document is None:
        return frozenset()
    if not isinstance(document, dict):
        raise ValueError(f"--config {path} is not a mapping of options: {_CONFIG_EXPECTED}")
    names = (_option_name(f"--{key}") for key in document)
    return frozenset(name for name in names if name is not None)


def _read_config_file(path: str) -> object:
    """The YAML document of a ``--config`` file; ValueError (one line naming the file)
    when it cannot be read as UTF-8 YAML.

    The file is the caller's to name, so it may be a FIFO (a plain open() would wait for a
    writer forever) or hold anything: YAML's constructors raise the ValueError of Python's
    own int()/date() for a malformed scalar (and a KeyError for ``!!bool abc``, an
    AttributeError for ``!!timestamp abc``), and deep nesting is a RecursionError.
    """
    data = read_named_file(Path(path), f"--config {path}",
                           "a regular file holding a UTF-8 YAML mapping of options")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"--config {path} is not UTF-8 (byte {error.start}): {_CONFIG_EXPECTED}"
        ) from None
    import yaml  # only for a command with --config

    try:
        return yaml.safe_load(text)
    except RecursionError:
        raise ValueError(f"--config {path} is nested too deeply: {_CONFIG_EXPECTED}") from None
    except (yaml.YAMLError, ValueError, TypeError, KeyError, AttributeError) as error:
        raise ValueError(
            f"--config {path} is not valid YAML ({_yaml_problem(error)}): {_CONFIG_EXPECTED}"
        ) from None


def _yaml_problem(error: Exception) -> str:
    """One line saying what is wrong and where (YAML's own texts span several lines)."""
    import yaml

    if isinstance(error, (KeyError, AttributeError)):
        # How PyYAML's !!bool and !!timestamp constructors fail on a value they cannot read;
        # their own texts ('maybe', a NoneType attribute) would name nothing useful.
        return "a tagged value its tag cannot construct"
    if isinstance(error, yaml.MarkedYAMLError) and error.problem:
        mark = error.problem_mark
        where = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
        return " ".join(error.problem.split()) + where
    return " ".join(str(error).split()) or type(error).__name__


def last_value(command: list[str], option: str) -> str | None:
    """The value vLLM reads for ``option`` (its last occurrence, either spelling), if any."""
    found = _occurrences(command, option)
    return found[-1][1] if found else None


def _dump(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def merge_additional_config(command: list[str], merged: Mapping[str, Any]) -> list[str]:
    """Merge the bundles' additional_config into the caller's ``--additional-config``."""
    if not merged:
        return command
    found = _occurrences(command, "--additional-config")
    if not found:
        return [*command, "--additional-config", _dump(dict(merged))]
    index, value, inline = found[-1]  # the one vLLM reads
    if value is None:
        raise ValueError("--additional-config requires a JSON object")
    try:
        existing = load_json(value)
    except JSONInputError:
        existing = None
    if not isinstance(existing, dict):
        raise ValueError("--additional-config must contain a JSON object")
    conflicts = sorted(
        k for k, v in merged.items() if k in existing and not same_json(existing[k], v)
    )
    if conflicts:
        raise ValueError(f"plugin activation conflicts with additional_config keys: {conflicts}")
    # An equal key keeps the caller's value (1.0 stays 1.0 where a bundle says 1).
    text = _dump({**merged, **existing})
    result = list(command)
    if inline:
        result[index] = f"--additional-config={text}"
    else:
        result[index + 1] = text
    return result


def merge_option(command: list[str], option: str, value: object, *, is_json: bool) -> list[str]:
    """Append ``option value`` unless the caller set it; an equal value is accepted (in
    every place the caller gave the option)."""
    found = _occurrences(command, option)
    if not found:
        return [*command, option, _dump(value) if is_json else str(value)]
    for _, existing, _ in found:
        if existing is None:
            raise ValueError(
                f"{option} requires a JSON object" if is_json else f"{option} requires a value"
            )
        if not _same_value(existing, value, is_json=is_json):
            raise ValueError(f"extension activation conflicts with {option}")
    return command


def _same_value(existing: str, value: object, *, is_json: bool) -> bool:
    if not is_json:
        return existing == value
    try:
        return same_json(load_json(existing), value)
    except JSONInputError:
        return False


def merge_flag(command: list[str], flag: str) -> list[str]:
    """Append ``flag`` unless the caller gave it (either spelling of its dashes).

    vLLM's boolean options also take a ``--no-`` form, and the last one given wins: the
    caller's ``--no-<flag>`` is a different value, so it is a conflict, never overridden.
    """
    negative = "--no-" + flag.removeprefix("--")
    if _occurrences(command, negative):
        raise ValueError(f"extension activation conflicts with {negative}")
    return command if _occurrences(command, flag) else [*command, flag]


# --- native manifests ---------------------------------------------------------------


def write_native_manifests(native: Mapping[str, Any]) -> tuple[Path, dict[str, str]]:
    """Write ``<i>-manifest.json`` files to a fresh temp dir; return it and the variables."""
    directory = Path(tempfile.mkdtemp(prefix="vllm-hust-ext-"))
    paths = []
    try:
        for index, document in enumerate(native.values()):
            path = directory / f"{index}-manifest.json"
            text = json.dumps(document, indent=2, sort_keys=True) + "\n"
            path.write_text(text, encoding="utf-8")
            paths.append(str(path))
    except BaseException:
        remove_directory(directory)  # the caller never learns the path: clean up here
        raise
    return directory, {
        "VLLM_EXTENSION_MANIFESTS": os.pathsep.join(paths),
        "VLLM_EXTENSION_BUNDLES": ",".join(native),
    }


# --- supervision --------------------------------------------------------------------


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in a process group, read from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text(encoding="utf-8")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 1 :].split()
        # fields[0] is the state, fields[2] the process group id.
        if len(fields) > 2 and fields[0] != "Z" and fields[2] == str(pgid):
            members.append(int(entry.name))
    return members


def check_grace(grace: float) -> None:
    """Refuse a grace period whose deadline is never reached (NaN, inf, 1e400).

    With such a deadline a child that ignores SIGTERM would never be SIGKILLed.
    """
    if not (math.isfinite(grace) and grace >= 0):
        raise ValueError("--shutdown-grace-seconds must be >= 0 and finite")


def _killpg(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


class _Supervisor:
    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.first_signal: int | None = None
        self.deadline: float | None = None
        self.killed = False
        self.forwarded = False
        self.escalated = False
        self.child: subprocess.Popen[bytes] | None = None

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.first_signal is None:
            self.first_signal = signum
            self.deadline = time.monotonic() + self.grace
            self.forward()
        else:
            self.escalated = True  # a second signal escalates at once
            self.kill()

    def forward(self) -> None:
        if self.child is not None and self.first_signal is not None and not self.forwarded:
            self.forwarded = True
            _killpg(self.child.pid, self.first_signal)

    def kill(self) -> None:
        if self.child is not None and not self.killed:
            self.killed = True
            _killpg(self.child.pid, signal.SIGKILL)

    def wait_child(self) -> int:
        child = self.child
        assert child is not None
        while True:
            try:
                return child.wait(timeout=_POLL_SECONDS)
            except subprocess.TimeoutExpired:
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    self.kill()

    def clean_group(self, pgid: int) -> None:
        """After the direct child exits: SIGTERM survivors, SIGKILL them at the deadline."""
        if not group_members(pgid):
            return
        _killpg(pgid, signal.SIGTERM)
        deadline = self.deadline if self.deadline is not None else time.monotonic() + self.grace
        while group_members(pgid):
            if time.monotonic() >= deadline:
                _killpg(pgid, signal.SIGKILL)
                end = time.monotonic() + 5.0
                while group_members(pgid) and time.monotonic() < end:
                    time.sleep(_POLL_SECONDS)
                return
            time.sleep(_POLL_SECONDS)


def supervise(command: Sequence[str], environment: Mapping[str, str], grace: float) -> int:
    """Run ``command`` in a new session; forward signals; return its exit code (or 128+N)."""
    check_grace(grace)
    supervisor = _Supervisor(grace)
    previous = {signum: signal.getsignal(signum) for signum in _FORWARDED}
    for signum, handler in previous.items():
        # A signal ignored when the manager started (``nohup`` ignores SIGHUP, a shell's
        # background job SIGINT) stays ignored, and the child inherits that, exactly as if
        # it had been started directly: ``nohup vllm-hust-ext run ...`` survives a hang-up.
        if handler is not signal.SIG_IGN:
            signal.signal(signum, supervisor.on_signal)
    try:
        supervisor.child = subprocess.Popen(
            list(command), env=dict(environment), start_new_session=True
        )
        # Signals that arrived before the child existed: forward the first, honour a second.
        supervisor.forward()
        if supervisor.escalated:
            supervisor.kill()
        code = supervisor.wait_child()
        supervisor.clean_group(supervisor.child.pid)
    finally:
        if supervisor.child is not None and supervisor.child.poll() is None:
            supervisor.kill()
            supervisor.child.wait()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if supervisor.first_signal is not None:
        return 128 + supervisor.first_signal
    return 128 - code if code < 0 else code


@contextlib.contextmanager
def ignoring_signals() -> Iterator[None]:
    """Ignore the forwarded signals (SIGTERM, SIGINT, SIGHUP) inside the block."""
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in _FORWARDED}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def remove_directory(directory: Path | None) -> None:
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
