"""End to end through the real ``vllm-hust-ext`` console script, editable and wheel installs.

Guards the operator's whole path for the BidKV bundle: list, inspect, validate, enable,
status (fails closed on stock vLLM, compatible once the operator declares the protocol),
``run -- vllm serve`` refused on stock vLLM with the adapter hint, ``run --dry-run`` with
the exact rendered command, environment and native manifest, forget refused while
enabled, disable, forget.

Editable case: the project venv, where ``scripts/setup.sh`` installed the bundle with
``pip install -e .`` (discovery goes through ``direct_url.json``).

Wheel case: the bundle and the manager are built once per session with
``pip wheel --no-deps --no-build-isolation`` from a copy of their sources (so no build
directory lands in the checkout) and installed with ``pip --python <venv> install
--no-deps`` into a fresh ``python -m venv --without-pip`` environment. That venv sees the
manager's dependencies through a ``.pth`` file naming a directory of symlinks to exactly
those packages from the project venv, so the editable bundle stays hidden and discovery
must go through the wheel's RECORD. vLLM is not visible there, so that case declares
``host_version`` as well.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = "org.vllm-hust.bidkv"
POLICY = "bidkv_ext.selector.BidkvPreemptionPolicy"
ENVIRONMENT = {
    "BIDKV_UTILITY_CASCADE_GAIN_RATIO": "1.25",
    "BIDKV_UTILITY_ENABLE": "1",
    "BIDKV_UTILITY_LIVENESS_PREEMPTIONS": "8",
    "BIDKV_UTILITY_STRATEGY": "bidkv",
    "VLLMHUST_EXT_ENABLED_BUNDLES": BUNDLE,
}
NATIVE = {
    "schema_version": "1.0",
    "bundle_id": BUNDLE,
    "bundle_version": "0.1.0",
    "host_api_range": ">=1,<2",
    "components": [
        {
            "component_id": "victim-selector",
            "contracts": ["vllm.preemption-policy.v1"],
            "execution_planes": ["scheduler"],
            "isolation": "trusted_in_process",
            "implementation_ref": "bidkv_ext.selector:BidkvPreemptionPolicy",
            "permissions": [],
        }
    ],
}


def _closure(names: list[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions ``names`` need at run time (markers evaluated)."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        requirement = Requirement(todo.pop())
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        dist = importlib.metadata.distribution(requirement.name)
        key = dist.metadata["Name"].lower()
        if key not in seen:
            seen[key] = dist
            todo.extend(dist.requires or [])
    return list(seen.values())


def _link_dependencies(target: Path) -> None:
    target.mkdir()
    for dist in _closure(["packaging", "platformdirs", "jsonschema", "pydantic"]):
        tops = {
            Path(str(f)).parts[0]
            for f in dist.files or ()
            if not str(f).startswith("..")
            and ".dist-info" not in str(f)
            and "__pycache__" not in str(f)
        }
        for top in tops:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (target / top).exists():
                (target / top).symlink_to(source)


@pytest.fixture(scope="session")
def wheel_cli(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("wheel-venv")
    bundle_src, manager_src = work / "bundle-src", work / "manager-src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    bundle_src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, bundle_src / name)
    for name in ("src", "manifests"):
        shutil.copytree(ROOT / name, bundle_src / name, ignore=ignore)
    shutil.copytree(ROOT / "manager", manager_src, ignore=ignore)
    wheels = work / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels)]
    subprocess.run([*build, str(bundle_src), str(manager_src)], check=True, timeout=300)
    venv = work / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    _link_dependencies(work / "deps")
    Path(purelib, "manager-deps.pth").write_text(str(work / "deps") + "\n")
    install = [*pip, "--python", str(python), "install", "--no-deps", "--no-index"]
    subprocess.run([*install, *map(str, sorted(wheels.glob("*.whl")))], check=True, timeout=300)
    return venv / "bin" / "vllm-hust-ext"


class Cli:
    def __init__(self, executable: Path, config: Path) -> None:
        self.executable = executable
        self.env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.env["VLLM_HUST_EXT_CONFIG"] = str(config)

    def __call__(self, *args: str, code: int = 0) -> str:
        done = subprocess.run(
            [str(self.executable), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd="/",
        )
        assert done.returncode == code, (args, done.stdout, done.stderr)
        if code == 2:
            assert done.stderr.splitlines()[-1].startswith("vllm-hust-ext: error: ")
            assert "Traceback" not in done.stderr
            return done.stderr.splitlines()[-1]
        return done.stdout


def _operator_path(cli: Cli, tmp_path: Path, *, wheel: bool) -> dict[str, Any]:
    listed = cli("extension", "list").splitlines()
    assert f"{BUNDLE} 0.1.0 disabled" in listed
    # The kvcached bundle's declared vLLM plugin is found as the distribution ships it.
    assert "org.vllm-hust.kvcached 0.1.0 disabled" in listed
    listed = [d for d in json.loads(cli("extension", "list", "--json")) if d["bundle_id"] == BUNDLE]
    inspected = json.loads(cli("extension", "inspect", BUNDLE))
    assert listed == [inspected]
    assert json.loads(cli("extension", "validate", BUNDLE)) == inspected
    assert inspected["distribution"] == "vllm-hust-bidkv"
    assert inspected["activation_ready"] is True and inspected["experimental"] is True
    manifest_path = Path(inspected["manifest_path"])
    assert manifest_path.name == "vllm-hust-extension-v0.2.json"
    assert manifest_path.parent.parts[-2:] == ("manifests", "bidkv")

    assert cli("extension", "enable", BUNDLE) == f"enabled {BUNDLE}\n"
    status = json.loads(cli("extension", "status", BUNDLE))
    assert status["states"] == ["installed", "discovered", "configured", "enabled", "degraded"]
    unavailable = (
        "host version is unavailable; compatibility is unverified"
        if wheel
        else "protocol vllm.preemption-policy version is unavailable"
    )
    assert unavailable in status["evidence"]
    refusal = cli("run", "--dry-run", "--", "vllm", "serve", "m", code=2)
    assert "vllm.preemption-policy contract" in refusal and "--preemption-policy" in refusal
    assert "--scheduler-cls bidkv_ext.hosts.vllm.policy_scheduler" in refusal
    refusal = cli("run", "--dry-run", "--", "bidkv-replay", code=2)
    assert f"refusing to launch unverified trusted in-process extension {BUNDLE!r}" in refusal

    declared: dict[str, Any] = {"protocol_versions": {"vllm.preemption-policy": "1.0"}}
    if wheel:
        declared["host_version"] = "0.33.0"
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps(declared))
    assert (
        cli("extension", "configure", BUNDLE, "--file", str(settings)) == f"configured {BUNDLE}\n"
    )
    status = json.loads(cli("extension", "check", BUNDLE))
    assert list(status) == ["extension_id", "provider", "states", "evidence"]
    assert status["states"] == ["installed", "discovered", "compatible", "configured", "enabled"]
    assert status["evidence"] == [
        "host version 0.33.0 satisfies the declared range",
        "host API 1.0 satisfies the declared range",
        "protocol vllm.preemption-policy 1.0 satisfies the declared range",
        "vLLM launch configuration can be rendered",
    ]

    plan = json.loads(cli("run", "--dry-run", "--", "bidkv-replay", "--trace", "t.csv"))
    assert plan == {
        "command": ["bidkv-replay", "--trace", "t.csv", "--preemption-policy", POLICY],
        "environment": ENVIRONMENT,
        "native_extension_manifests": {BUNDLE: NATIVE},
    }
    assert json.loads(cli("extension", "env")) == ENVIRONMENT
    rendered = json.loads(cli("extension", "render", BUNDLE))
    assert [a["name"] for a in rendered] == ["vllm-extension-manifest.json", "vllm-launch.json"]
    assert json.loads(rendered[0]["content"]) == NATIVE

    forget = cli("extension", "forget", BUNDLE, code=2)
    assert forget == f"vllm-hust-ext: error: disable {BUNDLE!r} before forgetting its stored state"
    assert cli("extension", "disable", BUNDLE) == f"disabled {BUNDLE}\n"
    assert f"{BUNDLE} 0.1.0 disabled" in cli("extension", "list").splitlines()
    assert cli("extension", "forget", BUNDLE) == f"forgot {BUNDLE}\n"
    assert json.loads((tmp_path / "config.json").read_text())["extensions"] == {}
    assert cli("--version") == "vllm-hust-ext 0.1.0\n"
    return inspected


def test_editable_install(tmp_path: Path) -> None:
    cli = Cli(Path(sys.executable).with_name("vllm-hust-ext"), tmp_path / "config.json")
    inspected = _operator_path(cli, tmp_path, wheel=False)
    assert (
        Path(inspected["manifest_path"])
        == ROOT / "manifests" / "bidkv" / "vllm-hust-extension-v0.2.json"
    )


def test_wheel_install(wheel_cli: Path, tmp_path: Path) -> None:
    cli = Cli(wheel_cli, tmp_path / "config.json")
    inspected = _operator_path(cli, tmp_path, wheel=True)
    site = Path(sysconfig.get_paths(vars={"base": str(wheel_cli.parents[1])})["purelib"])
    assert Path(inspected["manifest_path"]).is_relative_to(wheel_cli.parents[1])
    assert not Path(inspected["manifest_path"]).is_relative_to(ROOT)
    assert site.name == "site-packages"
