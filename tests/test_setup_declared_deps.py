"""Every third-party import is declared, and the declarations agree with the pins.

Guards two promises of ``scripts/setup.sh``:

- each third-party module imported in ``src/``, ``manager/src/``, ``qualification/`` or
  ``tests/`` comes from a distribution that ``pyproject.toml`` (dependencies or an extra) or
  ``manager/pyproject.toml`` declares; ``manager/src/`` from the manager's own dependencies
  alone (it is a distribution of its own). The only exceptions are what ``setup.sh``
  installs by hand (CPU torch, vLLM ``--no-deps``) and kvcached (GPU machines only). An
  undeclared import works only by accident of ``scripts/vllm-cpu-pins.txt``;
- each declared requirement admits the version ``scripts/vllm-cpu-pins.txt`` pins (the pins
  are installed first and used as constraints, so a disagreement breaks the set-up), the
  pins are exact and unique, and README's count of them is right.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import NormalizedName, canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PINS = REPO / "scripts" / "vllm-cpu-pins.txt"

# Installed by scripts/setup.sh itself, or only where a GPU is (never declared: a declared
# torch or vllm would pull a CUDA build into a plain `pip install`).
NOT_DECLARED = {
    "torch": "torch==2.13.0+cpu",
    "vllm": '"vllm==0.33.0"',
    "kvcached": None,  # tests/test_kvcached_real.py, GPU only (scripts/kvcached-gpu-check.sh)
}


def _local_names() -> set[str]:
    names = {"tests", "qualification", "manifests"}
    for where in (REPO / "src", REPO / "manager" / "src"):
        names |= {p.name for p in where.iterdir() if p.is_dir()}
    # Benchmark scripts some tests put on sys.path (headroom, run, ...).
    names |= {p.stem for p in (REPO / "benchmarks").rglob("*.py")}
    return names


def _imports(*roots: str) -> dict[str, set[str]]:
    """Top-level names of absolute imports -> the files that import them."""
    found: dict[str, set[str]] = {}
    for root in roots:
        for path in sorted((REPO / root).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    found.setdefault(module.split(".")[0], set()).add(
                        str(path.relative_to(REPO)))
    local = _local_names()
    return {name: files for name, files in found.items()
            if name not in sys.stdlib_module_names and name not in local
            and name != "__future__"}


def _requirements(pyproject: Path, extras: bool = True) -> list[Requirement]:
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    reqs = [Requirement(r) for r in project.get("dependencies", [])]
    if extras:
        for group in project.get("optional-dependencies", {}).values():
            reqs += [Requirement(r) for r in group]
    return reqs


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in PINS.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"pin not exact: {line}"
        name = canonicalize_name(req.name)
        assert name not in pins, f"pinned twice: {req.name}"
        pins[name] = specs[0].version
    return pins


def _undeclared(imports: dict[str, set[str]], declared: set[NormalizedName]) -> list[str]:
    distributions = importlib.metadata.packages_distributions()
    missing = []
    for name, files in sorted(imports.items()):
        if name in NOT_DECLARED:
            continue
        dists = {canonicalize_name(d) for d in distributions.get(name, [])}
        if not dists & declared:
            missing.append(f"{name} (from {sorted(dists) or 'nothing installed'}) "
                           f"imported by {sorted(files)[:3]}")
    return missing


def test_every_third_party_import_is_declared() -> None:
    declared = {canonicalize_name(r.name) for pyproject in
                (REPO / "pyproject.toml", REPO / "manager" / "pyproject.toml")
                for r in _requirements(pyproject)}
    imports = _imports("src", "manager/src", "qualification", "tests")
    assert _undeclared(imports, declared) == []


def test_the_manager_imports_only_its_own_dependencies() -> None:
    declared = {canonicalize_name(r.name)
                for r in _requirements(REPO / "manager" / "pyproject.toml", extras=False)}
    assert _undeclared(_imports("manager/src"), declared) == []


def test_what_is_not_declared_is_what_setup_installs_by_hand() -> None:
    setup = (REPO / "scripts" / "setup.sh").read_text(encoding="utf-8")
    for name, marker in NOT_DECLARED.items():
        if marker is not None:
            assert marker in setup, f"{name}: setup.sh no longer installs {marker}"


def test_declared_versions_admit_the_pins() -> None:
    pins = _pins()
    disagree = [f"{pyproject.relative_to(REPO)}: {req} vs pin {pins[canonicalize_name(req.name)]}"
                for pyproject in (REPO / "pyproject.toml", REPO / "manager" / "pyproject.toml")
                for req in _requirements(pyproject)
                if canonicalize_name(req.name) in pins
                and not req.specifier.contains(pins[canonicalize_name(req.name)],
                                               prereleases=True)]
    assert disagree == []


def test_readme_counts_the_pins() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    match = re.search(r"the (\d+) pinned scheduler dependencies", readme)
    assert match is not None
    assert int(match.group(1)) == len(_pins())
