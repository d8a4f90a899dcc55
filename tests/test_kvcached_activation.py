"""The ``org.vllm-hust.kvcached`` manifest and its launch rendering, alone and beside BidKV.

Runs the real ``vllm-hust-ext`` console script (the manager distribution installed in this
venv; the tests skip, saying so, only when the script is missing). kvcached cannot be
installed here, so the "GPU host" cases fake the installed state at the metadata boundary:
a throw-away venv (``--without-pip``) whose site-packages holds fake ``*.dist-info``
records for kvcached 0.1.6 (with ``kvcached/_C.abi3.so``), torch ``2.10.0+cu128`` and vLLM-HUST
``0.28.1rc1.dev319`` (whose RECORD lists the preemption contract module), plus a
placeholder ``kvcached_autopatch.pth``; a ``.pth`` there adds the project venv's
site-packages, so the real manager and this bundle run unchanged. Nothing is imported from
kvcached. Guarded: the manifest satisfies Manifest 0.2 (JSON Schema and the spec's rules);
the activation environment alone and with BidKV renders one consistent launch (no variable
in common); the per-instance ``KVCACHED_IPC_NAME`` override; on this CPU machine status is
degraded with our check lines and ``run`` refuses; a failing check makes ``run`` refuse
with its reason; ``run`` refuses a second launch under the name of an engine that is still
starting (a real process that loaded the bundle's plugin stands in for it), and under the
name of a ``run`` whose engine has not loaded the plugin yet.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import jsonschema
import pytest

ROOT = Path(__file__).resolve().parents[1]
MANIFEST_PATH = ROOT / "manifests/kvcached/vllm-hust-extension-v0.2.json"
MANIFEST = json.loads(MANIFEST_PATH.read_text(encoding="utf-8"))
BIDKV = json.loads((ROOT / "manifests/bidkv/vllm-hust-extension-v0.2.json").read_text())
SCHEMA = ROOT / "manifests/schema/vllm-hust-extension-v0.2.schema.json"
SCRIPT = Path(sys.executable).parent / "vllm-hust-ext"
KV = "org.vllm-hust.kvcached"
KV_ENV = {"ENABLE_KVCACHED": "true", "KVCACHED_AUTOPATCH": "1",
          "KVCACHED_IPC_NAME": "vllm_hust_kvcached"}

needs_manager = pytest.mark.skipif(
    not SCRIPT.exists(), reason=f"vllm-hust-ext console script not installed at {SCRIPT}")


def test_manifest_matches_the_schema() -> None:
    if not SCHEMA.exists():
        pytest.skip(f"Manifest 0.2 JSON Schema not present at {SCHEMA}")
    jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text())).validate(MANIFEST)


def test_manifest_values() -> None:
    assert MANIFEST["schema_version"] == "0.2-experimental"
    assert MANIFEST["extension_id"] == KV
    assert MANIFEST["kind"] == "in_process_plugin"
    assert MANIFEST["host"] == {"provider": "vllm", "name": "vllm",
                                "version_range": ">=0.17.0.dev0,<0.31"}
    assert MANIFEST["runtime"] == {"type": "python", "process_scope": "vllm-processes",
                                   "isolation": "trusted_in_process"}
    assert MANIFEST["requires_services"] == []
    assert MANIFEST["activation"]["environment"] == KV_ENV
    [carrier] = MANIFEST["implementation"]
    target = getattr(importlib.import_module(carrier["module"]), carrier["object"])
    assert callable(target) and carrier["status"] == "active"


def test_no_variable_shared_with_bidkv() -> None:
    ours = MANIFEST["activation"]
    theirs = BIDKV["activation"]
    assert not set(ours["environment"]) & set(theirs["environment"])
    assert not set(ours["additional_config"]) & set(theirs["additional_config"])


def manager(env: dict[str, str], *args: str, python: str = sys.executable
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.fixture
def base_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VLLM_", "KVCACHED_", "ENABLE_KVCACHED", "BIDKV_"))}
    env["VLLM_HUST_EXT_CONFIG"] = str(tmp_path / "config.json")
    return env


@needs_manager
def test_this_cpu_machine_is_degraded_and_run_refuses(base_env: dict[str, str]) -> None:
    assert manager(base_env, "extension", "enable", KV).returncode == 0
    status = json.loads(manager(base_env, "extension", "status", KV).stdout)
    assert "degraded" in status["states"]
    evidence = "\n".join(status["evidence"])
    assert "kvcached is not installed;" in evidence
    assert "is a CPU-only build" in evidence
    assert "kvcached_autopatch.pth is missing from site-packages" in evidence
    refused = manager(base_env, "run", "--dry-run", "--", "vllm", "serve", "m")
    assert refused.returncode == 2
    assert f"refusing to launch incompatible extension '{KV}'" in refused.stderr


def _fake_dist(site: Path, name: str, version: str, *files: str) -> None:
    info = site / f"{name}-{version.split('+')[0]}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in (f"{info.name}/METADATA", *files)))


@pytest.fixture
def gpu_host(tmp_path: Path) -> tuple[str, Path]:
    """A venv that looks like a GPU host with kvcached installed (metadata only)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = str(venv / "bin" / "python")
    site = Path(subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    project_site = sysconfig.get_paths()["purelib"]
    # addsitedir (not a bare path line) so the project's editable-install .pth files run too.
    (site / "zz_project.pth").write_text(f"import site; site.addsitedir({project_site!r})\n")
    _fake_dist(site, "kvcached", "0.1.6", "kvcached/_C.abi3.so", "kvcached_autopatch.pth")
    (site / "kvcached").mkdir()
    (site / "kvcached/_C.abi3.so").write_bytes(b"\x7fELF")
    (site / "kvcached_autopatch.pth").write_text("# placeholder for kvcached's import hook\n")
    _fake_dist(site, "torch", "2.10.0+cu128")
    _fake_dist(site, "vllm", "0.28.1rc1.dev319+g199e0bd", "vllm/v1/core/sched/preemption.py")
    return python, site


def _dry_run(env: dict[str, str], python: str) -> dict[str, object]:
    proc = manager(env, "run", "--dry-run", "--", "vllm", "serve", "m", python=python)
    assert proc.returncode == 0, proc.stderr
    rendered: dict[str, object] = json.loads(proc.stdout)
    return rendered


@needs_manager
def test_launch_alone_and_with_bidkv(gpu_host: tuple[str, Path], base_env: dict[str, str],
                                     tmp_path: Path) -> None:
    python, _ = gpu_host
    assert manager(base_env, "extension", "enable", KV, python=python).returncode == 0
    status = json.loads(manager(base_env, "extension", "status", KV, python=python).stdout)
    assert status["states"] == ["installed", "discovered", "compatible", "configured",
                                "enabled"], status
    alone = _dry_run(base_env, python)
    assert alone["command"] == ["vllm", "serve", "m"]
    assert alone["environment"] == {**KV_ENV, "VLLM_PLUGINS": "ascend,kvcached_provider",
                                    "VLLMHUST_EXT_ENABLED_BUNDLES": KV}

    assert manager(base_env, "extension", "enable", "org.vllm-hust.bidkv",
                   python=python).returncode == 0
    both = _dry_run(base_env, python)
    assert both["command"] == ["vllm", "serve", "m", "--preemption-policy",
                               "bidkv_ext.selector.BidkvPreemptionPolicy"]
    assert both["environment"] == {
        **KV_ENV, **BIDKV["activation"]["environment"],
        "VLLM_PLUGINS": "ascend,kvcached_provider",
        "VLLMHUST_EXT_ENABLED_BUNDLES": f"org.vllm-hust.bidkv,{KV}",
    }

    override = tmp_path / "instance.json"
    override.write_text(json.dumps({"environment": {"KVCACHED_IPC_NAME": "llama-8000"}}))
    assert manager(base_env, "extension", "configure", KV, "--file", str(override),
                   python=python).returncode == 0
    env = _dry_run(base_env, python)["environment"]
    assert isinstance(env, dict) and env["KVCACHED_IPC_NAME"] == "llama-8000"


@needs_manager
def test_failing_check_makes_run_refuse(gpu_host: tuple[str, Path], base_env: dict[str, str]
                                        ) -> None:
    python, site = gpu_host
    (site / "kvcached_autopatch.pth").unlink()
    assert manager(base_env, "extension", "enable", KV, python=python).returncode == 0
    status = json.loads(manager(base_env, "extension", "status", KV, python=python).stdout)
    assert "degraded" in status["states"]
    refused = manager(base_env, "run", "--dry-run", "--", "vllm", "serve", "m", python=python)
    assert refused.returncode == 2
    assert f"refusing to launch '{KV}'" in refused.stderr
    assert "kvcached_autopatch.pth is missing from site-packages" in refused.stderr


@pytest.fixture
def launch_env(gpu_host: tuple[str, Path], base_env: dict[str, str], tmp_path: Path
               ) -> tuple[str, dict[str, str]]:
    """The GPU-host venv's python and an environment with the bundle enabled and private
    kvcached-provider state and shm directories."""
    python, _ = gpu_host
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {**base_env, "KVCACHED_PROVIDER_STATE_DIR": str(tmp_path / "state"),
           "KVCACHED_PROVIDER_SHM_DIR": str(shm)}
    assert manager(env, "extension", "enable", KV, python=python).returncode == 0
    return python, env


@needs_manager
def test_run_refuses_the_name_of_a_starting_engine(launch_env: tuple[str, dict[str, str]]
                                                   ) -> None:
    python, env = launch_env
    assert manager(env, "run", "--dry-run", "--", "vllm", "serve", "m",
                   python=python).returncode == 0
    first = subprocess.Popen(  # loaded the plugin; kvcached has created no record yet
        [python, "-c", "import time, kvcached_provider.activation as a; a.register(); "
         "print('ready', flush=True); time.sleep(120)"],
        env={**env, **KV_ENV}, text=True, stdout=subprocess.PIPE)
    try:
        assert first.stdout is not None and first.stdout.readline() == "ready\n"
        refused = manager(env, "run", "--dry-run", "--", "vllm", "serve", "m", python=python)
        assert refused.returncode == 2
        assert f"refusing to launch '{KV}'" in refused.stderr
        assert (f"KVCACHED_IPC_NAME 'vllm_hust_kvcached' is claimed by pid {first.pid}"
                in refused.stderr)
    finally:
        first.kill()
        first.wait()
    assert manager(env, "run", "--dry-run", "--", "vllm", "serve", "m",
                   python=python).returncode == 0


@needs_manager
def test_run_holds_the_name_before_its_engine_loads_the_plugin(
    launch_env: tuple[str, dict[str, str]]
) -> None:
    """A real ``run`` whose child never loads the plugin (as an engine still importing
    vLLM): the name is claimed by the ``run`` process from its check on, so a second
    launch is refused naming it, and passes once the first ``run`` has ended. It used to
    pass: only the engine's plugin claimed the name."""
    python, env = launch_env
    first = subprocess.Popen(
        [python, str(SCRIPT), "run", "--", python, "-c",
         "import time; print('ready', flush=True); time.sleep(120)"],
        env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert first.stdout is not None and first.stdout.readline() == "ready\n"
        refused = manager(env, "run", "--dry-run", "--", "vllm", "serve", "m", python=python)
        assert refused.returncode == 2
        assert (f"KVCACHED_IPC_NAME 'vllm_hust_kvcached' is claimed by pid {first.pid} "
                in refused.stderr)
    finally:
        first.terminate()  # the manager forwards it to its child and exits 128 + 15
        first.communicate(timeout=60)
    assert first.returncode == 128 + 15
    assert manager(env, "run", "--dry-run", "--", "vllm", "serve", "m",
                   python=python).returncode == 0
