"""Pre-launch checks for the ``org.vllm-hust.kvcached`` bundle.

The extension manager loads :func:`check` through the ``vllm_hust_ext.bundle_checks`` entry
point for ``extension status/check`` and ``run``; every ``False`` line marks the bundle
degraded and makes ``run`` refuse to launch. Each line names exactly what is missing and
how to fix it.

Nothing here imports kvcached, torch or vLLM: importing kvcached needs a GPU build of torch
(its ``__init__`` raises without one), and the manager must stay fast and side-effect free.
Everything is read from distribution metadata (``importlib.metadata``), the filesystem, the
environment the launch will hand the engine, and -- only when torch's version carries no
local tag -- a short subprocess probe.

The checks describe the interpreter that runs them, i.e. the one running the manager; the
launched engine normally shares it (``vllm-hust-ext run -- vllm serve ...`` from one venv).
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import json
import math
import os
import re
import site
import stat
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from kvcached_provider import EXTENSION_ID, MIN_KVCACHED_VERSION

__all__ = [
    "AUTOPATCH_PTH",
    "DEFAULT_IPC_NAME",
    "GROUP_SUFFIX",
    "IPC_NAME_PATTERN",
    "KVCACHED_ON_WORDS",
    "KVCACHED_TESTED_VLLM_RANGE",
    "MIN_TORCH_RELEASE",
    "TUNING_VARIABLES",
    "SettingError",
    "check",
    "check_activation_environment",
    "check_autopatch_pth",
    "check_compiled_module",
    "check_ipc_name",
    "check_kv_events",
    "check_kvcached_version",
    "check_peer_bundles",
    "check_shm_writable",
    "check_torch_backend",
    "check_torch_version",
    "check_tuning_environment",
    "check_vllm_range",
    "env_directory",
    "launch_environment",
    "planned_environment",
    "shm_dir",
]

CheckLine = tuple[bool, str]

AUTOPATCH_PTH = "kvcached_autopatch.pth"
# kvcached 0.1.6 supports vLLM >= 0.17 and is tested up to 0.30. The ``.dev0`` lower bound
# names a pre-release on purpose: packaging then admits pre-release hosts such as vLLM-HUST's
# setuptools-scm versions (``0.28.1rc1.dev319+g...``), which a plain ``>=0.17`` would reject.
KVCACHED_TESTED_VLLM_RANGE = ">=0.17.0.dev0,<0.31"
DEFAULT_IPC_NAME = "vllm_hust_kvcached"
# kvcached sanitises explicit names to this alphabet and length; we require it verbatim so
# that ``kvctl`` and ``kvcached-provider`` can address the instance by the configured name.
# Use it with ``fullmatch``; the \A...\Z anchors also keep ``match`` from accepting a
# trailing newline, which ``$`` allows ("inst1\n" would name another file and state key).
IPC_NAME_PATTERN = re.compile(r"\A[A-Za-z0-9_-]{1,64}\Z")
# kvcached names the record of KV group N > 0 of instance X ``X_gN``.
GROUP_SUFFIX = re.compile(r"_g[0-9]+\Z")
# Contract or protocol names by which a 0.2 manifest says it owns KV-cache allocation or
# consumes KV-cache events (e.g. a custom ``vllm.kv-cache-allocator.v1``).
_KV_OWNERSHIP = re.compile(
    r"kv[-_.]?cache[-_.]?(allocator|coordinator|events?)|block[-_.]?pool|kv[-_.]?events?",
    re.IGNORECASE,
)
_KV_EVENTS_OPTION = "--kv-events-config"
_KV_EVENTS_FLAG = _KV_EVENTS_OPTION + ".enable_kv_cache_events"
_TRUE_WORDS = frozenset({"true", "1", "yes", "on", "t", "y"})
TORCH_PROBE_TIMEOUT_S = 60.0
# kvcached 0.1.6's ``_C`` is built against the libtorch stable ABI of torch 2.10; compared by
# release number, so that pre-release builds of 2.10 (``2.10.0a0+git...``) count as 2.10.
MIN_TORCH_RELEASE = (2, 10)
# kvcached's reading of ENABLE_KVCACHED and KVCACHED_AUTOPATCH: ``value.lower()`` in these,
# with no trimming (" true" is off).
KVCACHED_ON_WORDS = frozenset({"true", "1"})

_INSTALL_HINT = (
    "install it with `pip install 'kvcached>=0.1.6' --no-build-isolation` in an environment "
    "that has a CUDA or ROCm build of torch and the GPU toolkit (kvcached ships sdists only)"
)
_CONFIGURE_HINT = (
    f"`vllm-hust-ext extension configure {EXTENSION_ID} --file F` with F holding "
    '{"environment": {"KVCACHED_IPC_NAME": "<unique-name>"}}'
)


class SettingError(ValueError):
    """A malformed environment setting; the CLI prints it as one line and exits 2."""


def env_directory(variable: str, default: Path) -> Path:
    """The directory named by ``variable``; unset or empty means ``default``.

    An empty value must not become ``Path("")``, i.e. the current directory, where cleanup
    would delete files. A blank one (" ") is refused: it would name a directory " ".
    """
    value = os.environ.get(variable, "")
    if not value:
        return default
    if not value.strip():
        raise SettingError(
            f"{variable}={value!r} is invalid: expected a directory path, or the variable "
            f"unset or empty for the default {default}"
        )
    return Path(value)


def shm_dir() -> Path:
    """Directory holding kvcached's control records (``/dev/shm``; overridable for tests)."""
    return env_directory("KVCACHED_PROVIDER_SHM_DIR", Path("/dev/shm"))


def _distribution(name: str) -> metadata.Distribution | None:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None


def _version_of(dist: metadata.Distribution) -> str | None:
    """The METADATA's Version field, or None when it has none (or an empty one).

    Read through ``get_all`` because ``dist.version`` gives None for a missing field on
    Python 3.11 despite its annotation, and raises KeyError once importlib drops that
    deprecated None; either way a check would report nonsense or stop.
    """
    values = dist.metadata.get_all("Version")
    return str(values[0]) if values and values[0] else None


def _named(project: str, version: str | None) -> str:
    return f"{project} {version}" if version else f"{project} (no version)"


_REINSTALL_KVCACHED = "`pip install --force-reinstall 'kvcached>=0.1.6' --no-build-isolation`"


def check_kvcached_version() -> CheckLine:
    """kvcached is installed (metadata) and at least 0.1.6."""
    dist = _distribution("kvcached")
    if dist is None:
        return False, f"kvcached is not installed; {_INSTALL_HINT}"
    text = _version_of(dist)
    if text is None:
        return False, f"kvcached's metadata has no version; reinstall it with {_REINSTALL_KVCACHED}"
    try:
        version = Version(text)
    except InvalidVersion:
        return False, (
            f"kvcached reports an unparsable version {text!r}; reinstall it with "
            f"{_REINSTALL_KVCACHED}"
        )
    if version < Version(MIN_KVCACHED_VERSION):
        return False, (
            f"kvcached {version} is older than {MIN_KVCACHED_VERSION} (earlier releases lose "
            "restored limits, report deferred shrinks as applied and ignore the autopatch "
            "variables in editable installs); upgrade with "
            "`pip install -U 'kvcached>=0.1.6' --no-build-isolation`"
        )
    return True, f"kvcached {version} is installed (>= {MIN_KVCACHED_VERSION})"


def _native_stem(version: str) -> str:
    """Name of the compiled module: ``_C`` from 0.1.6, ``vmm_ops`` before."""
    try:
        return "_C" if Version(version) >= Version(MIN_KVCACHED_VERSION) else "vmm_ops"
    except InvalidVersion:
        return "_C"


def _is_native(path: Path, stem: str) -> bool:
    return path.name.startswith(stem + ".") and path.suffix in {".so", ".pyd"}


def _recorded_native(dist: metadata.Distribution, stem: str) -> list[Path]:
    found: list[Path] = []
    for entry in dist.files or []:
        rel = Path(str(entry))
        if rel.parts[:1] == ("kvcached",) and len(rel.parts) == 2 and _is_native(rel, stem):
            found.append(Path(str(dist.locate_file(entry))))
    return found


def _package_dir_native(stem: str) -> list[Path]:
    """Fallback for editable installs, whose RECORD lists no package files.

    ``find_spec`` of a top-level name locates the package without executing it.
    """
    spec = importlib.util.find_spec("kvcached")
    if spec is None:
        return []
    roots = list(spec.submodule_search_locations or [])
    return [p for root in roots for p in Path(root).glob(stem + ".*") if _is_native(p, stem)]


def check_compiled_module() -> CheckLine:
    """The native extension (``kvcached/_C*.so``; ``vmm_ops`` before 0.1.6) is on disk."""
    dist = _distribution("kvcached")
    if dist is None:
        return False, (
            "kvcached's compiled module (kvcached/_C) cannot be found because kvcached is "
            f"not installed; {_INSTALL_HINT}"
        )
    version = _version_of(dist)
    stem = _native_stem(version or "")
    candidates = _recorded_native(dist, stem) or _package_dir_native(stem)
    present = [p for p in candidates if p.is_file()]
    if not present:
        return False, (
            f"{_named('kvcached', version)} is installed without its compiled module "
            f"(no kvcached/{stem}.*.so in its file list or package directory); the build "
            "skipped or lost the CUDA/ROCm extension: reinstall with "
            "`pip install --force-reinstall --no-build-isolation 'kvcached>=0.1.6'` where "
            "torch is a CUDA or ROCm build and the toolkit (nvcc/hipcc) is on PATH"
        )
    return True, f"kvcached's compiled module is present: {present[0]}"


def _site_dirs() -> list[Path]:
    dirs: list[str] = []
    dirs.extend(site.getsitepackages())
    user = site.getusersitepackages()
    if user:
        dirs.append(user)
    for key in ("purelib", "platlib"):
        value = sysconfig.get_paths().get(key)
        if value:
            dirs.append(value)
    unique: list[Path] = []
    for d in dirs:
        path = Path(d)
        if path not in unique:
            unique.append(path)
    return unique


def check_autopatch_pth(site_dirs: Iterable[Path] | None = None) -> CheckLine:
    """``kvcached_autopatch.pth`` sits at a site-packages root, so the env vars take effect."""
    dirs = list(site_dirs) if site_dirs is not None else _site_dirs()
    for d in dirs:
        if (d / AUTOPATCH_PTH).is_file():
            return True, f"{AUTOPATCH_PTH} is present in {d}"
    listed = ", ".join(str(d) for d in dirs) or "(no site-packages directory found)"
    return False, (
        f"{AUTOPATCH_PTH} is missing from site-packages ({listed}); without it "
        "ENABLE_KVCACHED and KVCACHED_AUTOPATCH silently do nothing: install kvcached>=0.1.6 "
        "with a regular `pip install` (0.1.6 also ships it in editable installs), in this "
        "interpreter's environment"
    )


def _probe_torch_backend(timeout_s: float) -> tuple[str | None, str | None] | str:
    """Ask a child interpreter for ``torch.version.cuda`` / ``.hip``; a string is an error."""
    code = (
        "import json, torch; "
        "print(json.dumps([torch.version.cuda, getattr(torch.version, 'hip', None)]))"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"probing torch timed out after {timeout_s:g} s"
    except OSError as exc:
        return f"probing torch failed: {exc}"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return f"importing torch failed: {last}"
    try:
        cuda, hip = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return "probing torch printed no backend information"
    return (str(cuda) if cuda else None, str(hip) if hip else None)


# Local version tags of PyTorch's own non-GPU wheels.
_NON_GPU_TAGS = ("cpu", "xpu")


def check_torch_backend(
    probe: Callable[[float], tuple[str | None, str | None] | str] = _probe_torch_backend,
) -> CheckLine:
    """torch is a CUDA or ROCm build: from a local tag naming the backend (``+cu128``,
    ``+rocm6.3``, ``+cpu``, ``+xpu``), else a subprocess probe."""
    fix = (
        "install a CUDA or ROCm build of torch (e.g. `pip install torch --index-url "
        "https://download.pytorch.org/whl/cu128`), then rebuild kvcached against it"
    )
    dist = _distribution("torch")
    if dist is None:
        return False, f"torch is not installed; kvcached needs a GPU build of torch: {fix}"
    version = _version_of(dist)
    torch = _named("torch", version)
    try:
        local = (Version(version or "").local or "").lower()
    except InvalidVersion:
        local = ""
    if local.startswith("cu") or local.startswith("rocm"):
        return True, f"{torch} is a {'ROCm' if 'rocm' in local else 'CUDA'} build"
    if local.startswith(_NON_GPU_TAGS):
        return False, f"{torch} is a {local.upper()}-only build; {fix}"
    # No tag, or one naming no backend (NGC's CUDA builds: ``+<commit>.nv25.10``): ask torch.
    result = probe(TORCH_PROBE_TIMEOUT_S)
    if isinstance(result, str):
        return False, f"cannot tell whether {torch} is a GPU build ({result}); {fix}"
    cuda, hip = result
    if cuda:
        return True, f"{torch} is a CUDA {cuda} build"
    if hip:
        return True, f"{torch} is a ROCm (HIP {hip}) build"
    return False, f"{torch} is a CPU-only build (no CUDA or HIP version); {fix}"


def check_torch_version() -> list[CheckLine]:
    """torch is at least 2.10, whose stable ABI kvcached 0.1.6's compiled module targets.

    Nothing when torch is missing: :func:`check_torch_backend` reports that.
    """
    dist = _distribution("torch")
    if dist is None:
        return []
    floor = ".".join(map(str, MIN_TORCH_RELEASE))
    version = _version_of(dist)
    try:
        release = Version(version or "").release
    except InvalidVersion:
        release = ()
    if release[:len(MIN_TORCH_RELEASE)] >= MIN_TORCH_RELEASE:
        return [(True, f"torch {version} is at least {floor} (kvcached "
                       f"{MIN_KVCACHED_VERSION}'s compiled module needs it)")]
    # Without a version torch cannot be shown to reach the floor: refused, not "older".
    reason = "is older than" if version else "cannot be shown to be at least"
    return [(False, (
        f"{_named('torch', version)} {reason} {floor}: kvcached {MIN_KVCACHED_VERSION}'s "
        f"compiled module is built against the libtorch stable ABI of torch >= {floor}; "
        f"install a CUDA or ROCm build of torch >= {floor} that the host's vLLM accepts "
        f"(e.g. `pip install 'torch>={floor}' --index-url "
        "https://download.pytorch.org/whl/cu128`), then rebuild kvcached against it"
    ))]


def check_vllm_range(version_range: str = KVCACHED_TESTED_VLLM_RANGE) -> CheckLine:
    """The installed vLLM lies in kvcached's supported range (its patches are version gated)."""
    dist = _distribution("vllm")
    if dist is None:
        return False, (
            f"vLLM is not installed; kvcached patches vLLM {version_range}: install a vLLM "
            "in that range (e.g. vLLM-HUST 0.28.1) in this environment"
        )
    try:
        spec = SpecifierSet(version_range)
    except InvalidSpecifier:
        return False, f"the bundle's vLLM range {version_range!r} is not a valid version range"
    version = _version_of(dist)
    if version is None:
        return False, (
            f"vLLM (no version) cannot be checked against kvcached's supported range "
            f"{version_range}: reinstall a vLLM in that range (e.g. vLLM-HUST 0.28.1)"
        )
    try:
        inside = spec.contains(Version(version))
    except InvalidVersion:
        inside = False
    if not inside:
        return False, (
            f"vLLM {version} is outside kvcached's supported range {version_range} "
            "(kvcached 0.1.6 is tested up to vLLM 0.30; its core patches would still load "
            "on a later vLLM, untested against its internals): run on a vLLM in that range, "
            "e.g. vLLM-HUST 0.28.1, or "
            f"`vllm-hust-ext extension disable {EXTENSION_ID}`"
        )
    return True, f"vLLM {version} is inside kvcached's supported range {version_range}"


def check_shm_writable(directory: Path | None = None) -> CheckLine:
    """kvcached keeps one control record per instance in ``/dev/shm``."""
    try:
        target = directory if directory is not None else shm_dir()
    except SettingError as exc:
        return False, str(exc)
    fix = (
        "kvcached keeps each instance's control record there: mount a writable tmpfs at "
        "/dev/shm (containers: `--ipc=host` or `--shm-size=1g`)"
    )
    if not target.is_dir():
        return False, f"{target} does not exist or is not a directory; {fix}"
    try:
        fd, name = tempfile.mkstemp(prefix=".kvcached-provider-check-", dir=target)
    except OSError as exc:
        return False, f"{target} is not writable ({exc.strerror or exc}); {fix}"
    os.close(fd)
    os.unlink(name)
    return True, f"{target} is writable"


def check_ipc_name(
    name: str | None, directory: Path | None = None, *, launching: bool = False
) -> list[CheckLine]:
    """The planned ``KVCACHED_IPC_NAME`` is addressable and, ideally, unique per instance.

    ``launching`` (``run``): a live process holding the name's claim (another ``run``
    from its check on, an engine from when the bundle's plugin loads, both before kvcached
    creates its record), or an existing control record that a live process uses, means
    another engine runs or starts under this name, and a second would share its control
    record and limits (kvcached uses an explicit name exactly), so that fails. A free name
    is claimed for this process until it exits (``run`` outlives its engine). Otherwise
    (``status``, possibly of the running engine itself) an existing record is only
    reported.
    """
    if name is None:
        return [(False, (
            "KVCACHED_IPC_NAME is not set in the bundle's activation environment; without an "
            "explicit name kvcached derives one from the process group and neither kvctl "
            f"nor kvcached-provider can address the instance: set it with {_CONFIGURE_HINT}"
        ))]
    if not IPC_NAME_PATTERN.fullmatch(name):
        return [(False, (
            f"KVCACHED_IPC_NAME {name!r} is invalid: expected 1-64 characters from "
            "[A-Za-z0-9_-] (kvcached would rewrite it, so kvctl and kvcached-provider could "
            f"not address the instance by it); set a valid one with {_CONFIGURE_HINT}"
        ))]
    lines: list[CheckLine] = [(True, f"KVCACHED_IPC_NAME is {name!r}")]
    if GROUP_SUFFIX.search(name):
        lines.append((True, (
            f"KVCACHED_IPC_NAME {name!r} ends like a KV-group suffix: kvcached names group N "
            f"of instance X 'X_gN', so `kvcached-provider cleanup` of instance "
            f"{GROUP_SUFFIX.sub('', name)!r} would take this record for that instance's "
            "wherever it cannot see this engine's processes (another PID namespace); prefer "
            f"a name without it ({_CONFIGURE_HINT})"
        )))
    if name == DEFAULT_IPC_NAME:
        lines.append((True, (
            f"KVCACHED_IPC_NAME is the bundle default {name!r}; engines sharing this host "
            f"need distinct names: set one per instance with {_CONFIGURE_HINT}"
        )))
    if launching and (claimed := _claim_for_launch(name)) is not None:
        lines.append(claimed)
        return lines
    try:
        record = (directory if directory is not None else shm_dir()) / name
    except SettingError:  # check_shm_writable already reports the setting
        return lines
    if record.exists():
        users = _record_users(record) if launching else []
        if users:
            lines.append((False, (
                f"control record {record} is in use by pid {', '.join(map(str, users))}: an "
                f"engine already runs under KVCACHED_IPC_NAME {name!r}, and a second would "
                f"share its control record and limits; set a distinct name with "
                f"{_CONFIGURE_HINT}"
            )))
            return lines
        # Informational only: segments survive SIGKILL and (vLLM) SIGTERM, so this may be a
        # leak -- but it may also be a live engine, which must never be deleted blindly.
        lines.append((True, (
            f"control record {record} already exists (a live instance or a leaked segment); "
            f"if no engine uses it remove it with `kvctl delete {name}`, else pick another "
            "KVCACHED_IPC_NAME"
        )))
    return lines


def _claim_for_launch(name: str) -> CheckLine | None:
    """A failing line when another live process holds ``name``'s claim, else ``None``
    with the claim now this process's; an unusable claim file is not taken for a conflict
    (the record check still runs)."""
    from kvcached_provider.claim import ClaimError, claim_for_launch, claim_path

    try:
        pids = claim_for_launch(name)
    except ClaimError:
        return None
    if pids is None:
        return None
    by = f"pid {', '.join(map(str, pids))}" if pids else "a live process (pid not visible here)"
    return (False, (
        f"KVCACHED_IPC_NAME {name!r} is claimed by {by} (claim {claim_path(name)}): an "
        "engine already runs or is starting under it, and a second would share its "
        f"control record and limits; set a distinct name with {_CONFIGURE_HINT}"
    ))


def _record_users(record: Path) -> list[int]:
    """Live processes using the instance of ``record``; none when ``/proc`` is unreadable
    (then the record is reported as before, never taken for a conflict)."""
    from kvcached_provider.segments import CleanupError, record_users  # imports this module

    try:
        return record_users(record)
    except CleanupError:
        return []


def check_activation_environment(env: Mapping[str, str]) -> list[CheckLine]:
    """The planned environment really switches kvcached on (one line per variable).

    kvcached's import hook applies its vLLM patches only when ``ENABLE_KVCACHED`` is true/1
    and ``KVCACHED_AUTOPATCH`` is true/1 (the hook sets it to 1 when unset), each read as
    ``value.lower()`` without trimming. Both must reach the engine's environment before
    vLLM is imported, which the launch environment guarantees; an operator override that
    turns either off would launch vLLM without kvcached while the bundle looks ready.
    """
    reading = "kvcached reads only 'true' or '1' (any case, no surrounding spaces)"

    def fix(variable: str, value: str) -> str:
        return (f"set it with `vllm-hust-ext extension configure {EXTENSION_ID} --file F` "
                f'with F holding {{"environment": {{"{variable}": "{value}"}}}}, or disable '
                f"{EXTENSION_ID}")

    lines: list[CheckLine] = []
    enable = env.get("ENABLE_KVCACHED")
    if enable is None:
        lines.append((False, (
            "ENABLE_KVCACHED is not set in the bundle's activation environment, so kvcached "
            f"stays off ({reading}); {fix('ENABLE_KVCACHED', 'true')}"
        )))
    elif enable.lower() not in KVCACHED_ON_WORDS:
        lines.append((False, (
            f"ENABLE_KVCACHED={enable!r} leaves kvcached off ({reading}); "
            f"{fix('ENABLE_KVCACHED', 'true')}"
        )))
    else:
        lines.append((True, f"ENABLE_KVCACHED={enable!r} switches kvcached on"))
    autopatch = env.get("KVCACHED_AUTOPATCH")
    if autopatch is None:
        lines.append((True, (
            "KVCACHED_AUTOPATCH is unset: kvcached's import hook sets it to 1 when "
            "ENABLE_KVCACHED is on"
        )))
    elif autopatch.lower() not in KVCACHED_ON_WORDS:
        lines.append((False, (
            f"KVCACHED_AUTOPATCH={autopatch!r} leaves kvcached's vLLM patches unapplied "
            f"({reading}); {fix('KVCACHED_AUTOPATCH', '1')}"
        )))
    else:
        lines.append((True, f"KVCACHED_AUTOPATCH={autopatch!r} applies kvcached's vLLM patches"))
    return lines


def planned_environment(
    manifest: Mapping[str, object], configuration: Mapping[str, object]
) -> dict[str, str]:
    """The bundle's activation environment with the operator's overrides applied."""
    env: dict[str, str] = {}
    activation = manifest.get("activation")
    if isinstance(activation, Mapping):
        declared = activation.get("environment")
        if isinstance(declared, Mapping):
            env.update({str(k): str(v) for k, v in declared.items()})
    overrides = configuration.get("environment")
    if isinstance(overrides, Mapping):
        env.update({str(k): str(v) for k, v in overrides.items() if isinstance(v, str)})
    return env


def launch_environment(
    planned: Mapping[str, str], inherited: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment the engine will start with, as far as this bundle can know it.

    ``vllm-hust-ext run`` starts the engine with its own environment (``inherited``, by
    default this process's) overlaid by the activation environment, so a variable the
    bundle does not set -- kvcached's tuning variables -- comes from the shell that runs
    the manager. For ``extension status`` that is the shell running ``status``.
    """
    return {**(os.environ if inherited is None else inherited), **planned}


# --------------------------------------------------- kvcached's pass-through tuning variables
#
# kvcached 0.1.6 reads these when the engine imports ``kvcached.utils`` (and the tensor-
# parallel IPC module), with ``int()``, ``float()``, ``value.lower() == "true"`` or, for the
# log level, a ``logging`` attribute. Its C++ page allocator reads some a second time: the
# reserved-page bounds with ``atoi``, the utilization with ``atof`` and the log level's first
# letter. ``KVCACHED_LOG_COLOR_CODE`` takes any text and is not checked. A value is refused
# only when kvcached would fail on it inside the engine or misread it without a word (its
# two readers disagreeing, an unknown word read as off, a negative bound read as unsigned);
# merely odd values (a huge page, no prefix cache) pass.

# C's isspace() in the C locale: what atoi/atof skip before a number.
_C_SPACE = " \t\n\v\f\r"
_C_INT = re.compile(r"[+-]?[0-9]+")
_C_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_FALSE_WORDS = frozenset({"false", "0", "no", "off", "f", "n"})
_IMPORT_FAILS = "kvcached 0.1.6 would raise ValueError when the engine imports it"
_FLAG_MISREAD = (
    "kvcached 0.1.6 reads only 'true' (any case, no surrounding spaces) as on and anything "
    "else as off, so this would silently be off"
)


def _python_int(value: str) -> int | None:
    try:
        return int(value)
    except ValueError:
        return None


def _python_float(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None


def _c_atoi(value: str) -> int:
    """glibc's ``atoi``: ``(int) strtol(value, NULL, 10)`` -- the longest decimal prefix
    after C whitespace (0 if none), clamped to a 64-bit long, then wrapped to 32 bits."""
    found = _C_INT.match(value.lstrip(_C_SPACE))
    text = found.group() if found else "0"
    digits = text.lstrip("+-").lstrip("0") or "0"
    size = int(digits) if len(digits) <= 19 else 2**63  # no int() of a huge digit string
    number = -min(size, 2**63) if text.startswith("-") else min(size, 2**63 - 1)
    return (number + 2**31) % 2**32 - 2**31


def _c_atof(value: str) -> float:
    """glibc's ``atof`` for decimal text: the longest decimal prefix after C whitespace.

    Its hexadecimal, ``inf`` and ``nan`` forms are not modelled: Python's ``float()`` refuses
    hexadecimal text, and infinities and NaN are outside any range checked with this.
    """
    found = _C_DECIMAL.match(value.lstrip(_C_SPACE))
    return float(found.group()) if found else 0.0


def _page_size(value: str) -> str | None:
    number = _python_int(value)  # utils.py: int(value) MB, a positive multiple of 2 MB
    return None if number is not None and number > 0 and number % 2 == 0 else _IMPORT_FAILS


def _integer(value: str) -> str | None:
    return None if _python_int(value) is not None else _IMPORT_FAILS


def _reserved_pages(value: str) -> str | None:
    python = _python_int(value)
    if python is None:
        return _IMPORT_FAILS
    allocator = _c_atoi(value)
    if allocator != python:
        return (f"kvcached's Python code would read {python} but its C++ page allocator "
                f"(atoi) {allocator}")
    if python < 0:
        # page_allocator.cpp compares the bounds with size_t counts: -1 becomes 2**64 - 1.
        return ("kvcached's C++ page allocator compares the bound with unsigned page counts, "
                "so a negative one is misread (a negative maximum keeps every page freed "
                "one at a time mapped, never returning it to the GPU)")
    return None


def _utilization(value: str) -> str | None:
    python = _python_float(value)
    if python is None:
        return _IMPORT_FAILS
    if not 0.0 <= python <= 1.0:  # NaN too
        return ("kvcached's C++ page allocator keeps (1 - utilization) of the GPU's memory "
                "free, so outside 0..1 it is left no usable memory (above 1 through an "
                "undefined conversion)")
    allocator = _c_atof(value)
    if allocator != python:
        return (f"kvcached's Python code would read {python:g} but its C++ page allocator "
                f"(atof) {allocator:g}")
    return None


def _flag(value: str) -> str | None:
    if value.lower() == "true" or value.strip().lower() in _FALSE_WORDS:
        return None
    return _FLAG_MISREAD


def _timeout(value: str) -> str | None:
    python = _python_float(value)
    if python is None:
        return _IMPORT_FAILS
    if math.isnan(python):
        # NaN <= 0 is false, so kvcached keeps the bound, and asyncio fires it at once.
        return ("kvcached would pass NaN to asyncio.wait_for, which times every exchange "
                "with a tensor-parallel worker out at once")
    return None


# kvcached's Python logger resolves ``getattr(logging, value.upper(), logging.INFO)``: any
# other name silently logs at INFO. Its C++ page allocator (gpu_utils.hpp) reads only the
# first character, upper case, and takes anything else as its lowest setting, FATAL. Each
# Python level is paired with the allocator's letter that means the same (NOTSET has none);
# VERBOSE is the allocator's finest level, which Python does not know (it logs at INFO then).
_PYTHON_LEVEL_LETTER = {"DEBUG": "D", "INFO": "I", "WARNING": "W", "WARN": "W", "ERROR": "E",
                        "CRITICAL": "F", "FATAL": "F", "NOTSET": "-", "VERBOSE": "V"}
_ALLOCATOR_LEVELS = {"F": "FATAL", "E": "ERROR", "W": "WARNING", "I": "INFO", "D": "DEBUG",
                     "V": "VERBOSE"}


def _log_level(value: str) -> str | None:
    meant = _PYTHON_LEVEL_LETTER.get(value.upper())
    if meant is None:
        return ("kvcached's Python code knows only logging's level names (with another it "
                "would log at INFO, or fail at start-up on a logging attribute that is no level)")
    allocator = value[:1] if value[:1] in _ALLOCATOR_LEVELS else "F"
    if allocator == meant:
        return None
    python = "INFO" if meant == "V" else value.upper()
    return (f"kvcached's Python code would log at {python} but its C++ page allocator, "
            f"which reads only the first letter in upper case, at {_ALLOCATOR_LEVELS[allocator]}")


# name, kvcached's default, the accepted form, the reader deciding it.
_TUNING: tuple[tuple[str, str, str, Callable[[str], str | None]], ...] = (
    ("KVCACHED_PAGE_SIZE_MB", "2", "a positive even integer (the page size in MB)",
     _page_size),
    ("KVCACHED_GPU_UTILIZATION", "0.95", "a decimal fraction from 0 to 1 in plain digits",
     _utilization),
    ("KVCACHED_MIN_RESERVED_PAGES", "5", "a whole number of pages >= 0 in plain digits",
     _reserved_pages),
    ("KVCACHED_MAX_RESERVED_PAGES", "10", "a whole number of pages >= 0 in plain digits",
     _reserved_pages),
    ("KVCACHED_PAGE_PREALLOC_ENABLED", "true", "'true' or 'false'", _flag),
    ("KVCACHED_MAX_CACHED_TOKENS", "16000",
     "an integer (-1 for no bound, 0 to turn prefix caching off, N > 0 for at most N cached "
     "tokens)", _integer),
    ("KVCACHED_MAX_CACHED_BLOCKS", "1000",
     "an integer (a legacy bound kvcached 0.1.6 parses but no longer uses)", _integer),
    ("KVCACHED_CONTIGUOUS_LAYOUT", "true on CUDA, false on ROCm", "'true' or 'false'", _flag),
    ("KVCACHED_IPC_TIMEOUT", "60", "a number of seconds (0 or less: no timeout)", _timeout),
    ("KVCACHED_SANITY_CHECK", "false", "'true' or 'false'", _flag),
    ("KVCACHED_LOG_LEVEL", "INFO in its Python code, WARNING in its C++ page allocator",
     "DEBUG, INFO, WARNING, ERROR or CRITICAL, starting with an upper-case letter, or VERBOSE "
     "(the C++ page allocator's finest; Python logs at INFO then)", _log_level),
    ("KVCACHED_LOG_COLOR", "true", "'true' or 'false'", _flag),
)
TUNING_VARIABLES = tuple(name for name, *_ in _TUNING)
_RESERVED_DEFAULTS = {"KVCACHED_MIN_RESERVED_PAGES": 5, "KVCACHED_MAX_RESERVED_PAGES": 10}


def _tuning_fix(default: str) -> str:
    return (f"fix it, or unset it for kvcached's default ({default}), in the environment "
            "`vllm-hust-ext run` is started from")


def _reserved_order(env: Mapping[str, str]) -> list[CheckLine]:
    """MIN <= MAX, a default standing in for an unset bound; call it only when each set bound
    is accepted. kvcached's prealloc thread maps pages up to MIN and frees keep at most MAX
    mapped (page_allocator.cpp), so a larger MIN silently overrides the MAX bound."""
    names = list(_RESERVED_DEFAULTS)
    if not set(names) & env.keys():
        return []
    low, high = (int(env[n]) if n in env else _RESERVED_DEFAULTS[n] for n in names)
    if low <= high:
        return []
    shown = [f"{n}={env[n]!r}" if n in env else f"{n} (default {_RESERVED_DEFAULTS[n]})"
             for n in names]
    return [(False, (
        f"{shown[0]} exceeds {shown[1]}: expected the minimum at most the maximum; kvcached's "
        "prealloc thread keeps the minimum mapped, so the maximum would silently not hold; "
        "lower the minimum or raise the maximum (unset, they are 5 and 10) in the "
        "environment `vllm-hust-ext run` is started from"
    ))]


def check_tuning_environment(env: Mapping[str, str]) -> list[CheckLine]:
    """kvcached's tuning variables in the launch environment are read as they are meant.

    One failing line per refused variable (naming it, its value and the accepted form) or
    inverted reserved-page bounds, and one ok line listing the other variables that are set;
    nothing when none is set, so a plain launch's status stays as it was.
    """
    failed: list[CheckLine] = []
    accepted: dict[str, str] = {}
    for name, default, expected, read in _TUNING:
        value = env.get(name)
        if value is None:
            continue
        problem = read(value)
        if problem is None:
            accepted[name] = value
            continue
        failed.append((False, (
            f"{name}={value!r} is invalid: expected {expected}; {problem}; "
            f"{_tuning_fix(default)}"
        )))
    if all(n in accepted or n not in env for n in _RESERVED_DEFAULTS):
        order = _reserved_order(env)
        failed += order
        for name in _RESERVED_DEFAULTS if order else ():
            accepted.pop(name, None)
    if not accepted:
        return failed
    listed = ", ".join(f"{name}={value!r}" for name, value in accepted.items())
    return [*failed, (True, f"kvcached will read these tuning variables: {listed}")]


def _declared_names(manifest: Mapping[str, object]) -> list[str]:
    """Every contract and protocol name a manifest declares."""
    names: list[str] = []
    for key, field in (("components", "contracts"), ("protocols", "name")):
        items = manifest.get(key)
        for item in items if isinstance(items, list) else []:
            value = item.get(field) if isinstance(item, Mapping) else None
            names.extend(v for v in (value if isinstance(value, list) else [value])
                         if isinstance(v, str))
    return names


def check_peer_bundles(enabled: Mapping[str, Mapping[str, object]]) -> list[CheckLine]:
    """No other enabled bundle replaces the block pool or needs KV-cache events (check 7).

    Manifest 0.2 cannot declare an allocator claim (0.3's ``resource_claims`` can), so this
    sees what 0.2 can say: the contracts and protocols a bundle declares.
    """
    lines: list[CheckLine] = []
    for bundle_id, manifest in sorted(enabled.items()):
        hits = sorted({n for n in _declared_names(manifest) if _KV_OWNERSHIP.search(n)})
        if hits:
            lines.append((False, (
                f"enabled bundle {bundle_id!r} declares {', '.join(hits)}: kvcached replaces "
                "vLLM's BlockPool and KVCacheCoordinator and publishes no KV-cache events, so "
                "both cannot run in one engine; disable one of them with `vllm-hust-ext "
                "extension disable <id>`"
            )))
    return lines or [(True, (
        "no other enabled bundle declares a KV-cache allocator, block pool, coordinator or "
        "KV-cache events"
    ))]


def _option_name(arg: str) -> tuple[str, str | None]:
    """``--opt_name.field=value`` -> (``--opt-name.field``, ``value``), as vLLM reads it
    (its parser turns ``_`` into ``-`` in the option's name, before any ``.``)."""
    option, has_value, inline = arg.partition("=")
    head, dot, field = option.partition(".")
    return head.replace("_", "-") + dot + field, inline if has_value else None


def _truthy(value: object) -> bool:
    """pydantic's (lax) reading of a boolean field as true: ``true``/``1``/``yes``/``on``/
    ``t``/``y`` in any case, ``True``, or the number 1 -- an int or a float (``1.0``)."""
    if isinstance(value, str):
        return value.strip().lower() in _TRUE_WORDS
    return value is True or (type(value) in (int, float) and value == 1)


# vLLM's human-readable integers: a decimal multiplier (k, m, g, t) takes a fraction, a
# binary one (K, M, G, T) only a whole number.
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_HUMAN_MULTIPLIERS = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
                      "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _dotted_value(text: str) -> object:
    """A dotted option's value as vLLM 0.33.0 reads it: the JSON it parses as (``1.0``,
    ``"true"``), else a human-readable integer (``+1``, ``01``, ``0.001k``), else the text."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        pass
    stripped = text.strip()
    found = _HUMAN_INT.fullmatch(stripped)
    try:
        if found is None:
            return int(stripped)
        number, suffix = found.groups()
        if suffix.islower():
            return int(float(number) * _HUMAN_MULTIPLIERS[suffix])
        return int(number) * _HUMAN_MULTIPLIERS[suffix]
    except (ValueError, OverflowError):
        return text


def _config_file_options(command: Sequence[str]) -> list[str]:
    """The options vLLM 0.33.0 reads from ``--config FILE``, flattened as it flattens them.

    vLLM expands only the exact ``--config FILE`` pair, and only for a ``.yaml``/``.yml`` file
    holding a mapping: ``key: true`` becomes ``--key``, a list ``--key item...``, a mapping
    ``--key <its JSON>``, anything else ``--key <str(value)>``. A file vLLM would refuse
    (missing, unreadable, another suffix, not a mapping) gives nothing: that launch fails
    before kvcached matters. Only a regular file is read: a FIFO would hang the check (or
    hand its content to the check instead of vLLM), a device such as ``/dev/zero`` never
    ends; such a ``--config`` gives nothing either.
    """
    try:
        path = command[list(command).index("--config") + 1]
    except (ValueError, IndexError):  # no --config, or nothing after it
        return []
    if path.rsplit(".", 1)[-1] not in ("yaml", "yml"):
        return []
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (no effect on a file).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)  # checked before open(): it would raise on a directory and keep fd
        return []
    try:
        with open(fd, encoding="utf-8") as stream:
            loaded = yaml.safe_load(stream)
        if not isinstance(loaded, dict):
            return []
        options: list[str] = []
        for key, value in loaded.items():
            flag = f"--{key}"
            if isinstance(value, bool):
                options += [flag] if value else []
            elif isinstance(value, list):
                options += [flag, *map(str, value)] if value else []
            elif isinstance(value, dict):
                options += [flag, json.dumps(value)]
            else:
                options += [flag, str(value)]
    # PyYAML's safe constructors also raise KeyError (``!!bool abc``), AttributeError
    # (``!!timestamp abc``) and RecursionError (deep nesting); the manager names them.
    except (OSError, UnicodeDecodeError, yaml.YAMLError, TypeError, ValueError, KeyError,
            AttributeError, RecursionError):
        return []
    return options


def _kv_events_requested(command: Sequence[str]) -> bool:
    """Whether vLLM, launched with ``command``, ends up with ``enable_kv_cache_events`` on.

    Read as vLLM 0.33.0's parser reads it: the ``--config`` file's options come before the
    command line's, so the command line overrides them; the last whole
    ``--kv-events-config <JSON>`` wins, but any dotted ``--kv-events-config.<field>`` replaces
    it (vLLM gathers the dotted fields into one JSON value and adds it after all others).
    """
    args = [*_config_file_options(command), *command]
    whole = False
    dotted: bool | None = None
    for index, arg in enumerate(args):
        option, inline = _option_name(arg)
        if option != _KV_EVENTS_OPTION and not option.startswith(_KV_EVENTS_OPTION + "."):
            continue
        following = args[index + 1] if index + 1 < len(args) else None
        value = inline if inline is not None else following
        if option != _KV_EVENTS_OPTION:
            if option == _KV_EVENTS_FLAG:
                # With no value it reads as a bare flag: refuse what the user evidently meant.
                dotted = value is None or value.startswith("-") or _truthy(_dotted_value(value))
            elif dotted is None:
                dotted = False  # another field alone: the dotted value leaves events off
            continue
        try:
            parsed = json.loads(value or "")
        except ValueError:
            continue  # vLLM itself rejects a malformed value
        if isinstance(parsed, dict):
            whole = _truthy(parsed.get("enable_kv_cache_events"))
    return whole if dotted is None else dotted


def check_kv_events(command: Sequence[str] | None) -> list[CheckLine]:
    """The launch does not rely on KV-cache events, which kvcached never emits (check 7)."""
    if command is None or not _kv_events_requested(command):
        return []
    return [(False, (
        f"the command enables KV-cache events ({_KV_EVENTS_OPTION} with "
        "enable_kv_cache_events, on its command line or in its --config file), but "
        "kvcached's block pool publishes none, so subscribers "
        "would silently receive nothing: drop the option or disable "
        f"{EXTENSION_ID}"
    ))]


def _supported_range(manifest: Mapping[str, object]) -> str:
    host = manifest.get("host")
    if isinstance(host, Mapping):
        value = host.get("version_range")
        if isinstance(value, str) and value.strip():
            return value
    return KVCACHED_TESTED_VLLM_RANGE


def _context(
    context: Mapping[str, object] | None,
) -> tuple[dict[str, Mapping[str, object]], list[str] | None]:
    if context is None:
        return {}, None
    enabled = context.get("enabled_bundles")
    peers = {str(k): v for k, v in enabled.items() if isinstance(v, Mapping)} if isinstance(
        enabled, Mapping) else {}
    command = context.get("command")
    return peers, [str(a) for a in command] if isinstance(command, list) else None


def check(
    manifest: Mapping[str, object],
    configuration: Mapping[str, object],
    context: Mapping[str, object] | None = None,
) -> list[tuple[bool, str]]:
    """Run every check; one ``(ok, evidence line)`` per finding, in a fixed order.

    ``context`` is what the extension manager knows beyond this bundle: ``enabled_bundles``
    (the other enabled bundles' manifests, by id) and, for ``run``, ``command``. kvcached's
    tuning variables are read from :func:`launch_environment`: this process's environment,
    which ``run`` hands the engine, under the planned activation environment.
    """
    env = planned_environment(manifest, configuration)
    peers, command = _context(context)
    probes: list[tuple[str, Callable[[], CheckLine | list[CheckLine]]]] = [
        ("kvcached version", check_kvcached_version),
        ("kvcached compiled module", check_compiled_module),
        ("kvcached autopatch .pth", check_autopatch_pth),
        ("torch backend", check_torch_backend),
        ("torch version", check_torch_version),
        ("vLLM range", lambda: check_vllm_range(_supported_range(manifest))),
        ("/dev/shm", check_shm_writable),
        ("activation environment", lambda: check_activation_environment(env)),
        ("KVCACHED_IPC_NAME", lambda: check_ipc_name(env.get("KVCACHED_IPC_NAME"),
                                                     launching=command is not None)),
        ("kvcached tuning variables",
         lambda: check_tuning_environment(launch_environment(env))),
        ("other enabled bundles", lambda: check_peer_bundles(peers)),
        ("KV-cache events", lambda: check_kv_events(command)),
    ]
    lines: list[CheckLine] = []
    for label, probe in probes:
        try:
            found = probe()
        except Exception as exc:  # one broken probe must not hide the others' findings
            lines.append((False, f"{label} check failed unexpectedly: {exc}"))
            continue
        lines.extend(found if isinstance(found, list) else [found])
    return lines
