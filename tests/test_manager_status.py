"""``status`` states and ``run`` refusals: runtime evidence, bundle checks, hosts, conflicts.

Guards: ``runtime_effective`` appears only while a live process with the recorded pid and
``/proc`` start time has an ``effective`` event for the bundle (the bundle's own stdlib
writer and the manager's sink write the same line format; the bundle's lines are bound only
with both launch ids, only ``effective`` lines are an observation, the sink's binding is
fixed when it is made, its file is private and its directory is created, a failed write is
ignored unless strict, and a line names the given process by its ``/proc`` start time even
when its command name holds spaces and ``)``); a later ``disabled`` event or
a dead/recycled pid removes it; ``vllm_hust_ext.bundle_checks`` functions are loaded only
by status/check/run, their lines are evidence and a failure degrades status and refuses
``run``; host range, qualification profile and service health refusals; per-key
cross-bundle conflicts (different variables render one launch, the same variable with
different values is refused; likewise additional_config keys and rendered options). Also:
the manager's own sink (private file, bundle named only when one is enabled, refusals of
unknown or unbound events); which live lines count (bound ``effective`` or
``runtime_effective``, same host, or naming the bundle's entry point); host and protocol
detection from package metadata and its override; null protocol ranges; a qualification
never lifts a failed check and needs ``status: passed`` and every profile key; optional
and multiple services; a descriptor-only bundle is never launched; plugin modules shipped
as packages or extensions, or under ``src/`` of a source checkout found by its
``.egg-info`` (never for an installed RECORD), platform plugins, and ``VLLM_PLUGINS``
composition. Controller counters (an evidence line's ``stats``) never appear in status.
"""

from __future__ import annotations

import errno
import http.server
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hust_ext_manager import runtime_evidence

from bidkv_ext.evidence import evidence_line, evidence_sink_from_env
from tests.manager_helpers import fake_site, invoke, within
from tests.manager_helpers import install_bundles as install

ROOT = Path(__file__).resolve().parents[1]
BASE: dict[str, Any] = json.loads(
    (ROOT / "manifests" / "bidkv" / "vllm-hust-extension-v0.2.json").read_text()
)
DECLARED = {"protocol_versions": {"vllm.preemption-policy": "1.0"}, "host_version": "0.33.0"}


def _metadata(folder: Path, name: str, entry_points: str) -> Path:
    """A distribution's metadata folder (``*.dist-info``, or a source checkout's
    ``*.egg-info``) naming ``name`` 1.0 and publishing ``entry_points``."""
    folder.mkdir()
    metadata = "PKG-INFO" if folder.suffix == ".egg-info" else "METADATA"
    (folder / metadata).write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (folder / "entry_points.txt").write_text(entry_points)
    return folder


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VLLM_HUST_EXT_EVIDENCE_PATH", str(tmp_path / "evidence.jsonl"))
    return fake_site(tmp_path, monkeypatch)


def set_state(tmp_path: Path, entries: dict[str, dict[str, Any]]) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"schema_version": 2, "extensions": entries}))


def status(bundle_id: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code, out, err = invoke(["extension", "status", bundle_id], capsys)
    assert code == 0, err
    result: dict[str, Any] = json.loads(out)
    return result


# --- runtime evidence -----------------------------------------------------------------


def test_bundle_sink_needs_the_evidence_path() -> None:
    assert evidence_sink_from_env({}) is None


def test_bundle_writer_and_manager_sink_write_the_same_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ev.jsonl"
    binding = {
        "VLLM_HUST_EXT_EVIDENCE_PATH": str(path),
        "VLLM_ECPA_PLAN_ID": "p",
        "VLLM_ECPA_LAUNCH_ID": "l",
    }
    sink = evidence_sink_from_env(binding)
    assert sink is not None
    sink("effective", {"calls": 1})
    for key, value in binding.items():
        monkeypatch.setenv(key, value)
    runtime_evidence.record_event("effective", {"calls": 1}, extension_id="org.vllm-hust.bidkv")
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert set(first) - {"recorded_at"} == set(second)
    for line in (first, second):
        assert line["schema"] == "vllm-hust-plugin-evidence/0.1"
        assert line["binding_status"] == "bound"
        assert (line["event"], line["extension_id"], line["plan_id"], line["launch_id"]) == (
            "effective",
            "org.vllm-hust.bidkv",
            "p",
            "l",
        )
        assert line["process"]["pid"] == os.getpid()
        assert line["process"]["start_identity"] == runtime_evidence.start_identity(os.getpid())
        assert line["stats"] == {"calls": 1}
    with pytest.raises(ValueError, match="bound"):
        runtime_evidence.record_event({"schema": "x"})


def test_bundle_lines_are_bound_by_both_ids_fixed_at_sink_creation(tmp_path: Path) -> None:
    """A line is ``bound`` only with both the plan and the launch id; only ``effective``
    lines carry ``observation_kind``; the sink keeps the binding it was made with."""
    both = {"VLLM_ECPA_PLAN_ID": "p", "VLLM_ECPA_LAUNCH_ID": "l"}
    for environ in ({}, {"VLLM_ECPA_PLAN_ID": "p"}, {"VLLM_ECPA_LAUNCH_ID": "l"}):
        assert evidence_line("effective", {}, environ)["binding_status"] == "unbound"
    assert evidence_line("effective", {}, both)["binding_status"] == "bound"
    assert evidence_line("effective", {}, both)["observation_kind"] == "runtime_effective"
    for event in ("initialized", "disabled"):
        assert "observation_kind" not in evidence_line(event, {}, both)
    path = tmp_path / "ev.jsonl"
    environ = {**both, "VLLM_HUST_EXT_EVIDENCE_PATH": str(path)}
    sink = evidence_sink_from_env(environ)
    assert sink is not None
    environ["VLLM_ECPA_LAUNCH_ID"] = "later"
    sink("effective", {})
    (line,) = (json.loads(text) for text in path.read_text().splitlines())
    assert (line["plan_id"], line["launch_id"], line["binding_status"]) == ("p", "l", "bound")


def test_bundle_sink_file_mode_directory_and_write_failures(tmp_path: Path) -> None:
    """The sink creates the missing directories and a 0600 file; an empty path is no sink;
    a failed write is ignored unless VLLM_ECPA_EVIDENCE_STRICT=1, which raises it."""
    key = "VLLM_HUST_EXT_EVIDENCE_PATH"
    path = tmp_path / "new" / "dir" / "ev.jsonl"
    old = os.umask(0o022)
    try:
        sink = evidence_sink_from_env({key: str(path)})
        assert sink is not None
        sink("initialized", {})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text())["event"] == "initialized"
    assert evidence_sink_from_env({key: ""}) is None
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    target = str(blocker / "ev.jsonl")  # its parent is a file: the write fails
    for strict in ({}, {"VLLM_ECPA_EVIDENCE_STRICT": "0"}):
        quiet = evidence_sink_from_env({key: target, **strict})
        assert quiet is not None
        quiet("effective", {})
    loud = evidence_sink_from_env({key: target, "VLLM_ECPA_EVIDENCE_STRICT": "1"})
    assert loud is not None
    with pytest.raises(OSError):
        loud("effective", {})


def test_bundle_sink_ignores_stats_json_cannot_write_unless_strict(tmp_path: Path) -> None:
    """Stats JSON cannot write (an object value, a tuple key, a circular mapping) are
    dropped by the default sink like a failed write, writing nothing; the strict sink
    raises. Later events still reach the file."""
    key = "VLLM_HUST_EXT_EVIDENCE_PATH"
    path = tmp_path / "ev.jsonl"
    circular: dict[str, object] = {}
    circular["self"] = circular
    bad_stats: list[dict[Any, object]] = [{"x": object()}, {(1, 2): 0}, {"c": circular}]
    quiet = evidence_sink_from_env({key: str(path)})
    loud = evidence_sink_from_env({key: str(path), "VLLM_ECPA_EVIDENCE_STRICT": "1"})
    assert quiet is not None and loud is not None
    for stats in bad_stats:
        quiet("effective", stats)
        with pytest.raises((TypeError, ValueError)):
            loud("effective", stats)
    assert not path.exists() or path.read_text() == ""
    quiet("disabled", {"calls": 1})
    [line] = path.read_text().splitlines()
    assert json.loads(line)["stats"] == {"calls": 1}


def test_bundle_line_names_the_given_process(tmp_path: Path) -> None:
    """``pid=`` names another process: its pid and its ``/proc`` start identity as the
    manager reads it, also when the command name holds spaces and ')'; a pid with no
    ``/proc`` entry has an empty identity."""
    ready = tmp_path / "ready"
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; open('/proc/self/comm', 'w').write('ev) x (y'); "
        "open(sys.argv[1], 'w').write('1'); time.sleep(120)"), str(ready)])
    try:
        for _ in range(3000):
            if ready.exists():
                break
            assert child.poll() is None
            time.sleep(0.01)
        assert "(ev) x (y)" in Path(f"/proc/{child.pid}/stat").read_text()
        line = evidence_line("effective", {}, {}, pid=child.pid)
        identity = runtime_evidence.start_identity(child.pid)
        assert identity is not None and identity.startswith(f"pid:{child.pid}:start_ticks:")
        process = line["process"]
        assert isinstance(process, dict)
        assert (process["pid"], process["start_identity"]) == (child.pid, identity)
    finally:
        child.kill()
        child.wait()
    gone = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    assert runtime_evidence.start_identity(gone) is None
    process = evidence_line("effective", {}, {}, pid=gone)["process"]
    assert isinstance(process, dict) and process["start_identity"] == ""


_CHILD = textwrap.dedent(
    """
    import sys, time
    from bidkv_ext.contract import PreemptionCandidate, PreemptionContext
    from bidkv_ext.controller import PolicyController
    from bidkv_ext.evidence import evidence_sink_from_env

    class First:
        def select_victim(self, context):
            return context.candidates[0].request_id

    controller = PolicyController(First(), evidence=evidence_sink_from_env())
    candidate = PreemptionCandidate("r1", 0, 0.0, 8, 1, 8, 0, 16)
    context = PreemptionContext((candidate,), "fcfs", "r2", 0.9, 1.0)
    assert controller.select_victim(context) == "r1"
    open(sys.argv[1], "w").write("ready")
    time.sleep(120)
    """
)


def test_runtime_effective_only_while_the_writer_lives(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    install(site, {"org.test.p": BASE})
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": DECLARED}})
    evidence = tmp_path / "evidence.jsonl"
    assert "runtime_effective" not in status("org.test.p", capsys)["states"]
    ready = tmp_path / "ready"
    env = {
        **os.environ,
        "VLLM_HUST_EXT_EVIDENCE_PATH": str(evidence),
        "VLLM_ECPA_PLAN_ID": "p",
        "VLLM_ECPA_LAUNCH_ID": "l",
        "VLLMHUST_EXT_ENABLED_BUNDLES": "org.test.p",
    }
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(ready)], env=env)
    try:
        for _ in range(3000):
            if ready.exists():
                break
            child.poll()
            assert child.returncode is None
            import time

            time.sleep(0.01)
        events = [json.loads(line)["event"] for line in evidence.read_text().splitlines()]
        assert events == ["initialized", "effective"]
        # The bundle writes its own id; rebind the lines to the fake bundle under test.
        evidence.write_text(evidence.read_text().replace("org.vllm-hust.bidkv", "org.test.p"))
        # A corrupt line (nested deeper than the JSON parser follows) is no evidence, and
        # no crash either.
        evidence.write_text("[" * 100_000 + "]" * 100_000 + "\n" + evidence.read_text())
        shown = status("org.test.p", capsys)
        assert shown["states"][-1] == "runtime_effective"
        assert f"pid={child.pid}" in shown["evidence"][-1]
    finally:
        child.kill()
        child.wait()
    assert "runtime_effective" not in status("org.test.p", capsys)["states"]


def test_recycled_pid_and_disabled_event_are_not_effective(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    install(site, {"org.test.p": BASE})
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": DECLARED}})
    evidence = tmp_path / "evidence.jsonl"
    environ = {"VLLM_ECPA_PLAN_ID": "p", "VLLM_ECPA_LAUNCH_ID": "l"}
    line = evidence_line("effective", {}, environ)
    line["extension_id"] = "org.test.p"
    stale = json.loads(json.dumps(line))
    stale["process"]["start_identity"] = f"pid:{os.getpid()}:start_ticks:1"
    evidence.write_text(json.dumps(stale) + "\n")
    assert "runtime_effective" not in status("org.test.p", capsys)["states"]
    evidence.write_text(json.dumps(line) + "\n")
    assert "runtime_effective" in status("org.test.p", capsys)["states"]
    disabled = {**line, "event": "disabled"}
    disabled.pop("observation_kind")
    evidence.write_text(json.dumps(line) + "\n" + json.dumps(disabled) + "\n")
    assert "runtime_effective" not in status("org.test.p", capsys)["states"]


def test_an_oversized_integer_line_is_skipped_like_any_corrupt_line(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An integer over the int/str digit limit makes json.loads raise a plain ValueError;
    that line is no evidence, and the valid line after it still is."""
    install(site, {"org.test.p": BASE})
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": DECLARED}})
    line = evidence_line("effective", {}, {"VLLM_ECPA_PLAN_ID": "p", "VLLM_ECPA_LAUNCH_ID": "l"})
    line["extension_id"] = "org.test.p"
    huge = '{"pid": 1' + "0" * 5000 + "}"
    (tmp_path / "evidence.jsonl").write_text(huge + "\n" + json.dumps(line) + "\n")
    assert status("org.test.p", capsys)["states"][-1] == "runtime_effective"


def test_manager_sink_binds_lines_and_refuses_what_it_cannot_bind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``record_event`` (the sink ``VLLM_ECPA_EVIDENCE_SINK`` names): creates the missing
    directories and a 0600 file; names the bundle from ``VLLMHUST_EXT_ENABLED_BUNDLES`` only
    when exactly one is enabled; refuses an unknown event name, a line it cannot bind (no
    plan or launch id) and a host event that is not ``bound``."""
    path = tmp_path / "new" / "dir" / "ev.jsonl"
    monkeypatch.setenv("VLLM_HUST_EXT_EVIDENCE_PATH", str(path))
    monkeypatch.setenv("VLLM_ECPA_PLAN_ID", "p")
    monkeypatch.setenv("VLLM_ECPA_LAUNCH_ID", "l")
    old = os.umask(0o022)
    try:
        for enabled in ("org.test.p", "org.test.p,org.test.q"):
            monkeypatch.setenv("VLLMHUST_EXT_ENABLED_BUNDLES", enabled)
            runtime_evidence.record_event("initialized", {})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["extension_id"] for line in lines] == ["org.test.p", None]
    with pytest.raises(ValueError, match="unknown evidence event 'selected'"):
        runtime_evidence.record_event("selected", {})
    monkeypatch.delenv("VLLM_ECPA_PLAN_ID")
    with pytest.raises(ValueError, match="evidence needs VLLM_ECPA_PLAN_ID"):
        runtime_evidence.record_event("effective", {})
    unbound = {**lines[0], "binding_status": "unbound"}
    with pytest.raises(ValueError, match="bound"):
        runtime_evidence.record_event(unbound)
    assert len(path.read_text().splitlines()) == 2  # nothing refused was written


def test_an_evidence_path_at_a_fifo_blocks_neither_status_nor_a_writer(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The evidence path is the user's to set, so it may name a FIFO, which a plain open()
    waits on until the other end opens. ``status`` reads it as no evidence at once, and both
    writers (the bundle's sink and the manager's ``record_event``) fail at once with an
    OSError (ENXIO: no reader) instead of blocking the engine; the bundle's non-strict sink
    ignores it, as any failed write."""
    install(site, {"org.test.p": BASE})
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": DECLARED}})
    fifo = tmp_path / "evidence.jsonl"
    os.mkfifo(fifo)
    binding = {"VLLM_HUST_EXT_EVIDENCE_PATH": str(fifo), "VLLM_ECPA_PLAN_ID": "p",
               "VLLM_ECPA_LAUNCH_ID": "l"}
    for key, value in binding.items():
        monkeypatch.setenv(key, value)
    with within(5):
        assert "runtime_effective" not in status("org.test.p", capsys)["states"]
    with within(5), pytest.raises(OSError) as raised:
        runtime_evidence.record_event("effective", {}, extension_id="org.test.p")
    assert raised.value.errno == errno.ENXIO
    strict = evidence_sink_from_env({**binding, "VLLM_ECPA_EVIDENCE_STRICT": "1"})
    assert strict is not None
    with within(5), pytest.raises(OSError) as raised:
        strict("effective", {})
    assert raised.value.errno == errno.ENXIO
    quiet = evidence_sink_from_env(binding)
    assert quiet is not None
    with within(5):
        quiet("effective", {})
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def _live_line(**changes: Any) -> dict[str, Any]:
    """A bound ``effective`` line of this (live) test process for ``org.test.p``."""
    line = evidence_line("effective", {}, {"VLLM_ECPA_PLAN_ID": "p", "VLLM_ECPA_LAUNCH_ID": "l"})
    line["extension_id"] = "org.test.p"
    line.update(changes)
    copied: dict[str, Any] = json.loads(json.dumps(line))
    return copied


@pytest.mark.parametrize(
    ("line", "effective"),
    [
        (_live_line(binding_status="unbound"), False),
        (_live_line(event="runtime_effective", observation_kind=None), True),
        (_live_line(event="initialized", observation_kind=None), False),
    ],
    ids=["unbound", "runtime-effective-event", "initialized-event"],
)
def test_which_live_lines_count_as_runtime_effective(
    site: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    line: dict[str, Any],
    effective: bool,
) -> None:
    """§5.1: only a *bound* ``effective`` or ``runtime_effective`` event (or one observed as
    ``runtime_effective``) of a live process sets ``runtime_effective``."""
    install(site, {"org.test.p": BASE})
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": DECLARED}})
    (tmp_path / "evidence.jsonl").write_text(json.dumps(line) + "\n")
    assert ("runtime_effective" in status("org.test.p", capsys)["states"]) is effective


def test_controller_counters_never_appear_in_status(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§5.1: a live ``effective`` line sets ``runtime_effective`` with one evidence line
    naming the launch, pid and event; the line's controller counters (``stats``) are never
    shown."""
    install(site, {"org.test.p": BASE})
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": DECLARED}})
    # Nine digits: no pid (at most 4,194,304) can contain one, so the evidence line's pid
    # cannot look like a counter (891 once matched pid 5891).
    line = _live_line(stats={"preemptions": 712371237, "policy_calls": 456745674,
                             "fallbacks": 891891891})
    (tmp_path / "evidence.jsonl").write_text(json.dumps(line) + "\n")
    code, out, err = invoke(["extension", "status", "org.test.p"], capsys)
    assert code == 0, err
    shown = json.loads(out)
    assert shown["states"][-1] == "runtime_effective"
    assert shown["evidence"][-1] == (
        f"live runtime evidence launch_id=l pid={os.getpid()} event=effective"
    )
    for counter in ("preemptions", "policy_calls", "fallbacks", "712371237", "456745674",
                    "891891891"):
        assert counter not in out


def test_a_line_from_another_machine_is_not_live(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same pid and start time on another host is another process: a line written there
    (a shared evidence path) is no live evidence here."""
    install(site, {"org.test.p": BASE})
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": DECLARED}})
    line = _live_line()
    line["process"]["host"] = "another-" + line["process"]["host"]
    (tmp_path / "evidence.jsonl").write_text(json.dumps(line) + "\n")
    assert "runtime_effective" not in status("org.test.p", capsys)["states"]


def test_a_line_naming_the_bundles_entry_point_counts_for_the_bundle(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A host that records the activation entry point instead of the extension id (its
    plugin does not know the id) still binds the line to the bundle declaring it."""
    plugin = _with(
        _other({}), activation__entry_points=[{"group": "vllm.general_plugins", "name": "kvp"}]
    )
    install(site, {"org.test.q": plugin}, plugins={"kvp": "fakestatus.kvp_plugin"})
    set_state(tmp_path, {"org.test.q": {"enabled": True, "configuration": DECLARED}})
    line = _live_line(extension_id=None, entry_point={"group": "vllm.general_plugins",
                                                      "name": "kvp"})
    (tmp_path / "evidence.jsonl").write_text(json.dumps(line) + "\n")
    assert status("org.test.q", capsys)["states"][-1] == "runtime_effective"


# --- bundle checks --------------------------------------------------------------------


def _check_module(site: Path, body: str, name: str) -> Path:
    """Write check module ``name`` (unique per test: sys.modules outlives a test)."""
    marker = site / "imported.marker"
    (site / f"{name}.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\n"
        "def check(manifest, configuration):\n" + textwrap.indent(body, "    ") + "\n"
    )
    return marker


def test_bundle_checks_feed_status_and_refuse_run(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = _check_module(
        site,
        "assert manifest['extension_id'] == 'org.test.p' and configuration['host_version']\n"
        "return [(True, 'service socket present'), (False, 'limit not applied')]",
        "fakecheck_lines",
    )
    install(site, {"org.test.p": BASE}, checks={"org.test.p": "fakecheck_lines:check"})
    set_state(tmp_path, {"org.test.p": {"enabled": False, "configuration": DECLARED}})
    for argv in (
        ["extension", "list"],
        ["extension", "inspect", "org.test.p"],
        ["extension", "validate", "org.test.p"],
        ["extension", "enable", "org.test.p"],
    ):
        assert invoke(argv, capsys)[0] == 0
    assert not marker.exists()  # never loaded outside status/check/run
    shown = status("org.test.p", capsys)
    assert marker.exists()
    assert shown["states"] == [
        "installed",
        "discovered",
        "compatible",
        "configured",
        "enabled",
        "degraded",
    ]
    assert shown["evidence"][-2:] == ["service socket present", "limit not applied"]
    code, _, err = invoke(["run", "--dry-run", "--", "true"], capsys)
    assert code == 2
    assert (
        err.splitlines()[-1]
        == "vllm-hust-ext: error: refusing to launch 'org.test.p': limit not applied"
    )


def test_only_the_bundles_own_distribution_registers_its_hooks(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A check or shutdown hook that another installed distribution registers under the
    bundle's id is never loaded: it could veto the launch or run code in the bundle's name."""
    marker = _check_module(site, "return [(False, 'vetoed')]", "fakecheck_intruder")
    install(site, {"org.test.p": BASE})
    _metadata(site / "intruder-1.0.dist-info", "intruder",
              "[vllm_hust_ext.bundle_checks]\norg.test.p = fakecheck_intruder:check\n"
              "[vllm_hust_ext.bundle_shutdown]\norg.test.p = fakecheck_intruder:check\n")
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": DECLARED}})
    shown = status("org.test.p", capsys)
    assert "vetoed" not in shown["evidence"] and "degraded" not in shown["states"]
    monkeypatch.delenv("VLLM_HUST_EXT_EVIDENCE_PATH")  # a real launch owns it
    code, _, err = invoke(["run", "--", sys.executable, "-c", "pass"], capsys)
    assert code == 0, err
    assert not marker.exists()


def test_a_hook_of_a_distribution_without_a_name_is_not_the_bundles(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """A distribution whose METADATA has no ``Name`` cannot be the bundle's own (discovery
    refuses one as a bundle's), so a check it registers under the bundle's id is never
    loaded, and ``status`` still answers (it used to end in "internal error:
    AttributeError")."""
    marker = _check_module(site, "return [(False, 'vetoed')]", "fakecheck_nameless")
    install(site, {"org.test.p": BASE})
    nameless = site / "nameless-1.0.dist-info"
    nameless.mkdir()
    (nameless / "METADATA").write_text("Metadata-Version: 2.1\nVersion: 1.0\n")
    (nameless / "entry_points.txt").write_text(
        "[vllm_hust_ext.bundle_checks]\norg.test.p = fakecheck_nameless:check\n")
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": DECLARED}})
    shown = status("org.test.p", capsys)
    assert "vetoed" not in shown["evidence"] and "degraded" not in shown["states"]
    assert not marker.exists()


def test_a_raising_bundle_check_is_a_failed_line(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _check_module(site, "raise RuntimeError('boom')", "fakecheck_raises")
    install(site, {"org.test.p": BASE}, checks={"org.test.p": "fakecheck_raises:check"})
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": DECLARED}})
    shown = status("org.test.p", capsys)
    assert "bundle check failed: boom" in shown["evidence"] and "degraded" in shown["states"]
    code, _, err = invoke(["run", "--dry-run", "--", "true"], capsys)
    assert code == 2 and "refusing to launch 'org.test.p': bundle check failed: boom" in err


def test_a_check_taking_context_sees_the_other_enabled_bundles_and_the_command(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = tmp_path / "context.jsonl"
    (site / "fakecheck_context.py").write_text(
        "import json\n"
        "def check(manifest, configuration, context):\n"
        f"    with open({str(seen)!r}, 'a') as f:\n"
        "        f.write(json.dumps({'peers': sorted(context['enabled_bundles']),\n"
        "                            'command': context['command']}) + '\\n')\n"
        "    return [(True, 'looked')]\n"
    )
    plain = _with(BASE, components=[])
    install(site, {"org.test.p": BASE, "org.test.q": plain, "org.test.r": plain},
            checks={"org.test.p": "fakecheck_context:check"})
    set_state(tmp_path, {
        "org.test.p": {"enabled": True, "configuration": DECLARED},
        "org.test.q": {"enabled": True, "configuration": DECLARED},
        "org.test.r": {"enabled": False, "configuration": DECLARED},
    })
    assert "looked" in status("org.test.p", capsys)["evidence"]
    assert invoke(["run", "--dry-run", "--", "true", "--flag"], capsys)[0] == 0
    calls = [json.loads(line) for line in seen.read_text().splitlines()]
    assert calls == [{"peers": ["org.test.q"], "command": None},
                     {"peers": ["org.test.q"], "command": ["true", "--flag"]}]


def test_shutdown_hooks_report_after_the_launch_and_never_change_its_status(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_HUST_EXT_EVIDENCE_PATH")  # a real launch owns it
    trace = tmp_path / "child-ran"
    (site / "fakehook_report.py").write_text(
        "import os\n"
        "def on_shutdown(manifest, configuration):\n"
        f"    ran = os.path.exists({str(trace)!r})\n"
        "    return [f'child ran: {ran}', manifest['extension_id']]\n"
    )
    (site / "fakehook_raises.py").write_text(
        "def on_shutdown(manifest, configuration):\n    raise OSError('disk gone')\n")
    install(site, {"org.test.p": BASE, "org.test.q": _with(BASE, components=[])},
            shutdown={"org.test.p": "fakehook_report:on_shutdown",
                      "org.test.q": "fakehook_raises:on_shutdown"})
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": DECLARED},
                         "org.test.q": {"enabled": True, "configuration": DECLARED}})
    code, _, err = invoke(["run", "--dry-run", "--", "true"], capsys)
    assert code == 0 and "vllm-hust-ext: org.test" not in err  # a dry run launches nothing
    code, _, err = invoke(["run", "--", "sh", "-c", f"touch {trace}; exit 3"], capsys)
    assert code == 3
    assert err.splitlines()[-3:] == [
        "vllm-hust-ext: org.test.p: child ran: True",
        "vllm-hust-ext: org.test.p: org.test.p",
        "vllm-hust-ext: org.test.q: bundle shutdown hook failed: disk gone",
    ]


def test_a_late_signal_neither_interrupts_the_hooks_nor_changes_the_status(
    site: Path, tmp_path: Path
) -> None:
    """Ctrl-C while the shutdown hooks run (after the launch ended) is ignored."""
    (site / "fakehook_signal.py").write_text(
        "import os, signal, time\n"
        "def on_shutdown(manifest, configuration):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(0.2)\n"
        "    return ['finished']\n"
    )
    install(site, {"org.test.p": BASE}, shutdown={"org.test.p": "fakehook_signal:on_shutdown"})
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": DECLARED}})
    env = {k: v for k, v in os.environ.items() if k != "VLLM_HUST_EXT_EVIDENCE_PATH"}
    env.update(PYTHONPATH=str(site), VLLM_HUST_EXT_CONFIG=str(tmp_path / "config.json"))
    manager = str(Path(sys.executable).with_name("vllm-hust-ext"))
    done = subprocess.run([manager, "run", "--", "sh", "-c", "exit 5"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 5, done.stderr
    assert done.stderr.splitlines() == ["vllm-hust-ext: org.test.p: finished"]


# --- host, qualification, services ----------------------------------------------------


def _with(document: dict[str, Any], **changes: Any) -> dict[str, Any]:
    result = json.loads(json.dumps(document))
    for dotted, value in changes.items():
        target = result
        *parents, last = dotted.split("__")
        for part in parents:
            target = target[part]
        target[last] = value
    return result


def test_host_out_of_range_is_incompatible_and_refused(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    install(site, {"org.test.p": BASE})
    set_state(
        tmp_path,
        {"org.test.p": {"enabled": True, "configuration": {**DECLARED, "host_version": "0.40.0"}}},
    )
    shown = status("org.test.p", capsys)
    assert shown["states"] == ["installed", "discovered", "incompatible", "enabled"]
    assert shown["evidence"][0] == "host version 0.40.0 is outside >=0.28.1rc1.dev319,<0.34"
    code, _, err = invoke(["run", "--dry-run", "--", "true"], capsys)
    assert code == 2
    assert (
        "refusing to launch incompatible extension 'org.test.p': host version 0.40.0 is outside"
        in err
    )
    # §6.2 order: the refusal (step 2) comes before the empty-command error (step 3).
    code, _, err = invoke(["run", "--"], capsys)
    assert code == 2 and "refusing to launch incompatible extension 'org.test.p'" in err


def test_bad_user_configuration_is_incompatible(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    install(site, {"org.test.p": BASE})
    set_state(
        tmp_path, {"org.test.p": {"enabled": True, "configuration": {"launch_options": {"x": 1}}}}
    )
    shown = status("org.test.p", capsys)
    assert shown["states"] == ["installed", "discovered", "incompatible"]
    assert shown["evidence"] == ["unsupported vLLM launch_options: ['x']"]


PROFILE = {"accelerator": "ascend", "tensor_parallel_size": 4}


@pytest.mark.parametrize(
    ("profile", "observed", "state", "evidence", "refusal"),
    [
        (PROFILE, None, "degraded", "required runtime qualification is unavailable",
         "refusing to launch unverified trusted in-process extension 'org.test.p': "),
        # Every profile key matches, but the operator's run did not pass.
        (PROFILE, {"status": "failed", **PROFILE}, "degraded",
         "required runtime qualification is unavailable",
         "refusing to launch unverified trusted in-process extension 'org.test.p': "),
        (
            PROFILE,
            {"status": "passed", "accelerator": "cuda", "tensor_parallel_size": 4},
            "incompatible",
            "runtime qualification profile mismatch: {'accelerator': ('ascend', 'cuda')}",
            "refusing to launch incompatible extension 'org.test.p': ",
        ),
        # A profile key the operator's object leaves out differs too (expected, None).
        (
            PROFILE,
            {"status": "passed", "accelerator": "ascend"},
            "incompatible",
            "runtime qualification profile mismatch: {'tensor_parallel_size': (4, None)}",
            "refusing to launch incompatible extension 'org.test.p': ",
        ),
        # JSON true is not 4 nor 1: a boolean never matches a number (Python: True == 1).
        (
            {"accelerator": "ascend", "tensor_parallel_size": 1},
            {"status": "passed", "accelerator": "ascend", "tensor_parallel_size": True},
            "incompatible",
            "runtime qualification profile mismatch: {'tensor_parallel_size': (1, True)}",
            "refusing to launch incompatible extension 'org.test.p': ",
        ),
        (
            "ascend",
            {"status": "passed"},
            "incompatible",
            "manifest runtime qualification profile is invalid",
            "refusing to launch incompatible extension 'org.test.p': ",
        ),
    ],
)
def test_qualification_profile_refusals(
    site: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    profile: object,
    observed: dict[str, Any] | None,
    state: str,
    evidence: str,
    refusal: str,
) -> None:
    """A trusted in-process bundle is refused with manager-protocol.md §6.2's own text:
    incompatible, or (qualification unavailable) unverified; there is no fifth refusal."""
    document = _with(
        BASE, activation__additional_config={"_manager_runtime_qualification": profile}
    )
    install(site, {"org.test.p": document})
    configuration = {**DECLARED, **({"runtime_qualification": observed} if observed else {})}
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": configuration}})
    shown = status("org.test.p", capsys)
    assert state in shown["states"] and any(evidence in line for line in shown["evidence"])
    code, _, err = invoke(["run", "--dry-run", "--", "true"], capsys)
    assert code == 2 and refusal in err and evidence in err


def test_an_unqualified_external_service_bundle_is_not_refused(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§6.2 refuses a missing qualification (an unknown result) only for a trusted
    in-process runtime; a bundle isolated as an external service is degraded, not refused."""
    document = _with(
        BASE,
        activation__additional_config={"_manager_runtime_qualification": PROFILE},
        runtime__isolation="external_service",
    )
    install(site, {"org.test.p": document})
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": DECLARED}})
    assert "degraded" in status("org.test.p", capsys)["states"]
    code, _, err = invoke(["run", "--dry-run", "--", "true"], capsys)
    assert code == 0, err


def test_passed_qualification_passes_the_reserved_key_to_the_host(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = _with(
        BASE, activation__additional_config={"_manager_runtime_qualification": PROFILE, "k": 1}
    )
    install(site, {"org.test.p": document})
    observed = {"status": "passed", **PROFILE}
    set_state(
        tmp_path,
        {
            "org.test.p": {
                "enabled": True,
                "configuration": {**DECLARED, "runtime_qualification": observed},
            }
        },
    )
    assert "compatible" in status("org.test.p", capsys)["states"]
    code, out, err = invoke(["run", "--dry-run", "--", "h", '--additional-config={"z": 0}'], capsys)
    assert code == 0, err
    command = json.loads(out)["command"]
    reserved = json.dumps(
        {"_manager_runtime_qualification": PROFILE, "k": 1, "z": 0},
        separators=(",", ":"),
        sort_keys=True,
    )
    assert command[:2] == ["h", f"--additional-config={reserved}"]
    code, out, _ = invoke(["extension", "plan", "org.test.p"], capsys)
    assert json.loads(out)["generated_config"]["additional_config"] == {"k": 1}


def test_a_qualification_never_lifts_a_failed_check(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§5.2 rule 5 applies only when the check result is already true: a passed
    qualification cannot turn a host API outside the declared range into compatible."""
    document = _with(
        BASE, activation__additional_config={"_manager_runtime_qualification": PROFILE}
    )
    install(site, {"org.test.p": document})
    configuration = {
        **DECLARED,
        "host_api_version": "2.0",
        "runtime_qualification": {"status": "passed", **PROFILE},
    }
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": configuration}})
    shown = status("org.test.p", capsys)
    assert "incompatible" in shown["states"] and "compatible" not in shown["states"]
    assert "required runtime qualification profile passed" not in shown["evidence"]
    code, _, err = invoke(["run", "--dry-run", "--", "true"], capsys)
    assert code == 2 and "refusing to launch incompatible extension 'org.test.p'" in err


def _fake_host(site: Path, *, contract: bool) -> None:
    """An installed host distribution ``fakehost`` 9.1; its RECORD lists the preemption
    contract module only when ``contract``."""
    info = site / "fakehost-9.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakehost\nVersion: 9.1\n")
    listed = "vllm/v1/core/sched/preemption.py" if contract else "fakehost/__init__.py"
    (info / "RECORD").write_text(f"{listed},,\n")


@pytest.mark.parametrize("record", [b"fakehost/__init__.py,,\n\n", b"a,b,c,d\n"],
                         ids=["blank-row", "four-columns"])
def test_an_unreadable_host_record_is_one_line_naming_the_host(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], record: bytes
) -> None:
    """A host RECORD Python cannot read (a blank row or one of four columns raise
    TypeError inside importlib) leaves the protocol undetectable: ``status`` reports the
    bundle incompatible with that reason, and ``run`` refuses in one line naming the host,
    not with an internal error."""
    document = _with(BASE, host__name="fakehost", host__version_range=">=9,<10")
    install(site, {"org.test.p": document})
    _fake_host(site, contract=True)
    (site / "fakehost-9.1.dist-info" / "RECORD").write_bytes(record)
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": {}}})
    shown = status("org.test.p", capsys)
    assert "incompatible" in shown["states"]
    assert "host distribution 'fakehost' RECORD cannot be read" in shown["evidence"][0]
    for argv in (["run", "--dry-run", "--", "true"], ["run", "--", "true"]):
        code, _, err = invoke(argv, capsys)
        assert code == 2, (argv, err)
        last = err.splitlines()[-1]
        assert "host distribution 'fakehost' RECORD cannot be read" in last, err
        assert "internal error" not in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("environment", "named"),
    [
        ({"A=B": "x"}, "environment variable name 'A=B' cannot be exported"),
        ({"": "x"}, "environment variable name '' cannot be exported"),
        ({"A\0": "x"}, "environment variable name 'A\\x00' cannot be exported"),
        ({"A": "x\0y"}, "environment variable 'A' cannot be exported: its value holds a NUL"),
    ],
)
def test_an_environment_no_process_can_hold_is_refused_before_launch(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    environment: dict[str, str], named: str,
) -> None:
    """Manifest 0.2 takes any string as an activation variable, but a name that is empty
    or holds '=' or NUL, or a value holding NUL, cannot reach a process: ``status``, a dry
    run and ``run`` refuse it naming the variable (it used to pass every check and fail at
    exec with "embedded null byte" or "illegal environment variable name")."""
    document = _with(BASE)
    document["activation"]["environment"] = environment
    install(site, {"org.test.p": document})
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": DECLARED}})
    shown = status("org.test.p", capsys)
    assert "incompatible" in shown["states"] and named in shown["evidence"][0]
    for argv in (["run", "--dry-run", "--", "true"], ["run", "--", "true"]):
        code, _, err = invoke(argv, capsys)
        assert code == 2, (argv, err)
        assert named in err.splitlines()[-1], (argv, err)


@pytest.mark.parametrize(
    ("contract", "declared", "state", "line"),
    [
        (True, None, "compatible",
         "protocol vllm.preemption-policy 1.0 satisfies the declared range"),
        (True, "2.0", "incompatible", "protocol vllm.preemption-policy 2.0 is outside >=1,<2"),
        (False, None, "degraded", "protocol vllm.preemption-policy version is unavailable"),
    ],
    ids=["detected", "configuration-overrides", "host-without-contract"],
)
def test_the_host_and_its_protocol_are_detected_from_package_metadata(
    site: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    contract: bool,
    declared: str | None,
    state: str,
    line: str,
) -> None:
    """§5.2 steps 1 and 3, with nothing configured: the host version is the installed
    ``host.name`` distribution's, and the preemption protocol is "1.0" exactly when that
    distribution's RECORD lists the contract module; ``protocol_versions`` overrides it."""
    document = _with(BASE, host__name="fakehost", host__version_range=">=9,<10")
    install(site, {"org.test.p": document})
    _fake_host(site, contract=contract)
    configuration = {} if declared is None else {
        "protocol_versions": {"vllm.preemption-policy": declared}}
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": configuration}})
    shown = status("org.test.p", capsys)
    assert state in shown["states"]
    assert shown["evidence"][:3] == [
        "host version 9.1 satisfies the declared range",
        "host API 1.0 satisfies the declared range",
        line,
    ]


def _fake_editable_host(site: Path, source: Path, *, direct_url: str | None = None) -> None:
    """``fakehost`` 9.1 installed editable from ``source``: its RECORD lists only the
    editable hook, as pip's PEP 660 installs do, and direct_url.json names the tree."""
    info = site / "fakehost-9.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakehost\nVersion: 9.1\n")
    (info / "RECORD").write_text("__editable__.fakehost-9.1.pth,,\n")
    if direct_url is None:
        direct_url = json.dumps({"url": source.as_uri(), "dir_info": {"editable": True}})
    (info / "direct_url.json").write_text(direct_url)


@pytest.mark.parametrize("contract", [True, False], ids=["ships-contract", "stock"])
def test_an_editable_host_is_detected_from_its_source_tree(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], contract: bool
) -> None:
    """§5.2 step 3 on a host installed from source (``pip install -e``): its RECORD lists no
    package files, so the contract module is looked for in the source tree direct_url.json
    names. With it there the protocol is detected and ``run`` renders
    ``--preemption-policy`` for ``vllm serve``; without it the version is unavailable, as
    for any stock vLLM."""
    document = _with(BASE, host__name="fakehost", host__version_range=">=9,<10")
    install(site, {"org.test.p": document})
    source = tmp_path / "vllm-hust"
    _fake_editable_host(site, source)
    if contract:
        module = source / "vllm" / "v1" / "core" / "sched" / "preemption.py"
        module.parent.mkdir(parents=True)
        module.write_text("")
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": {}}})
    shown = status("org.test.p", capsys)
    line = ("protocol vllm.preemption-policy 1.0 satisfies the declared range" if contract
            else "protocol vllm.preemption-policy version is unavailable")
    assert shown["evidence"][2] == line
    assert ("compatible" in shown["states"]) is contract
    if contract:
        code, out, err = invoke(["run", "--dry-run", "--", "vllm", "serve", "m"], capsys)
        assert code == 0, err
        command = json.loads(out)["command"]
        assert command[command.index("--preemption-policy") + 1] == (
            "bidkv_ext.selector.BidkvPreemptionPolicy")


@pytest.mark.parametrize("tree", ["not-json", "name-too-long"])
def test_an_editable_host_with_an_invalid_direct_url_can_still_be_declared(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], tree: str
) -> None:
    """An editable host whose direct_url.json is not JSON names no source tree, and one
    naming a tree whose path the file system cannot even look at (a name too long, where
    Python 3.11's ``is_file`` raises) has none either: the contract is not detected (the
    version is unavailable), and a declared ``protocol_versions`` still makes the bundle
    compatible, as on any host without it."""
    document = _with(BASE, host__name="fakehost", host__version_range=">=9,<10")
    install(site, {"org.test.p": document})
    direct_url = "{not json" if tree == "not-json" else json.dumps(
        {"url": (tmp_path / ("x" * 300)).as_uri(), "dir_info": {"editable": True}})
    _fake_editable_host(site, tmp_path, direct_url=direct_url)
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": {}}})
    shown = status("org.test.p", capsys)
    assert shown["evidence"][2] == "protocol vllm.preemption-policy version is unavailable"
    assert "degraded" in shown["states"]
    declared = {"protocol_versions": {"vllm.preemption-policy": "1.0"}}
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": declared}})
    assert "compatible" in status("org.test.p", capsys)["states"]


def test_a_null_protocol_range_accepts_any_version(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§5.2 step 3: a protocol declared with ``version_range: null`` (not independently
    versioned) is satisfied by whatever version is detected or declared."""
    document = _with(BASE, protocols=[{"name": "vllm.preemption-policy", "version_range": None}])
    install(site, {"org.test.p": document})
    configuration = {**DECLARED, "protocol_versions": {"vllm.preemption-policy": "7.3"}}
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": configuration}})
    shown = status("org.test.p", capsys)
    assert "compatible" in shown["states"]
    assert "protocol vllm.preemption-policy 7.3 satisfies the declared range" in shown["evidence"]


def test_a_descriptor_only_bundle_enabled_in_the_state_file_is_never_launched(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§5.2 rule 6 and §6.2: a blocked bundle is not configured and is degraded, the blocker
    last in its evidence, even when its host checks pass; ``run`` refuses it first with
    ``refusing to launch '<id>': <blocker>``, also when a state file (hand-edited, or written
    before the bundle's upgrade) has it enabled although ``enable`` would refuse."""
    document = _with(BASE)
    document["implementation"][0]["status"] = "import_only"
    install(site, {"org.test.p": document})
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": DECLARED}})
    shown = status("org.test.p", capsys)
    assert shown["states"] == ["installed", "discovered", "compatible", "enabled", "degraded"]
    assert "descriptor-only" in shown["evidence"][-1]
    code, _, err = invoke(["run", "--dry-run", "--", "true"], capsys)
    assert code == 2
    assert err.splitlines()[-1].startswith(
        "vllm-hust-ext: error: refusing to launch 'org.test.p': Python implementation carriers "
        "are descriptor-only"
    )


def _install_with_service(site: Path, **extra: Any) -> None:
    """Bundle ``org.test.p`` needing HTTP service ``kv`` whose health URL is configured
    as ``health_url``."""
    service = {"service_id": "kv", "protocol": "http", "version_range": None,
               "endpoint_config": "health_url", **extra}
    document = _with(BASE, requires_services=[service], runtime__isolation="external_service")
    install(site, {"org.test.p": document})


def test_unhealthy_required_service_refuses_run(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _install_with_service(site)
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": DECLARED}})
    shown = status("org.test.p", capsys)
    assert "degraded" in shown["states"] and "reachable" not in shown["states"]
    code, _, err = invoke(["run", "--dry-run", "--", "true"], capsys)
    assert code == 2
    assert "refusing to launch 'org.test.p': required service health is not verified (kv)" in err


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/ok" else 500)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[str]:
    """A real HTTP server on loopback: /ok answers 200, anything else 500."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(("path", "reachable", "healthy", "finding"), [
    ("/ok", True, True, "is healthy"),
    ("/fail", True, False, "is unhealthy: HTTP 500"),
    ("file:///etc/hostname", False, False, "must be an http:// or https:// URL"),
])
def test_service_health_separates_reachable_from_healthy(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], health_server: str,
    path: str, reachable: bool, healthy: bool, finding: str,
) -> None:
    """A server answering 500 is reachable but not healthy (manager-protocol.md §5.1 keeps
    the two states apart); an endpoint that is not http(s) is evidence, not a crash."""
    _install_with_service(site)
    url = path if ":" in path else health_server + path
    set_state(tmp_path, {"org.test.p": {
        "enabled": True, "configuration": {**DECLARED, "health_url": url}}})
    shown = status("org.test.p", capsys)
    assert ("reachable" in shown["states"]) is reachable
    assert ("healthy" in shown["states"]) is healthy
    assert ("degraded" in shown["states"]) is not healthy  # reachable is not enough
    assert any(line.startswith(f"service kv at {url} is") and finding in line
               for line in shown["evidence"])
    code, _, err = invoke(["run", "--dry-run", "--", "true"], capsys)
    assert (code == 0) is healthy, err


def test_an_optional_service_is_evidence_but_never_refuses_run(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§6.2 refuses only *non-optional* services without ``healthy``: an optional service
    that is not even configured degrades status but the launch goes ahead."""
    _install_with_service(site, optional=True)
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": DECLARED}})
    shown = status("org.test.p", capsys)
    assert "degraded" in shown["states"] and "healthy" not in shown["states"]
    code, _, err = invoke(["run", "--dry-run", "--", "true"], capsys)
    assert code == 0, err


def test_one_unreachable_service_makes_the_bundle_unreachable(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], health_server: str
) -> None:
    """``reachable`` and ``healthy`` hold for all the services together: a healthy second
    service does not hide an unconfigured first one."""
    services = [
        {"service_id": sid, "protocol": "http", "version_range": None, "endpoint_config": key}
        for sid, key in (("kv1", "kv1_url"), ("kv2", "kv2_url"))
    ]
    document = _with(BASE, requires_services=services, runtime__isolation="external_service")
    install(site, {"org.test.p": document})
    configuration = {**DECLARED, "kv2_url": health_server + "/ok"}
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": configuration}})
    shown = status("org.test.p", capsys)
    assert "reachable" not in shown["states"] and "healthy" not in shown["states"]
    assert "service kv1 endpoint kv1_url is not configured" in shown["evidence"]
    code, _, err = invoke(["run", "--dry-run", "--", "true"], capsys)
    assert code == 2 and "required service health is not verified (kv1)" in err


# --- cross-bundle conflicts -----------------------------------------------------------


def _other(environment: dict[str, str]) -> dict[str, Any]:
    return _with(
        BASE,
        components=[],
        protocols=[],
        kind="in_process_plugin",
        runtime__isolation="external_service",
        activation__environment=environment,
    )


def test_bundles_with_different_variables_render_one_launch(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    install(site, {"org.test.p": BASE, "org.test.q": _other({"KVCACHED_X": "1"})})
    entry = {"enabled": True, "configuration": DECLARED}
    set_state(
        tmp_path,
        {
            "org.test.p": entry,
            "org.test.q": {"enabled": True, "configuration": {"host_version": "0.33.0"}},
        },
    )
    code, out, err = invoke(["run", "--dry-run", "--", "h"], capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["environment"]["KVCACHED_X"] == "1"
    assert plan["environment"]["BIDKV_UTILITY_ENABLE"] == "1"
    assert plan["environment"]["VLLMHUST_EXT_ENABLED_BUNDLES"] == "org.test.p,org.test.q"
    assert plan["command"] == [
        "h",
        "--preemption-policy",
        "bidkv_ext.selector.BidkvPreemptionPolicy",
    ]


def test_bundles_disagreeing_on_a_variable_are_refused(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    install(site, {"org.test.p": BASE, "org.test.q": _other({"BIDKV_UTILITY_ENABLE": "0"})})
    set_state(
        tmp_path,
        {
            "org.test.p": {"enabled": True, "configuration": DECLARED},
            "org.test.q": {"enabled": True, "configuration": {"host_version": "0.33.0"}},
        },
    )
    code, _, err = invoke(["run", "--dry-run", "--", "h"], capsys)
    assert code == 2
    assert (
        err.splitlines()[-1]
        == "vllm-hust-ext: error: enabled Bundles disagree on environment variable "
        "BIDKV_UTILITY_ENABLE"
    )
    code, _, err = invoke(["extension", "env"], capsys)
    assert code == 2 and "disagree on environment variable BIDKV_UTILITY_ENABLE" in err


@pytest.mark.parametrize(
    ("q_config", "error"),
    [
        ({"k": 1}, None),
        ({"k": 2}, "enabled Bundles disagree on additional_config key k"),
        # JSON true is not 1, though Python's == says True == 1.
        ({"k": True}, "enabled Bundles disagree on additional_config key k"),
    ],
    ids=["same-value", "different-value", "boolean-for-number"],
)
def test_bundles_may_share_an_additional_config_key_only_with_one_value(
    site: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    q_config: dict[str, Any],
    error: str | None,
) -> None:
    """§6.2 step 4 and §9 (per key): enabled bundles' additional_config keys merge; the same
    key with the same value is one claim, with different values it is refused."""
    p_document = _with(BASE, activation__additional_config={"k": 1, "p": True})
    q_document = _with(_other({}), activation__additional_config=q_config)
    install(site, {"org.test.p": p_document, "org.test.q": q_document})
    set_state(tmp_path, {
        "org.test.p": {"enabled": True, "configuration": DECLARED},
        "org.test.q": {"enabled": True, "configuration": {"host_version": "0.33.0"}},
    })
    code, out, err = invoke(["run", "--dry-run", "--", "h"], capsys)
    if error is None:
        assert code == 0, err
        assert json.loads(out)["command"][:3] == ["h", "--additional-config", '{"k":1,"p":true}']
    else:
        assert code == 2
        assert err.splitlines()[-1] == f"vllm-hust-ext: error: {error}"
    # `extension env` makes the same check: it never prints an environment `run` refuses.
    code, out, err = invoke(["extension", "env"], capsys)
    if error is None:
        assert code == 0, err
        assert json.loads(out)["VLLMHUST_EXT_ENABLED_BUNDLES"] == "org.test.p,org.test.q"
    else:
        assert (code, out) == (2, "")
        assert err.splitlines()[-1] == f"vllm-hust-ext: error: {error}"


def test_bundles_rendering_different_policies_conflict_by_name(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§9 (per key): two bundles rendering ``--preemption-policy`` with different values
    are refused naming both bundles and the option, before anything is merged."""
    other = _with(BASE)
    other["components"][0]["implementation_ref"] = "other_pkg.policy:Other"
    install(site, {"org.test.p": BASE, "org.test.q": other})
    set_state(tmp_path, {
        "org.test.p": {"enabled": True, "configuration": DECLARED},
        "org.test.q": {"enabled": True, "configuration": DECLARED},
    })
    code, _, err = invoke(["run", "--dry-run", "--", "h"], capsys)
    assert code == 2
    assert err.splitlines()[-1] == (
        "vllm-hust-ext: error: extensions 'org.test.p' and 'org.test.q' conflict on "
        "--preemption-policy"
    )
    # `extension env` refuses the same pair: its environment would launch neither.
    code, out, err = invoke(["extension", "env"], capsys)
    assert (code, out) == (2, "")
    assert err.splitlines()[-1] == (
        "vllm-hust-ext: error: extensions 'org.test.p' and 'org.test.q' conflict on "
        "--preemption-policy"
    )


def test_vllm_serve_by_path_is_refused_on_a_host_without_the_contract(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The stock-vLLM refusal (no ``--preemption-policy`` flag to render) recognises
    ``vllm serve`` also when ``vllm`` is given by its path, and names the command that
    runs it through the stock-vLLM adapter instead."""
    install(site, {"org.test.p": BASE})
    set_state(tmp_path, {"org.test.p": {"enabled": True, "configuration": DECLARED}})
    code, _, err = invoke(["run", "--dry-run", "--", "/opt/venv/bin/vllm", "serve", "m"], capsys)
    assert code == 2
    assert "the installed vLLM lacks the vllm.preemption-policy contract" in err
    assert err.splitlines()[-1].endswith(
        ": vllm-hust-ext run -- /opt/venv/bin/vllm serve m "
        "--scheduler-cls bidkv_ext.hosts.vllm.policy_scheduler")


def test_plugins_variable_lists_declared_plugins(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin = _with(
        _other({}), activation__entry_points=[{"group": "vllm.general_plugins", "name": "kvp"}]
    )
    install(site, {"org.test.q": plugin}, plugins={"kvp": "fakestatus.kvp_plugin"})
    set_state(
        tmp_path, {"org.test.q": {"enabled": True, "configuration": {"host_version": "0.33.0"}}}
    )
    monkeypatch.setenv("VLLM_PLUGINS", "mine")
    code, out, _ = invoke(["extension", "env"], capsys)
    assert code == 0
    assert json.loads(out)["VLLM_PLUGINS"] == "mine,ascend,kvp"


def test_plugins_variable_keeps_a_bundles_own_names_and_refuses_a_shared_plugin(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """§6.3: the names a bundle's environment puts in ``VLLM_PLUGINS`` come after the
    caller's and before ``ascend`` and the declared plugins; two enabled bundles declaring
    one plugin name are refused."""
    declares = [{"group": "vllm.general_plugins", "name": "kvp"}]
    plugin = _with(_other({"VLLM_PLUGINS": "fromenv,mine"}), activation__entry_points=declares)
    install(site, {"org.test.q": plugin, "org.test.r": _with(_other({}),
                   activation__entry_points=declares)}, plugins={"kvp": "fakestatus.kvp_plugin"})
    entry = {"enabled": True, "configuration": {"host_version": "0.33.0"}}
    set_state(tmp_path, {"org.test.q": entry, "org.test.r": {**entry, "enabled": False}})
    monkeypatch.setenv("VLLM_PLUGINS", "mine")
    code, out, err = invoke(["extension", "env"], capsys)
    assert code == 0, err
    assert json.loads(out)["VLLM_PLUGINS"] == "mine,fromenv,ascend,kvp"
    set_state(tmp_path, {"org.test.q": entry, "org.test.r": entry})
    code, _, err = invoke(["extension", "env"], capsys)
    assert code == 2
    assert err.splitlines()[-1] == (
        "vllm-hust-ext: error: enabled Bundles ['org.test.q', 'org.test.r'] both declare "
        "vLLM plugin 'kvp'"
    )


def _source_checkout(site: Path, document: dict[str, Any]) -> Path:
    """A project checkout on ``sys.path`` whose ``.egg-info`` (left by setuptools) is the
    distribution found: SOURCES.txt lists the plugin module under ``src/``."""
    info = _metadata(site / "fake_src.egg-info", "fake-src",
                     "[vllm_hust.extension_bundles]\norg.test.q = fakesrcb.b0\n"
                     "[vllm.general_plugins]\nkvp = fakesrc.kvp_plugin:register\n")
    manifest = site / "fakesrcb" / "b0" / "vllm-hust-extension-v0.2.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({**document, "extension_id": "org.test.q"}))
    module = site / "src" / "fakesrc" / "kvp_plugin.py"
    module.parent.mkdir(parents=True)
    module.write_text("def register() -> None:\n    pass\n")
    (info / "SOURCES.txt").write_text(
        "pyproject.toml\nfakesrcb/b0/vllm-hust-extension-v0.2.json\n"
        "src/fakesrc/kvp_plugin.py\n")
    return module


def test_a_source_checkouts_egg_info_ships_its_src_modules(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run from a project checkout (``python -m hust_ext_manager`` puts it on sys.path),
    the checkout's ``.egg-info`` is the distribution found, and its SOURCES.txt names
    modules by their place under ``src/``: a declared plugin module there counts as
    shipped, and one missing from the tree still does not."""
    plugin = _with(
        _other({}), activation__entry_points=[{"group": "vllm.general_plugins", "name": "kvp"}]
    )
    module = _source_checkout(site, plugin)
    set_state(tmp_path, {"org.test.q": {"enabled": True,
                                       "configuration": {"host_version": "0.33.0"}}})
    code, out, _ = invoke(["extension", "list", "--json"], capsys)
    [listed] = [d for d in json.loads(out) if d["bundle_id"] == "org.test.q"]
    assert code == 0 and "discovery_error" not in listed, listed
    assert listed["distribution"] == "fake-src"
    module.unlink()
    code, out, _ = invoke(["extension", "list", "--json"], capsys)
    [listed] = [d for d in json.loads(out) if d["bundle_id"] == "org.test.q"]
    assert listed["valid"] is False
    assert listed["discovery_error"].endswith(
        "targets module 'fakesrc.kvp_plugin', which distribution 'fake-src' does not contain")


def test_an_installed_record_is_not_searched_under_src(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An installed distribution (it has a RECORD) ships only the module paths its RECORD
    lists: a file of that name under ``src/`` beside it is not the module vLLM imports."""
    plugin = _with(
        _other({}), activation__entry_points=[{"group": "vllm.general_plugins", "name": "kvp"}]
    )
    install(site, {"org.test.q": plugin}, plugins={"kvp": "fakestatus.gone"})
    (site / "fakestatus" / "gone.py").unlink()
    (site / "src" / "fakestatus").mkdir(parents=True)
    (site / "src" / "fakestatus" / "gone.py").write_text("def register() -> None:\n    pass\n")
    # Even with a SOURCES.txt naming it there: the RECORD is what was installed.
    (site / "fake_status-1.0.dist-info" / "SOURCES.txt").write_text("src/fakestatus/gone.py\n")
    set_state(tmp_path, {"org.test.q": {"enabled": True,
                                       "configuration": {"host_version": "0.33.0"}}})
    _, out, _ = invoke(["extension", "list", "--json"], capsys)
    [listed] = [d for d in json.loads(out) if d["bundle_id"] == "org.test.q"]
    assert listed["valid"] is False


@pytest.mark.parametrize(("plugins", "why"), [
    ({}, "is not published by distribution 'fake-status'"),
    ({"kvp": "fakestatus.gone"}, "targets module 'fakestatus.gone', which distribution "
                                 "'fake-status' does not contain"),
])
def test_a_declared_plugin_must_be_the_bundles_own(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    plugins: dict[str, str], why: str,
) -> None:
    """manager-protocol.md §2 (newer managers): a vllm.general_plugins entry point the
    manifest declares must be published by the bundle's distribution, its module file
    present; otherwise VLLM_PLUGINS would name a plugin vLLM never finds. Nothing is
    imported to tell."""
    plugin = _with(
        _other({}), activation__entry_points=[{"group": "vllm.general_plugins", "name": "kvp"}]
    )
    install(site, {"org.test.q": plugin}, plugins=plugins)
    if plugins:
        (site / "fakestatus" / "gone.py").unlink()
    set_state(
        tmp_path, {"org.test.q": {"enabled": True, "configuration": {"host_version": "0.33.0"}}}
    )
    code, out, _ = invoke(["extension", "list", "--json"], capsys)
    [listed] = [d for d in json.loads(out) if d["bundle_id"] == "org.test.q"]
    assert listed["valid"] is False
    assert listed["discovery_error"] == (
        f"'org.test.q' activation entry point vllm.general_plugins:kvp {why}")
    code, _, err = invoke(["run", "--dry-run", "--", "true"], capsys)
    assert code == 2 and why in err


@pytest.mark.parametrize(
    "shipped",
    ["fakestatus/kvp_plugin/__init__.py", "fakestatus/kvp_plugin.cpython-312-x86_64-linux-gnu.so"],
    ids=["package", "extension-module"],
)
def test_a_declared_plugin_may_ship_as_a_package_or_an_extension_module(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], shipped: str
) -> None:
    """The plugin's target module counts as shipped when the RECORD lists it as a package
    (``__init__.py``) or a compiled extension, not only as ``<module>.py``; the file is only
    looked at, never imported (the ``.so`` here is empty)."""
    plugin = _with(
        _other({}), activation__entry_points=[{"group": "vllm.general_plugins", "name": "kvp"}]
    )
    install(site, {"org.test.q": plugin}, plugins={"kvp": "fakestatus.kvp_plugin"})
    (site / "fakestatus" / "kvp_plugin.py").unlink()
    (site / shipped).parent.mkdir(parents=True, exist_ok=True)
    (site / shipped).write_bytes(b"")
    record = site / "fake_status-1.0.dist-info" / "RECORD"
    record.write_text(record.read_text().replace("fakestatus/kvp_plugin.py", shipped))
    set_state(
        tmp_path, {"org.test.q": {"enabled": True, "configuration": {"host_version": "0.33.0"}}}
    )
    code, out, err = invoke(["extension", "env"], capsys)
    assert code == 0, err
    assert "kvp" in json.loads(out)["VLLM_PLUGINS"].split(",")


def test_a_declared_platform_plugin_must_be_the_bundles_own_too(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The ownership rule covers ``vllm.platform_plugins`` as well as general plugins: the
    same name published only as a general plugin does not satisfy a platform declaration."""
    plugin = _with(
        _other({}), activation__entry_points=[{"group": "vllm.platform_plugins", "name": "kvp"}]
    )
    install(site, {"org.test.q": plugin}, plugins={"kvp": "fakestatus.kvp_plugin"})
    code, out, err = invoke(["extension", "list", "--json"], capsys)
    assert code == 0, err
    [listed] = [d for d in json.loads(out) if d["bundle_id"] == "org.test.q"]
    assert listed["discovery_error"] == (
        "'org.test.q' activation entry point vllm.platform_plugins:kvp is not published by "
        "distribution 'fake-status'"
    )


def test_a_malformed_plugin_entry_point_value_is_the_bundles_own_diagnostic(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A declared plugin whose entry point value in the distribution's entry_points.txt
    names no module (``kvp = !!!``) makes that bundle invalid, with a line naming the entry
    point and its value; ``list`` still lists the other bundles (it used to abort with
    "internal error: AttributeError") and strict discovery of the bundle is one line."""
    plugin = _with(
        _other({}), activation__entry_points=[{"group": "vllm.general_plugins", "name": "kvp"}]
    )
    install(site, {"org.test.p": BASE, "org.test.q": plugin},
            plugins={"kvp": "fakestatus.kvp_plugin"})
    entry_points = site / "fake_status-1.0.dist-info" / "entry_points.txt"
    entry_points.write_text(
        entry_points.read_text().replace("kvp = fakestatus.kvp_plugin:register", "kvp = !!!"))
    why = ("'org.test.q' activation entry point vllm.general_plugins:kvp has the value '!!!' "
           "in distribution 'fake-status''s entry_points.txt: expected 'module:attribute'")
    code, out, err = invoke(["extension", "list", "--json"], capsys)
    assert code == 0, err
    listed = {d["bundle_id"]: d for d in json.loads(out)}
    assert listed["org.test.p"]["bundle_version"] == BASE["extension_version"]
    assert listed["org.test.q"] == {
        "bundle_id": "org.test.q", "discovery_error": why, "valid": False}
    code, out, err = invoke(["extension", "list"], capsys)
    assert code == 0
    assert out.startswith("org.test.p ")
    assert err.splitlines() == [f"org.test.q invalid {why}"]
    code, _, err = invoke(["extension", "inspect", "org.test.q"], capsys)
    assert code == 2 and err.splitlines()[-1] == f"vllm-hust-ext: error: {why}"


def test_only_the_vllm_provider_is_served(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    install(site, {"org.test.m": _with(_other({}), host__provider="mooncake")})
    code, _, err = invoke(["extension", "status", "org.test.m"], capsys)
    assert code == 2
    assert "no Host Provider named 'mooncake' is installed for 'org.test.m'" in err
