"""Packaging: the wheel ships the manifest at the entry point's directory, discovery finds it
through importlib.metadata without importing bidkv_ext, and versions agree everywhere."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
import zipfile
from importlib.metadata import version
from pathlib import Path

import jsonschema
import pytest

import bidkv_ext

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "manifests" / "bidkv" / "vllm-hust-extension-v0.2.json"
SCHEMA = ROOT / "manifests" / "schema" / "vllm-hust-extension-v0.2.schema.json"

DISCOVER = r"""
import json
from importlib.metadata import entry_points
(ep,) = [e for e in entry_points(group="vllm_hust.extension_bundles")
         if e.name == "org.vllm-hust.bidkv"]
rel = ep.value.replace(".", "/") + "/vllm-hust-extension-v0.2.json"
(entry,) = [f for f in ep.dist.files if str(f) == rel]
manifest = json.loads(ep.dist.locate_file(entry).read_text(encoding="utf-8"))
print(json.dumps({"id": manifest["extension_id"], "version": manifest["extension_version"],
                  "dist_version": ep.dist.version, "path": rel}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(ROOT)],
        check=True,
    )
    (built,) = out.glob("vllm_hust_bidkv-*.whl")
    return built


def test_wheel_contains_manifest_and_entry_point(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert "manifests/bidkv/vllm-hust-extension-v0.2.json" in names
        assert "bidkv_ext/selector.py" in names
        (ep_file,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points = zf.read(ep_file).decode()
    assert "[vllm_hust.extension_bundles]" in entry_points
    assert "org.vllm-hust.bidkv = manifests.bidkv" in entry_points


def test_the_wheels_entry_point_names_its_manifest_in_a_fresh_venv(
    wheel: Path, tmp_path: Path
) -> None:
    """Installed from the wheel alone, the entry point's value leads to the manifest file
    through the distribution's RECORD (what discovery reads instead of importing). That no
    verb imports the bundle is guarded by test_manager_manifest.py's
    test_no_verb_imports_the_bundle_or_the_host; this lookup imports nothing by itself."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    # Install with this interpreter's pip into the fresh venv (no network, no deps: the
    # fresh venv has no pydantic, so importing bidkv_ext there would fail loudly too).
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
         "--no-compile", str(wheel)],
        check=True,
    )
    result = subprocess.run([str(py), "-I", "-c", DISCOVER], capture_output=True, text=True,
                            check=True)
    found = json.loads(result.stdout)
    assert found == {
        "id": "org.vllm-hust.bidkv",
        "version": bidkv_ext.__version__,
        "dist_version": bidkv_ext.__version__,
        "path": "manifests/bidkv/vllm-hust-extension-v0.2.json",
    }


def test_manifest_version_equals_distribution_version() -> None:
    manifest = json.loads(MANIFEST.read_text(encoding="utf-8"))
    assert manifest["extension_version"] == bidkv_ext.__version__ == version("vllm-hust-bidkv")


def test_manifest_validates_against_the_schema() -> None:
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(json.loads(MANIFEST.read_text()))


def test_manifest_component_points_at_a_real_policy_class() -> None:
    manifest = json.loads(MANIFEST.read_text(encoding="utf-8"))
    (component,) = manifest["components"]
    assert component["contracts"] == ["vllm.preemption-policy.v1"]
    module, _, obj = component["implementation_ref"].partition(":")
    assert (module, obj) == ("bidkv_ext.selector", "BidkvPreemptionPolicy")
    from bidkv_ext.contract import PreemptionPolicy
    from bidkv_ext.selector import BidkvPreemptionPolicy

    assert isinstance(BidkvPreemptionPolicy(), PreemptionPolicy)
    env = manifest["activation"]["environment"]
    assert env["BIDKV_UTILITY_ENABLE"] == "1" and env["BIDKV_UTILITY_STRATEGY"] == "bidkv"


BUILD_METADATA = r"""
import sys, warnings
from setuptools import build_meta
from setuptools.warnings import SetuptoolsDeprecationWarning
warnings.simplefilter("error", SetuptoolsDeprecationWarning)
print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))
"""


@pytest.mark.parametrize("project", [".", "manager"])
def test_build_uses_no_deprecated_setuptools_configuration(
    project: str, tmp_path: Path
) -> None:
    """setup.sh builds both projects with whatever setuptools the index offers (build
    isolation): a configuration setuptools has deprecated (the ``license`` table, refused
    from 2027-02-18) would break a fresh set-up on that release. Built in a copy: the
    metadata build writes an ``.egg-info`` where it runs."""
    import shutil

    source, copy = ROOT / project, tmp_path / "project"
    copy.mkdir()
    for name in ("pyproject.toml", "README.md"):
        if (source / name).exists():
            shutil.copy2(source / name, copy / name)
    for tree in ("src", "manifests"):
        if (source / tree).is_dir():
            shutil.copytree(source / tree, copy / tree,
                            ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    out = tmp_path / "metadata"
    out.mkdir()
    result = subprocess.run([sys.executable, "-c", BUILD_METADATA, str(out)], cwd=copy,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    metadata = (out / result.stdout.split()[-1] / "METADATA").read_text(encoding="utf-8")
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
