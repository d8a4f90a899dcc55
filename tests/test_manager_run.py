"""``vllm-hust-ext run``: supervision of a real child, and launch rendering rules.

Guards: the child's exit code is returned; SIGTERM sent to the manager reaches the child
(the manager then exits 128+15); a child that ignores SIGTERM is SIGKILLed after
``--shutdown-grace-seconds``; a second signal SIGKILLs at once; SIGINT and SIGHUP are
forwarded like SIGTERM; descendants left in the child's process group are cleaned up within
the same grace deadline, so no orphan survives; in-process ``supervise`` restores the
previous signal handlers; ``merge_flag`` never duplicates a flag; ``--additional-config``
merging in both flag forms with conflict detection; option conflicts; manager-owned
variables preset by the caller are refused; bad grace values and empty commands are
one-line errors; a property test keeps every caller and bundle key through the merge or
refuses the conflict.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hust_ext_manager import launch
from hust_ext_manager.cli import main
from hust_ext_manager.launch import (
    group_members,
    merge_additional_config,
    merge_flag,
    merge_option,
    supervise,
)
from hypothesis import given
from hypothesis import strategies as st

from tests.manager_helpers import wait_for_text

CLI = str(Path(sys.executable).with_name("vllm-hust-ext"))
PY = sys.executable


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """Empty manager state: ``run`` launches with no bundle enabled."""
    environment = dict(os.environ)
    environment["VLLM_HUST_EXT_CONFIG"] = str(tmp_path / "config.json")
    return environment


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_exit_code_is_propagated(env: dict[str, str]) -> None:
    done = subprocess.run(
        [
            CLI,
            "run",
            "--",
            PY,
            "-c",
            "import os, sys; sys.exit(7 if os.getpgid(0) == os.getpid() else 1)",
        ],
        env=env,
        timeout=60,
    )
    assert done.returncode == 7  # and the child led its own process group


def test_child_killed_by_signal_maps_to_128_plus_n(env: dict[str, str]) -> None:
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert subprocess.run([CLI, "run", "--", PY, "-c", code], env=env, timeout=60).returncode == 137


def _default_signals() -> None:
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_sigterm_reaches_the_child(env: dict[str, str], tmp_path: Path, signum: int) -> None:
    """Each forwarded signal (SIGTERM, SIGINT, SIGHUP) sent to the manager reaches the
    child, and the manager exits 128+N."""
    ready, got = tmp_path / "ready", tmp_path / "got"
    child = (
        "import os, signal, sys, time\n"
        f"def on(s, f):\n    open({str(got)!r}, 'w').write(str(s)); sys.exit(0)\n"
        f"signal.signal({int(signum)}, on)\n"
        f"open({str(ready)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    # Default dispositions: a signal ignored at start (pytest under nohup) is left ignored.
    manager = subprocess.Popen(
        [CLI, "run", "--", PY, "-c", child], env=env, preexec_fn=_default_signals
    )
    pid = int(wait_for_text(ready))
    manager.send_signal(signum)
    assert manager.wait(timeout=30) == 128 + signum
    assert wait_for_text(got) == str(int(signum))
    assert not _alive(pid)


def _ignoring_sigterm(ready: Path) -> str:
    """A child program that ignores SIGTERM, writes its pid to ``ready`` and sleeps."""
    return (
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"open({str(ready)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(120)\n"
    )


def test_child_ignoring_sigterm_is_killed_after_grace(env: dict[str, str], tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    child = _ignoring_sigterm(ready)
    manager = subprocess.Popen(
        [CLI, "run", "--shutdown-grace-seconds", "0.5", "--", PY, "-c", child], env=env
    )
    pid = int(wait_for_text(ready))
    manager.send_signal(signal.SIGTERM)
    assert manager.wait(timeout=60) == 128 + signal.SIGTERM
    assert not _alive(pid)
    assert group_members(pid) == []


def test_second_signal_before_the_child_exists_still_kills_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two signals that land while the child is still being spawned: the first is forwarded
    once it exists and the second escalates to SIGKILL then, not at the grace deadline."""
    real_popen = subprocess.Popen

    def popen_after_two_signals(*args: object, **kwargs: object) -> object:
        os.kill(os.getpid(), signal.SIGTERM)  # handled by the manager's own handler
        os.kill(os.getpid(), signal.SIGTERM)
        # The child ignores SIGTERM from its first instruction (SIG_IGN survives exec), so
        # only a SIGKILL ends it before the grace deadline.
        ignore_term = lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN)  # noqa: E731
        return real_popen(*args, preexec_fn=ignore_term, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(launch.subprocess, "Popen", popen_after_two_signals)
    started = time.monotonic()
    code = launch.supervise(["sleep", "60"], dict(os.environ), grace=60.0)
    assert code == 128 + signal.SIGTERM
    assert time.monotonic() - started < 30.0  # not the 60 s grace


def test_no_orphans_remain_in_the_process_group(env: dict[str, str], tmp_path: Path) -> None:
    """The child exits at once, leaving a SIGTERM-ignoring grandchild in its group; the
    manager SIGKILLs the group at the grace deadline, so no orphan survives. The child
    exits only once the grandchild reports that it ignores SIGTERM (no race)."""
    ready, armed = tmp_path / "ready", tmp_path / "armed"
    grandchild = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(armed)!r}, 'w').write('1'); time.sleep(120)"
    )
    child = (
        "import os, subprocess, sys, time\n"
        f"p = subprocess.Popen([{PY!r}, '-c', {grandchild!r}])\n"
        f"open({str(ready)!r}, 'w').write(f'{{os.getpid()}} {{p.pid}}')\n"
        f"while not os.path.exists({str(armed)!r}):\n    time.sleep(0.01)\n"
        "sys.exit(3)\n"
    )
    done = subprocess.run(
        [CLI, "run", "--shutdown-grace-seconds", "0.5", "--", PY, "-c", child], env=env, timeout=60
    )
    assert done.returncode == 3
    pgid, grandchild_pid = (int(x) for x in wait_for_text(ready).split())
    assert group_members(pgid) == []
    assert not _alive(grandchild_pid)


def test_second_signal_sigkills_a_running_child_at_once(
    env: dict[str, str], tmp_path: Path
) -> None:
    """A second signal while the child runs escalates to SIGKILL at once instead of
    waiting for the (60 s) grace deadline; the manager still exits 128+first signal."""
    ready = tmp_path / "ready"
    child = _ignoring_sigterm(ready)
    manager = subprocess.Popen(
        [CLI, "run", "--shutdown-grace-seconds", "60", "--", PY, "-c", child], env=env
    )
    pid = int(wait_for_text(ready))
    try:
        manager.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # let the first signal be handled, so the two do not merge
        started = time.monotonic()
        manager.send_signal(signal.SIGTERM)
        assert manager.wait(timeout=30) == 128 + signal.SIGTERM
        assert time.monotonic() - started < 10.0
        assert not _alive(pid)
    finally:
        if manager.poll() is None:
            manager.kill()
            os.killpg(pid, signal.SIGKILL)


def test_group_cleanup_shares_the_grace_deadline(env: dict[str, str], tmp_path: Path) -> None:
    """End to end: a child that exits just before the grace deadline, leaving a
    SIGTERM-ignoring grandchild, still ends with the whole group gone and the manager's
    128 + signal status. (That the deadline is shared, not renewed, is checked without a
    clock in the next test.)"""
    ready, armed = tmp_path / "ready", tmp_path / "armed"
    grandchild = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(armed)!r}, 'w').write('1'); time.sleep(120)"
    )
    child = (
        "import os, signal, subprocess, sys, time\n"
        "def on(s, f):\n    time.sleep(2.7); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, on)\n"
        f"p = subprocess.Popen([{PY!r}, '-c', {grandchild!r}])\n"
        f"while not os.path.exists({str(armed)!r}):\n    time.sleep(0.01)\n"
        f"open({str(ready)!r}, 'w').write(f'{{os.getpid()}} {{p.pid}}')\n"
        "time.sleep(120)\n"
    )
    manager = subprocess.Popen(
        [CLI, "run", "--shutdown-grace-seconds", "3", "--", PY, "-c", child], env=env
    )
    pgid, grandchild_pid = (int(x) for x in wait_for_text(ready).split())
    try:
        manager.send_signal(signal.SIGTERM)
        assert manager.wait(timeout=30) == 128 + signal.SIGTERM
        assert not _alive(grandchild_pid)
        assert group_members(pgid) == []
    finally:
        if manager.poll() is None:
            manager.kill()
        if group_members(pgid):
            os.killpg(pgid, signal.SIGKILL)


def test_group_cleanup_keeps_the_signals_deadline_instead_of_a_fresh_grace() -> None:
    """After the direct child exited, cleaning its group up uses the deadline the first
    signal set: with that deadline already past, a SIGTERM-ignoring survivor is SIGKILLed
    at once, although the grace is 600 s. (A fresh grace would keep it alive for 600 s:
    the cleanup would still be running when the 60 s join below gives up.)"""
    survivor = subprocess.Popen(
        [PY, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "print('armed', flush=True); time.sleep(600)"],
        start_new_session=True, stdout=subprocess.PIPE)
    try:
        assert survivor.stdout is not None and survivor.stdout.readline() == b"armed\n"
        supervisor = launch._Supervisor(600.0)
        supervisor.deadline = time.monotonic()  # set by the first signal; now past
        cleanup = threading.Thread(target=supervisor.clean_group, args=(survivor.pid,),
                                   daemon=True)
        cleanup.start()
        cleanup.join(timeout=60)
        assert not cleanup.is_alive()
        assert survivor.wait(timeout=10) == -signal.SIGKILL
    finally:
        if survivor.poll() is None:
            survivor.kill()
            survivor.wait()


def test_supervise_restores_the_previous_signal_handlers() -> None:
    """In-process ``supervise`` puts back the handlers it replaced for SIGTERM, SIGINT and
    SIGHUP once the child has exited."""
    forwarded = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    before = {signum: signal.getsignal(signum) for signum in forwarded}
    try:
        assert supervise(["true"], dict(os.environ), grace=1.0) == 0
        assert {signum: signal.getsignal(signum) for signum in forwarded} == before
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_dry_run_starts_nothing(env: dict[str, str], tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    done = subprocess.run(
        [CLI, "run", "--dry-run", "--", PY, "-c", f"open({str(marker)!r}, 'w')"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0
    plan = json.loads(done.stdout)
    assert plan["command"] == [PY, "-c", f"open({str(marker)!r}, 'w')"]
    assert plan["environment"] == {"VLLMHUST_EXT_ENABLED_BUNDLES": ""}
    assert plan["native_extension_manifests"] == {}
    assert not marker.exists()


# --- in-process error paths -------------------------------------------------------------


def _invoke(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as stop:
        code = int(stop.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--"], "run requires a command after --"),
        (
            ["run", "--shutdown-grace-seconds", "-1", "--", "true"],
            "--shutdown-grace-seconds must be >= 0",
        ),
        (
            ["run", "--shutdown-grace-seconds", "nan", "--", "true"],
            "--shutdown-grace-seconds must be >= 0",
        ),
        # A deadline at infinity is never reached: a SIGTERM-ignoring child would live on.
        *(
            (
                ["run", f"--shutdown-grace-seconds={value}", "--", "true"],
                "--shutdown-grace-seconds must be >= 0 and finite",
            )
            for value in ("inf", "-inf", "1e400", "infinity")
        ),
        (["run", "--", "/nonexistent/binary"], "No such file or directory"),
        (["run", "--bogus"], "unrecognized arguments"),
    ],
)
def test_run_errors_are_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    monkeypatch.setenv("VLLM_HUST_EXT_CONFIG", str(tmp_path / "config.json"))
    code, err = _invoke(argv, capsys)
    assert code == 2
    assert err.splitlines()[-1].startswith("vllm-hust-ext: error: ")
    assert message in err.splitlines()[-1] or message in err


def test_preset_evidence_variable_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VLLM_HUST_EXT_CONFIG", str(tmp_path / "config.json"))
    monkeypatch.setenv("VLLM_ECPA_LAUNCH_ID", "mine")
    code, err = _invoke(["run", "--", "true"], capsys)
    assert code == 2
    assert (
        "vllm-hust-ext owns runtime evidence environment variables: ['VLLM_ECPA_LAUNCH_ID']" in err
    )


# --- rendering rules ------------------------------------------------------------------


def test_additional_config_is_appended_compact_and_sorted() -> None:
    assert merge_additional_config(["vllm", "serve"], {"b": 1, "a": {"x": 2}}) == [
        "vllm",
        "serve",
        "--additional-config",
        '{"a":{"x":2},"b":1}',
    ]
    assert merge_additional_config(["vllm"], {}) == ["vllm"]


@pytest.mark.parametrize("inline", [False, True])
def test_additional_config_merges_in_place_in_both_forms(inline: bool) -> None:
    given = ["--additional-config=" + '{"c": 3}'] if inline else ["--additional-config", '{"c": 3}']
    merged = merge_additional_config(["vllm", *given, "--x"], {"a": 1})
    expected = (
        ['--additional-config={"a":1,"c":3}']
        if inline
        else ["--additional-config", '{"a":1,"c":3}']
    )
    assert merged == ["vllm", *expected, "--x"]


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["vllm", "--additional-config"], "--additional-config requires a JSON object"),
        (["vllm", "--additional-config", "[1]"], "--additional-config must contain a JSON object"),
        (["vllm", "--additional-config={bad"], "--additional-config must contain a JSON object"),
        # Over the int/str digit limit json.loads raises a plain ValueError: still "not JSON".
        (
            ["vllm", "--additional-config", '{"b": 1' + "0" * 5000 + "}"],
            "--additional-config must contain a JSON object",
        ),
        (
            ["vllm", "--additional-config", '{"a": 2}'],
            "plugin activation conflicts with additional_config keys: ['a']",
        ),
    ],
)
def test_additional_config_errors(command: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        merge_additional_config(command, {"a": 1})


def test_scalar_option_rules() -> None:
    policy = "pkg.mod.Policy"
    assert merge_option(["vllm"], "--preemption-policy", policy, is_json=False)[-2:] == [
        "--preemption-policy",
        policy,
    ]
    same = ["vllm", f"--preemption-policy={policy}"]
    assert merge_option(same, "--preemption-policy", policy, is_json=False) == same
    with pytest.raises(ValueError, match="extension activation conflicts with --preemption-policy"):
        merge_option(
            ["vllm", "--preemption-policy", "x.Y"], "--preemption-policy", policy, is_json=False
        )
    with pytest.raises(ValueError, match="--preemption-policy requires a value"):
        merge_option(["vllm", "--preemption-policy"], "--preemption-policy", policy, is_json=False)
    spec = {"k": 1}
    assert merge_option(
        ["v", "--speculative-config", '{"k": 1}'], "--speculative-config", spec, is_json=True
    ) == [
        "v",
        "--speculative-config",
        '{"k": 1}',
    ]
    with pytest.raises(ValueError, match="--speculative-config requires a JSON object"):
        merge_option(["v", "--speculative-config"], "--speculative-config", spec, is_json=True)


def test_an_oversized_integer_in_a_json_option_is_a_conflict_not_a_crash() -> None:
    huge = "1" + "0" * 5000
    with pytest.raises(ValueError, match="extension activation conflicts with --kv"):
        merge_option(["vllm", "--kv", huge], "--kv", {"a": 1}, is_json=True)


def test_supervise_refuses_a_grace_it_could_never_reach() -> None:
    for grace in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="--shutdown-grace-seconds must be >= 0 and finite"):
            supervise(["true"], dict(os.environ), grace=grace)


def test_merge_flag_keeps_a_flag_the_caller_gave() -> None:
    """``merge_flag`` appends a missing flag once and leaves a command that already has it
    unchanged (no duplicate)."""
    flag = "--scheduler-reserve-output-budget"
    assert merge_flag(["vllm", "serve"], flag) == ["vllm", "serve", flag]
    given_flag = ["vllm", flag, "serve"]
    assert merge_flag(given_flag, flag) == given_flag


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(
    caller=st.dictionaries(st.text(min_size=1, max_size=5), _JSON, max_size=4),
    bundles=st.dictionaries(st.text(min_size=1, max_size=5), _JSON, min_size=1, max_size=4),
    inline=st.booleans(),
)
def test_additional_config_merge_keeps_every_key_or_refuses(
    caller: dict[str, object], bundles: dict[str, object], inline: bool
) -> None:
    text = json.dumps(caller)
    command = (
        ["vllm", f"--additional-config={text}"] if inline else ["vllm", "--additional-config", text]
    )
    clash = sorted(k for k in bundles if k in caller and caller[k] != bundles[k])
    if clash:
        with pytest.raises(
            ValueError, match="plugin activation conflicts with additional_config keys"
        ):
            merge_additional_config(command, bundles)
        return
    merged = merge_additional_config(command, bundles)
    assert len(merged) == len(command)
    value = merged[1].split("=", 1)[1] if inline else merged[2]
    assert json.loads(value) == {**caller, **bundles}
