"""``kvcached_provider.checks``: every pre-launch check, and each failure message's advice.

kvcached cannot be installed here (sdists only, needs a CUDA/ROCm torch), so the installed
state is faked at the metadata boundary: throw-away ``*.dist-info`` directories (METADATA +
RECORD) for ``kvcached``, ``torch`` and ``vllm`` are put first on ``sys.path``, which is
exactly what ``importlib.metadata`` reads; no kvcached module is imported or faked. The
torch subprocess probe is replaced by a stub where a test needs one. Guarded: each failure
names what is missing and how to fix it; successes are reported; only the compiled file
itself, directly in the ``kvcached`` package and present on disk, counts as the native
module; torch's local version tag is read without probing when it names a backend (cu*,
rocm*, cpu, xpu) and probed when it names none (NGC's ``+<commit>.nv25.10``); torch older
than 2.10 (the stable ABI kvcached 0.1.6's ``_C`` is built against) is refused, by release
number so that pre-release builds of 2.10 pass; an unparsable vLLM version is outside the
range; a METADATA without a Version is refused by each check in its own words, and
``check()`` uses the manifest's own range; the planned activation environment
really switches kvcached on (``ENABLE_KVCACHED`` true/1, read untrimmed as kvcached reads
it; ``KVCACHED_AUTOPATCH`` true/1 or left unset); ``check()`` imports neither kvcached,
torch nor vLLM; one failing probe cannot hide the others; the KV-events check reads a
command (and its ``--config`` YAML file) as vLLM's real argument parser does, and never
waits on or consumes a ``--config`` that is not a regular file (a FIFO);
``kvcached-provider check`` reads the bundle's manifest (its default instance name) and exits
0 (``ready``) only when every line is ok, else 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvcached_provider import checks

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = json.loads(
    (ROOT / "manifests/kvcached/vllm-hust-extension-v0.2.json").read_text(encoding="utf-8"))


def fake_dist(site: Path, name: str, version: str | None,
              files: dict[str, bytes] | None = None) -> None:
    """A minimal installed distribution: METADATA (without a Version field when ``version``
    is None), RECORD and the listed files."""
    info = site / f"{name}-{(version or '0').split('+')[0]}.dist-info"
    info.mkdir(parents=True)
    field = "" if version is None else f"Version: {version}\n"
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\n{field}")
    record = [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    for rel, content in (files or {}).items():
        target = site / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        record.append(f"{rel},,")
    (info / "RECORD").write_text("\n".join(record) + "\n")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "site"
    directory.mkdir()
    monkeypatch.syspath_prepend(str(directory))
    return directory


# ---------------------------------------------------------------- kvcached version


def test_kvcached_missing(tmp_path: Path) -> None:
    ok, line = checks.check_kvcached_version()  # not installed on this machine
    assert not ok
    assert line.startswith("kvcached is not installed;")
    assert "pip install 'kvcached>=0.1.6' --no-build-isolation" in line
    assert "CUDA or ROCm build of torch" in line


def test_kvcached_too_old(site: Path) -> None:
    fake_dist(site, "kvcached", "0.1.5")
    ok, line = checks.check_kvcached_version()
    assert not ok
    assert line.startswith("kvcached 0.1.5 is older than 0.1.6")
    assert "pip install -U 'kvcached>=0.1.6' --no-build-isolation" in line


def test_kvcached_recent_enough(site: Path) -> None:
    fake_dist(site, "kvcached", "0.1.6")
    assert checks.check_kvcached_version() == (True, "kvcached 0.1.6 is installed (>= 0.1.6)")


# ----------------------------------------------------------------- compiled module


def test_compiled_module_without_kvcached() -> None:
    ok, line = checks.check_compiled_module()
    assert not ok
    assert "compiled module (kvcached/_C) cannot be found because kvcached is not installed" \
        in line


def test_compiled_module_missing_from_install(site: Path) -> None:
    fake_dist(site, "kvcached", "0.1.6", {"kvcached/__init__.py": b""})
    ok, line = checks.check_compiled_module()
    assert not ok
    assert "kvcached 0.1.6 is installed without its compiled module" in line
    assert "kvcached/_C.*.so" in line
    assert "pip install --force-reinstall --no-build-isolation" in line
    assert "toolkit (nvcc/hipcc) is on PATH" in line


def test_compiled_module_present(site: Path) -> None:
    fake_dist(site, "kvcached", "0.1.6",
              {"kvcached/__init__.py": b"", "kvcached/_C.abi3.so": b"\x7fELF"})
    ok, line = checks.check_compiled_module()
    assert ok and line.endswith("kvcached/_C.abi3.so")


@pytest.mark.parametrize("files", [
    {"kvcached/_C.py": b""},  # a Python file named like the extension is not the extension
    {"kvcached/ops/_C.abi3.so": b"\x7fELF"},  # not directly in the package
    {"kvcached_extras/_C.abi3.so": b"\x7fELF"},  # another package of the distribution
])
def test_compiled_module_must_be_the_packages_own_shared_object(
    site: Path, files: dict[str, bytes]
) -> None:
    fake_dist(site, "kvcached", "0.1.6", {"kvcached/__init__.py": b"", **files})
    ok, line = checks.check_compiled_module()
    assert not ok and "is installed without its compiled module" in line


def test_compiled_module_listed_but_gone_from_disk(site: Path) -> None:
    """RECORD names kvcached/_C*.so but the file was lost: the build 'lost' the extension."""
    fake_dist(site, "kvcached", "0.1.6",
              {"kvcached/__init__.py": b"", "kvcached/_C.abi3.so": b"\x7fELF"})
    (site / "kvcached/_C.abi3.so").unlink()
    ok, line = checks.check_compiled_module()
    assert not ok and "is installed without its compiled module" in line


def test_compiled_module_before_016_is_vmm_ops(site: Path) -> None:
    fake_dist(site, "kvcached", "0.1.5", {"kvcached/vmm_ops.cpython-311-x86_64-linux-gnu.so":
                                          b"\x7fELF"})
    assert checks.check_compiled_module()[0]


def test_compiled_module_editable_install(site: Path) -> None:
    """Editable RECORDs list no package files: the package directory is searched instead."""
    fake_dist(site, "kvcached", "0.1.6")
    (site / "kvcached").mkdir()
    (site / "kvcached/__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (site / "kvcached/_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    assert checks.check_compiled_module()[0]
    assert "kvcached" not in sys.modules


# ------------------------------------------------------------------- autopatch .pth


def test_autopatch_pth_missing(tmp_path: Path) -> None:
    ok, line = checks.check_autopatch_pth([tmp_path])
    assert not ok
    assert line.startswith(f"kvcached_autopatch.pth is missing from site-packages ({tmp_path})")
    assert "ENABLE_KVCACHED and KVCACHED_AUTOPATCH silently do nothing" in line
    assert not checks.check_autopatch_pth()[0]  # this interpreter's site-packages
    (tmp_path / "kvcached_autopatch.pth").mkdir()  # a directory is no .pth file
    assert not checks.check_autopatch_pth([tmp_path])[0]


def test_autopatch_pth_present(tmp_path: Path) -> None:
    (tmp_path / "kvcached_autopatch.pth").write_text("import os\n")
    assert checks.check_autopatch_pth([tmp_path / "x", tmp_path]) == (
        True, f"kvcached_autopatch.pth is present in {tmp_path}")


# ---------------------------------------------------------------------- torch build


def test_torch_cpu_build_here() -> None:
    ok, line = checks.check_torch_backend()  # the venv has torch 2.x+cpu
    assert not ok
    assert "is a CPU-only build" in line
    assert "https://download.pytorch.org/whl/cu128" in line


@pytest.mark.parametrize(("version", "expected"), [
    ("2.9.0+cu128", "torch 2.9.0+cu128 is a CUDA build"),
    ("2.9.0+rocm6.3", "torch 2.9.0+rocm6.3 is a ROCm build"),
])
def test_torch_gpu_builds(site: Path, version: str, expected: str) -> None:
    fake_dist(site, "torch", version)
    assert checks.check_torch_backend() == (True, expected)


@pytest.mark.parametrize(("version", "expected"), [
    ("2.9.0+cpu", "torch 2.9.0+cpu is a CPU-only build"),
    ("2.9.0+xpu", "torch 2.9.0+xpu is a XPU-only build"),
])
def test_torch_local_tag_is_read_without_probing(site: Path, version: str, expected: str
                                                 ) -> None:
    """A local tag other than cu*/rocm* names the build: no child interpreter is started."""
    fake_dist(site, "torch", version)

    def probe(_timeout: float) -> tuple[str | None, str | None]:
        raise AssertionError("torch must not be probed when its version has a local tag")

    ok, line = checks.check_torch_backend(probe)
    assert not ok and line.startswith(expected + ";")


@pytest.mark.parametrize("version", ["2.10.0a0+b465a5843b.nv25.10", "2.10.0+git1a2b3c"])
def test_torch_with_an_unknown_local_tag_is_probed(site: Path, version: str) -> None:
    """A local tag naming no backend (NVIDIA's NGC containers ship CUDA torch as
    ``2.10.0a0+<commit>.nv25.10``) says nothing about the build: it was refused as a
    "B465A5843B.NV25.10-only build" without asking torch."""
    fake_dist(site, "torch", version)
    assert checks.check_torch_backend(lambda _t: ("13.0", None)) == (
        True, f"torch {version} is a CUDA 13.0 build")
    ok, line = checks.check_torch_backend(lambda _t: (None, None))
    assert not ok and f"torch {version} is a CPU-only build (no CUDA or HIP version)" in line


def test_torch_without_local_tag_is_probed(site: Path) -> None:
    fake_dist(site, "torch", "2.9.0")
    assert checks.check_torch_backend(lambda _t: ("12.8", None)) == (
        True, "torch 2.9.0 is a CUDA 12.8 build")
    assert checks.check_torch_backend(lambda _t: (None, "6.3.1")) == (
        True, "torch 2.9.0 is a ROCm (HIP 6.3.1) build")
    ok, line = checks.check_torch_backend(lambda _t: (None, None))
    assert not ok and "torch 2.9.0 is a CPU-only build (no CUDA or HIP version)" in line
    ok, line = checks.check_torch_backend(lambda _t: "probing torch timed out after 60 s")
    assert not ok
    assert "cannot tell whether torch 2.9.0 is a GPU build (probing torch timed out" in line


@pytest.mark.parametrize(("version", "ok"), [
    ("2.9.1+cu128", False),
    ("2.9.0", False),
    ("1.13.1+cu117", False),
    ("2.10.0+cu128", True),
    ("2.10.0a0+git1234", True),  # a pre-release build of 2.10 has its stable ABI
    ("2.14.0", True),
])
def test_torch_version_floor(site: Path, version: str, ok: bool) -> None:
    """kvcached 0.1.6's ``_C`` targets the libtorch stable ABI of torch >= 2.10 (notes §1)."""
    fake_dist(site, "torch", version)
    [(found, line)] = checks.check_torch_version()
    assert found is ok, line
    if ok:
        assert line == f"torch {version} is at least 2.10 (kvcached 0.1.6's compiled module " \
                       "needs it)"
    else:
        assert line.startswith(f"torch {version} is older than 2.10: kvcached 0.1.6's "
                               "compiled module is built against the libtorch stable ABI of "
                               "torch >= 2.10;")
        assert "pip install 'torch>=2.10'" in line


def test_torch_version_floor_in_check(site: Path) -> None:
    fake_dist(site, "torch", "2.9.0+cu128")
    failed = [line for ok, line in checks.check(MANIFEST, {}) if not ok]
    assert any(line.startswith("torch 2.9.0+cu128 is older than 2.10") for line in failed)
    assert not any("is a CUDA build" in line for line in failed)


def test_torch_version_not_repeated_when_torch_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = checks._distribution
    monkeypatch.setattr(checks, "_distribution",
                        lambda name: None if name == "torch" else real(name))
    assert checks.check_torch_version() == []


def test_torch_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    real = checks._distribution
    monkeypatch.setattr(checks, "_distribution",
                        lambda name: None if name == "torch" else real(name))
    ok, line = checks.check_torch_backend()
    assert not ok and line.startswith("torch is not installed; kvcached needs a GPU build")


def test_torch_probe_reports_cpu_here() -> None:
    """The real probe, in a child interpreter with a timeout, on this CPU-only torch."""
    assert checks._probe_torch_backend(120.0) == (None, None)


# ----------------------------------------------------------------------- vLLM range


def test_vllm_outside_range_here() -> None:
    ok, line = checks.check_vllm_range()  # vLLM 0.33.0 is installed
    assert not ok
    assert line.startswith("vLLM 0.33.0 is outside kvcached's supported range "
                           ">=0.17.0.dev0,<0.31")
    assert "tested up to vLLM 0.30" in line
    assert "vllm-hust-ext extension disable org.vllm-hust.kvcached" in line


def test_vllm_hust_prerelease_inside_range(site: Path) -> None:
    fake_dist(site, "vllm", "0.28.1rc1.dev319+g199e0bd")
    ok, line = checks.check_vllm_range(MANIFEST["host"]["version_range"])
    assert ok, line


def test_vllm_with_an_unparsable_version_is_outside_the_range(site: Path) -> None:
    fake_dist(site, "vllm", "custom-build")
    ok, line = checks.check_vllm_range()
    assert not ok and line.startswith("vLLM custom-build is outside kvcached's supported range")


@pytest.mark.parametrize("version", [None, ""])
def test_a_distribution_without_a_version_is_refused_by_name(site: Path, version: str | None
                                                             ) -> None:
    """A METADATA with no (or an empty) Version field: each check refuses it in its own line,
    saying the version is missing. ``dist.version`` is None there on 3.11 (packaging then
    raises TypeError, and lines showed "torch None") and a KeyError on newer importlib."""
    for name in ("kvcached", "torch", "vllm"):
        fake_dist(site, name, version, {f"{name}/__init__.py": b""})
    assert checks.check_kvcached_version() == (False, (
        "kvcached's metadata has no version; reinstall it with "
        "`pip install --force-reinstall 'kvcached>=0.1.6' --no-build-isolation`"))
    ok, line = checks.check_compiled_module()  # no version: 0.1.6's name, kvcached/_C
    assert not ok and line.startswith(
        "kvcached (no version) is installed without its compiled module (no kvcached/_C.*.so")
    assert checks.check_torch_backend(lambda _timeout: ("12.8", None)) == (
        True, "torch (no version) is a CUDA 12.8 build")
    [(ok, line)] = checks.check_torch_version()
    assert not ok and line.startswith("torch (no version) cannot be shown to be at least 2.10:")
    assert checks.check_vllm_range(">=0.33,<0.34") == (False, (
        "vLLM (no version) cannot be checked against kvcached's supported range "
        ">=0.33,<0.34: reinstall a vLLM in that range (e.g. vLLM-HUST 0.28.1)"))


@pytest.mark.parametrize(("version_range", "ok"), [
    (">=0.33,<0.34", True),  # the manifest's range, not the built-in one, decides
    ("", False),  # absent or blank: the built-in range (vLLM 0.33.0 is outside it)
    ("  ", False),
])
def test_check_uses_the_manifests_vllm_range(version_range: str, ok: bool) -> None:
    manifest = {**MANIFEST, "host": {**MANIFEST["host"], "version_range": version_range}}
    [line] = [line for line in checks.check(manifest, {}) if line[1].startswith("vLLM ")]
    assert line[0] is ok, line


def test_vllm_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    real = checks._distribution
    monkeypatch.setattr(checks, "_distribution",
                        lambda name: None if name == "vllm" else real(name))
    ok, line = checks.check_vllm_range()
    assert not ok and line.startswith("vLLM is not installed; kvcached patches vLLM")


# ------------------------------------------------------------------------ /dev/shm


def test_shm_writable(tmp_path: Path) -> None:
    assert checks.check_shm_writable(tmp_path) == (True, f"{tmp_path} is writable")
    assert not list(tmp_path.iterdir())


def test_shm_missing(tmp_path: Path) -> None:
    ok, line = checks.check_shm_writable(tmp_path / "nope")
    assert not ok
    assert "does not exist or is not a directory" in line and "--shm-size" in line
    (tmp_path / "file").write_text("")
    ok, line = checks.check_shm_writable(tmp_path / "file")
    assert not ok and "does not exist or is not a directory" in line


def test_shm_not_writable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(**_: object) -> tuple[int, str]:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(checks.tempfile, "mkstemp", refuse)
    ok, line = checks.check_shm_writable(tmp_path)
    assert not ok
    assert line.startswith(f"{tmp_path} is not writable (Permission denied)")
    assert "mount a writable tmpfs at /dev/shm" in line


# ------------------------------------------------------------------ KVCACHED_IPC_NAME


def test_shm_dir_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Empty means the default (not Path(""), the current directory); blank is refused."""
    monkeypatch.setenv("KVCACHED_PROVIDER_SHM_DIR", "")
    assert checks.shm_dir() == Path("/dev/shm")
    monkeypatch.setenv("KVCACHED_PROVIDER_SHM_DIR", " \t")
    with pytest.raises(checks.SettingError, match=r"KVCACHED_PROVIDER_SHM_DIR=' \\t' is"):
        checks.shm_dir()
    ok, line = checks.check_shm_writable()
    assert not ok and line == (
        "KVCACHED_PROVIDER_SHM_DIR=' \\t' is invalid: expected a directory path, or the "
        "variable unset or empty for the default /dev/shm")
    assert checks.check_ipc_name("inst1") == [(True, "KVCACHED_IPC_NAME is 'inst1'")]


def test_ipc_name_with_a_trailing_newline_is_invalid(tmp_path: Path) -> None:
    [(ok, line)] = checks.check_ipc_name("inst1\n", tmp_path)
    assert not ok and line.startswith("KVCACHED_IPC_NAME 'inst1\\n' is invalid")
    assert checks.IPC_NAME_PATTERN.match("inst1\n") is None


def test_ipc_name_rules(tmp_path: Path) -> None:
    [(ok, line)] = checks.check_ipc_name(None, tmp_path)
    assert not ok and line.startswith("KVCACHED_IPC_NAME is not set")
    [(ok, line)] = checks.check_ipc_name("has space", tmp_path)
    assert not ok
    assert "KVCACHED_IPC_NAME 'has space' is invalid: expected 1-64 characters" in line
    assert 'vllm-hust-ext extension configure org.vllm-hust.kvcached --file F' in line
    assert checks.check_ipc_name("a" * 65, tmp_path)[0][0] is False
    lines = checks.check_ipc_name("vllm_hust_kvcached", tmp_path)
    assert all(ok for ok, _ in lines) and "bundle default" in lines[1][1]
    (tmp_path / "llama-8000").write_bytes(b"\0" * 24)
    lines = checks.check_ipc_name("llama-8000", tmp_path)
    assert [ok for ok, _ in lines] == [True, True]
    assert "already exists" in lines[1][1] and "kvctl delete llama-8000" in lines[1][1]
    # A name ending like kvcached's KV-group suffix is valid but warned about (cleanup of
    # instance 'llama' could take its record for group 2 of that instance).
    lines = checks.check_ipc_name("llama_g2", tmp_path)
    assert [ok for ok, _ in lines] == [True, True]
    assert "ends like a KV-group suffix" in lines[1][1] and "'llama'" in lines[1][1]


def test_a_record_a_live_engine_uses_fails_the_launch_check_only(tmp_path: Path) -> None:
    """kvcached uses an explicit KVCACHED_IPC_NAME exactly, so a second engine launched
    under the name of a running one would share its control record and limits: before a
    launch (``run``) a record that a live process uses is a failing line naming the pid;
    for ``status`` (perhaps of that very engine) it stays a report. A real process, found
    through /proc by its environment, stands in for the engine. The name is this run's
    own: processes are found machine-wide, and another run's engine must not be counted."""
    name = f"llama-{os.getpid()}"
    (tmp_path / name).write_bytes(b"\0" * 24)
    engine = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; print(flush=True); time.sleep(60)"],
        env={**os.environ, "KVCACHED_IPC_NAME": name}, stdout=subprocess.PIPE)
    try:
        assert engine.stdout is not None and engine.stdout.readline()  # it is running
        lines = checks.check_ipc_name(name, tmp_path, launching=True)
        assert [ok for ok, _ in lines] == [True, False]
        assert lines[1][1].startswith(f"control record {tmp_path / name} is in use by "
                                      f"pid {engine.pid}: an engine already runs under")
        status = checks.check_ipc_name(name, tmp_path)
        assert [ok for ok, _ in status] == [True, True] and "already exists" in status[1][1]
    finally:
        engine.kill()
        engine.wait()
    lines = checks.check_ipc_name(name, tmp_path, launching=True)
    assert [ok for ok, _ in lines] == [True, True]  # a leaked record: reported, not fatal
    assert "already exists" in lines[1][1]


# ------------------------------------------------------- activation environment


@pytest.mark.parametrize(("environment", "failures"), [
    ({"ENABLE_KVCACHED": "true", "KVCACHED_AUTOPATCH": "1"}, []),
    ({"ENABLE_KVCACHED": "TRUE", "KVCACHED_AUTOPATCH": "True"}, []),
    ({"ENABLE_KVCACHED": "1"}, []),  # kvcached's hook sets KVCACHED_AUTOPATCH=1 if unset
    ({"ENABLE_KVCACHED": "false", "KVCACHED_AUTOPATCH": "1"}, ["ENABLE_KVCACHED"]),
    ({"ENABLE_KVCACHED": " true", "KVCACHED_AUTOPATCH": "1"}, ["ENABLE_KVCACHED"]),
    ({"ENABLE_KVCACHED": "yes", "KVCACHED_AUTOPATCH": "1"}, ["ENABLE_KVCACHED"]),
    ({"KVCACHED_AUTOPATCH": "1"}, ["ENABLE_KVCACHED"]),
    ({"ENABLE_KVCACHED": "true", "KVCACHED_AUTOPATCH": "0"}, ["KVCACHED_AUTOPATCH"]),
    ({"ENABLE_KVCACHED": "true", "KVCACHED_AUTOPATCH": "on"}, ["KVCACHED_AUTOPATCH"]),
])
def test_activation_environment_switches_kvcached_on(
    environment: dict[str, str], failures: list[str]
) -> None:
    """kvcached applies its patches only when ``ENABLE_KVCACHED`` is true/1 and
    ``KVCACHED_AUTOPATCH`` is true/1 (set to 1 by its hook when unset), read with
    ``.lower()`` and no trimming (notes §4). An override that turns either off launched
    vLLM without kvcached while the bundle reported itself ready."""
    lines = checks.check_activation_environment(environment)
    failed = [line for ok, line in lines if not ok]
    assert [line.split("=")[0].split(" ")[0] for line in failed] == failures
    for line in failed:
        assert "kvcached reads only 'true' or '1'" in line
        assert "vllm-hust-ext extension configure org.vllm-hust.kvcached --file F" in line
    assert len(lines) == 2  # one line per variable
    passed = [line for ok, line in lines if ok]
    if "ENABLE_KVCACHED" not in failures:
        assert f"ENABLE_KVCACHED={environment['ENABLE_KVCACHED']!r} switches kvcached on" \
            in passed
    if "KVCACHED_AUTOPATCH" not in failures:
        assert (f"KVCACHED_AUTOPATCH={environment['KVCACHED_AUTOPATCH']!r} applies kvcached's "
                "vLLM patches" if "KVCACHED_AUTOPATCH" in environment else
                "KVCACHED_AUTOPATCH is unset: kvcached's import hook sets it to 1 when "
                "ENABLE_KVCACHED is on") in passed


def test_check_refuses_an_override_that_switches_kvcached_off() -> None:
    overrides = {"environment": {"ENABLE_KVCACHED": "false", "KVCACHED_IPC_NAME": "inst1"}}
    failed = [line for ok, line in checks.check(MANIFEST, overrides) if not ok]
    assert any(line.startswith("ENABLE_KVCACHED='false' leaves kvcached off") for line in failed)
    assert not [line for ok, line in checks.check(MANIFEST, {}) if not ok
                and line.startswith("ENABLE_KVCACHED")]


# ------------------------------------------------------------------------- check()


def test_check_on_this_machine_fails_with_every_reason() -> None:
    lines = checks.check(MANIFEST, {"environment": {"KVCACHED_IPC_NAME": "llama-8000"}})
    failed = [line for ok, line in lines if not ok]
    assert [line.split(" ")[0] for line in failed] == [
        "kvcached", "kvcached's", "kvcached_autopatch.pth", "torch", "vLLM"]
    assert (True, "KVCACHED_IPC_NAME is 'llama-8000'") in lines


def test_check_survives_a_broken_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> tuple[bool, str]:
        raise RuntimeError("metadata exploded")

    monkeypatch.setattr(checks, "check_kvcached_version", boom)
    lines = checks.check(MANIFEST, {})
    assert lines[0] == (False, "kvcached version check failed unexpectedly: metadata exploded")
    assert len(lines) >= 7


def test_check_imports_no_heavy_module() -> None:
    code = (
        "import json, sys\n"
        "from kvcached_provider.checks import check\n"
        f"check(json.loads({json.dumps(json.dumps(MANIFEST))}), {{}})\n"
        "print(sorted(m for m in ('kvcached', 'torch', 'vllm') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]"


def test_cli_check_prints_every_line(capsys: pytest.CaptureFixture[str]) -> None:
    from kvcached_provider.cli import main

    assert main(["check", "--ipc", "llama-8000"]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL ") == 5
    assert out.rstrip().endswith("org.vllm-hust.kvcached: 5 check(s) failed")


def test_cli_check_exit_status(monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    """``kvcached-provider check`` exits 0 and prints ``ready`` only when every line is ok;
    one failed line means exit 1 and the count of failures."""
    from kvcached_provider.cli import main

    monkeypatch.setattr(checks, "check", lambda *_: [(True, "a"), (True, "b")])
    assert main(["check"]) == 0
    assert capsys.readouterr().out == "ok   a\nok   b\norg.vllm-hust.kvcached: ready\n"
    monkeypatch.setattr(checks, "check", lambda *_: [(True, "a"), (False, "b")])
    assert main(["check"]) == 1
    assert capsys.readouterr().out == (
        "ok   a\nFAIL b\norg.vllm-hust.kvcached: 1 check(s) failed\n")


def test_cli_check_with_an_empty_ipc_checks_it_as_given(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``check --ipc ''`` was read as "no --ipc" and checked the manifest's default name
    (ok), where ``limit`` and ``cleanup`` refuse an empty name: it is checked as given."""
    from kvcached_provider.cli import main

    assert main(["check", "--ipc", ""]) == 1
    out = capsys.readouterr().out
    assert "'vllm_hust_kvcached'" not in out
    assert any(line.startswith("FAIL") and "KVCACHED_IPC_NAME" in line
               for line in out.splitlines()), out


def test_cli_check_without_ipc_reads_the_bundles_manifest(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without --ipc the planned name is the manifest's default: the command found the
    manifest beside the package (here the editable install's repository root)."""
    from kvcached_provider.cli import main

    assert main(["check"]) == 1
    out = capsys.readouterr().out
    assert "ok   KVCACHED_IPC_NAME is 'vllm_hust_kvcached'" in out
    assert out.rstrip().endswith("org.vllm-hust.kvcached: 5 check(s) failed")


# ------------------------------------------- check 7: other bundles and KV-cache events

BIDKV_MANIFEST = json.loads(
    (ROOT / "manifests/bidkv/vllm-hust-extension-v0.2.json").read_text(encoding="utf-8"))


def _allocator_bundle(contract: str) -> dict[str, object]:
    return {**BIDKV_MANIFEST, "components": [{
        "component_id": "pool", "contracts": [contract], "execution_planes": ["scheduler"],
        "isolation": "trusted_in_process", "implementation_ref": "x.pool:Pool"}]}


def test_bidkv_beside_kvcached_is_fine() -> None:
    lines = checks.check_peer_bundles({"org.vllm-hust.bidkv": BIDKV_MANIFEST})
    assert lines == [(True, "no other enabled bundle declares a KV-cache allocator, block "
                            "pool, coordinator or KV-cache events")]


@pytest.mark.parametrize("contract", [
    "vllm.kv-cache-allocator.v1", "vllm.block-pool.v1", "vllm.kv_cache_coordinator.v1",
    "vllm.kv-events.v1", "vllm.KV-Cache-Events.v2"])
def test_a_bundle_declaring_the_block_pool_or_kv_events_fails(contract: str) -> None:
    lines = checks.check_peer_bundles({"org.other.pool": _allocator_bundle(contract)})
    assert lines == [(False, (
        f"enabled bundle 'org.other.pool' declares {contract}: kvcached replaces vLLM's "
        "BlockPool and KVCacheCoordinator and publishes no KV-cache events, so both cannot "
        "run in one engine; disable one of them with `vllm-hust-ext extension disable <id>`"))]


def test_a_protocol_name_counts_too() -> None:
    protocol = {"name": "vllm.kv-cache-events", "version_range": None}
    peer = {**BIDKV_MANIFEST, "protocols": [protocol]}
    [(ok, line)] = checks.check_peer_bundles({"org.other.events": peer})
    assert not ok and "declares vllm.kv-cache-events:" in line


@pytest.mark.parametrize(("command", "refused"), [
    (["vllm", "serve", "m"], False),
    (["vllm", "serve", "m", "--kv-events-config", '{"enable_kv_cache_events": true}'], True),
    (["vllm", "serve", "m", '--kv-events-config={"enable_kv_cache_events":true}'], True),
    (["vllm", "serve", "m", "--kv-events-config", '{"enable_kv_cache_events": false}'], False),
    (["vllm", "serve", "m", "--kv-events-config.enable_kv_cache_events", "true"], True),
    (["vllm", "serve", "m", "--kv-events-config.enable_kv_cache_events=false"], False),
    (["vllm", "serve", "m", "--kv-events-config.enable_kv_cache_events", "--port", "1"], True),
    (["vllm", "serve", "m", "--kv-events-config", "{not json"], False),  # vLLM rejects it
    (["vllm", "serve", "m", "--kv_events_config", '{"enable_kv_cache_events": true}'], True),
    (["vllm", "serve", "m", "--kv_events_config.enable_kv_cache_events", "on"], True),
    (["vllm", "serve", "m", "--kv-events-config", '{"enable_kv_cache_events": "yes"}'], True),
    (["vllm", "serve", "m", "--kv-events-config", '{"enable_kv_cache_events": "off"}'], False),
])
def test_kv_events_on_the_command_line(command: list[str], refused: bool) -> None:
    lines = checks.check_kv_events(command)
    assert bool(lines) is refused
    if refused:
        assert lines[0][0] is False and "publishes none" in lines[0][1]
    assert checks.check_kv_events(None) == []  # status: no command to judge


_NESTED_ON = "kv-events-config:\n  enable_kv_cache_events: true\nmax-num-seqs: 8\n"


@pytest.mark.parametrize(("config", "tail", "refused"), [
    (_NESTED_ON, [], True),
    (_NESTED_ON.replace("kv-events-config", "kv_events_config"), [], True),
    ("kv-events-config: '{\"enable_kv_cache_events\": \"yes\"}'\n", [], True),
    # The command line comes after the file's options, so it overrides them ...
    (_NESTED_ON, ["--kv-events-config", '{"enable_kv_cache_events": false}'], False),
    ("kv-events-config:\n  enable_kv_cache_events: false\n",
     ["--kv-events-config.enable_kv_cache_events", "true"], True),
    # ... and any dotted field replaces the whole JSON value, wherever that came from.
    (_NESTED_ON, ["--kv-events-config.publisher", "zmq"], False),
    (None, ["--kv-events-config", '{"enable_kv_cache_events": true}',
            "--kv-events-config.publisher", "zmq"], False),
    (None, ["--kv-events-config", '{"enable_kv_cache_events": true}',
            "--kv-events-config", "{}"], False),
    (None, ["--kv_events_config.enable_kv_cache_events", "on"], True),
    ("max-num-seqs: 8\n", [], False),
    # pydantic reads booleans case-insensitively ...
    (None, ["--kv-events-config", '{"enable_kv_cache_events": "ON"}'], True),
    # ... and vLLM drops a `key: false` of the file entirely, even a dotted one.
    ("kv-events-config.enable_kv_cache_events: false\nmax-num-seqs: 8\n", [], False),
])
def test_kv_events_read_as_vllms_own_parser_reads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    config: str | None, tail: list[str], refused: bool,
) -> None:
    """vLLM 0.33.0's real argument parser (``FlexibleArgumentParser`` with the engine's
    options and ``--config``, as ``vllm serve`` builds it) is the oracle: the check refuses
    exactly the commands after which vLLM's ``kv_events_config.enable_kv_cache_events`` is
    on, including options read from a ``--config`` YAML file."""
    monkeypatch.chdir(tmp_path)
    assert_kv_events_read_as_vllm(config, tail, refused, "serve.yaml")


def assert_kv_events_read_as_vllm(
    config: str | None, tail: list[str], refused: bool, config_name: str
) -> None:
    """vLLM's parser, given ``tail`` after ``--config <config_name>`` holding ``config``
    (in the working directory; no file when None), turns KV-cache events on exactly when
    ``refused``, and the check refuses exactly then."""
    args = list(tail)
    if config is not None:
        Path(config_name).write_text(config, encoding="utf-8")
        args = ["--config", config_name, *args]
    parsed = _vllm_parser().parse_args(args).kv_events_config
    assert bool(parsed is not None and parsed.enable_kv_cache_events) is refused
    assert bool(checks.check_kv_events(["vllm", "serve", "m", *args])) is refused


@pytest.mark.parametrize("args", [
    ["--config=serve.yaml"],  # vLLM expands only the separate ``--config FILE`` pair
    ["--config", "serve.yml.txt"],  # vLLM refuses a file that is not .yaml/.yml
    ["--config", "missing.yaml"],  # ... or that it cannot read: the launch fails anyway
    ["--config", "list.yaml"],  # a YAML list is no set of options
    # Files YAML cannot construct: PyYAML raises KeyError, AttributeError, RecursionError
    # (the check failed with them; the manager names the file in one line).
    ["--config", "bool.yaml"],
    ["--config", "time.yaml"],
    ["--config", "deep.yaml"],
    ["--config", "dir.yaml"],  # a directory: nothing read, its descriptor closed
])
def test_config_files_vllm_does_not_read_enable_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("serve.yaml", "serve.yml.txt"):
        Path(name).write_text(_NESTED_ON, encoding="utf-8")
    Path("list.yaml").write_text("- kv-events-config\n", encoding="utf-8")
    Path("bool.yaml").write_text(_NESTED_ON + "enforce-eager: !!bool maybe\n")
    Path("time.yaml").write_text(_NESTED_ON + "seed: !!timestamp soon\n")
    Path("deep.yaml").write_text("[" * 5000 + "]" * 5000)
    Path("dir.yaml").mkdir()
    open_before = len(os.listdir("/proc/self/fd"))
    assert checks.check_kv_events(["vllm", "serve", "m", *args]) == []
    assert len(os.listdir("/proc/self/fd")) == open_before


def _vllm_parser() -> Any:
    global _PARSER
    if _PARSER is None:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        _PARSER = FlexibleArgumentParser()
        _PARSER.add_argument("--config", type=str)
        EngineArgs.add_cli_args(_PARSER)
    return _PARSER


_PARSER: Any = None


def test_check_reads_the_managers_context() -> None:
    context = {"enabled_bundles": {"org.other.pool": _allocator_bundle("vllm.block-pool.v1")},
               "command": ["vllm", "serve", "m", "--kv-events-config.enable_kv_cache_events"]}
    failed = [line for ok, line in checks.check(MANIFEST, {}, context) if not ok]
    assert any(line.startswith("enabled bundle 'org.other.pool' declares") for line in failed)
    assert any(line.startswith("the command enables KV-cache events") for line in failed)
    without = [line for ok, line in checks.check(MANIFEST, {}) if not ok]
    assert len(failed) == len(without) + 2


def test_a_config_fifo_neither_hangs_the_check_nor_is_read(tmp_path: Path) -> None:
    """``--config`` naming a FIFO: opening it waited for a writer forever (the manager's
    ``run`` hung in its checks), and with a writer the check would consume what vLLM was
    to read. Only a regular file is read; the check must return at once, reading nothing."""
    fifo = tmp_path / "serve.yaml"
    os.mkfifo(fifo)
    code = ("from kvcached_provider import checks\n"
            f"print(checks.check_kv_events(['vllm', 'serve', 'm', '--config', {str(fifo)!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[]\n"
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # the FIFO's content stays for vLLM
    try:
        os.write(writer, _NESTED_ON.encode())
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=30)
        assert done.stdout == "[]\n", done.stderr
        assert os.read(writer, 1 << 16) == _NESTED_ON.encode()
    finally:
        os.close(writer)
