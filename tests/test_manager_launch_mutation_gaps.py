"""``run`` rendering and supervision behaviour a mutation audit of ``launch.py`` found
unguarded: each test pins one promise that a small change to the code (a narrowed
pattern, a dropped condition, a slower poll) broke without any other test failing.

- launch.py ``_NEGATIVE_NUMBER`` comment and manager-protocol.md §6.2 step 5: argparse
  takes a negative number as a value, ``-.5`` (no digit before the point) included, so a
  different ``-.5`` is a conflict, not a missing value;
- launch.py ``_occurrences`` docstring: any abbreviation of a merged option is refused,
  down to one letter after the dashes (``--a`` for ``--additional-config``);
- launch.py ``_RENDERED_NAMES`` comment: a rendered option whose name prefixes another
  rendered one (``--batch-admission-policy`` and its ``-config``) is not an abbreviation
  of it, so the caller's ``--batch-admission-policy`` is kept and the ``-config`` merged;
- launch.py ``without_option``: removing ``--opt=V`` removes that one argument, never the
  argument after it (the stock-vLLM adapter command suggested in a refusal);
- launch.py ``config_file_options`` ("vLLM expands only this exact token"): an option
  that merely starts with ``--config`` (``--config-format``, ``--config=F``) is no config
  file to read;
- launch.py ``config_file_options``: ``--config`` with nothing after it is ``--config
  requires a file``; ``.yml`` is read like ``.yaml``; a file of another name is not read
  (vLLM refuses it itself); an empty file sets no options, which is not "no file";
- launch.py ``_yaml_problem``: a YAML error names its line and column counted from 1, and
  a multi-line YAML text (a reader error) is joined into the one error line;
- launch.py ``group_members`` ("Live (non-zombie) processes"): an exited, unreaped member
  is not listed; a member whose name holds ``)`` is (``/proc/PID/stat`` is read after
  the name's last ``)``);
- manager-protocol.md §6.5: the grace period is counted from the first signal, so a
  child that needs part of it to exit on the forwarded signal is not SIGKILLed first;
- manager-protocol.md §6.5: the first signal is forwarded once, not again when
  ``forward`` runs a second time (after the spawn);
- manager-protocol.md §6.5 ("The child is always reaped"): if waiting fails, the child is
  SIGKILLed and reaped before the error propagates;
- launch.py ``_killpg``: a group that is gone or that the manager may not signal (a
  member that changed user) is no error: supervision goes on to wait and reap;
- manager-protocol.md §6.5: at the end of the grace period the group is SIGKILLed then,
  not at the end of some longer poll.

A twenty-fifth audit ran the signal-forwarding and exit-code mutants the eighteenth left
unrun (28 mutants, 4 survived the run and launch tests) and added: a grace of 0 is valid;
a signal that lands before the child exists reaches it once it does; the group's survivors
get SIGTERM before SIGKILL; ``ignoring_signals`` ignores SIGINT, SIGTERM and SIGHUP and
restores the handlers after.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hust_ext_manager import launch
from hust_ext_manager.launch import (
    config_file_options,
    merge_additional_config,
    merge_option,
    without_option,
)

from tests.manager_helpers import wait_for_text
from tests.test_manager_launch_guards import _serve_with_config, site
from tests.test_manager_run import CLI, PY, _alive, env

__all__ = ["env", "site"]  # fixtures, used by name


def _sleeper(*, ignore_term: bool = False) -> subprocess.Popen[bytes]:
    """A real child leading its own process group, once it has started (and, if asked,
    ignores SIGTERM)."""
    code = ("import signal, time\n"
            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "")
            + "print('armed', flush=True)\ntime.sleep(600)\n")
    child = subprocess.Popen([PY, "-c", code], start_new_session=True, stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdout.readline() == b"armed\n"
    return child


def _end(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is None:
        child.kill()
        child.wait()
    if child.stdout is not None:
        child.stdout.close()


def test_a_negative_number_without_a_leading_digit_is_a_value() -> None:
    """argparse's negative-number pattern is ``^-\\d+$|^-\\d*\\.\\d+$``: ``-.5`` is a value,
    so a different one is a conflict, not ``requires a value``."""
    with pytest.raises(ValueError) as refused:
        merge_option(["h", "--preemption-policy", "-.5"], "--preemption-policy", "a.B",
                     is_json=False)
    assert str(refused.value) == "extension activation conflicts with --preemption-policy"


def test_a_one_letter_abbreviation_is_refused() -> None:
    """The shortest abbreviation (``--a``) would be read as ``--additional-config`` by a
    parser where it is unique: it is refused like any longer one."""
    with pytest.raises(ValueError) as refused:
        merge_additional_config(["h", "--a", "{}"], {"k": 1})
    assert str(refused.value).startswith("--a abbreviates --additional-config, ")


def test_a_rendered_option_prefixing_another_is_not_its_abbreviation() -> None:
    """The caller's ``--batch-admission-policy`` is its own option, not an abbreviation of
    ``--batch-admission-policy-config``: the bundle's config is appended after it."""
    command = ["vllm", "serve", "m", "--batch-admission-policy", "a.B"]
    merged = merge_option(command, "--batch-admission-policy-config", {"k": 1}, is_json=True)
    assert merged == [*command, "--batch-admission-policy-config", '{"k":1}']


def test_removing_an_inline_option_keeps_the_next_argument() -> None:
    """``--opt=V`` is one argument: the option after it stays, with its value."""
    command = ["vllm", "serve", "m", "--preemption-policy=a.B", "--port", "8000"]
    assert without_option(command, "--preemption-policy") == [
        "vllm", "serve", "m", "--port", "8000"
    ]


@pytest.mark.parametrize("arg", ["--config-format", "--config=serve.yaml"])
def test_only_the_exact_config_token_names_a_config_file(arg: str) -> None:
    """vLLM reads a file only after the exact ``--config`` token: another option that
    starts with it is no config file (and no error)."""
    assert config_file_options(["vllm", "serve", "m", arg, "hf"]) is None


def test_config_without_a_file_is_refused() -> None:
    with pytest.raises(ValueError) as refused:
        config_file_options(["vllm", "serve", "m", "--config"])
    assert str(refused.value) == "--config requires a file"


@pytest.mark.parametrize(("name", "read"), [
    ("serve.yml", True), ("serve.yaml", True), ("serve.json", False), ("serve.yml.txt", False)
])
def test_which_config_files_are_read(tmp_path: Path, name: str, read: bool) -> None:
    """vLLM reads a ``.yaml`` or ``.yml`` file (and refuses any other): only those are read
    here, so ``{"max_model_len": 8}`` (valid YAML) counts only in them."""
    path = tmp_path / name
    path.write_text('{"max_model_len": 8}\n')
    found = config_file_options(["vllm", "serve", "m", "--config", str(path)])
    assert found == (frozenset({"--max-model-len"}) if read else None)


def test_an_empty_config_file_sets_no_options(tmp_path: Path) -> None:
    """An empty file is a config file setting nothing (``frozenset()``), not the ``None``
    that means the command has no ``--config``."""
    path = tmp_path / "serve.yaml"
    path.write_text("# nothing set\n")
    assert config_file_options(["vllm", "serve", "m", "--config", str(path)]) == frozenset()


@pytest.mark.parametrize(("data", "problem"), [
    (b"a: b: c\n", "is not valid YAML (mapping values are not allowed here at line 1, "
                   "column 5)"),
    (b"port: 1\x07\n", "is not valid YAML (unacceptable character #x0007: special "
                       'characters are not allowed in "<unicode string>", position 7)'),
])
def test_a_yaml_error_is_one_line_with_its_position_from_one(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], data: bytes, problem: str
) -> None:
    path = tmp_path / "serve.yaml"
    path.write_bytes(data)
    assert _serve_with_config(path, capsys) == (
        f"vllm-hust-ext: error: --config {path} {problem}: expected a UTF-8 YAML mapping of "
        "options")


def test_a_passed_deadline_sigkills_within_a_short_poll() -> None:
    """§6.5: once the grace deadline has passed, a child that ignores SIGTERM is SIGKILLed
    at the next poll (every 0.05 s), well within two seconds: a poll of two seconds or more
    would wait it out. The bound is that loose so that a loaded CI machine cannot fail it."""
    child = _sleeper(ignore_term=True)
    try:
        supervisor = launch._Supervisor(0.0)
        supervisor.child = child
        supervisor.deadline = time.monotonic()  # set by a first signal; now past
        started = time.monotonic()
        assert supervisor.wait_child() == -signal.SIGKILL
        assert time.monotonic() - started < 2.0
    finally:
        _end(child)


def test_group_members_skips_a_zombie() -> None:
    """A member that exited but is not reaped yet is no live member."""
    child = subprocess.Popen([PY, "-c", "pass"], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while _alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        assert launch.group_members(child.pid) == []
    finally:
        child.wait()


def test_group_members_lists_a_process_whose_name_holds_a_parenthesis() -> None:
    """``/proc/PID/stat`` puts the name in parentheses and the name may hold ``)``: the
    fields are read after the last one."""
    code = ("open('/proc/self/comm', 'w').write('x) R 1 1')\n"
            "print('armed', flush=True)\nimport time; time.sleep(600)\n")
    child = subprocess.Popen([PY, "-c", code], start_new_session=True, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"armed\n"
        assert launch.group_members(child.pid) == [child.pid]
    finally:
        _end(child)


def test_the_grace_period_lets_a_child_finish_on_the_forwarded_signal(
    env: dict[str, str], tmp_path: Path
) -> None:
    """§6.5: SIGTERM is forwarded and the child has the grace period (30 s) to exit: one
    that takes a second to shut down is not SIGKILLed first, and finishes its shutdown."""
    ready, finished = tmp_path / "ready", tmp_path / "finished"
    child = (
        "import os, signal, sys, time\n"
        "def on(s, f):\n"
        f"    time.sleep(1.0); open({str(finished)!r}, 'w').write('done'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, on)\n"
        f"open({str(ready)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(120)\n"
    )
    manager = subprocess.Popen(
        [CLI, "run", "--shutdown-grace-seconds", "30", "--", PY, "-c", child], env=env
    )
    try:
        pid = int(wait_for_text(ready))
        manager.send_signal(signal.SIGTERM)
        assert manager.wait(timeout=60) == 128 + signal.SIGTERM
        assert finished.read_text() == "done"
        assert not _alive(pid)
    finally:
        if manager.poll() is None:
            manager.kill()
            manager.wait()


def test_the_first_signal_is_forwarded_only_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``forward`` runs from the handler and again right after the spawn: the child's
    group gets the first signal once, not twice (a second would read as escalation)."""
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(launch, "_killpg", lambda pgid, signum: sent.append((pgid, signum)))
    child = _sleeper()
    try:
        supervisor = launch._Supervisor(10.0)
        supervisor.child = child
        supervisor.on_signal(signal.SIGINT, None)
        supervisor.forward()
        assert sent == [(child.pid, signal.SIGINT)]
    finally:
        _end(child)


def test_the_child_is_reaped_when_waiting_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """§6.5: an error while waiting still SIGKILLs and reaps the child (no orphan left
    running, no zombie) before it propagates; the handlers are restored too."""
    children: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def recording_popen(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        children.append(real_popen(*args, **kwargs))  # type: ignore[call-overload]
        return children[-1]

    def failing_wait(self: object) -> int:
        raise RuntimeError("wait failed")

    monkeypatch.setattr(launch.subprocess, "Popen", recording_popen)  # type: ignore[attr-defined]
    monkeypatch.setattr(launch._Supervisor, "wait_child", failing_wait)
    forwarded = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    before = {signum: signal.getsignal(signum) for signum in forwarded}
    try:
        with pytest.raises(RuntimeError, match="wait failed"):
            launch.supervise(["sleep", "20"], dict(os.environ), grace=60.0)
        (child,) = children
        assert child.returncode == -signal.SIGKILL  # not 0 from the end of its 20 s
        assert not Path(f"/proc/{child.pid}").exists()
        assert {signum: signal.getsignal(signum) for signum in forwarded} == before
    finally:
        for child in children:
            _end(child)
        for signum, handler in before.items():
            signal.signal(signum, handler)


@pytest.mark.parametrize("error", [ProcessLookupError, PermissionError])
def test_a_group_that_cannot_be_signalled_is_no_error(
    monkeypatch: pytest.MonkeyPatch, error: type[OSError]
) -> None:
    """``killpg`` failing with ESRCH (the group is gone) or EPERM (no member the manager
    may signal) leaves the signal undelivered, without raising out of the handler."""
    calls: list[tuple[int, int]] = []

    def refusing_killpg(pgid: int, signum: int) -> None:
        calls.append((pgid, signum))
        raise error

    monkeypatch.setattr(launch.os, "killpg", refusing_killpg)  # type: ignore[attr-defined]
    launch._killpg(12345, signal.SIGTERM)
    assert calls == [(12345, signal.SIGTERM)]


# -- twenty-fifth audit: signal forwarding and exit codes (the eighteenth audit's unrun part)


def test_a_grace_of_zero_is_accepted() -> None:
    """manager-protocol.md §6.5: ``--shutdown-grace-seconds`` "must be ≥ 0", so 0 (SIGKILL
    as soon as the forwarded signal is not enough) is a valid grace; below 0 is not.
    Mutant: 0 refused along with the negatives."""
    launch.check_grace(0.0)
    with pytest.raises(ValueError, match="must be >= 0 and finite"):
        launch.check_grace(-0.001)


def test_a_signal_before_the_child_exists_is_forwarded_once_it_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """§6.5: "a signal received before the child starts is forwarded as soon as it exists".
    One SIGTERM lands while the child is being spawned; the child, which exits 0 on SIGTERM
    after noting it, gets it at once rather than being SIGKILLed at the (20 s) grace
    deadline. The child starts with SIGTERM blocked (the mask survives exec) and unblocks it
    once its handler is in place, so the forward cannot outrun the handler. Mutant: the
    forward after the spawn dropped."""
    noted = tmp_path / "termed"
    program = (
        "import signal, sys, time\n"
        f"def on_term(*_):\n    open({str(noted)!r}, 'w').write('1')\n    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})\n"
        "time.sleep(60)\n"
    )
    real_popen = subprocess.Popen

    def popen_after_a_signal(*args: object, **kwargs: object) -> object:
        os.kill(os.getpid(), signal.SIGTERM)  # handled by the manager's own handler
        block = lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # noqa: E731
        return real_popen(*args, preexec_fn=block, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(launch.subprocess, "Popen", popen_after_a_signal)
    started = time.monotonic()
    code = launch.supervise([sys.executable, "-c", program], dict(os.environ), grace=20.0)
    assert code == 128 + signal.SIGTERM
    assert time.monotonic() - started < 10.0  # not the 20 s grace
    assert noted.read_text() == "1"


def test_group_survivors_get_sigterm_before_sigkill(tmp_path: Path) -> None:
    """§6.5: "after the direct child exits, surviving group members get SIGTERM, then
    SIGKILL at the deadline": a grandchild that handles SIGTERM (noting it, then exiting)
    is given that chance. Mutant: the survivors SIGKILLed at once."""
    ready, noted = tmp_path / "ready", tmp_path / "termed"
    grandchild = (
        "import signal, sys, time\n"
        f"def on_term(*_):\n    open({str(noted)!r}, 'w').write('1')\n    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        f"open({str(ready)!r}, 'w').write('1')\n"
        "time.sleep(60)\n"
    )
    child = (
        "import os, subprocess, sys, time\n"
        f"subprocess.Popen([{sys.executable!r}, '-c', {grandchild!r}])\n"
        f"while not os.path.exists({str(ready)!r}):\n    time.sleep(0.01)\n"
        "sys.exit(4)\n"
    )
    code = launch.supervise([sys.executable, "-c", child], dict(os.environ), grace=30.0)
    assert code == 4
    assert noted.read_text() == "1"


def test_signals_are_ignored_inside_ignoring_signals() -> None:
    """cli.py runs the bundles' shutdown hooks inside ``ignoring_signals`` so that a late
    Ctrl-C neither interrupts a clean-up nor changes the status: SIGINT, SIGTERM and SIGHUP
    are ignored there, and the handlers in force before come back after. Mutant: nothing
    ignored."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    with launch.ignoring_signals():
        assert all(signal.getsignal(s) is signal.SIG_IGN for s in before)
        os.kill(os.getpid(), signal.SIGINT)  # would raise KeyboardInterrupt if handled
        time.sleep(0.05)
    assert {s: signal.getsignal(s) for s in before} == before
