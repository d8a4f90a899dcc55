"""Behaviour a mutation audit of the manager found unguarded (state file, manifest rules,
discovery, launch rendering and runtime evidence).

Each test pins one promise of manager-protocol.md or of the module it exercises, which a
small change to the code (a dropped check, a loosened comparison) broke without any other
test failing:

- an empty ``VLLM_HUST_EXT_CONFIG`` means the default state location, like an unset one;
- ``write_state`` given a symlinked path replaces the link's target and keeps the link;
- ``mutate_state`` through a link holds the lock of the file the link names, so two links
  to one state file share one lock;
- a falsy non-array ``components`` (``{}``, ``false``) means no components (§1.3: only a
  truthy non-array is refused);
- only activation entry points in vLLM's plugin groups must be the bundle's own (§2): one
  in another group is not looked up;
- strict resolution of requested ids ignores an unrelated broken bundle;
- ``--opt`` is found only as ``--opt V`` or ``--opt=V``, never as the prefix of a longer
  option (``--batch-admission-policy`` vs ``--batch-admission-policy-config``);
- ``--shutdown-grace-seconds 0`` is accepted (§6.5: must be >= 0);
- a JSON value the caller gave is never rewritten: ``true`` and ``1`` (equal in Python)
  are different values, so they conflict instead of one replacing the other;
- §5.1: an ``initialized`` line the manager's sink writes for a live process is no
  ``runtime_effective`` evidence (only its ``effective`` line is);
- an evidence log of exactly the tail window's size is read whole: its first line is not
  a torn one, and dropping it would lose a live process's evidence;
- the sink refuses a host-built event whose pid is a boolean.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hust_ext_manager import runtime_evidence
from hust_ext_manager.launch import merge_additional_config, merge_option
from hust_ext_manager.state import ExtensionState, State, load_state, mutate_state, write_state

from tests.lock_helpers import lock_is_held
from tests.manager_helpers import fake_site, install_bundles, invoke

ROOT = Path(__file__).resolve().parents[1]
BASE: dict[str, Any] = json.loads(
    (ROOT / "manifests" / "bidkv" / "vllm-hust-extension-v0.2.json").read_text()
)
CLI = str(Path(sys.executable).with_name("vllm-hust-ext"))
GOOD = "org.test.good"


def _empty_state(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema_version": 2, "extensions": {}}))


# --- state ----------------------------------------------------------------------------


def test_an_empty_config_variable_means_the_default_location(tmp_path: Path) -> None:
    """An empty ``VLLM_HUST_EXT_CONFIG`` is read as unset: the state goes to the platform's
    user config directory, not to a path named "" (the working directory)."""
    work = tmp_path / "work"
    work.mkdir()
    environment = {
        **os.environ,
        "VLLM_HUST_EXT_CONFIG": "",
        "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
    }
    done = subprocess.run(
        [CLI, "extension", "disable", "org.test.none"],
        env=environment, cwd=work, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    state = load_state(tmp_path / "xdg" / "vllm-hust-ext" / "config.json")
    assert "org.test.none" in state.extensions and not state.is_enabled("org.test.none")
    assert list(work.iterdir()) == []


def test_write_state_through_a_link_replaces_the_links_target(tmp_path: Path) -> None:
    target = tmp_path / "real" / "config.json"
    _empty_state(target)
    link = tmp_path / "config.json"
    link.symlink_to(target)
    write_state(State(extensions={"org.test.a": ExtensionState(enabled=True)}), link)
    assert link.is_symlink() and link.resolve() == target
    assert load_state(target).is_enabled("org.test.a")


def test_a_change_through_a_link_holds_the_lock_of_the_file_it_names(tmp_path: Path) -> None:
    """While the change runs, the lock beside the real file is taken: a second locker of
    that file (another link, or the path itself) must wait, so no update is lost."""
    target = tmp_path / "real" / "config.json"
    _empty_state(target)
    link = tmp_path / "config.json"
    link.symlink_to(target)
    probed: list[bool] = []

    def probe(state: State) -> State:
        probed.append(lock_is_held(target.with_name("config.json.lock")))
        return state

    mutate_state(probe, link)
    assert probed == [True]


# --- manifest and discovery -------------------------------------------------------------


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return fake_site(tmp_path, monkeypatch)


@pytest.mark.parametrize("components", [{}, False], ids=["empty-object", "false"])
def test_a_falsy_components_value_means_no_components(
    site: Path, capsys: pytest.CaptureFixture[str], components: object
) -> None:
    document = {**copy.deepcopy(BASE), "components": components}
    install_bundles(site, {GOOD: document})
    code, _, err = invoke(["extension", "validate", GOOD], capsys)
    assert code == 0, err
    code, out, err = invoke(["extension", "inspect", GOOD], capsys)
    assert code == 0, err
    assert json.loads(out)["components"] == []


def test_an_activation_entry_point_outside_the_plugin_groups_is_not_looked_up(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = copy.deepcopy(BASE)
    document["activation"]["entry_points"] = [{"group": "example.hooks", "name": "unpublished"}]
    install_bundles(site, {GOOD: document})
    code, _, err = invoke(["extension", "validate", GOOD], capsys)
    assert code == 0, err


def test_strict_resolution_ignores_an_unrelated_broken_bundle(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§2: strict resolution fails for the *requested* ids; a broken bundle nobody asked
    for does not stop ``validate`` or ``inspect`` of a good one."""
    install_bundles(site, {GOOD: BASE})
    install_bundles(site, {"org.test.broken": {**BASE, "kind": "nonsense"}}, name="fake-broken")
    for verb in ("validate", "inspect"):
        code, _, err = invoke(["extension", verb, GOOD], capsys)
        assert code == 0, err
    code, _, err = invoke(["extension", "validate", "org.test.broken"], capsys)
    assert code == 2 and "kind contains unsupported values" in err


# --- launch -----------------------------------------------------------------------------


def test_an_option_is_not_found_as_the_prefix_of_a_longer_one() -> None:
    command = ["vllm", "serve", "m", '--batch-admission-policy-config={"k":1}']
    policy = "pkg.mod.Admission"
    merged = merge_option(command, "--batch-admission-policy", policy, is_json=False)
    assert merged == [*command, "--batch-admission-policy", policy]


def test_a_zero_grace_is_accepted(tmp_path: Path) -> None:
    """§6.5: ``--shutdown-grace-seconds`` must be >= 0, so 0 (kill at once on a signal)
    is a valid choice, and a child that exits normally keeps its status."""
    environment = {**os.environ, "VLLM_HUST_EXT_CONFIG": str(tmp_path / "config.json")}
    done = subprocess.run(
        [CLI, "run", "--shutdown-grace-seconds", "0", "--", sys.executable, "-c",
         "raise SystemExit(3)"],
        env=environment, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 3, done.stderr


@pytest.mark.parametrize(
    ("given", "bundle"),
    [(1, True), (True, 1), (0, False), (1.0, True), ({"x": 1}, {"x": True}), ([1], [True]),
     ({"x": 1}, {"x": 1, "y": 2}), ({"x": 1, "y": 2}, {"x": 1}), ({"x": 1}, {"y": 1}),
     ([1], [1, 2]), ([1, 2], [1])],
    ids=["int-vs-true", "true-vs-int", "zero-vs-false", "float-vs-true", "nested", "list",
         "extra-key", "missing-key", "other-key", "longer-list", "shorter-list"],
)
def test_values_that_differ_as_json_conflict(given: object, bundle: object) -> None:
    """The caller's ``--additional-config`` value is never rewritten: ``1 == True`` in
    Python, but in JSON they are different values, so the key conflicts (§6.2 step 4);
    a JSON option the caller gave conflicts the same way (step 5). So do objects whose keys
    differ and lists that are longer or shorter, whatever their common part."""
    command = ["vllm", "--additional-config", json.dumps({"a": given})]
    with pytest.raises(ValueError, match=r"conflicts with additional_config keys: \['a'\]"):
        merge_additional_config(command, {"a": bundle})
    option = ["vllm", "--speculative-config", json.dumps({"a": given})]
    with pytest.raises(ValueError, match="extension activation conflicts with --speculative"):
        merge_option(option, "--speculative-config", {"a": bundle}, is_json=True)


def test_equal_json_values_still_merge_and_keep_the_callers_form() -> None:
    """Equal values are accepted; where the caller wrote ``1.0`` and a bundle ``1`` (one
    number), the caller's ``1.0`` is what the command keeps."""
    command = ["vllm", "--additional-config", '{"a": true, "b": [1, {"c": null}], "d": 1.0}']
    merged = merge_additional_config(
        command, {"a": True, "b": [1, {"c": None}], "d": 1, "e": "x"}
    )
    assert merged[-1] == '{"a":true,"b":[1,{"c":null}],"d":1.0,"e":"x"}'
    option = ["v", "--speculative-config", '{"k": [false, 2]}']
    assert merge_option(option, "--speculative-config", {"k": [False, 2]}, is_json=True) == option


# --- runtime evidence -------------------------------------------------------------------

DECLARED = {"protocol_versions": {"vllm.preemption-policy": "1.0"}, "host_version": "0.33.0"}


@pytest.fixture
def evidence(site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A good enabled bundle and this process bound as its engine (the sink's variables)."""
    path = tmp_path / "evidence.jsonl"
    monkeypatch.setenv("VLLM_HUST_EXT_EVIDENCE_PATH", str(path))
    monkeypatch.setenv("VLLM_ECPA_PLAN_ID", "p")
    monkeypatch.setenv("VLLM_ECPA_LAUNCH_ID", "l")
    monkeypatch.setenv("VLLMHUST_EXT_ENABLED_BUNDLES", GOOD)
    install_bundles(site, {GOOD: BASE})
    (tmp_path / "config.json").write_text(json.dumps(
        {"schema_version": 2, "extensions": {GOOD: {"enabled": True, "configuration": DECLARED}}}
    ))
    return path


def _states(capsys: pytest.CaptureFixture[str]) -> list[str]:
    code, out, err = invoke(["extension", "status", GOOD], capsys)
    assert code == 0, err
    states: list[str] = json.loads(out)["states"]
    return states


def test_an_initialized_line_from_the_sink_is_not_runtime_effective(
    evidence: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runtime_evidence.record_event("initialized", {})
    assert "runtime_effective" not in _states(capsys)
    runtime_evidence.record_event("effective", {})
    assert _states(capsys)[-1] == "runtime_effective"


def test_a_log_of_exactly_the_window_size_is_read_whole(
    evidence: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The live ``effective`` line comes first, then non-JSON padding up to exactly the
    1 MiB the reader takes from the end of the log."""
    runtime_evidence.record_event("effective", {})
    size = runtime_evidence._MAX_READ_BYTES
    first = evidence.stat().st_size
    filler = size - first - 1  # one padding line, with its newline, fills the window
    evidence.write_bytes(evidence.read_bytes() + b"#" * filler + b"\n")
    assert evidence.stat().st_size == size
    assert _states(capsys)[-1] == "runtime_effective"


def test_a_host_event_whose_pid_is_a_boolean_is_refused(
    evidence: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """JSON ``true`` is no process id (Python's bool is an int): the sink refuses such a
    host-built event and writes nothing."""
    runtime_evidence.record_event("effective", {})
    line = json.loads(evidence.read_text())
    line["process"]["pid"] = True
    with pytest.raises(ValueError, match="host evidence must be a bound"):
        runtime_evidence.record_event(line)
    assert len(evidence.read_text().splitlines()) == 1
