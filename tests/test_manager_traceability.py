"""Clauses of manager-protocol.md that no other manager test pinned (a traceability audit).

Guards, each by the clause it names:

- §1.2 ``runtime``: ``process_scope`` and ``isolation`` are free but *non-empty* strings; a
  whitespace-only one is refused (``runtime.<key> must be a non-empty string``).
- §2 discovery: each of the three accepted manifest file names is found on its own;
  strict resolution with no requested ids returns every bundle sorted by id (not in
  registration order); a registration whose entry point has no distribution is refused
  with ``'<id>' has no distribution metadata`` (strict) and is a diagnostic in ``list``.
- §5.2 step 5: a bundle whose qualification profile has no passed user qualification is
  unverified with the exact text ``matching source contracts are insufficient; required
  runtime qualification is unavailable``.
- §1.4 renderers: ``vllm.batch-admission-policy.v1`` renders ``--batch-admission-policy``
  and ``vllm.worker-class.v1`` renders ``--worker-cls`` (``:`` becomes ``.``), and another
  contract renders nothing, in the plan and in ``run``'s command.
- §6.2 step 5: ``launch_options.scheduler_reserve_output_budget: true`` puts
  ``--scheduler-reserve-output-budget`` into ``run``'s command, once, even when the caller
  already gave it.
- §6.3: ``VLLM_ECPA_PLAN_ID`` is a digest over the bundle ids, versions *and* manifest
  paths. A real launch's child gets the caller's environment plus every enabled bundle's
  activation variables and the native-manifest variables: ``VLLM_EXTENSION_MANIFESTS`` is
  the ``os.pathsep``-joined ``<i>-manifest.json`` paths (``indent=2``, sorted keys) in one
  ``vllm-hust-ext-*`` directory, ``VLLM_EXTENSION_BUNDLES`` the comma-joined ids.
- §6.5: a signal that arrives before the child exists is forwarded to it once it does;
  after the direct child exits, members left in its process group get SIGTERM first (not
  only SIGKILL at the grace deadline).

The CLI runs in-process through ``main(argv)``, except where the clause is about the
manager process itself (the console script in a real subprocess).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

import pytest
from hust_ext_manager import discovery, launch
from hust_ext_manager.runtime_evidence import launch_environment

from tests.manager_helpers import fake_site, install_bundles, invoke, wait_for_text

ROOT = Path(__file__).resolve().parents[1]
BASE: dict[str, Any] = json.loads(
    (ROOT / "manifests" / "bidkv" / "vllm-hust-extension-v0.2.json").read_text()
)
DECLARED = {"host_version": "0.33.0", "protocol_versions": {"vllm.preemption-policy": "1.0"}}
BUNDLE = "org.test.trace"
OTHER = "org.test.other"
POLICY = "bidkv_ext.selector.BidkvPreemptionPolicy"
CLI = str(Path(sys.executable).with_name("vllm-hust-ext"))
PY = sys.executable
_MANAGED = (
    "VLLM_HUST_EXT_EVIDENCE_PATH",
    "VLLM_ECPA_EVIDENCE_SINK",
    "VLLM_ECPA_EVIDENCE_STRICT",
    "VLLM_ECPA_PLAN_ID",
    "VLLM_ECPA_LAUNCH_ID",
    "VLLM_EXTENSION_MANIFESTS",
    "VLLM_EXTENSION_BUNDLES",
    "VLLM_PLUGINS",
    "VLLMHUST_EXT_ENABLED_BUNDLES",
)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return fake_site(tmp_path, monkeypatch, _MANAGED)  # a real launch owns _MANAGED


def install(site: Path, documents: dict[str, dict[str, Any]]) -> None:
    install_bundles(site, documents, name="fake-trace")


def enable(tmp_path: Path, configurations: dict[str, dict[str, Any]]) -> None:
    extensions = {k: {"enabled": True, "configuration": v} for k, v in configurations.items()}
    (tmp_path / "config.json").write_text(
        json.dumps({"schema_version": 2, "extensions": extensions})
    )


def with_(document: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A deep copy of ``document`` with ``section__key=value`` changes."""
    copy: dict[str, Any] = json.loads(json.dumps(document))
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        target = copy
        for part in parents:
            target = target[part]
        target[leaf] = value
    return copy


def last_error(err: str) -> str:
    lines = err.splitlines()
    assert lines and lines[-1].startswith("vllm-hust-ext: error: "), err
    return lines[-1].removeprefix("vllm-hust-ext: error: ")


# --- §1.2 runtime ---------------------------------------------------------------------


@pytest.mark.parametrize("key", ["process_scope", "isolation"])
def test_runtime_scope_and_isolation_must_be_non_empty_strings(
    site: Path, capsys: pytest.CaptureFixture[str], key: str
) -> None:
    """The two free runtime strings still follow §1.1's non-empty rule (``strip()``)."""
    install(site, {BUNDLE: with_(BASE, **{f"runtime__{key}": "  "})})
    code, _, err = invoke(["extension", "validate", BUNDLE], capsys)
    assert code == 2
    assert last_error(err) == (
        f"{BUNDLE!r} manifest is invalid: runtime.{key} must be a non-empty string"
    )


# --- §2 discovery -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "filename",
    ["vllm-hust-extension-v0.2.json", "vllm-hust-extension-v1.json", "extension-bundle-v1.json"],
)
def test_each_accepted_manifest_file_name_is_found_alone(
    site: Path, capsys: pytest.CaptureFixture[str], filename: str
) -> None:
    """Any one of the three names, listed in the RECORD, is the bundle's manifest."""
    install(site, {BUNDLE: BASE})
    default = "vllm-hust-extension-v0.2.json"
    folder = site / "faketrace" / "b0"
    (folder / default).rename(folder / filename)
    record = next(site.glob("*.dist-info")) / "RECORD"
    record.write_text(record.read_text().replace(default, filename))
    code, out, err = invoke(["extension", "inspect", BUNDLE], capsys)
    assert code == 0, err
    assert Path(json.loads(out)["manifest_path"]) == folder / filename


def test_strict_discovery_of_every_bundle_is_sorted_by_id(site: Path) -> None:
    """§2: results come back sorted by id when no ids were requested, whatever order the
    distribution registers them in."""
    install(site, {"org.test.z": BASE, "org.test.a": BASE, "org.test.m": BASE})
    registered = [e.name for e in entry_points(group=discovery.BUNDLE_GROUP)]
    assert registered[:3] == ["org.test.z", "org.test.a", "org.test.m"]  # then the project's
    assert [b.bundle_id for b in discovery.discover()] == sorted(registered)


def test_a_registration_without_a_distribution_is_refused(
    site: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """§2: an entry point with no ``dist`` is ``'<id>' has no distribution metadata``:
    a one-line refusal for a strict verb, an ``invalid`` line for ``list``."""
    orphan = EntryPoint(name=BUNDLE, value="faketrace.b0", group=discovery.BUNDLE_GROUP)
    assert orphan.dist is None
    monkeypatch.setattr(discovery, "entry_points", lambda group: [orphan])
    code, _, err = invoke(["extension", "inspect", BUNDLE], capsys)
    assert code == 2
    assert last_error(err) == f"{BUNDLE!r} has no distribution metadata"
    code, out, err = invoke(["extension", "list"], capsys)
    assert code == 0 and out == ""
    assert err == f"{BUNDLE} invalid {BUNDLE!r} has no distribution metadata\n"


# --- §5.2 qualification ---------------------------------------------------------------


def test_a_profile_without_a_passed_qualification_is_unverified_with_the_spec_text(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Step 5: no user ``runtime_qualification`` (or one not ``passed``) leaves the result
    unknown, with the spec's whole sentence as the last check evidence."""
    profile = {"accelerator": "cpu"}
    install(
        site,
        {
            BUNDLE: with_(
                BASE, activation__additional_config={"_manager_runtime_qualification": profile}
            )
        },
    )
    expected = (
        "matching source contracts are insufficient; required runtime qualification is unavailable"
    )
    for observed in (None, {"status": "failed", **profile}):
        configuration = dict(DECLARED)
        if observed is not None:
            configuration["runtime_qualification"] = observed
        enable(tmp_path, {BUNDLE: configuration})
        code, out, err = invoke(["extension", "status", BUNDLE], capsys)
        assert code == 0, err
        shown = json.loads(out)
        assert shown["states"] == ["installed", "discovered", "configured", "enabled", "degraded"]
        assert shown["evidence"][-2:] == [expected, "vLLM launch configuration can be rendered"]


# --- §1.4 renderers, §6.2 step 5 flags --------------------------------------------------


def test_each_rendered_contract_gives_its_option_and_others_render_nothing(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Batch admission and worker class render their scalar options (``:`` -> ``.``) beside
    the preemption policy; a custom ``vllm.kv-cache-allocator.v1`` parses and renders
    nothing."""
    component = BASE["components"][0]
    components = [
        component,
        {
            **component,
            "component_id": "admission",
            "contracts": ["vllm.batch-admission-policy.v1"],
            "implementation_ref": "pkg.admission:Admit",
        },
        {
            **component,
            "component_id": "worker",
            "contracts": ["vllm.worker-class.v1"],
            "execution_planes": ["worker"],
            "implementation_ref": "pkg.worker:Worker.Inner",
        },
        {
            **component,
            "component_id": "allocator",
            "contracts": ["vllm.kv-cache-allocator.v1"],
            "implementation_ref": "pkg.alloc:Allocator",
        },
    ]
    install(site, {BUNDLE: with_(BASE, components=components)})
    enable(tmp_path, {BUNDLE: DECLARED})
    options = {
        "--batch-admission-policy": "pkg.admission.Admit",
        "--preemption-policy": POLICY,
        "--worker-cls": "pkg.worker.Worker.Inner",
    }
    code, out, err = invoke(["extension", "plan", BUNDLE], capsys)
    assert code == 0, err
    assert json.loads(out)["generated_config"]["vllm_options"] == options
    code, out, err = invoke(["run", "--dry-run", "--", "h"], capsys)
    assert code == 0, err
    rendered = [part for option in sorted(options.items()) for part in option]
    assert json.loads(out)["command"] == ["h", *rendered]


@pytest.mark.parametrize("given", [[], ["--scheduler-reserve-output-budget"]])
def test_a_true_reserve_output_budget_reaches_the_command_once(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], given: list[str]
) -> None:
    """The boolean launch option is a flag in ``run``'s command, appended once (not only an
    entry in the plan)."""
    install(site, {BUNDLE: BASE})
    launch_options = {"scheduler_reserve_output_budget": True}
    enable(tmp_path, {BUNDLE: {**DECLARED, "launch_options": launch_options}})
    code, out, err = invoke(["run", "--dry-run", "--", "h", *given], capsys)
    assert code == 0, err
    command = json.loads(out)["command"]
    assert command.count("--scheduler-reserve-output-budget") == 1
    assert sorted(command[1:]) == sorted(
        ["--preemption-policy", POLICY, "--scheduler-reserve-output-budget"]
    )


# --- §6.3 evidence binding and the child's environment ----------------------------------


def test_the_plan_id_covers_ids_versions_and_manifest_paths() -> None:
    """Same bundles, same plan id; a different id, version or manifest path, another one.
    The launch id is new every time."""
    bundle = ("org.test.a", "1.0", "/site/a/vllm-hust-extension-v0.2.json")
    first, again = launch_environment([bundle]), launch_environment([bundle])
    assert first["VLLM_ECPA_PLAN_ID"] == again["VLLM_ECPA_PLAN_ID"]
    assert first["VLLM_ECPA_LAUNCH_ID"] != again["VLLM_ECPA_LAUNCH_ID"]
    for changed in (
        ("org.test.b", *bundle[1:]),
        (bundle[0], "1.1", bundle[2]),
        (*bundle[:2], "/other/a/vllm-hust-extension-v0.2.json"),
    ):
        assert launch_environment([changed])["VLLM_ECPA_PLAN_ID"] != first["VLLM_ECPA_PLAN_ID"]


def test_a_real_launch_gives_the_child_activation_and_native_manifest_variables(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Child environment = caller + activation + evidence + native-manifest variables, with
    two enabled bundles: each bundle's variables, the enabled ids, and one native manifest
    file per bundle, named ``<i>-manifest.json``, joined with ``os.pathsep``."""
    environment = {**BASE["activation"]["environment"], "TRACE_OTHER": "other"}
    install(site, {BUNDLE: BASE, OTHER: with_(BASE, activation__environment=environment)})
    enable(tmp_path, {BUNDLE: DECLARED, OTHER: DECLARED})
    monkeypatch.setenv("TRACE_CALLER", "kept")
    code, out, err = invoke(["run", "--dry-run", "--", "h"], capsys)
    assert code == 0, err
    planned = json.loads(out)
    seen = tmp_path / "seen.json"
    child = (
        "import json, os\n"
        "paths = os.environ['VLLM_EXTENSION_MANIFESTS'].split(os.pathsep)\n"
        f"json.dump({{'env': dict(os.environ), 'files': [[p, open(p).read()] for p in paths]}}, "
        f"open({str(seen)!r}, 'w'))\n"
    )
    code, _, err = invoke(["run", "--", PY, "-c", child], capsys)
    assert code == 0, err
    shown = json.loads(seen.read_text())
    child_env: dict[str, str] = shown["env"]
    assert child_env["TRACE_CALLER"] == "kept"
    for name, value in planned["environment"].items():  # both bundles' variables, the ids
        assert child_env[name] == value, name
    assert child_env["TRACE_OTHER"] == "other"
    assert child_env["VLLMHUST_EXT_ENABLED_BUNDLES"] == f"{OTHER},{BUNDLE}"
    assert child_env["VLLM_EXTENSION_BUNDLES"] == f"{OTHER},{BUNDLE}"
    files = [(Path(path), text) for path, text in shown["files"]]
    assert [p.name for p, _ in files] == ["0-manifest.json", "1-manifest.json"]
    assert files[0][0].parent == files[1][0].parent
    assert files[0][0].parent.name.startswith("vllm-hust-ext-")
    native = planned["native_extension_manifests"]
    assert [text for _, text in files] == [
        json.dumps(native[bundle_id], indent=2, sort_keys=True) + "\n"
        for bundle_id in (OTHER, BUNDLE)
    ]


# --- §6.5 supervision -------------------------------------------------------------------


def test_one_signal_before_the_child_exists_is_forwarded_once_it_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM lands while the child is being spawned: the manager forwards it as soon as
    the child exists. The child starts with SIGTERM blocked (the mask survives exec), so
    the forwarded signal waits until its handler is in place, and the handler records it;
    without the forward the child would only be SIGKILLed at the grace deadline."""
    got = tmp_path / "got"
    real_popen = subprocess.Popen

    def block_term() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def popen_after_one_signal(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)  # handled by the manager's own handler
        return real_popen(*args, preexec_fn=block_term, **kwargs)  # type: ignore[call-overload]

    child = (
        "import signal, sys, time\n"
        f"def on(s, f):\n    open({str(got)!r}, 'w').write(str(s)); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, on)\n"
        "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})\n"
        "time.sleep(120)\n"
    )
    monkeypatch.setattr(subprocess, "Popen", popen_after_one_signal)  # as launch sees it
    code = launch.supervise([PY, "-c", child], dict(os.environ), grace=20.0)
    assert code == 128 + signal.SIGTERM
    assert got.read_text() == str(int(signal.SIGTERM))


def test_group_members_left_behind_get_sigterm_before_sigkill(tmp_path: Path) -> None:
    """The direct child exits on its own, leaving a grandchild in its process group; the
    manager sends the group SIGTERM, which the grandchild records, rather than leaving it
    to the SIGKILL at the (20 s) deadline. ``run`` exits with the child's status."""
    armed, got = tmp_path / "armed", tmp_path / "got"
    grandchild = (
        "import signal, sys, time\n"
        f"def on(s, f):\n    open({str(got)!r}, 'w').write(str(s)); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, on)\n"
        f"open({str(armed)!r}, 'w').write('1')\n"
        "time.sleep(120)\n"
    )
    child = (
        "import os, subprocess, sys, time\n"
        f"subprocess.Popen([{PY!r}, '-c', {grandchild!r}])\n"
        f"while not os.path.exists({str(armed)!r}):\n    time.sleep(0.01)\n"
        "sys.exit(3)\n"
    )
    environment = {**os.environ, "VLLM_HUST_EXT_CONFIG": str(tmp_path / "config.json")}
    for name in _MANAGED:
        environment.pop(name, None)
    done = subprocess.run(
        [CLI, "run", "--shutdown-grace-seconds", "20", "--", PY, "-c", child],
        env=environment,
        timeout=120,
    )
    assert done.returncode == 3
    assert wait_for_text(got) == str(int(signal.SIGTERM))
