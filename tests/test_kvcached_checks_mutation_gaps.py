"""``kvcached_provider.checks`` and ``kvcached-provider``: what a mutation audit found unguarded.

Each test here failed under one deliberate mutation of ``checks.py`` or ``cli.py`` that every
other test let pass (named in the test's docstring), or reproduces the one bug the audit
found. Guarded:

- only kvcached's compiled module itself counts (``_C.<tag>.so``, not ``_C_utils...so``), and
  a kvcached distribution with no package anywhere is a failing line, not an exception;
- the torch probe reports the last line of a failed import (the exception, not
  ``Traceback``), reads the last line torch printed, keeps CUDA and HIP apart, and is given
  its 60 s bound;
- an unparsable torch version is refused by the version floor; an invalid vLLM range in the
  manifest is a failing line;
- a launch refused for a claimed name gets one failing line (the record check does not
  add a second), and a claim whose holders cannot be seen says so instead of naming
  ``pid `` with no number;
- the atoi model of a reserved-page bound reports what the C library reads for a 19-digit
  value;
- the KV-events check reads values as vLLM 0.33.0 does, its real argument parser the
  oracle: a JSON number 1 or 1.0, a dotted value vLLM parses as JSON (``1.0``,
  ``"true"``) or as a human-readable integer (``+1``, ``01``) enables events (the bug: the
  check let these launch, kvcached then publishing no event), a dotted field after the
  dotted flag leaves it on, a ``.yml`` file is read, and an empty list in the file is no
  bare flag;
- ``kvcached-provider check --ipc NAME`` checks that name; ``check`` finds the manifest of a
  wheel install (``<site-packages>/manifests/kvcached/``); ``limit`` waits its documented
  default of 5 s; ``cleanup --dry-run`` removes nothing; a SIGTERM during any command exits
  143 without a traceback, and the caller's SIGTERM handler is put back afterwards; a
  broken pipe other than standard output's is not silenced as a closed stdout.

kvcached and torch cannot be installed here as GPU builds: installed distributions are faked
with ``*.dist-info`` directories (``tests/test_kvcached_checks.py``), a child interpreter's
torch with a throw-away package on its ``PYTHONPATH``, an engine by a real process running
the bundle's plugin (``tests/test_kvcached_claim.py``); locks, files and vLLM's parser are real.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvcached_provider import checks, claim, cli
from kvcached_provider.cli import main
from tests.fake_kvcached import provider_dirs
from tests.test_kvcached_checks import (
    MANIFEST,
    assert_kv_events_read_as_vllm,
    fake_dist,
    site,
)
from tests.test_kvcached_claim import NAME, dirs, engine
from tests.test_kvcached_cleanup import ipc, record, shm
from tests.test_kvcached_tuning_env import LIBC

__all__ = ["dirs", "engine", "ipc", "shm", "site"]  # fixtures, used by name

ELF = b"\x7fELF"


# ------------------------------------------------------------------ compiled module


def test_a_module_merely_named_like_the_compiled_one_does_not_count(site: Path) -> None:
    """Rule: only the compiled module itself (``_C.<tag>.so``) counts. Mutant:
    ``_is_native`` matching the bare stem (``startswith(stem)``), which took
    ``kvcached/_C_utils...so`` for kvcached's ``_C``."""
    fake_dist(site, "kvcached", "0.1.6", {
        "kvcached/__init__.py": b"", "kvcached/_C_utils.cpython-311-x86_64-linux-gnu.so": ELF})
    ok, line = checks.check_compiled_module()
    assert not ok and "kvcached 0.1.6 is installed without its compiled module" in line


def test_a_distribution_without_any_package_is_a_failing_line(site: Path) -> None:
    """Rule: each check reports, never raises. A kvcached distribution whose RECORD lists
    no package file and whose package cannot be found (a broken install) is the missing
    module's line. Mutant: ``_package_dir_native`` without its ``spec is None`` return,
    which raised AttributeError."""
    fake_dist(site, "kvcached", "0.1.6")
    ok, line = checks.check_compiled_module()
    assert not ok and "kvcached 0.1.6 is installed without its compiled module" in line


# -------------------------------------------------------------------- torch probe


def _child_torch(root: Path, monkeypatch: pytest.MonkeyPatch, init: str,
                 cuda: str | None = None, hip: str | None = None) -> None:
    """A ``torch`` package first on the child interpreter's path (the probe runs
    ``sys.executable`` with this process's environment)."""
    package = root / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(init + "from . import version\n", encoding="utf-8")
    (package / "version.py").write_text(f"cuda = {cuda!r}\nhip = {hip!r}\n", encoding="utf-8")
    inherited = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(root), inherited])))


def test_a_failed_torch_import_is_reported_by_its_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rule: a probe that cannot import torch says why: the last line of the child's
    stderr, the exception. Mutant: the first line (``[0]``), which reported
    ``Traceback (most recent call last):``."""
    _child_torch(tmp_path, monkeypatch,
                 "raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    assert checks._probe_torch_backend(120.0) == (
        "importing torch failed: ImportError: libcuda.so.1: cannot open shared object file")


@pytest.mark.parametrize(("cuda", "hip"), [("12.8", None), (None, "6.3.42131")])
def test_the_probe_reads_the_last_line_and_keeps_cuda_and_hip_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cuda: str | None, hip: str | None
) -> None:
    """Rule: the probe's answer is the last line the child prints (torch, or what it loads,
    may print before it) and is ``(cuda, hip)`` in that order. Mutants: reading the first
    stdout line (a banner: "printed no backend information"), and returning the pair
    swapped (a ROCm torch reported as CUDA 6.3)."""
    _child_torch(tmp_path, monkeypatch, "print('torch: loading a vendor banner')\n",
                 cuda=cuda, hip=hip)
    assert checks._probe_torch_backend(120.0) == (cuda, hip)


def test_the_torch_probe_is_given_its_bound(site: Path) -> None:
    """Rule: the probe of an untagged torch runs with ``TORCH_PROBE_TIMEOUT_S`` (60 s):
    importing a CUDA torch takes seconds. Mutant: ``probe(1.0)``, which would report a
    GPU build as undecidable on a slow import."""
    fake_dist(site, "torch", "2.10.0")
    seen: list[float] = []

    def probe(timeout_s: float) -> tuple[str | None, str | None]:
        seen.append(timeout_s)
        return "12.8", None

    assert checks.check_torch_backend(probe) == (True, "torch 2.10.0 is a CUDA 12.8 build")
    assert seen == [checks.TORCH_PROBE_TIMEOUT_S] == [60.0]


# ------------------------------------------------------------ torch and vLLM versions


def test_an_unparsable_torch_version_is_refused_by_the_floor(site: Path) -> None:
    """Rule: a torch whose version cannot be read is not taken to be >= 2.10. Mutant: the
    ``InvalidVersion`` fallback giving a release above the floor."""
    fake_dist(site, "torch", "custom-build")
    [(ok, line)] = checks.check_torch_version()
    assert not ok and line.startswith("torch custom-build is older than 2.10:")


def test_an_invalid_vllm_range_is_a_failing_line() -> None:
    """Rule: the manifest's vLLM range must be a valid version range, else the check fails
    naming it. Mutant: the ``InvalidSpecifier`` branch returning ok."""
    assert checks.check_vllm_range("not a range") == (
        False, "the bundle's vLLM range 'not a range' is not a valid version range")
    manifest = {**MANIFEST, "host": {**MANIFEST["host"], "version_range": "==0.33,<<1"}}
    assert (False, "the bundle's vLLM range '==0.33,<<1' is not a valid version range") in \
        checks.check(manifest, {})


# ----------------------------------------------------------------- KVCACHED_IPC_NAME


def test_a_claimed_name_is_one_failing_line_even_with_a_record(
    engine: object, dirs: tuple[Path, Path]
) -> None:
    """Rule: a launch under a claimed name fails once, on the claim; the record check does
    not run then. Mutant: no ``return`` after the claim's line, which added the record's
    "in use by pid" line for the same engine."""
    _, shm = dirs
    (shm / NAME).write_bytes(b"\0" * 24)
    lines = checks.check_ipc_name(NAME, shm, launching=True)
    assert [ok for ok, _ in lines] == [True, False]
    assert lines[1][1].startswith(f"KVCACHED_IPC_NAME {NAME!r} is claimed by pid ")


def test_a_claim_held_by_an_unseen_process_says_so(
    engine: object, dirs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rule: when the claim's holders cannot be seen (another user, a hidden ``/proc``) the
    line says "a live process (pid not visible here)". Mutant: ``if pids is not None``,
    which printed "claimed by pid  (claim ...)". An empty directory stands in for
    ``/proc``; the engine's lock is real."""
    _, shm = dirs
    hidden = tmp_path / "no-proc"
    hidden.mkdir()
    monkeypatch.setattr(claim, "_PROC", hidden)
    lines = checks.check_ipc_name(NAME, shm, launching=True)
    assert [ok for ok, _ in lines] == [True, False]
    assert lines[1][1].startswith(
        f"KVCACHED_IPC_NAME {NAME!r} is claimed by a live process (pid not visible here) "
        f"(claim {claim.claim_path(NAME)})")


# ----------------------------------------------------------------- tuning variables


def test_a_nineteen_digit_bound_is_reported_as_atoi_reads_it() -> None:
    """Rule: the refusal names the value kvcached's C++ page allocator (``atoi``) reads.
    Mutant: ``_c_atoi`` clamping 19-digit values (``len(digits) < 19``), which reported
    -1 for 10**18 where glibc's atoi gives the value wrapped to 32 bits."""
    value = "1000000000000000000"
    [(ok, line)] = checks.check_tuning_environment({"KVCACHED_MAX_RESERVED_PAGES": value})
    assert not ok
    assert (f"Python code would read {value} but its C++ page allocator (atoi) "
            f"{LIBC.atoi(value.encode())};") in line


def test_a_lower_case_verbose_level_names_what_python_logs_at() -> None:
    """Rule: a log level the two readers take differently names what each logs at; Python
    does not know VERBOSE and logs at INFO. Mutant: the Python side shown as
    ``value.upper()``, which claimed kvcached's Python code would log at VERBOSE."""
    [(ok, line)] = checks.check_tuning_environment({"KVCACHED_LOG_LEVEL": "verbose"})
    assert not ok
    assert ("kvcached's Python code would log at INFO but its C++ page allocator, which "
            "reads only the first letter in upper case, at FATAL;") in line


# ----------------------------------------------------------------- KV-cache events


_ON_IN_FILE = "kv-events-config:\n  enable_kv_cache_events: true\n"


@pytest.mark.parametrize(("config", "tail", "refused"), [
    # The bug: vLLM (pydantic) reads the number 1.0 as true, and parses a dotted value as
    # JSON, else as a human-readable integer; the check took all of these for "off".
    (None, ["--kv-events-config", '{"enable_kv_cache_events": 1.0}'], True),
    (None, ["--kv-events-config.enable_kv_cache_events", "1.0"], True),
    (None, ["--kv-events-config.enable_kv_cache_events", '"true"'], True),
    (None, ["--kv-events-config.enable_kv_cache_events", "+1"], True),
    (None, ["--kv-events-config.enable_kv_cache_events=01"], True),
    ("kv-events-config:\n  enable_kv_cache_events: 1.0\n", [], True),
    ("kv-events-config.enable_kv_cache_events: 1.0\n", [], True),
    (None, ["--kv-events-config.enable_kv_cache_events", "0.0"], False),
    # Mutant: ``_truthy`` taking only ``True`` (an int 1 is true too).
    (None, ["--kv-events-config", '{"enable_kv_cache_events": 1}'], True),
    # Mutant: any dotted field resetting the dotted value (``else`` for ``elif dotted is
    # None``): a field after the flag leaves it on.
    (None, ["--kv-events-config.enable_kv_cache_events", "true",
            "--kv-events-config.publisher", "zmq"], True),
    # Mutant: only ``.yaml`` files read (vLLM reads ``.yml`` too).
    (_ON_IN_FILE, [], True),
    # Mutant: the file taken from the command's last word, not the one after ``--config``.
    (_ON_IN_FILE, ["--max-num-seqs", "8"], True),
    # Mutant: an empty YAML list becoming a bare flag (vLLM drops it).
    ("kv-events-config.enable_kv_cache_events: []\nmax-num-seqs: 8\n", [], False),
])
def test_kv_events_read_as_vllm_reads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    config: str | None, tail: list[str], refused: bool,
) -> None:
    """Rule: the check refuses exactly the commands after which vLLM 0.33.0's
    ``kv_events_config.enable_kv_cache_events`` is on; vLLM's real parser is the oracle
    (the file is ``.yml`` here, ``.yaml`` in tests/test_kvcached_checks.py)."""
    monkeypatch.chdir(tmp_path)
    assert_kv_events_read_as_vllm(config, tail, refused, "serve.yml")


# --------------------------------------------------------------- kvcached-provider


def test_check_ipc_names_the_instance_checked(capsys: pytest.CaptureFixture[str]) -> None:
    """Rule: ``kvcached-provider check --ipc NAME`` checks NAME, not the bundle's default.
    Mutant: the configuration built without ``--ipc`` (``configuration = {}``), which
    checked 'vllm_hust_kvcached' whatever was asked."""
    assert main(["check", "--ipc", "llama-8000"]) == 1
    out = capsys.readouterr().out
    assert "ok   KVCACHED_IPC_NAME is 'llama-8000'\n" in out
    assert "vllm_hust_kvcached" not in out


def test_check_finds_the_manifest_of_a_wheel_install(tmp_path: Path) -> None:
    """Rule: the manifest ships beside the package, ``<site-packages>/manifests/kvcached/``
    in a wheel (``<repo>/manifests/kvcached/`` in an editable install, which the other tests
    use). Mutant: ``_MANIFEST_CANDIDATES`` without the wheel's location, which checked no
    instance name at all (``KVCACHED_IPC_NAME is not set``) from a wheel. The package is
    copied into a directory laid out as a wheel installs it, and run from there."""
    site_packages = tmp_path / "lib" / "site-packages"
    shutil.copytree(Path(cli.__file__).parent, site_packages / "kvcached_provider",
                    ignore=shutil.ignore_patterns("__pycache__"))
    manifest = Path(__file__).resolve().parents[1] / "manifests/kvcached"
    shutil.copytree(manifest, site_packages / "manifests/kvcached")
    code = ("import sys, kvcached_provider.cli as c\n"
            "assert c.__file__.startswith(sys.argv[1]), c.__file__\n"
            "raise SystemExit(c.main(['check']))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(site_packages), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code, str(site_packages)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "ok   KVCACHED_IPC_NAME is the bundle default 'vllm_hust_kvcached'" in done.stdout


def test_limit_waits_its_documented_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rule: ``limit`` waits 5 s for the engine unless ``--timeout`` says otherwise (the
    module's and ``--help``'s "default 5"). Mutant: another ``--timeout`` default. No engine
    runs: the command reports the wait it gave the engine."""
    provider_dirs(tmp_path, monkeypatch, "inst1")
    monkeypatch.delenv("KVCACHED_IPC_NAME")
    assert main(["limit", "--ipc", "inst1", "1G"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("unavailable ")
    assert "no engine process of instance 'inst1' answered within 5 s" in out


def test_the_sigterm_handler_is_put_back(capsys: pytest.CaptureFixture[str]) -> None:
    """Rule: ``main`` turns SIGTERM into an interrupt only while a command runs, then puts
    the caller's handler back (the manager and the tests call it in-process). Mutant: the
    ``finally`` not restoring it."""
    def mine(signum: int, frame: object) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        assert main(["check", "--ipc", "llama-8000"]) == 1
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)
    capsys.readouterr()


def test_cleanup_dry_run_removes_nothing(shm: Path, ipc: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Rule: ``kvcached-provider cleanup --dry-run`` only reports. Mutant: ``--dry-run`` not
    passed on (``dry_run=False``), which removed the leaked record it was to report."""
    path = record(shm, ipc)
    main(["cleanup", "--ipc", ipc, "--dry-run"])
    assert capsys.readouterr().out.splitlines() == [f"would remove {path}"]
    assert path.exists()


def test_a_sigterm_outside_a_limit_exits_143_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rule: SIGTERM ends any command as an interrupt does, with the shell's status 128 + 15
    and no traceback. Mutant: ``_main`` without its ``except KeyboardInterrupt``, which let
    the interrupt escape ``main``. A real SIGTERM, sent to this process from inside the
    first check, stands in for an operator's ``kill``."""
    def terminated() -> tuple[bool, str]:
        os.kill(os.getpid(), signal.SIGTERM)
        return True, "not reached"

    monkeypatch.setattr(checks, "check_kvcached_version", terminated)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        code = main(["check", "--ipc", "llama-8000"])
    except KeyboardInterrupt as exc:  # the mutant's escape: fail here, not end the session
        pytest.fail(f"the interrupt escaped main: {exc!r}")
    assert code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is previous
    assert "not reached" not in capsys.readouterr().out


def test_a_broken_pipe_other_than_standard_outputs_is_not_silenced(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rule: only a reader leaving standard output ends the command quietly (status 141);
    any other broken pipe is an error that shows. Mutant: ``main`` without its
    ``_stdout_reader_left`` test, which took every BrokenPipeError for a closed stdout."""
    def broken(*_: object) -> list[tuple[bool, str]]:
        raise BrokenPipeError(32, "Broken pipe (a helper's pipe, not stdout)")

    monkeypatch.setattr(checks, "check", broken)
    with pytest.raises(BrokenPipeError, match="a helper's pipe"):
        main(["check"])
